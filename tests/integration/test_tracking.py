"""MLflow tracking: one run per job, owned by the kernel (cases C20 and C22).

Real MLflow on local sqlite stores, real ranks, nothing mocked. In-process tests use the
session's store (conftest points ``MLFLOW_TRACKING_URI`` at the session's temporary directory)
and a fresh experiment each, named through ``MLFLOW_EXPERIMENT_NAME``; they never call
``mlflow.set_experiment`` or ``mlflow.set_tracking_uri``, which would change this process's
MLflow state for later tests. The cases as written (C20, C22 with a kernel interrupt), the
kernel SIGKILL and ``%mlflow_ui`` run in real Jupyter kernels.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import socket
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest

from sgpu_magic import JobState, distributed
from sgpu_magic.errors import JobTimeoutError, LauncherError, RankFailedError
from sgpu_magic.launch.client import get_host
from sgpu_magic.testing import start_job, wait_for_tracking
from sgpu_magic.tracking.server import MlflowUIError, run_link, start_ui, stop_ui
from sgpu_magic.tracking.uri import absolute_tracking_uri

from helpers import wait_for
from kernel_utils import collect, execute, start_kernel, stop_kernel

START_DEADLINE_S = 120.0


# ----------------------------------------------------------------------------- helpers


@pytest.fixture
def experiment(monkeypatch):
    """A fresh experiment name for this test's jobs (through MLFLOW_EXPERIMENT_NAME); returns (client, name)."""
    from mlflow import MlflowClient

    name = f"test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", name)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    return MlflowClient(os.environ["MLFLOW_TRACKING_URI"]), name


def runs_of(client, name: str) -> list:
    """The experiment's runs, once the kernel's queued MLflow writes are done (runs are made and ended off the
    jobs' path: ``job.mlflow_run_id`` waits for them likewise)."""
    assert wait_for_tracking(120.0)
    experiment = client.get_experiment_by_name(name)
    return [] if experiment is None else client.search_runs([experiment.experiment_id], order_by=["start_time ASC"])


def artifact_paths(client, run_id: str, folder: str) -> list[str]:
    return sorted(a.path for a in client.list_artifacts(run_id, folder))


def start_sleepers(fn, piddir):
    """Start ``fn(piddir)`` (2 ranks that record their pid and sleep) in the background; return the job once both run."""
    job = start_job(fn, (str(piddir),))
    wait_for(lambda: len(os.listdir(piddir)) >= 2, START_DEADLINE_S, "both ranks to record their pid")
    return job


@distributed(gpus=2, timeout=120)
def sleeper(piddir):
    import os
    import time

    open(os.path.join(piddir, str(os.getpid())), "w").close()
    time.sleep(600)


# ----------------------------------------------------------------------------- URIs and links


def test_relative_tracking_uris_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_tracking_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path}/mlflow.db"
    assert absolute_tracking_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert absolute_tracking_uri("mlruns") == f"{tmp_path}/mlruns"
    assert absolute_tracking_uri("file:mlruns") == f"file://{tmp_path}/mlruns"
    assert absolute_tracking_uri("http://host:5000") == "http://host:5000"
    assert absolute_tracking_uri("postgresql://u@h/db") == "postgresql://u@h/db"


def test_the_warm_up_imports_the_sql_stores_module_for_a_database_uri_only(tmp_path):
    """``%load_ext``'s background MLflow import also imports the SQL store's module (about 1 s of CPU the first tracked
    launch paid), for a database URI only, and creates no database."""
    import subprocess
    import sys

    db = tmp_path / "mlflow.db"
    code = (
        "import sys\n"
        "from sgpu_magic.tracking.run import import_store_module\n"
        "loaded = lambda: 'mlflow.store.tracking.sqlalchemy_store' in sys.modules\n"
        "print(import_store_module('file:///tmp/mlruns'), import_store_module('http://127.0.0.1:5000'), loaded())\n"
        f"print(import_store_module('sqlite:///{db}'), loaded())\n"
        "print(import_store_module('postgresql+psycopg2://user@db.example/mlflow'))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["False False False", "True True", "True"]
    assert not db.exists()


OPEN_STORE = """
import sys, mlflow
from sgpu_magic.tracking.uri import open_client
sys.stdin.readline()  # both processes have imported mlflow: they open the fresh store together
open_client(mlflow, sys.argv[1]).search_experiments(max_results=1)
print("opened")
"""


def test_two_processes_that_open_a_fresh_local_store_at_once_both_get_it(tmp_path):
    """MLflow's SQL store checks for its tables, then makes them: two kernels (or a kernel and the one it attached
    to) that first touch a fresh sqlite store together both failed (``table ... already exists``), and their jobs
    ran with tracking off. sgpu_magic's processes make a fresh store one at a time."""
    import subprocess
    import sys

    uri = f"sqlite:///{tmp_path}/fresh.db"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPEN_STORE, uri],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    done = [proc.communicate(timeout=180) for proc in procs]
    assert [out for out, _ in done] == ["opened\n", "opened\n"], [err[-2000:] for _, err in done]


def test_run_link_points_at_an_http_server_without_credentials():
    assert (
        run_link("https://user:secret@mlflow.example.com:8443/base/", "3", "abc")
        == "https://mlflow.example.com:8443/base/#/experiments/3/runs/abc"
    )
    assert run_link("sqlite:////nowhere/mlflow.db", "3", "abc") is None  # no %mlflow_ui server for it


# ----------------------------------------------------------------------------- C20 and what a run holds

C20_CELL = """%%distributed --gpus 2
import os, mlflow
r = int(os.environ["RANK"])
for step in range(3):
    mlflow.log_metric(f"loss_rank{r}", 1.0 / (step + 1), step=step)
"""


def test_c20_one_run_per_execution_with_both_ranks_metrics_params_tags_and_logs(run_cell, experiment, sgpu_home):
    client, name = experiment
    result, out, err = run_cell(C20_CELL)
    assert result.error_in_exec is None, (result.error_in_exec, out, err)
    assert "database is locked" not in out + err

    (run,) = runs_of(client, name)  # exactly one run, top level
    run_id = run.info.run_id
    assert "mlflow.parentRunId" not in run.data.tags
    assert run.info.status == "FINISHED" and run.info.end_time is not None
    assert [len(client.get_metric_history(run_id, k)) for k in ("loss_rank0", "loss_rank1")] == [3, 3]
    assert [m.value for m in client.get_metric_history(run_id, "loss_rank1")] == [1.0, 0.5, 1.0 / 3]
    assert run.data.params == {
        "gpus": "2",
        "gpu_type": "any",
        "device": "cpu",
        "world_size": "2",
        "backend": "gloo",
        "timeout_s": "10800",
        "name": "%%distributed cell",
        "max_restarts": "0",
    }
    job_id = run.data.tags["sgpu_magic.job_id"]
    assert (sgpu_home / "runs" / job_id).is_dir()
    assert run.data.tags["sgpu_magic.state"] == "succeeded"
    assert artifact_paths(client, run_id, "logs") == ["logs/rank_0.log", "logs/rank_1.log"]
    assert "system/cpu_utilization_percentage" in run.data.metrics  # the kernel's system metrics monitor
    assert "system/system_memory_usage_megabytes" in run.data.metrics
    # the store's artifacts stay next to the session's database, not in the current directory
    assert run.info.artifact_uri.startswith((sgpu_home / "mlruns").as_uri())


def test_job_names_its_run_and_ranks_get_the_run_identity(experiment):
    client, name = experiment

    @distributed(gpus=2)
    def identity():
        import os

        before = os.environ.get("MLFLOW_RUN_ID")  # the run is made while the ranks start: adopted on import
        import mlflow  # noqa: F401

        return before, {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID")}

    seen = identity.distributed()
    (run,) = runs_of(client, name)
    job = identity.last_job
    assert job.mlflow_run_id == run.info.run_id
    assert job.run_url is None  # a local store and no %mlflow_ui server: no page to link to
    assert (
        seen
        == [
            (
                None,
                {
                    "MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"],
                    "MLFLOW_RUN_ID": run.info.run_id,
                    "MLFLOW_EXPERIMENT_ID": run.info.experiment_id,
                },
            )
        ]
        * 2
    )


def test_a_rank_that_does_not_import_mlflow_gets_the_run_through_the_runtime(experiment):
    """``runtime.get_mlflow_run_id()`` adopts the job's run (made while the ranks started) and sets the variables in
    the rank's environment, for code that reads them without importing mlflow; an untracked job has none."""
    client, name = experiment

    def adopted():
        import os
        import sys

        from sgpu_magic import runtime

        return runtime.get_mlflow_run_id(), os.environ.get("MLFLOW_RUN_ID"), "mlflow" in sys.modules

    seen = distributed(gpus=2)(adopted).distributed()
    (run,) = runs_of(client, name)
    assert seen == [(run.info.run_id, run.info.run_id, False)] * 2
    assert distributed(gpus=1, mlflow=False)(adopted).distributed() == [(None, None, False)]


def test_ranks_never_end_the_run_even_with_start_run_end_run_or_a_with_block(experiment, tmp_path):
    """Rank 0 resumes the run with ``with mlflow.start_run():`` and calls ``mlflow.end_run()``, then returns
    and exits as a Python program does (its atexit handlers run, MLflow's ``end_run`` among them); rank 1
    adopts the run first through a bare ``log_metric``, waits until rank 0's last exit handler has run,
    and reads the status: still RUNNING."""
    client, name = experiment

    @distributed(gpus=2)
    def logs_like_users_do(folder):
        import atexit
        import os
        import time

        rank = int(os.environ["RANK"])
        # registered before mlflow is imported: it runs after MLflow's own atexit end_run (handlers run last-in first)
        atexit.register(lambda: open(os.path.join(folder, f"atexit-ran-{rank}"), "w").close())
        import mlflow

        run_id = os.environ["MLFLOW_RUN_ID"]
        adopted, marker = os.path.join(folder, "rank1-adopted-the-run"), os.path.join(folder, "atexit-ran-0")

        def wait_for(path):
            deadline = time.monotonic() + 60
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.05)

        if rank == 0:
            wait_for(adopted)  # so that rank 1's adoption (which sets RUNNING) cannot hide an ended run
            with mlflow.start_run() as run:  # this rank's child run (see test_start_run_in_a_rank_...)
                mlflow.log_metric("inside_with", 1.0)
                assert run.info.run_id != run_id
            mlflow.start_run(run_id=run_id)
            mlflow.end_run()
            mlflow.start_run(run_id=run_id)  # left active: MLflow's atexit handler ends it
            return run_id
        mlflow.log_metric("bare", 2.0)
        open(adopted, "w").close()
        wait_for(marker)
        return mlflow.MlflowClient().get_run(run_id).info.status

    run_id, status_seen_by_rank1 = logs_like_users_do.distributed(str(tmp_path))
    assert status_seen_by_rank1 == "RUNNING"
    assert sorted(os.listdir(tmp_path)) == ["atexit-ran-0", "atexit-ran-1", "rank1-adopted-the-run"]
    run, child = runs_of(client, name)
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert run.data.metrics["bare"] == 2.0 and "inside_with" not in run.data.metrics
    assert child.data.tags["mlflow.parentRunId"] == run_id and child.info.status == "FINISHED"
    assert child.data.metrics == {"inside_with": 1.0}


def test_start_run_in_a_rank_opens_the_rank_s_own_child_run(experiment):
    """Code written for one process, ``with mlflow.start_run(): mlflow.log_param("seed", 1000 + rank)``, gives each
    rank a child run of the job's run (params differ freely), every run ends FINISHED, and a bare
    ``mlflow.log_metric`` after the block still logs to the job's run."""
    client, name = experiment

    @distributed(gpus=2)
    def seeds():
        import mlflow

        from sgpu_magic import runtime

        rank = runtime.get_global_rank()
        with mlflow.start_run():
            mlflow.log_param("seed", 1000 + rank)
            mlflow.log_metric("inner", rank)
        with mlflow.start_run(run_name="eval", tags={"phase": "eval"}) as run:
            mlflow.log_param("seed", 2000 + rank)
            eval_run = run.info.run_id
        mlflow.log_metric(f"outer_rank{rank}", 1.0)
        return eval_run

    eval_runs = seeds.distributed()
    job_run = seeds.last_job.mlflow_run_id
    runs = {r.info.run_id: r for r in runs_of(client, name)}
    assert runs[job_run].info.status == "FINISHED" and "seed" not in runs[job_run].data.params
    assert {k: v for k, v in runs[job_run].data.metrics.items() if not k.startswith("system/")} == {
        "outer_rank0": 1.0,
        "outer_rank1": 1.0,
    }
    children = [r for r in runs.values() if r.data.tags.get("mlflow.parentRunId") == job_run]
    found = {(r.data.tags["sgpu_magic.rank"], r.data.tags["mlflow.runName"], r.data.params["seed"]) for r in children}
    assert found == {("0", "rank 0", "1000"), ("1", "rank 1", "1001"), ("0", "eval 0", "2000"), ("1", "eval 1", "2001")}
    assert {r.info.status for r in children} == {"FINISHED"}
    assert [runs[i].data.tags["phase"] for i in eval_runs] == ["eval", "eval"]
    assert {r.data.metrics.get("inner") for r in children if r.data.tags["mlflow.runName"].startswith("rank")} == {0, 1}


def test_a_rank_run_left_open_by_a_killed_rank_ends_with_the_job(experiment):
    client, name = experiment

    @distributed(gpus=1)
    def dies_inside():
        import os
        import signal

        import mlflow

        with mlflow.start_run():
            mlflow.log_param("seed", 1)
            os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(RankFailedError, match="SIGKILL"):
        dies_inside.distributed()
    job_run, child = runs_of(client, name)
    assert child.data.tags["mlflow.parentRunId"] == job_run.info.run_id
    assert (job_run.info.status, child.info.status) == ("FAILED", "FAILED")


def test_rank_metrics_reach_mlflow_and_the_metrics_file(experiment):
    """``runtime.log_metric`` points go to the job's run (from the writer's thread) and to ``job.metrics()``;
    ``mlflow.log_metric`` / ``mlflow.log_metrics`` called by the rank's code still reach MLflow and are in
    ``job.metrics()`` too (a point without a step has MLflow's step 0)."""
    client, name = experiment

    @distributed(gpus=2, widgets=False)
    def logs_both_ways(n):
        import mlflow

        from sgpu_magic import runtime

        rank = runtime.get_global_rank()
        for step in range(n):
            runtime.log_metric(f"loss_rank{rank}", 1.0 / (step + 1), step=step)
        for step in range(3):
            mlflow.log_metric(f"acc_rank{rank}", step / 10, step=step)
        mlflow.log_metrics({f"m_rank{rank}": rank + 0.5, f"k_rank{rank}": 2})

    logs_both_ways.distributed(700)
    job = logs_both_ways.last_job
    run_id = job.mlflow_run_id
    for rank in range(2):
        history = client.get_metric_history(run_id, f"loss_rank{rank}")
        assert sorted((m.step, m.value) for m in history) == [(s, 1.0 / (s + 1)) for s in range(700)]
        assert len(client.get_metric_history(run_id, f"acc_rank{rank}")) == 3
        assert job.metrics(f"loss_rank{rank}")[f"loss_rank{rank}"] == {rank: [(s, 1.0 / (s + 1)) for s in range(700)]}
        assert job.metrics(f"acc_rank{rank}")[f"acc_rank{rank}"] == {rank: [(0, 0.0), (1, 0.1), (2, 0.2)]}
        assert job.metrics(f"m_rank{rank}")[f"m_rank{rank}"] == {rank: [(0, rank + 0.5)]}
        assert job.metrics(f"k_rank{rank}")[f"k_rank{rank}"] == {rank: [(0, 2.0)]}
    assert "could not be logged" not in job.logs(0) + job.logs(1)


def test_each_rank_s_step_times_reach_mlflow_under_its_own_key(experiment):
    """``runtime.step()`` times reach the job's run as ``step_time_s/rank_<r>`` (every rank logs to the one run): the
    first step, then the mean of the steps since, at most once a second and when the code ends; the time inside
    collectives stays in the metrics file."""
    client, _ = experiment

    @distributed(gpus=2, widgets=False)
    def three_steps():
        import time

        from sgpu_magic import runtime

        for _ in range(3):
            with runtime.step():
                time.sleep(0.01)

    three_steps.distributed()
    job = three_steps.last_job
    run_id = job.mlflow_run_id
    for rank in range(2):
        history = sorted(client.get_metric_history(run_id, f"step_time_s/rank_{rank}"), key=lambda m: m.step)
        times = job.step_times()[rank]
        assert [(m.step, m.value) for m in history] == [(0, times[0]), (2, pytest.approx((times[1] + times[2]) / 2))]
        assert min(times) >= 0.01
    assert [len(t) for t in job.step_times().values()] == [3, 3]
    assert client.get_metric_history(run_id, "step_collective_s") == []
    assert client.get_metric_history(run_id, "step_time_s") == []


def test_a_tracked_training_loop_s_ranks_never_import_mlflow_for_their_step_times(experiment, tmp_path):
    """Each optimizer step is a step (its time goes to MLflow), but the kernel logs it when the job has ended, from the
    metrics files: a rank that imported mlflow for it paid 1-4 s at its end (a 4-rank 5-step DDP job took 4.0-4.4 s
    tracked, 0.16-0.22 s untracked). Each rank says at its exit (atexit: after its points are flushed) whether it
    imported mlflow."""
    client, _ = experiment

    @distributed(gpus=2, widgets=False)
    def train(out):
        import atexit
        import sys
        from pathlib import Path

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        path = Path(out) / f"rank_{dist.get_rank()}"
        atexit.register(lambda: path.write_text(str("mlflow" in sys.modules)))

    train.distributed(str(tmp_path))
    assert [(tmp_path / f"rank_{r}").read_text() for r in range(2)] == ["False", "False"]
    job = train.last_job
    assert wait_for_tracking(120.0)  # the run's end (and its step times) are written off the job's path
    for rank in range(2):
        history = client.get_metric_history(job.mlflow_run_id, f"step_time_s/rank_{rank}")
        assert max(m.step for m in history) == len(job.step_times()[rank]) - 1 == 1  # the 3rd step is open at the end


def test_step_time_points_are_the_first_step_then_a_mean_at_most_once_a_second():
    from sgpu_magic.tracking.run import step_time_points

    points = [("step_time_s", 0.5, 0, 1000), ("loss", 9.0, 0, 1000), ("step_time_s", 0.1, 1, 1200)]
    points += [("step_time_s", 0.3, 2, 1999), ("step_time_s", 0.7, 3, 2000), ("step_time_s", 0.2, 4, 2100)]
    assert step_time_points(points, 3) == [
        ("step_time_s/rank_3", 0.5, 0, 1000),
        ("step_time_s/rank_3", pytest.approx((0.1 + 0.3 + 0.7) / 3), 3, 2000),
        ("step_time_s/rank_3", 0.2, 4, 2100),
    ]
    assert step_time_points([("loss", 1.0, 0, 5)], 0) == []


def test_nested_under_the_kernels_active_run(experiment, tmp_path):
    import mlflow

    client, name = experiment
    # the fluent start_run() would create the experiment with MLflow's default artifact root, ./mlruns in the
    # working directory (here the repository): create it first, with its artifacts under this test's folder
    client.create_experiment(name, artifact_location=(tmp_path / "artifacts").as_uri())

    @distributed(gpus=2)
    def one():
        return 1

    with mlflow.start_run() as parent:
        assert one.distributed() == [1, 1]
        assert client.get_run(parent.info.run_id).info.status == "RUNNING"  # the job ended only its own run
    (child,) = [r for r in runs_of(client, name) if r.info.run_id != parent.info.run_id]
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.experiment_id == parent.info.experiment_id
    assert child.info.status == "FINISHED"
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"


def test_experiment_named_after_the_notebook_else_the_configured_default(ip, run_cell, monkeypatch):
    from mlflow import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    stem = f"nb-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("JPY_SESSION_NAME", f"/home/me/work/{stem}.ipynb")
    result, out, err = run_cell("%%distributed --gpus 1\n1")
    assert result.error_in_exec is None, (out, err)
    (run,) = runs_of(client, stem)
    assert run.data.tags["sgpu_magic.notebook"] == f"/home/me/work/{stem}.ipynb"
    assert run.data.tags["mlflow.source.type"] == "NOTEBOOK"

    monkeypatch.delenv("JPY_SESSION_NAME")
    default = f"default-{uuid.uuid4().hex[:8]}"
    ip.run_line_magic("config", f"DistributedMagics.mlflow_experiment = {default!r}")
    try:
        result, out, err = run_cell("%%distributed --gpus 1\n1")
    finally:
        ip.run_line_magic("config", "DistributedMagics.mlflow_experiment = 'sgpu_magic'")
    assert result.error_in_exec is None, (out, err)
    (run,) = runs_of(client, default)
    assert run.data.tags["mlflow.source.type"] == "LOCAL" and "sgpu_magic.notebook" not in run.data.tags


def test_no_mlflow_flag_and_mlflow_false_track_nothing(ip, run_cell, experiment):
    client, name = experiment
    result, out, err = run_cell("%%distributed --gpus 1 --no-mlflow -o untracked_job\n1")
    assert result.error_in_exec is None, (out, err)
    assert ip.user_ns["untracked_job"].mlflow_run_id is None

    @distributed(gpus=1, mlflow=False)
    def untracked():
        import os

        return os.environ.get("SGPU_MAGIC_MLFLOW_RUN_ID")

    assert untracked.distributed() == [None]
    assert untracked.last_job.mlflow_run_id is None and untracked.last_job.run_url is None
    assert runs_of(client, name) == []


def test_tracking_that_cannot_start_warns_and_the_job_still_runs(experiment, capsys):
    client, name = experiment
    client.delete_experiment(client.create_experiment(name))

    @distributed(gpus=1)
    def fine():
        return "ran"

    assert fine.distributed() == ["ran"]
    err = capsys.readouterr().err
    assert re.search(
        rf"sgpu_magic warning: MLflow tracking is off for job \S+: SgpuError: the MLflow experiment "
        rf"'{name}' is deleted; restore it with MlflowClient\(\)\.restore_experiment\('\d+'\) or pick "
        rf"another with mlflow\.set_experiment\(\.\.\.\)",
        err,
    ), err
    assert fine.last_job.mlflow_run_id is None


def test_an_experiment_deleted_after_a_run_is_refused_with_the_remedy(experiment, capsys):
    """The kernel remembers the experiment of its runs (no lookup per job): one deleted since is still noticed."""
    client, name = experiment

    @distributed(gpus=1)
    def fine():
        return "ran"

    assert fine.distributed() == ["ran"]
    assert fine.last_job.mlflow_run_id is not None
    client.delete_experiment(client.get_experiment_by_name(name).experiment_id)
    assert fine.distributed() == ["ran"]
    assert fine.last_job.mlflow_run_id is None  # waits for the run's creation (and its warning)
    err = capsys.readouterr().err
    assert re.search(
        rf"MLflow tracking is off for job \S+: SgpuError: the MLflow experiment '{name}' is deleted", err
    ), err


# ----------------------------------------------------------------------------- rank-side async logging


def test_rank_metrics_are_logged_asynchronously_and_none_is_lost(experiment):
    """10,000 points from 2 ranks with plain per-step ``mlflow.log_metric``: the calls are MLflow's async ones
    (they return a future at once), and every point is in the run when the job has ended."""
    client, name = experiment

    @distributed(gpus=2, widgets=False)
    def log_many(n):
        import os

        import mlflow

        rank = int(os.environ["RANK"])
        futures = [mlflow.log_metric(f"loss_rank{rank}", 1.0 / (step + 1), step=step) for step in range(n)]
        return os.environ["MLFLOW_ENABLE_ASYNC_LOGGING"], type(futures[-1]).__name__

    assert log_many.distributed(5000) == [("true", "RunOperations")] * 2
    (run,) = runs_of(client, name)
    assert run.info.status == "FINISHED"
    for rank in range(2):
        history = client.get_metric_history(run.info.run_id, f"loss_rank{rank}")
        assert sorted(m.step for m in history) == list(range(5000))
        assert {m.step: m.value for m in history}[4999] == 1.0 / 5000


def test_a_cell_ending_with_log_metric_gives_none_as_with_sync_logging(run_cell, experiment):
    """With async logging ``log_metric`` returns a future (which cannot be pickled back); as the cell's value it
    becomes ``None`` once written, as synchronous logging returns; a future whose batch failed says why."""
    client, name = experiment
    result, out, err = run_cell(
        '%%distributed --gpus 1 --no-widgets -o logged_job\nimport mlflow\nmlflow.log_metric("last_line", 7.0)'
    )
    assert result.error_in_exec is None and result.result is None, (out, err)
    (run,) = runs_of(client, name)
    assert run.data.metrics["last_line"] == 7.0

    @distributed(gpus=1, widgets=False)
    def returns_a_failed_future():
        from mlflow import MlflowClient

        return MlflowClient().log_metric("0" * 32, "x", 1.0, synchronous=False)  # no such run

    assert returns_a_failed_future.distributed() == [None]
    assert re.search(
        r"sgpu_magic: MLflow could not log the points of the last call \(MlflowException: .*Run with "
        r"id=0{32} not found",
        returns_a_failed_future.last_job.logs(0),
    )


def test_the_kernels_own_choice_of_sync_logging_reaches_the_ranks(experiment, monkeypatch):
    """``MLFLOW_ENABLE_ASYNC_LOGGING=false`` in the kernel (what ``mlflow.config.enable_async_logging(False)`` sets)
    keeps the ranks' ``log_metric`` synchronous."""
    from sgpu_magic.tracking.run import ASYNC_LOGGING_ENV, rank_logging_env

    assert rank_logging_env({}) == ASYNC_LOGGING_ENV
    assert rank_logging_env({"MLFLOW_ENABLE_ASYNC_LOGGING": "false"}) == {"MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS": "1"}
    monkeypatch.setenv("MLFLOW_ENABLE_ASYNC_LOGGING", "false")

    @distributed(gpus=1, widgets=False)
    def log_one():
        import os

        import mlflow

        return os.environ["MLFLOW_ENABLE_ASYNC_LOGGING"], mlflow.log_metric("x", 1.0)

    assert log_one.distributed() == [("false", None)]


def test_a_flush_that_fails_is_named_in_the_rank_log_and_the_job_stands(experiment):
    """A rank that points MLflow at a tracking URI it cannot use after logging: the flush at the rank's end
    fails; the rank's log says so and that the last points may be missing; the job still succeeds."""

    @distributed(gpus=1, widgets=False)
    def moves_the_store():
        import os

        import mlflow

        mlflow.log_metric("before", 1.0)
        os.environ["MLFLOW_TRACKING_URI"] = "no-such-scheme://nowhere"
        return "done"

    assert moves_the_store.distributed() == ["done"]
    log = moves_the_store.last_job.logs(0)
    assert re.search(
        r"sgpu_magic: MLflow's async logging could not be flushed \(\w+: .*no-such-scheme.*\); metrics "
        r"logged last may be missing from the run",
        log,
    ), log


# ----------------------------------------------------------------------------- final status


def test_failed_job_is_failed_with_its_logs_and_error_file(experiment):
    client, name = experiment

    @distributed(gpus=2)
    def explodes():
        import os

        if os.environ["RANK"] == "0":
            raise ZeroDivisionError("loss exploded")

    with pytest.raises(RankFailedError, match=r"ZeroDivisionError: loss exploded"):
        explodes.distributed()
    (run,) = runs_of(client, name)
    assert run.info.status == "FAILED" and run.info.end_time is not None
    assert run.data.tags["sgpu_magic.state"] == "failed"
    assert artifact_paths(client, run.info.run_id, "logs") == ["logs/rank_0.log", "logs/rank_1.log"]
    assert artifact_paths(client, run.info.run_id, "errors") == ["errors/rank_0.json"]
    local = client.download_artifacts(run.info.run_id, "errors/rank_0.json")
    assert json.loads(Path(local).read_text())["message"] == "loss exploded"


def test_cancelled_job_is_killed(experiment, tmp_path):
    client, name = experiment
    job = start_sleepers(sleeper, tmp_path)
    assert client.get_run(job.mlflow_run_id).info.status == "RUNNING"
    job.cancel()
    assert job.state is JobState.CANCELLED
    run = client.get_run(job.mlflow_run_id)
    assert run.info.status == "KILLED" and run.info.end_time is not None
    assert run.data.tags["sgpu_magic.state"] == "cancelled"


def test_timed_out_job_is_killed(experiment):
    client, name = experiment

    @distributed(gpus=2, timeout=1.5)
    def too_slow():
        import time

        time.sleep(600)

    with pytest.raises(JobTimeoutError, match=r"job .* ran longer than its timeout of 1.5 s"):
        too_slow.distributed()
    (run,) = runs_of(client, name)
    assert run.info.status == "KILLED" and run.info.end_time is not None
    assert run.data.tags["sgpu_magic.state"] == "timed_out"


def test_launch_host_killed_during_a_job_fails_the_run(experiment, tmp_path):
    client, name = experiment
    job = start_sleepers(sleeper, tmp_path)
    os.kill(get_host().pid, signal.SIGKILL)
    with pytest.raises(LauncherError, match=r"the launch host died while job .* ran; see .*host-.*\.log"):
        job.wait(timeout_s=30)
    run = client.get_run(job.mlflow_run_id)
    assert run.info.status == "FAILED" and run.info.end_time is not None
    with pytest.raises(LauncherError, match=r"the launch host died while job .* ran"):
        job.result()


# ----------------------------------------------------------------------------- %mlflow_ui errors


def test_mlflow_ui_refuses_a_server_uri_and_gives_up_on_a_server_that_does_not_answer(tmp_path):
    with pytest.raises(
        MlflowUIError,
        match=r"the tracking URI http://127\.0\.0\.1:5000 is already an MLflow "
        r"server; open it directly",
    ):
        start_ui("http://127.0.0.1:5000")
    with pytest.raises(
        MlflowUIError,
        match=r"the MLflow UI server did not answer on http://127\.0\.0\.1:\d+ within "
        r"0\.3 s; see .*server-\d+-\d+\.log",
    ):
        start_ui(f"sqlite:///{tmp_path}/mlflow.db", timeout_s=0.3)
    assert stop_ui() is False  # the failed server was stopped and forgotten


def test_mlflow_ui_refuses_a_busy_port(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        with pytest.raises(
            MlflowUIError,
            match=rf"port {port} on 127\.0\.0\.1 is in use; pick another with --port, "
            rf"or leave it out for a free one",
        ):
            start_ui(f"sqlite:///{tmp_path}/mlflow.db", port=port)


@pytest.mark.slow
def test_mlflow_ui_server_that_exits_says_why():
    with pytest.raises(
        MlflowUIError,
        match=r"the MLflow UI server exited with code 1; see .*server-\d+-\d+\.log:\n"
        r"(.|\n)*unsupported URI 'bogus://nowhere'",
    ):
        start_ui("bogus://nowhere")


# ----------------------------------------------------------------------------- in real kernels

C20_CELL1 = """
import mlflow, tempfile
mlflow.set_tracking_uri(f"sqlite:///{tempfile.mkdtemp()}/mlflow.db")
mlflow.set_experiment("sgpu-case-C20")
"""
C20_CELL3 = """
runs = mlflow.search_runs(experiment_names=["sgpu-case-C20"])
top = runs[runs.get("tags.mlflow.parentRunId").isna()] if "tags.mlflow.parentRunId" in runs else runs
client = mlflow.MlflowClient()
rid = top.iloc[0]["run_id"]
print(len(top), top.iloc[0]["status"],
      [len(client.get_metric_history(rid, k)) for k in ("loss_rank0", "loss_rank1")])
"""
C22_CELL1 = C20_CELL1.replace("C20", "C22") + "print(mlflow.get_tracking_uri())\n"
C22_CELL2 = """%%distributed --gpus 2
import os
if os.environ["RANK"] == "0":
    raise ZeroDivisionError("loss exploded")
"""
C22_CELL3 = """%%distributed --gpus 2
import time
time.sleep(3600)
"""
C22_CELL4 = """
runs = mlflow.search_runs(experiment_names=["sgpu-case-C22"], order_by=["start_time ASC"])
print(list(runs["status"]), bool(runs["end_time"].notna().all()))
"""


def _running_job_dir(client, experiment_name: str, sgpu_home):
    """The run dir of the experiment's RUNNING job once its ranks run (status.json says so), else None."""
    runs = [r for r in runs_of(client, experiment_name) if r.info.status == "RUNNING"]
    if not runs:
        return None
    status = sgpu_home / "runs" / runs[0].data.tags["sgpu_magic.job_id"] / "status.json"
    try:
        return status.parent if json.loads(status.read_text())["state"] == "running" else None
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.slow
def test_c20_and_c22_in_a_kernel_failed_is_failed_and_interrupted_is_killed(tmp_path, sgpu_home):
    from mlflow import MlflowClient

    km, kc = start_kernel(tmp_path)
    try:
        for code in (C20_CELL1, C20_CELL):
            out = execute(kc, code)
            assert out.error is None, out.error
        out = execute(kc, C20_CELL3)
        assert out.error is None, out.error
        assert out.stdout.strip() == "1 FINISHED [3, 3]"

        out = execute(kc, C22_CELL1)
        assert out.error is None, out.error
        client = MlflowClient(out.stdout.strip().splitlines()[-1])
        out = execute(kc, C22_CELL2)
        assert out.error is not None and out.error["ename"] == "RankFailedError"

        msg_id = kc.execute(C22_CELL3)
        wait_for(
            lambda: _running_job_dir(client, "sgpu-case-C22", sgpu_home),
            START_DEADLINE_S,
            "the interrupted cell's ranks to run",
        )
        km.interrupt_kernel()
        out = collect(kc, msg_id, timeout_s=60)
        assert out.error is not None and out.error["ename"] == "JobCancelledError", out.error

        out = execute(kc, C22_CELL4)
        assert out.error is None, out.error
        assert out.stdout.strip() == "['FAILED', 'KILLED'] True"
        failed = runs_of(client, "sgpu-case-C22")[0]
        assert artifact_paths(client, failed.info.run_id, "logs") == ["logs/rank_0.log", "logs/rank_1.log"]
    finally:
        stop_kernel(km, kc)


UI_JOB = """%%distributed --gpus 1 -o ui_job
import mlflow
mlflow.log_metric("seen_by_ui", 7.0)
"""


@pytest.mark.slow
def test_kernel_sigkill_kills_the_running_jobs_run_and_the_mlflow_ui_server(tmp_path, sgpu_home):
    """``%mlflow_ui`` serves the runs on 127.0.0.1 and links jobs to it (also one started before it, in
    ``%distributed_jobs``); SIGKILLing the kernel while a job runs leaves the run KILLED with an end time
    (the launch host ends it), and the server gone."""
    from mlflow import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    name = f"kill-{uuid.uuid4().hex[:8]}"
    # the kernel's working directory holds the store: its path is not a secret (issue 18: it printed ***)
    km, kc = start_kernel(tmp_path, env={"PWD": str(sgpu_home), "OLDPWD": str(sgpu_home.parent)})
    try:
        out = execute(kc, f"import os\nos.environ['MLFLOW_EXPERIMENT_NAME'] = {name!r}")
        assert out.error is None, out.error
        out = execute(kc, UI_JOB.replace("ui_job", "early_job"))
        assert out.error is None, out.error
        out = execute(kc, "%mlflow_ui")
        assert out.error is None, out.error
        url = re.fullmatch(r"MLflow UI for (\S+): (http://127\.0\.0\.1:\d+)", out.stdout.strip())
        assert url and url.group(1) == os.environ["MLFLOW_TRACKING_URI"], out.stdout
        base = url.group(2)
        watchdog = ast.literal_eval(
            execute(kc, "from sgpu_magic.testing import mlflow_ui_pid\nprint(mlflow_ui_pid())").stdout
        )

        out = execute(kc, UI_JOB)
        assert out.error is None, out.error
        run_url, run_id = ast.literal_eval(execute(kc, "print(repr((ui_job.run_url, ui_job.mlflow_run_id)))").stdout)
        experiment_id = client.get_run(run_id).info.experiment_id
        assert run_url == f"{base}/#/experiments/{experiment_id}/runs/{run_id}"
        assert f"MLflow run: {run_url}" in out.stdout  # the summary line links it
        early_id = ast.literal_eval(execute(kc, "print(repr(early_job.mlflow_run_id))").stdout)
        table = execute(kc, "%distributed_jobs").results[0].splitlines()
        assert table[0].split()[-5:] == ["MLflow", "run", "what", "run", "page"], table
        for job_run in (early_id, run_id):  # the job from before %mlflow_ui is linked too
            row = next(row for row in table if job_run in row).split()
            assert job_run in row and row[-1] == f"{base}/#/experiments/{experiment_id}/runs/{job_run}", table
        with urllib.request.urlopen(f"{base}/api/2.0/mlflow/runs/get?run_id={run_id}", timeout=30) as reply:
            served = json.loads(reply.read())["run"]
        assert served["info"]["status"] == "FINISHED"
        assert {"key": "seen_by_ui", "value": 7.0} in [
            {k: m[k] for k in ("key", "value")} for m in served["data"]["metrics"]
        ]
        server = [p.pid for p in psutil.process_iter() if _pgid(p.pid) == watchdog]
        assert len(server) >= 2, "the watchdog and the server"

        kc.execute(C22_CELL3)
        wait_for(lambda: _running_job_dir(client, name, sgpu_home), START_DEADLINE_S, "the job's ranks to run")
        (running,) = runs_of(client, name)[2:]  # after early_job and ui_job
        t0 = time.monotonic()
        km.shutdown_kernel(now=True)  # SIGKILL: no code runs in the kernel

        def killed():
            run = client.get_run(running.info.run_id)
            return run if run.info.status != "RUNNING" else None

        wait_for(lambda: not [p for p in server if psutil.pid_exists(p)], 15, "the MLflow UI server to exit")
        server_gone_s = time.monotonic() - t0
        run = wait_for(killed, 30, "the launch host to end the run", interval_s=0.2)
        assert run.info.status == "KILLED" and run.info.end_time is not None
        print(
            f"after the kernel's SIGKILL: UI server gone in {server_gone_s:.1f} s, "
            f"run KILLED in {time.monotonic() - t0:.1f} s"
        )
    finally:
        stop_kernel(km, kc)


def _pgid(pid: int):
    try:
        return os.getpgid(pid)
    except OSError:
        return None


@distributed(gpus=2, widgets=False, timeout=120)
def holds_memory(folder):
    import os
    import time

    from sgpu_magic import runtime

    block = b"\1" * (200 << 20) if runtime.get_global_rank() == 1 else b""  # resident: every page written
    deadline = time.monotonic() + 100
    while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(block)


def test_each_rank_s_cpu_and_memory_are_sampled_and_its_peak_rss_reported(experiment, tmp_path, capsys):
    """The launch host samples each rank's CPU % and RSS about once a second into the job's status; when the job
    ends each rank's peak RSS is in the summary and in the job's MLflow run. Rank 1 holds 200 MiB more."""
    client, name = experiment
    job = holds_memory.submit(str(tmp_path))
    try:
        usage = wait_for(
            lambda: len(u := job.status.usage) == 2 and u[1].peak_rss_bytes - u[0].peak_rss_bytes > 150 << 20 and u,
            START_DEADLINE_S,
            "a sample of both ranks after rank 1 took its memory",
        )
        assert all(u.cpu_percent >= 0 and u.rss_bytes > 0 and u.time_s > job.submitted_s for u in usage.values())
    finally:
        (tmp_path / "go").touch()
    assert job.result(timeout_s=60) == [0, 200 << 20]
    peaks = {r: u.peak_rss_bytes for r, u in job.status.usage.items()}
    out = capsys.readouterr().out
    match = re.search(r"sgpu_magic: peak RSS per rank: rank 0 (\d+) MiB, rank 1 (\d+) MiB\n", out)
    assert match, out
    assert [int(m) for m in match.groups()] == [round(peaks[r] / 2**20) for r in (0, 1)]
    metrics = client.get_run(job.mlflow_run_id).data.metrics
    assert [metrics[f"system/rank_{r}_peak_rss_megabytes"] for r in (0, 1)] == [
        round(peaks[r] / 1e6, 1) for r in (0, 1)
    ]


@pytest.mark.slow  # ~60 s: 200 cells and 50 jobs, every write of theirs checked in the store
@pytest.mark.timeout(600)
def test_nothing_tracked_is_lost_off_the_path_200_session_cells_and_50_jobs(experiment):
    """Runs are made, parameterised and ended on the kernel's tracking worker, off every launch's and cell's path:
    once the session stops (and the jobs have returned), every param, tag, metric and artifact is in the store."""
    from sgpu_magic import Session

    client, name = experiment
    session = Session(gpus=2, widgets=False, mlflow_per_cell=True, name="tracked")
    try:
        session.run_cell("from sgpu_magic import runtime\nimport mlflow")
        for i in range(200):
            assert session.run_cell(
                f"runtime.log_metric('cell_rank' + str(runtime.get_global_rank()), {i}, step={i})\n{i}"
            ) == [i, i]
    finally:
        session.stop()

    @distributed(gpus=2, widgets=False)
    def job(i):
        if i % 10 == 0:  # a rank's first MLflow call imports mlflow there (2 s of CPU): every tenth job logs
            import os

            import mlflow

            # each rank's own step: MLflow keeps one of two equal points (key, value, step, ms), and the ranks
            # can log in the same millisecond
            mlflow.log_metric("job_value", i, step=int(os.environ["RANK"]))
        return i

    ids = []
    for i in range(50):
        assert job.distributed(i) == [i, i]
        ids.append(job.last_job.mlflow_run_id)
    assert wait_for_tracking(120.0)
    session_run = client.get_run(session.job.mlflow_run_id)
    assert session_run.info.status == "FINISHED"
    for rank in (0, 1):
        history = client.get_metric_history(session_run.info.run_id, f"cell_rank{rank}")
        assert sorted(m.step for m in history) == list(range(200)), rank
    cells = client.search_runs(
        [session_run.info.experiment_id], f"tags.mlflow.parentRunId = '{session_run.info.run_id}'", max_results=1000
    )
    assert len(cells) == 201 and {c.info.status for c in cells} == {"FINISHED"}
    assert all(c.data.params["world_size"] == "2" and c.data.tags["sgpu_magic.state"] == "succeeded" for c in cells)
    assert all(artifact_paths(client, c.info.run_id, "logs") == ["logs/rank_0.log", "logs/rank_1.log"] for c in cells)
    for i, run_id in enumerate(ids):
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.data.params["gpus"] == "2", i
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "job_value"))
        assert history == [(rank, float(i)) for rank in (0, 1)] * (i % 10 == 0), i
        assert run.data.tags["sgpu_magic.state"] == "succeeded" and run.info.end_time is not None
        assert artifact_paths(client, run_id, "logs") == ["logs/rank_0.log", "logs/rank_1.log"]
