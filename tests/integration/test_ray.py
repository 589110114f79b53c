"""Jobs on a Ray cluster (sgpu_magic.launch.ray.cluster): a real two-node Ray cluster on this machine.

``ray.cluster_utils.Cluster`` starts a head node and a worker node (each its own raylet, with 2
CPUs), as Ray's own tests do; jobs run with ``cluster=<its address>``. Skipped without Ray
(``pip install "sgpu_magic[ray]"``).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
from pathlib import Path

import psutil
import pytest

from sgpu_magic.rundir import RunDir, read_json

ray = pytest.importorskip("ray")

from sgpu_magic import distributed  # noqa: E402
from sgpu_magic.errors import JobCancelledError, RankFailedError, ResourceError  # noqa: E402

from helpers import (  # noqa: E402
    OOM_HINT,
    check_each_failed_attempt_kept,
    check_killed_once_and_restarted,
    flaky_rank,
    job_processes,
    run_until_killed,
    wait_for,
    wait_gone,
)
from kernel_utils import execute, start_kernel, stop_kernel  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _nothing_kept_warm_after_a_test():
    """Each test starts with the cluster's resources free: what a test's jobs kept warm is given back after it (the
    warm tests below keep and take it within one test)."""
    yield
    import sgpu_magic

    sgpu_magic.release()


def _agent_processes(marks=("RankAgent", "sgpu_magic.launch.ray.zygote")) -> list[int]:
    """The live processes of rank agents (Ray workers of the RankAgent actor) and of their zygotes on this machine."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(mark in cmdline for mark in marks):
            found.append(p.pid)
    return found


def _placement_group_state(name: str) -> set[str]:
    from ray.util.placement_group import placement_group_table

    return {pg["state"] for pg in placement_group_table().values() if pg["name"] == name}


def _status_file(job) -> dict:
    """The job's status.json as its launcher wrote it (every key, not only the typed ones of job.status)."""
    return read_json(RunDir(job.run_dir).status_file)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    for attempt in (1, 2):  # a raylet gets 30 s (hard-coded in Ray) to register: a busy 2-core machine may miss it
        c = Cluster(initialize_head=False, connect=False)
        try:
            c.add_node(num_cpus=2, include_dashboard=False)
            c.add_node(num_cpus=2)
            c.wait_for_nodes()
            break
        except Exception:
            c.shutdown()
            if attempt == 2:
                raise
    yield c
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


def test_a_4_rank_ddp_job_spreads_over_both_nodes(cluster, monkeypatch):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "ray-tests")

    @distributed(gpus=4, cluster=cluster.address, timeout=300, widgets=False)
    def ddp_step():
        import os

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        model(torch.ones(8, 4)).sum().backward()
        grad = model.module.weight.grad.clone()
        from sgpu_magic import runtime

        for step in range(2):
            runtime.log_metric("loss", dist.get_rank() + step, step=step)
        print(f"rank {dist.get_rank()} of {dist.get_world_size()} on node {os.environ['GROUP_RANK']}", flush=True)
        return {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")} | {
            "grad": grad.tolist()
        }

    results = ddp_step.distributed()
    assert [r["RANK"] for r in results] == ["0", "1", "2", "3"]  # rank order, as on one machine
    assert [(r["GROUP_RANK"], r["LOCAL_RANK"]) for r in results] == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert {r["LOCAL_WORLD_SIZE"] for r in results} == {"2"}
    assert len({str(r["grad"]) for r in results}) == 1  # gradients all-reduced across both nodes
    job = ddp_step.last_job
    assert _status_file(job)["start_method"] == "ray" and len(set(_status_file(job)["nodes"].values())) >= 1
    for rank in range(4):
        assert f"rank {rank} of 4 on node {rank // 2}" in job.logs(rank)  # logs came back into the run dir
    assert job.metrics() == {"loss": {r: [(0, float(r)), (1, r + 1.0)] for r in range(4)}}  # and the metrics
    assert not job_processes(job.job_id)
    from mlflow import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.get_run(job.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "4"
    assert sorted(a.path for a in client.list_artifacts(job.mlflow_run_id, "logs")) == [
        f"logs/rank_{r}.log" for r in range(4)
    ]  # the ranks' logs kept as run artifacts


def test_remote_true_and_scripts_run_on_the_kernels_remote_cluster(cluster, ip, monkeypatch, tmp_path):
    """The serverless GPU API's ``remote=True`` goes to the configured remote cluster through the Ray path, for
    the decorator (trait), ``run_script`` and ``%distributed_run --remote`` (environment variable)."""
    from sgpu_magic import run_script

    monkeypatch.delenv("SGPU_MAGIC_REMOTE_CLUSTER", raising=False)
    ip.run_line_magic("config", f"DistributedMagics.remote_cluster = {cluster.address!r}")
    try:

        @distributed(gpus=2, remote=True, mlflow=False, widgets=False)
        def where():
            import os

            return os.environ["GROUP_RANK"], os.environ["WORLD_SIZE"]

        assert where.spec.cluster == cluster.address
        assert where.distributed() == [("0", "2"), ("0", "2")]
        assert _status_file(where.last_job)["start_method"] == "ray"
    finally:
        ip.run_line_magic("config", "DistributedMagics.remote_cluster = ''")
    monkeypatch.setenv("SGPU_MAGIC_REMOTE_CLUSTER", cluster.address)
    script = tmp_path / "report.py"
    script.write_text("import os, sys\nprint('rank', os.environ['RANK'], 'argv', sys.argv[1:], 'main', __name__)\n")
    job = run_script(
        str(script), ["--flag", "x"], num_accelerators=2, remote=True, mlflow=False, widgets=False, background=True
    )
    assert job.result(timeout_s=300) == [0, 0] and _status_file(job)["start_method"] == "ray"
    assert "rank 1 argv ['--flag', 'x'] main __main__" in job.logs(1)
    ip.run_line_magic("distributed_run", f"--gpus 2 --remote --no-mlflow --no-widgets -o remote_job {script} y")
    assert ip.user_ns["remote_job"].result() == [0, 0] and "argv ['y']" in ip.user_ns["remote_job"].logs(0)


def test_step_times_the_straggler_and_the_profile_come_back_from_the_nodes(cluster):
    """The same figures as a local job's: each rank's steps (metrics files read from its node), the straggler, and a
    profiled job's traces and figures brought back from both nodes into one merged trace."""

    @distributed(gpus=2, cluster=cluster.address, timeout=300, mlflow=False, widgets=False, profile=3)
    def uneven(steps):
        import time

        import torch
        import torch.distributed as dist

        from sgpu_magic import runtime

        dist.init_process_group("gloo")
        for _ in range(steps):
            with runtime.step():
                if runtime.get_global_rank() == 1:
                    time.sleep(0.03)
                dist.all_reduce(torch.ones(4))
        dist.destroy_process_group()

    uneven.distributed(12)
    job = uneven.last_job
    assert [len(t) for t in job.step_times().values()] == [12, 12]
    assert job.straggler() is not None and job.straggler().rank == 1
    assert sorted(job.profile_summary()) == [0, 1] and all(s["steps"] == 3 for s in job.profile_summary().values())
    trace = json.loads(job.profile_trace().read_bytes())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}


def _line_of(text: str) -> int:
    """The line of this file that holds ``text`` (where a rank's stack names it)."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip() == text)


def test_stacks_of_ray_ranks_are_taken_on_their_nodes_live_and_when_the_job_times_out(cluster):
    """The twin of test_stacks.py's hang on one machine: rank 0 waits in dist.broadcast for rank 1, which sleeps in
    a loop. job.stacks() reads both through their agents (py-spy on each rank's node) while they run, and the
    timeout stops the job (test_a_job_past_its_timeout_is_stopped, before) and its error names where each rank
    was, their stacks kept in the run directory as locally."""
    from sgpu_magic.errors import JobTimeoutError

    @distributed(gpus=2, cluster=cluster.address, timeout=40, mlflow=False, widgets=False)
    def hangs():
        import time

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.zeros(1)
        if dist.get_rank() == 0:
            dist.broadcast(t, src=1)  # ray stacks: rank 0 waits here
        while True:
            time.sleep(0.05)  # ray stacks: rank 1 loops here

    here = f"{__file__} line "
    at0 = f"dist.broadcast at {here}{_line_of('dist.broadcast(t, src=1)  # ray stacks: rank 0 waits here')}"
    at1 = f"time.sleep at {here}{_line_of('time.sleep(0.05)  # ray stacks: rank 1 loops here')}"

    def in_place(job):
        if job.state.value != "running":
            return None
        stacks = job.stacks()
        firsts = [stacks[r].splitlines()[0] for r in (0, 1)]
        return stacks if firsts[0].endswith(at0) and firsts[1].endswith(at1) else None

    job = hangs.submit()
    stacks = wait_for(lambda: in_place(job), 35, "rank 0 in dist.broadcast and rank 1 in time.sleep")
    assert re.fullmatch(rf"rank 0 \(pid \d+\): {re.escape(at0)}", stacks[0].splitlines()[0])
    assert "        dist.broadcast(t, src=1)  # ray stacks: rank 0 waits here" in stacks[0].splitlines()
    error = job.exception(timeout_s=90)
    assert isinstance(error, JobTimeoutError) and "ran longer than its timeout of 40 s; every rank was stopped" in str(
        error
    )
    assert wait_for(lambda: not job_processes(job.job_id), 30, "the ranks to stop")
    stacks_dir = job.run_dir / "stacks"
    assert f"Where the ranks still running were: rank 0: {at0}; rank 1: {at1} (their stacks: {stacks_dir})" in str(
        error
    )
    assert job.status.stacks == {0: at0, 1: at1}
    for rank, at in ((0, at0), (1, at1)):
        path = stacks_dir / f"rank_{rank}.txt"
        assert oct(path.stat().st_mode & 0o777) == "0o600" and path.read_text().splitlines()[0].endswith(at)
    assert oct(stacks_dir.stat().st_mode & 0o777) == "0o700"
    with pytest.raises(Exception, match=rf"^job {job.job_id} has ended \(timed_out\): its ranks are gone; the stacks"):
        job.stacks()


def test_ray_ranks_usage_is_sampled_on_their_nodes_as_the_launch_host_samples_its_own(cluster, tmp_path):
    """Parity with a job on this machine (test_panel's usage tests): each rank's CPU %, RSS and peak RSS, sampled
    by its agent on its node about once a second, are in job.status.usage while the job runs and after it ends."""
    gate = tmp_path / "go"

    @distributed(gpus=2, cluster=cluster.address, timeout=120, mlflow=False, widgets=False)
    def busy(gate: str, nbytes: int):
        import os

        held = bytearray(nbytes)  # resident: every page written
        held[::4096] = b"x" * len(held[::4096])
        while not os.path.exists(gate):
            sum(range(10_000))  # busy: a CPU % above 0
        return len(held)

    nbytes = 64 * 2**20
    job = busy.submit(str(gate), nbytes)

    def sampled():
        usage = job.status.usage
        if set(usage) != {0, 1} or any(u.rss_bytes < nbytes or u.cpu_percent <= 0 for u in usage.values()):
            return None
        return usage

    usage = wait_for(sampled, 90, "both ranks' usage with their 64 MiB resident and a busy CPU")
    assert all(u.peak_rss_bytes >= u.rss_bytes and u.time_s > 0 for u in usage.values())
    gate.touch()
    assert job.result(timeout_s=60) == [nbytes, nbytes]
    assert set(job.status.usage) == {0, 1}  # the last figures stay once the job has ended


def test_a_quiet_ray_job_is_possibly_stuck_with_each_ranks_stack_until_it_writes_again(cluster, tmp_path):
    """test_forensics.py's hang detector on the cluster: the supervisor watches the logs and metrics it copies from
    the nodes, as the launch host watches its own, and takes the quiet ranks' stacks through their agents."""
    gate = tmp_path / "go"

    @distributed(gpus=2, cluster=cluster.address, timeout=300, mlflow=False, widgets=False, stuck_after_s=2)
    def quiet_until_gate(gate: str):
        import os
        import time

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            dist.broadcast(torch.zeros(1), src=1)  # ray stuck: rank 0 waits here
        while not os.path.exists(gate):
            time.sleep(0.05)  # ray stuck: rank 1 waits here
        while True:
            print("progress", flush=True)
            time.sleep(0.2)

    here = f"{__file__} line "
    expected = {
        0: f"dist.broadcast at {here}{_line_of('dist.broadcast(torch.zeros(1), src=1)  # ray stuck: rank 0 waits here')}",
        1: f"time.sleep at {here}{_line_of('time.sleep(0.05)  # ray stuck: rank 1 waits here')}",
    }
    job = quiet_until_gate.submit(str(gate))
    try:
        wait_for(lambda: job.status.stuck and job.status.stuck.stacks == expected, 90, "the stuck report")
        assert job.status.stuck.stuck_after_s == 2 and job.state.value == "running"
        gate.touch()  # rank 1 writes again: the report goes
        wait_for(lambda: job.status.stuck is None, 60, "the stuck report to clear")
    finally:
        job.cancel()
    assert isinstance(job.exception(timeout_s=60), JobCancelledError) and job.status.stuck is None


def test_a_sigkilled_ray_rank_gets_the_oom_verdict_of_its_node_as_a_local_rank_does(cluster):
    """test_forensics.py's SIGKILL on the cluster: the rank's agent judges on its node whether the OOM killer ended
    it (its kernel log, its memory cgroup), and the job's error says it in the same words as on one machine."""

    @distributed(gpus=1, cluster=cluster.address, timeout=120, mlflow=False, widgets=False)
    def killed():
        import os

        print("about to crash", flush=True)
        os.kill(os.getpid(), 9)

    with pytest.raises(RankFailedError) as caught:
        killed.distributed()
    root = caught.value.root_cause
    assert root.exitcode == -9 and root.exc_type is None and root.oom_killed is None
    assert re.fullmatch(OOM_HINT, root.oom), root.oom
    lines = str(caught.value).splitlines()
    assert lines[0] == "rank 0 failed (root cause): exited without a Python exception (killed by signal SIGKILL (9))"
    assert lines[1] == f"  {root.oom}" and "    | about to crash" in lines


def _flaky_on(cluster):
    return distributed(gpus=2, cluster=cluster.address, max_restarts=2, mlflow=False, widgets=False, timeout=300)(
        flaky_rank
    )


def test_a_ray_rank_killed_once_is_restarted_on_its_agents_and_attempt_2_succeeds(cluster):
    """test_restarts.py's twin: torchrun's restart policy on the cluster (every rank again, same agents, a fresh
    store), each attempt's record kept, the logs going on after a line naming the attempt."""
    check_killed_once_and_restarted(_flaky_on(cluster))


def test_each_failed_ray_attempts_errors_are_kept_and_the_last_one_fails_the_job(cluster):
    check_each_failed_attempt_kept(_flaky_on(cluster))


def test_the_first_failing_rank_is_the_root_cause_and_the_rest_stop(cluster):
    @distributed(gpus=4, cluster=cluster.address, timeout=300, mlflow=False, widgets=False)
    def fails_on_rank_2():
        import time

        import torch.distributed as dist

        dist.init_process_group("gloo")
        if dist.get_rank() == 2:
            raise ValueError("bad shard on rank 2")
        time.sleep(600)

    with pytest.raises(
        RankFailedError, match=r"rank 2 failed \(root cause\): ValueError: bad shard on rank 2"
    ) as caught:
        fails_on_rank_2.distributed()
    assert "bad shard on rank 2" in caught.value.root_cause.traceback
    assert wait_for(lambda: not job_processes(fails_on_rank_2.last_job.job_id), 30, "the other ranks to stop")


def test_a_rank_that_wedges_after_returning_keeps_its_value_after_the_grace(cluster):
    """As on one machine: the rank's agent ends it teardown_grace_s after its value is written, and the job succeeds."""

    @distributed(gpus=2, cluster=cluster.address, timeout=300, mlflow=False, widgets=False, teardown_grace_s=1)
    def returns_then_wedges():
        import atexit
        import os
        import threading

        lock = threading.Lock()
        lock.acquire()
        if os.environ["RANK"] == "1":
            atexit.register(lock.acquire)  # its exit path waits for good
        return int(os.environ["RANK"])

    assert returns_then_wedges.distributed() == [0, 1]
    assert returns_then_wedges.last_job.notes == [
        "rank 1 needed the teardown grace: it returned its value but had not exited 1 s later (teardown_grace_s), "
        "so sgpu_magic ended it (SIGTERM); its value is kept"
    ]
    assert wait_for(lambda: not job_processes(returns_then_wedges.last_job.job_id), 30, "the ranks to stop")


def test_cancel_stops_every_rank_and_release_gives_the_placement_group_back(cluster):
    @distributed(gpus=4, cluster=cluster.address, timeout=300, mlflow=False, widgets=False)
    def sleeper():
        import time

        print("sleeping", flush=True)
        time.sleep(600)

    job = sleeper.submit()
    wait_for(lambda: all("sleeping" in job.logs(r) for r in range(4)), 120, "every rank to start")
    job.cancel()
    assert isinstance(job.exception(timeout_s=60), JobCancelledError)
    assert job.state.value == "cancelled"
    wait_for(lambda: not job_processes(job.job_id), 30, "the ranks to stop")
    pids = [int(p) for p in _status_file(job)["pids"].values()]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    import sgpu_magic

    # its bundles and agents are kept for the next job of its shape, until given back
    (released,) = sgpu_magic.release()
    assert re.fullmatch(
        rf"4 warm rank agent\(s\) and placement group sgpu_magic-{job.job_id} \(4 x 1 CPU\) on the Ray cluster, "
        r"held since \d\d:\d\d:\d\d",
        released,
    ), released
    assert sgpu_magic.release() == []  # nothing held any more
    wait_for(lambda: _placement_group_state(f"sgpu_magic-{job.job_id}") == {"REMOVED"}, 30, "the group's removal")
    wait_for(lambda: not _agent_processes(), 60, "the agents and their zygotes to end")


def test_a_cluster_too_small_says_so_and_no_wait_fails_at_once(cluster):
    with pytest.raises(ResourceError, match=r"has 4 CPUs in all, fewer than the 9 ranks asked for"):
        distributed(gpus=9, cluster=cluster.address, mlflow=False, widgets=False)(lambda: 1).distributed()

    @distributed(gpus=4, cluster=cluster.address, timeout=300, mlflow=False, widgets=False)
    def hold():
        import time

        print("holding", flush=True)
        time.sleep(600)

    holder = hold.submit()
    try:
        wait_for(lambda: all("holding" in holder.logs(r) for r in range(4)), 120, "the holder's ranks")
        with pytest.raises(ResourceError, match=r"has 0 of 4 CPUs free, the job needs 2; wait=False / --no-wait"):
            distributed(gpus=2, cluster=cluster.address, wait=False, mlflow=False, widgets=False)(
                lambda: 1
            ).distributed()
        waiting = distributed(gpus=2, cluster=cluster.address, mlflow=False, widgets=False)(lambda: 1).submit()
        wait_for(
            lambda: (
                "waiting for 2 CPU bundle(s) on the Ray cluster: 0 of 4 CPUs free" in (waiting.pending_reason or "")
            ),
            60,
            "the pending job to say what it waits for",
        )
        holder.cancel()
        assert waiting.result(timeout_s=120) == [1, 1]  # it starts once the CPUs are free
    finally:
        holder.cancel()


def test_kernel_sigkill_leaves_no_actor_or_rank(cluster, tmp_path):
    """The kernel is the Ray driver: when it is SIGKILLed, Ray removes its actors, and the ranks die with them."""
    km, kc = start_kernel(cwd=tmp_path, env={"SGPU_MAGIC_WIDGETS": "0"})
    try:
        code = (
            f"%%distributed --gpus 4 --cluster {cluster.address} --no-mlflow\n"
            "import os, time\nprint('job', os.environ['SGPU_MAGIC_JOB_ID'], flush=True)\ntime.sleep(600)"
        )
        kc.execute(code)
        job_id = None

        def started():
            nonlocal job_id
            try:
                msg = kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                msg = {"msg_type": None, "content": {}}
            text = msg["content"].get("text", "") if msg["msg_type"] == "stream" else ""
            for line in text.splitlines():
                if line.startswith("[rank ") and " job " in line:
                    job_id = line.split()[-1]
            return job_id is not None and len(job_processes(job_id)) == 4

        wait_for(started, 180, "the 4 ranks to run")
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        wait_for(lambda: not job_processes(job_id), 60, "Ray to remove the dead kernel's actors and their ranks")
        # An actor's worker process exits a moment after its rank children; Ray must end it, not leave it idle.
        wait_for(
            lambda: (
                not [p for p in psutil.process_iter(["cmdline"]) if "RankAgent" in " ".join(p.info["cmdline"] or [])]
            ),
            60,
            "Ray to end the dead kernel's RankAgent actor processes",
        )
    finally:
        stop_kernel(km, kc)


def test_gpu_ranks_see_their_nodes_gpus_in_local_rank_order(tmp_path):
    """torchrun's contract on GPU nodes: each local rank sees the node's job GPUs and takes cuda:LOCAL_RANK."""
    from sgpu_magic.launch.ray.launcher import _Supervisor
    from sgpu_magic.rundir import RunDir
    from sgpu_magic.wire import LaunchRecord

    rd = RunDir.create(tmp_path)
    rd.write_launch(LaunchRecord(job_id=rd.job_id, world_size=4, backend="nccl", cwd=str(tmp_path), sys_path=()))
    sup = _Supervisor(rd, "auto", None)
    nodes = [("a", "10.0.0.1", ["3"]), ("a", "10.0.0.1", ["1"]), ("b", "10.0.0.2", ["0"]), ("b", "10.0.0.2", ["5"])]
    envs = [sup._rank_env(r, nodes, 29500) for r in range(4)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,1", "3,1", "0,5", "0,5"]
    assert [(e["GROUP_RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "2"),
        ("0", "1", "2"),
        ("1", "0", "2"),
        ("1", "1", "2"),
    ]
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"} and {e["GROUP_WORLD_SIZE"] for e in envs} == {"2"}


def test_a_kernel_connected_to_one_cluster_refuses_another(cluster):
    from sgpu_magic.launch.ray import cluster as ray_cluster

    ray_cluster.connect(cluster.address)
    with pytest.raises(
        ResourceError,
        match=r"this kernel is connected to the Ray cluster '.*', not '127.0.0.1:9'; a "
        r"kernel uses one Ray cluster at a time",
    ):
        distributed(gpus=2, cluster="127.0.0.1:9", mlflow=False, widgets=False)(lambda: 1).distributed()


def test_a_second_job_of_its_shape_forks_its_ranks_on_the_warm_agents_and_sees_a_module_edit(
    cluster, ip, tmp_path, monkeypatch
):
    """Issue 34: the placement group and agents of a job are kept; the next job of its shape forks its ranks from each
    agent's zygote (torch preloaded), with the same contract (rank env, collectives, results in rank order), and a
    module of the notebook's edited between the jobs is imported afresh, as it is locally."""
    from sgpu_magic.launch.ray.warm import WARM

    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "sgpu_ray_mod.py"

    @distributed(gpus=4, cluster=cluster.address, timeout=300, mlflow=False, widgets=False)
    def read_value():
        import os

        import sgpu_ray_mod
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        print(f"rank {os.environ['RANK']} reads {sgpu_ray_mod.VALUE}", flush=True)
        return sgpu_ray_mod.VALUE, t.item(), os.environ["RANK"], os.environ["LOCAL_RANK"], os.getpid()

    module.write_text("VALUE = 1\n")
    first = read_value.distributed()
    assert [v[:2] for v in first] == [(1, 4.0)] * 4 and "warm_agents" not in _status_file(read_value.last_job)
    held = WARM.held()
    assert held is not None and held.name == f"sgpu_magic-{read_value.last_job.job_id}"
    wait_for(lambda: all(ray.get([a.warm.remote() for a in held.actors])), 180, "the agents' zygotes to preload torch")
    table = repr(ip.run_line_magic("distributed_jobs", ""))
    assert f"Ray: 4 warm rank agent(s) and placement group {held.name} (4 x 1 CPU) on the Ray cluster" in table
    assert "given back after 180 s with no job (sgpu_magic.release() now)" in table
    from sgpu_magic.front.doctor import diagnose

    (ray_row,) = [row for row in diagnose().rows if row.name == "ray"]  # the doctor says it too
    assert f"this kernel is connected to the Ray cluster {cluster.address!r}" in ray_row.details
    assert f"4 warm rank agent(s) and placement group {held.name}" in ray_row.details

    module.write_text("VALUE = 22\n")  # edited between the jobs
    second = read_value.distributed()
    job = read_value.last_job
    assert [v[:4] for v in second] == [(22, 4.0, str(r), str(r % 2)) for r in range(4)]
    status = _status_file(job)
    assert status["warm_agents"] is True and status["forked_ranks"] == 4
    assert {v[4] for v in second}.isdisjoint(v[4] for v in first)  # fresh rank processes, forked
    assert all(f"rank {r} reads 22" in job.logs(r) for r in range(4))  # the logs come back as from cold ranks
    assert WARM.held() is not None and WARM.held().name == held.name  # parked again for the next one


def test_a_job_of_another_shape_and_the_keep_warm_time_give_the_warm_set_back(cluster, ip):
    """A job that needs other bundles gives the held set back first (so its own placement group gets the CPUs); an
    idle set goes after ray_keep_warm_s, and with it its placement group and agents."""
    from sgpu_magic.launch.ray.warm import WARM

    two = distributed(gpus=2, cluster=cluster.address, timeout=300, mlflow=False, widgets=False)(lambda: 2)
    four = distributed(gpus=4, cluster=cluster.address, timeout=300, mlflow=False, widgets=False)(lambda: 4)
    assert two.distributed() == [2, 2]
    two_set = WARM.held().name
    ip.run_line_magic("config", "DistributedMagics.ray_keep_warm_s = 2")
    try:
        assert four.distributed() == [4] * 4  # the 2 held CPUs are given back: 4 of 4 are needed
        assert (two_set, "a job of another shape") in WARM.released
        four_set = WARM.held().name
        wait_for(lambda: WARM.held() is None, 60, "the idle set to be given back")
        assert WARM.released[-1] == (four_set, "idle for 2 s")
        wait_for(lambda: _placement_group_state(four_set) == {"REMOVED"}, 30, "its placement group's removal")
        wait_for(lambda: not _agent_processes(), 60, "its agents and their zygotes to end")
        ip.run_line_magic("config", "DistributedMagics.ray_keep_warm_s = 0")
        assert two.distributed() == [2, 2] and WARM.held() is None  # 0 keeps nothing
        last = f"sgpu_magic-{two.last_job.job_id}"
        wait_for(lambda: _placement_group_state(last) == {"REMOVED"}, 30, "the group of a job with 0 keep-warm")
    finally:
        ip.run_line_magic("config", "DistributedMagics.ray_keep_warm_s = None")


def test_a_bad_keep_warm_time_is_refused_before_the_job_starts(cluster, ip, monkeypatch, caplog):
    from sgpu_magic.errors import SpecError
    from sgpu_magic.launch.ray.warm import DEFAULT_KEEP_WARM_S, keep_warm_s

    ip.run_line_magic("config", "DistributedMagics.ray_keep_warm_s = -5")  # %config logs a trait's refusal
    assert "'ray_keep_warm_s' trait of a DistributedMagics instance should not be less than 0.0" in caplog.text
    assert keep_warm_s() == DEFAULT_KEEP_WARM_S  # unchanged
    monkeypatch.setenv("SGPU_MAGIC_RAY_KEEP_WARM_S", "three minutes")
    with pytest.raises(
        SpecError,
        match=r"SGPU_MAGIC_RAY_KEEP_WARM_S='three minutes': give the seconds a Ray job's placement group and rank "
        r"agents are kept for the next job, a number >= 0 \(0 keeps nothing warm\)",
    ):
        distributed(gpus=2, cluster=cluster.address, mlflow=False, widgets=False)(lambda: 1).distributed()


def test_a_sigkilled_kernel_leaves_no_warm_agent_or_zygote(cluster, tmp_path):
    """What a kernel keeps warm goes with it: Ray removes a dead driver's actors, and each zygote dies with its
    agent."""
    km, kc = start_kernel(cwd=tmp_path, env={"SGPU_MAGIC_WIDGETS": "0"})
    try:
        out = execute(kc, f"%%distributed --gpus 2 --cluster {cluster.address} --no-mlflow\n1 + 1", 300)
        assert out.error is None and "2" in "".join(out.results)

        wait_for(
            lambda: len(_agent_processes(["sgpu_magic.launch.ray.zygote"])) == 2,
            180,
            "the kernel's two warm agents to start their zygotes",
        )
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        wait_for(lambda: not _agent_processes(), 30, "Ray to end the dead kernel's warm agents, and their zygotes")
    finally:
        stop_kernel(km, kc)


DETACHED_STARTER = """
import os
from sgpu_magic import distributed

@distributed(gpus=2, cluster={address!r}, widgets=False, detach=True, timeout=300)
def lines(n):
    import time
    for i in range(n):
        print("line", i, flush=True)
        time.sleep(0.25)
    return n

job = lines.submit({n})
print("started", job.job_id, flush=True)
while "line 1" not in job.logs(1):   # running on its actors, and printing
    job.wait(0.05)
assert job.mlflow_run_id  # its MLflow run made (reading it waits for that)
os._exit(9)  # as a killed kernel
"""


def _one():
    return 1


def _start_detached_and_die(address: str, n: int) -> str:
    """Start a detached 2-rank Ray job printing ``n`` lines from another process (a kernel), which dies once rank 1
    has printed two; the job's id."""
    return run_until_killed(DETACHED_STARTER.format(address=address, n=n), 300)[0]


def test_a_detached_ray_job_outlives_its_kernel_and_attach_gives_every_line_its_stacks_result_and_run(
    cluster, keeper_home, capsys
):
    """detach=True on a cluster: the run keeper is the Ray driver that owns the job's actors, so the job outlives
    the process that started it; another one attaches to it by id as to a local detached job."""
    from mlflow import MlflowClient

    import sgpu_magic
    from sgpu_magic import attach, detached_runs
    from sgpu_magic.launch import held_warm

    again = distributed(gpus=2, cluster=cluster.address, widgets=False, detach=True, mlflow=False)(_one)
    job_id = _start_detached_and_die(cluster.address, 60)  # 15 s: still running when this process attaches
    [run] = detached_runs()
    assert run.job_id == job_id and run.world_size == 2
    job = attach(job_id, widgets=False)
    assert job.detached and _status_file(job)["start_method"] == "ray"
    assert _status_file(job)["host_pid"] == job.launcher.pid  # supervised by the keeper
    stacks = job.stacks()  # taken on the nodes by the rank agents, asked through the keeper
    assert sorted(stacks) == [0, 1] and all("lines (<string>:" in stacks[r] for r in (0, 1)), stacks
    assert job.result(timeout_s=120) == [60, 60]
    out = capsys.readouterr().out
    for rank in (0, 1):  # every line once: those printed before the attach, and after
        assert [line for line in out.splitlines() if line.startswith(f"[rank {rank}] line")] == [
            f"[rank {rank}] line {i}" for i in range(60)
        ]
    client = MlflowClient(job.mlflow_tracking_uri)
    assert client.get_run(job.mlflow_run_id).info.status == "FINISHED"  # the dead process's run, ended here
    # as a kernel does, the keeper keeps the job's agents warm: the next detached job of its shape forks its ranks there
    keeper = job.launcher.pid
    assert again.distributed() == [1, 1] and again.last_job.launcher.pid == keeper
    assert _status_file(again.last_job).get("warm_agents") and _status_file(again.last_job)["forked_ranks"] == 2
    [held] = held_warm()  # what %distributed_jobs says is held
    assert held.startswith("Ray, for detached jobs: 2 warm rank agent(s)") and f"run keeper (pid {keeper})" in held
    [given] = sgpu_magic.release()
    assert given.startswith("2 warm rank agent(s)") and given.endswith(
        f"kept by the run keeper (pid {keeper}) for detached jobs"
    )
    assert wait_gone([keeper], 30) == []  # the keeper exits once it holds no run and nothing warm
    wait_for(lambda: not job_processes(job_id) and not _agent_processes(), 60, "no rank or agent of the job left")


def test_a_killed_keeper_takes_its_detached_ray_jobs_actors_and_ranks_with_it(cluster, keeper_home):
    """The keeper is the Ray driver of its detached Ray jobs: when it is SIGKILLed Ray removes their actors, the
    ranks die with them, and the attached job fails naming the keeper."""
    from sgpu_magic import attach
    from sgpu_magic.errors import LauncherError

    job_id = _start_detached_and_die(cluster.address, 400)
    job = attach(job_id, widgets=False)
    wait_for(lambda: len(job_processes(job_id)) == 2, 60, "the 2 ranks")
    os.kill(job.launcher.pid, signal.SIGKILL)
    with pytest.raises(LauncherError, match=rf"the run keeper died while job {job_id} ran; see .*keeper-.*\.log"):
        job.result(timeout_s=60)
    wait_for(lambda: not job_processes(job_id) and not _agent_processes(), 60, "Ray to remove the keeper's actors")


def test_a_keeper_refuses_a_detached_job_on_another_cluster_than_the_one_it_joined(tmp_path):
    """A process joins one Ray cluster: the keeper's second cluster is refused, naming both and the remedy (real
    keeper, real Ray supervisor; the first address has nothing listening, so its job fails on its own)."""
    from sgpu_magic._util.unix_socket import bind_private
    from sgpu_magic.launch.host.keeper import Keeper
    from sgpu_magic.launch.keeper_main import ray_jobs
    from sgpu_magic.launch.ray.warm import set_keep_warm_s
    from sgpu_magic.rundir import make_private_dir
    from sgpu_magic.wire import LaunchRecord
    from sgpu_magic.wire.host import Launch, RayTarget

    folder = make_private_dir(tmp_path / "keeper")
    listener = bind_private(folder / "k.sock")
    keeper = Keeper(listener, folder / "k.sock", folder / "k.lock", None, str(folder / "k.log"), ray_jobs)
    first, second = RunDir.create(tmp_path), RunDir.create(tmp_path)
    try:
        for rd, port in ((first, 1), (second, 2)):
            rd.write_launch(
                LaunchRecord(job_id=rd.job_id, world_size=1, backend="gloo", cwd=str(tmp_path), sys_path=())
            )
            keeper.handle(Launch(str(rd.path), {}, RayTarget(f"127.0.0.1:{port}")))
        assert read_json(second.status_file)["launch_error"] == (
            f"RuntimeError: the run keeper (pid {os.getpid()}) drives detached jobs on the Ray cluster '127.0.0.1:1', "
            "not '127.0.0.1:2': a process joins one Ray cluster; run this job once the keeper has exited (10 s after "
            "its last run ends), or without detach"
        )
        ended = wait_for(
            lambda: (s := read_json(first.status_file) or {}).get("state") == "failed" and s, 60, "job 1's end"
        )
        # nothing listens there (or this process joined the tests' cluster already): it fails on its own
        assert ended["launch_error"].startswith("ResourceError: ") and "'127.0.0.1:1'" in ended["launch_error"]
        assert keeper.ray is not None and keeper.ray.running() == []
    finally:
        set_keep_warm_s(None)
        listener.close()


DETACHED_SESSION_STARTER = """
import os
from sgpu_magic import Session

sess = Session(gpus=2, cluster={address!r}, widgets=False, mlflow=False, detach=True, name="train")
sess.run_cell("import os\\nw = 10 + int(os.environ['RANK'])")
print("started", sess.job.job_id, *sess.pull("w"), flush=True)
os._exit(9)  # as a killed kernel
"""


def test_a_detached_ray_session_outlives_its_kernel_and_attach_runs_cells_on_its_ranks_with_their_state(
    cluster, keeper_home
):
    """``Session(cluster=..., detach=True)``: the run keeper drives the session's rank actors, named so that a kernel
    that is not their driver finds them; a new one attaches and runs cells on the same ranks, with their state."""
    from sgpu_magic import Session, attach

    job_id, *words = run_until_killed(DETACHED_SESSION_STARTER.format(address=cluster.address), 300)
    w = [int(x) for x in words]
    assert w == [10, 11]
    sess = attach(job_id, widgets=False)
    assert isinstance(sess, Session) and sess.name == "train" and sess.state.value == "idle"
    assert sess.pull("w") == [10, 11]  # the state its ranks kept on their actors
    assert sess.run_cell("w * 2") == [20, 22]
    keeper = sess.job.launcher.pid
    assert _status_file(sess.job)["host_pid"] == keeper
    sess.stop()
    assert sess.job.state.value == "succeeded"
    assert wait_gone([keeper], 30) == []  # a session's agents are never kept warm: the keeper exits
    wait_for(lambda: not job_processes(job_id) and not _agent_processes(), 60, "no rank or agent of the session left")
