"""Detached jobs (``detach=True``): ranks under the user's run keeper outlive the process that started them, any
process of the user attaches to them (every line from the first, the result, the MLflow run ended), and cancel,
stop or a killed keeper leave no process behind. Each test has a home of its own, so a keeper of its own."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import textwrap
from pathlib import Path

import pytest

from sgpu_magic import attach, detached_runs, distributed
from sgpu_magic.errors import LauncherError, SgpuError, SpecError
from sgpu_magic.front.detached import stop_detached
from sgpu_magic.launch.keeper import running_keeper

from helpers import run_until_killed, wait_for, wait_gone

START_DEADLINE_S = 120.0  # fresh ranks (and a fresh keeper importing torch) on a busy 2-core box


@pytest.fixture
def home(keeper_home):
    """The test's own sgpu_magic home and run keeper (the integration conftest's ``keeper_home``)."""
    return keeper_home


STARTER = textwrap.dedent(
    """
    import os, sys
    from sgpu_magic import distributed

    @distributed(gpus=2, widgets=False, detach=True, mlflow={mlflow})
    def lines(n):
        import time
        for i in range(n):
            print("line", i, flush=True)
            time.sleep(0.25)
        return n

    job = lines.submit({n})
    print("started", job.job_id, flush=True)
    while "line 1" not in job.logs(1):   # started, and printing
        job.wait(0.05)
    assert job.mlflow_run_id or not {mlflow}  # its run made (reading it waits for that)
    os._exit(9)  # as a killed kernel
    """
)


def start_and_die(n: int, mlflow: bool) -> str:
    """Start a detached 2-rank job printing ``n`` lines from a separate process, which is killed once rank 1 has
    printed two; returns the job's id."""
    return run_until_killed(STARTER.format(n=n, mlflow=mlflow), START_DEADLINE_S)[0]


def test_a_detached_job_outlives_its_process_and_attach_gives_every_line_its_result_and_its_mlflow_run(home, capsys):
    from mlflow import MlflowClient

    job_id = start_and_die(40, mlflow=True)  # 10 s: still running when this process attaches and takes stacks
    [run] = detached_runs()
    assert run.job_id == job_id and run.world_size == 2 and run.gpus == "cpu"
    job = attach(job_id, widgets=False)
    assert job.detached and job.job_id == job_id
    stacks = job.stacks()  # taken by the keeper, the ranks' tracer, for a kernel that did not start them
    assert sorted(stacks) == [0, 1], stacks
    assert all(stacks[r].startswith(f"rank {r} (pid ") and "lines (<string>:" in stacks[r] for r in (0, 1)), stacks
    assert job.result(timeout_s=60) == [40, 40]
    out = capsys.readouterr().out
    for rank in (0, 1):  # every line once: those printed before the attach, and after
        assert [line for line in out.splitlines() if line.startswith(f"[rank {rank}] line")] == [
            f"[rank {rank}] line {i}" for i in range(40)
        ]
    assert f"job {job_id} (attached) succeeded" in out
    client = MlflowClient(job.mlflow_tracking_uri)
    mlflow_run = client.get_run(job.mlflow_run_id)  # the run the dead process made, ended by this one
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.tags["sgpu_magic.state"] == "succeeded"
    assert sorted(a.path for a in client.list_artifacts(job.mlflow_run_id, "logs")) == [
        "logs/rank_0.log",
        "logs/rank_1.log",
    ]
    assert wait_gone([job.launcher.pid], 30) == []  # the keeper exits once it holds no run


@distributed(gpus=2, widgets=False, detach=True, mlflow=False, timeout=120)
def sleepers(piddir):
    import os
    import time

    open(os.path.join(piddir, str(os.getpid())), "w").close()
    time.sleep(100)


@pytest.mark.parametrize("how", ["cancel", "stop", "keeper SIGKILL"])
def test_cancel_stop_or_a_killed_keeper_leave_no_process_of_a_detached_job(home, tmp_path, how):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    job = sleepers.submit(str(piddir))
    ranks = {int(p) for p in wait_for(lambda: len(os.listdir(piddir)) == 2 and os.listdir(piddir), 120, "2 ranks")}
    keeper = running_keeper(home)
    assert keeper is not None and job.launcher.pid == keeper.pid
    if how == "cancel":
        assert job.cancel()
        assert job.state.value == "cancelled"
    elif how == "stop":
        assert stop_detached(job.job_id[-6:]) == f"job {job.job_id}: cancelled"
        assert job.wait(30).value == "cancelled"
        assert stop_detached(job.job_id) == f"job {job.job_id} already ended: cancelled"
    else:
        os.kill(keeper.pid, signal.SIGKILL)
        with pytest.raises(
            LauncherError, match=rf"the run keeper died while job {job.job_id} ran; see .*keeper-.*\.log"
        ):
            job.result(timeout_s=30)
    assert wait_gone(ranks | {keeper.pid}, 30) == []


@distributed(gpus=1, widgets=False, mlflow=False)
def plain():
    return 1


def test_attach_and_stop_name_what_is_not_a_detached_run_of_yours(home):
    with pytest.raises(
        SgpuError, match=r"^you have no detached run on this machine; start one with detach=True / --detach$"
    ):
        attach()
    assert plain.distributed() == [1]
    plain_id = plain.last_job.job_id
    with pytest.raises(
        SgpuError,
        match=rf"^'{plain_id}' matches no detached run of yours on this machine \(detached runs: none\); give more of the id, as %distributed_jobs --all lists them \(a job started without detach=True cannot be attached\)$",
    ):
        attach(plain_id)
    with pytest.raises(SgpuError, match=r"^'nope' matches no detached run"):
        stop_detached("nope")


def test_detach_is_taken_with_a_cluster_and_refused_as_a_string():
    assert distributed(gpus=2, detach=True, cluster="auto")(lambda: 1).spec.detach  # a job on a cluster may detach
    with pytest.raises(
        SpecError,
        match=r"^detach must be True or False \(run under the run keeper, so the job outlives the kernel\); got 'yes'$",
    ):
        distributed(gpus=2, detach="yes")


def test_a_keeper_socket_path_too_long_is_refused_naming_the_remedy(tmp_path, monkeypatch):
    from sgpu_magic.launch.keeper import get_keeper

    home = tmp_path / ("h" * 100)
    monkeypatch.setenv("SGPU_MAGIC_HOME", str(home))
    with pytest.raises(
        LauncherError,
        match=r"^the sgpu_magic run keeper did not start: the run keeper's socket path .* is longer than the 107 bytes a Unix socket may have; set SGPU_MAGIC_HOME to a shorter private directory$",
    ):
        get_keeper()


NOBODY = 65534


def _as_nobody(action) -> str:
    """Run ``action()`` in a fork of this process that has become uid/gid 65534 (no supplementary groups): the
    code of sgpu_magic as the test process has it loaded, as another user; what it raised, as ``Type: message``
    (``""``: nothing)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only what is loaded already runs here, then it exits at once
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                action()
                said = ""
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                said = f"{type(exc).__name__}: {exc}"
            os.write(write_fd, said.encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        said = pipe.read().decode()
    os.waitpid(pid, 0)
    return said


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to a second uid needs root")
def test_another_user_cannot_list_attach_to_or_stop_your_detached_runs(tmp_path, monkeypatch):
    import socket

    shared = Path(tempfile.mkdtemp(prefix="sgpu-shared-"))  # a folder every user may enter: only sgpu_magic's own
    os.chmod(shared, 0o711)  # modes keep the other user out
    home = shared / "home"
    monkeypatch.setenv("SGPU_MAGIC_HOME", str(home))
    monkeypatch.setenv("SGPU_MAGIC_KEEPER_LINGER_S", "0.5")
    piddir = tmp_path / "pids"
    piddir.mkdir()
    job = sleepers.submit(str(piddir))
    try:
        wait_for(lambda: len(os.listdir(piddir)) == 2, 120, "2 ranks")
        keeper = running_keeper(home)
        assert keeper is not None
        assert oct(os.stat(home / "runs").st_mode & 0o777) == "0o700"
        assert oct(os.stat(keeper.paths.socket).st_mode & 0o777) == "0o600"

        def connect():
            socket.socket(socket.AF_UNIX).connect(str(keeper.paths.socket))

        tries = {
            "list": detached_runs,
            "attach": lambda: attach(job.job_id),
            "stop": lambda: stop_detached(job.job_id),
            "connect to the keeper": connect,
            "read the attach record": lambda: (home / "runs" / job.job_id / "attach.pkl").read_bytes(),
        }
        said = {what: _as_nobody(action) for what, action in tries.items()}
        assert all(text.startswith("PermissionError: ") for text in said.values()), said
        assert "owned by uid 0, not by you" in said["list"], said
        assert job.state.value == "running"  # untouched
    finally:
        job.cancel()
        shutil.rmtree(shared, ignore_errors=True)


def test_the_magics_list_attach_to_and_stop_detached_runs_and_name_a_bad_line(home, ip, capsys):
    from IPython.core.error import UsageError

    for line, said in (
        ("", r"^give a detached run's id \(see %distributed_jobs --all\) or --last, e.g. %distributed_attach --last$"),
        ("abc --last", r"^give a detached run's id"),
        ("--last", r"^you have no detached run on this machine; start one with detach=True / --detach$"),
        ("--last -o 1x", r"^-o/--output takes a Python variable name"),
    ):
        with pytest.raises(UsageError, match=said):
            ip.run_line_magic("distributed_attach", line)
    for line, said in (
        ("--all --stop abc", r"^give --all \(to list\) or --stop JOB_ID \(to stop one\), not both$"),
        ("--stop nope", r"^'nope' matches no detached run of yours on this machine"),
        ("--every", r"^unrecognized arguments: --every\nusage: %distributed_jobs"),
    ):
        with pytest.raises(UsageError, match=said):
            ip.run_line_magic("distributed_jobs", line)
    assert repr(ip.run_line_magic("distributed_jobs", "--all")) == (
        "no detached runs of yours on this machine (start one with detach=True / --detach)"
    )

    assert ip.run_cell_magic("distributed", "--gpus 2 --detach --no-widgets --no-mlflow -o dj", "6 * 7") == 42
    job = ip.user_ns["dj"]
    assert job.detached and job.state.value == "succeeded"
    table = repr(ip.run_line_magic("distributed_jobs", "--all")).splitlines()
    assert table[0].split() == ["job", "state", "age", "world", "size", "GPUs", "MLflow", "run"]
    assert table[1].split()[:2] == [job.job_id, "succeeded"] and table[1].split()[-3:] == ["2", "cpu", "-"]
    capsys.readouterr()
    again = ip.run_line_magic("distributed_attach", "--last --no-widgets -o again")  # an ended run, rebuilt
    assert again is ip.user_ns["again"] and again is not job and again.result(timeout_s=30) == [42, 42]
    assert f"job {job.job_id} (attached) succeeded" in capsys.readouterr().out
    ip.run_line_magic("distributed_jobs", f"--stop {job.job_id}")
    assert capsys.readouterr().out == f"job {job.job_id} already ended: succeeded\n"


SESSION_STARTER = textwrap.dedent(
    """
    import os
    from sgpu_magic import Session

    sess = Session(gpus=2, widgets=False, mlflow=False, detach=True, name="train", idle_timeout={idle})
    sess.run_cell("import torch\\ntorch.manual_seed(0)\\nmodel = torch.nn.Linear(3, 1)\\n"
                  "w = model.weight.sum().item() + int(os.environ['RANK'])")
    print("started", sess.job.job_id, *sess.pull("w"), flush=True)
    os._exit(9)  # as a killed kernel
    """
)


def start_session_and_die(idle: float | None) -> tuple[str, list[float]]:
    """Start a detached 2-rank session named ``train`` whose ranks hold a model and ``w`` (rank 1's is rank 0's
    plus 1) from a process that is then killed; returns the session job's id and ``w`` of each rank."""
    job_id, *w = run_until_killed(SESSION_STARTER.format(idle=idle), START_DEADLINE_S)
    return job_id, [float(x) for x in w]


def test_a_detached_session_outlives_its_process_and_attach_runs_cells_on_its_ranks_with_their_state(home):
    from sgpu_magic import Session, current_session

    job_id, w = start_session_and_die(idle=None)
    assert w[1] == w[0] + 1
    sess = attach(widgets=False)
    assert isinstance(sess, Session) and sess.name == "train" and sess.job.job_id == job_id
    assert current_session() is sess and sess.state.value == "idle"
    assert sess.pull("w") == w  # the state the ranks kept
    assert sess.run_cell("model.weight.shape[1] * 10 + int(os.environ['RANK'])") == [30, 31]
    assert attach(job_id[-6:]) is sess  # followed here already
    ranks, keeper = list(sess.pids.values()), sess.job.launcher.pid
    sess.stop()
    assert sess.job.state.value == "succeeded"
    assert wait_gone([*ranks, keeper], 30) == []


def test_a_detached_session_never_attached_again_ends_after_its_idle_timeout(home):
    import json

    job_id, _ = start_session_and_die(idle=1)
    status = home / "runs" / job_id / "status.json"
    ended = wait_for(
        lambda: (s := json.loads(status.read_text())).get("state") in ("succeeded", "failed") and s, 60, "its end"
    )
    assert ended["state"] == "succeeded", ended
    assert wait_gone([int(p) for p in ended["pids"].values()] + [ended["host_pid"]], 30) == []
