"""How ranks end: the value first, then the exit of a Python process, bounded by the teardown grace.

Every job here runs real CPU rank processes (gloo) started by the session's launch host; the
notebook side is this test process (the decorator) or the session's real IPython shell.
The same behaviour in a real Jupyter kernel is in ``test_exit_kernel.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sgpu_magic import distributed
from sgpu_magic.errors import JobTimeoutError, RankFailedError, SpecError
from sgpu_magic.launch.client import get_host
from sgpu_magic.launch.host.warm_pool import warm_wait_s

from helpers import wait_for, wait_gone


def status(job) -> dict:
    return json.loads((job.run_dir / "status.json").read_text())


def wait_warm(timeout_s: float = 180.0) -> None:
    """Launch until the host's forkserver has finished preloading, so the next launches fork from it."""

    @distributed(gpus=1, mlflow=False)
    def nothing():
        return None

    marker = Path(str(get_host().log_path) + ".warm")
    wait_for(lambda: nothing.distributed() == [None] and marker.exists(), timeout_s, "the warm forkserver")


# --- the root cause: warm ranks keep their process groups, as torchrun's ranks do -------------------


@distributed(gpus=2, mlflow=False)
def group_threads_after_destroy():
    """The gloo group's worker threads once the group is destroyed and every user reference is gone."""
    import gc
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    gc.collect()
    tasks = os.listdir("/proc/self/task")
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks)


def test_a_warm_rank_keeps_its_destroyed_process_group_as_torchrun_ranks_do():
    """Under torchrun (and in cold ranks) the first DDP imports torch._dynamo after init_process_group, and
    module-level defaults (torch.distributed.nn.functional's group=group.WORLD) keep the default group alive:
    its C++ destructor, which joins the gloo threads with the GIL held, never runs while Python code does.
    A warm rank has those modules from the forkserver, imported before any group existed; sgpu_magic keeps
    the groups itself, so the group's threads are still there after destroy_process_group()."""
    wait_warm()
    results = group_threads_after_destroy.distributed()
    assert status(group_threads_after_destroy.last_job)["start_method"] == "forkserver"
    for threads in results:
        assert threads.count("pt_gloo_runloop") >= 1, threads


class Trainer:
    """The DDP tutorial's Trainer (multigpu_torchrun.py, on CPU): it holds the DDP model."""

    def __init__(self, model, optimizer):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model, self.optimizer = DDP(model), optimizer

    def train(self, steps):
        import torch
        import torch.nn.functional as F

        for _ in range(steps):
            self.optimizer.zero_grad()
            F.mse_loss(self.model(torch.rand(32, 20)), torch.rand(32, 1)).backward()
            self.optimizer.step()


@distributed(gpus=2, mlflow=False, teardown_grace_s=20)
def tutorial_main():
    """The tutorial's main(): destroy_process_group() at its end, the Trainer freed when it returns."""
    import torch
    from torch.distributed import destroy_process_group, init_process_group

    init_process_group(backend="gloo")
    model = torch.nn.Linear(20, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    trainer.train(32)
    destroy_process_group()


def test_the_ddp_tutorial_shape_ends_without_the_teardown_grace():
    """Before the fix 1 warm launch in 3 to 7 of this shape wedged for good in ~ProcessGroupGloo as main()'s
    locals were freed (now the teardown grace would end it, with a note); 6 warm launches need no grace at all."""
    wait_warm()
    for _ in range(6):
        assert tutorial_main.distributed() == [None, None]
        job = tutorial_main.last_job
        assert status(job)["start_method"] == "forkserver" and job.notes == [] and job.rank_exitcodes == {0: 0, 1: 0}


# --- the teardown grace -----------------------------------------------------------------------------


@distributed(gpus=2, mlflow=False, teardown_grace_s=1)
def returns_then_wedges():
    """Returns, then blocks for good while its locals are freed: a destructor waits for a lock that a thread
    holds, as ~ProcessGroupGloo joins a gloo thread that waits for the GIL. SIGTERM alone does not end it."""
    import os
    import signal
    import threading

    signal.signal(signal.SIGTERM, lambda *_: None)
    lock, taken = threading.Lock(), threading.Event()

    def hold():
        lock.acquire()
        taken.set()
        threading.Event().wait()

    threading.Thread(target=hold, daemon=True).start()
    taken.wait()

    class Reducer:
        def __del__(self):
            lock.acquire()

    reducer = Reducer()  # noqa: F841 - freed after the return
    return {"rank": int(os.environ["RANK"]), "pid": os.getpid()}


def test_a_rank_that_wedges_after_returning_succeeds_with_its_value_and_is_named(capsys):
    values = returns_then_wedges.distributed()
    job = returns_then_wedges.last_job
    assert [v["rank"] for v in values] == [0, 1] and job.state.value == "succeeded"
    for rank in (0, 1):
        assert (
            f"rank {rank} needed the teardown grace: it returned its value but had not exited 1 s later "
            f"(teardown_grace_s), so sgpu_magic ended it (SIGKILL); its value is kept"
        ) in job.notes
    summary = capsys.readouterr().out
    assert "sgpu_magic: rank 1 needed the teardown grace" in summary, summary
    assert [e["signal"] for e in status(job)["teardown_ended"]] == ["SIGKILL", "SIGKILL"]
    assert wait_gone([v["pid"] for v in values]) == []


@distributed(gpus=2, mlflow=False, teardown_grace_s=1, timeout=120)
def raises_then_wedges():
    import atexit
    import os
    import threading

    import torch.distributed as dist

    dist.init_process_group("gloo")
    lock, taken = threading.Lock(), threading.Event()
    threading.Thread(target=lambda: (lock.acquire(), taken.set(), threading.Event().wait()), daemon=True).start()
    taken.wait()
    if os.environ["RANK"] == "1":
        atexit.register(lock.acquire)  # its exit path waits for good
        raise ValueError("bad batch on rank 1")
    dist.barrier()  # rank 0 waits for rank 1, which never comes


def test_a_rank_that_wedges_after_raising_fails_the_job_after_the_grace_not_the_timeout():
    with pytest.raises(RankFailedError, match=r"rank 1 failed \(root cause\): ValueError: bad batch on rank 1"):
        raises_then_wedges.distributed()  # not JobTimeoutError: the job's timeout is 120 s
    assert status(raises_then_wedges.last_job)["teardown_ended"][0]["rank"] == 1


@distributed(gpus=2, mlflow=False, teardown_grace_s=0.5, timeout=6)
def one_rank_never_returns():
    import os
    import threading

    if os.environ["RANK"] == "1":
        threading.Event().wait()  # user code that never ends: not teardown
    return "rank 0 is done"


def test_a_rank_that_wedges_before_its_value_exists_is_left_to_the_timeout():
    with pytest.raises(JobTimeoutError, match=r"ran longer than its timeout of 6 s"):
        one_rank_never_returns.distributed()
    assert "teardown_ended" not in status(one_rank_never_returns.last_job)


@pytest.mark.parametrize("grace", [-1, float("nan"), float("inf"), "10", True, 10**400])
def test_teardown_grace_must_be_seconds(grace):
    with pytest.raises(SpecError, match=r"teardown_grace_s must be a number of seconds >= 0 \(how long a rank"):
        distributed(gpus=1, teardown_grace_s=grace)


def test_the_decorator_reads_the_teardown_grace_trait(ip):
    ip.run_line_magic("config", "DistributedMagics.teardown_grace_s = 2.5")
    try:
        assert distributed(gpus=1)(len).spec.teardown_grace_s == 2.5
        assert distributed(gpus=1, teardown_grace_s=0)(len).spec.teardown_grace_s == 0.0
    finally:
        ip.run_line_magic("config", "DistributedMagics.teardown_grace_s = 10.0")


# --- ranks end like a Python process -------------------------------------------------------------------


@distributed(gpus=2, mlflow=False)
def registers_exit_work(folder):
    import atexit
    import concurrent.futures
    import logging
    import os
    import sys
    import threading

    rank = os.environ["RANK"]
    log = logging.getLogger("user")
    log.addHandler(logging.FileHandler(os.path.join(folder, f"log-{rank}.txt"), delay=True))
    log.propagate = False
    atexit.register(lambda: log.warning("atexit ran on rank %s", rank))
    atexit.register(lambda: sys.stdout.write(f"unflushed at exit {rank}"))  # no newline, no flush
    freed = threading.Event()

    class SetWhenFreed:
        def __del__(self):
            freed.set()

    def finish(name):  # runs on once the function's locals are freed: after the return
        freed.wait()
        with open(os.path.join(folder, f"{name}-{rank}.txt"), "w") as f:
            f.write("done")

    threading.Thread(target=finish, args=("thread",)).start()  # non-daemon: the program waits for it
    concurrent.futures.ThreadPoolExecutor(1).submit(finish, "pool")  # joined by threading's exit callbacks
    token = SetWhenFreed()  # noqa: F841 - freed after the return
    import builtins
    import tempfile

    builtins.sgpu_test_scratch = tempfile.TemporaryDirectory(dir=folder)  # alive to the end: its finalizer cleans it
    return rank, builtins.sgpu_test_scratch.name


def test_atexit_handlers_threads_and_flushes_run_after_the_user_code(tmp_path):
    (rank0, scratch0), (rank1, scratch1) = registers_exit_work.distributed(str(tmp_path))
    assert (rank0, rank1) == ("0", "1") and os.path.isabs(scratch0)
    assert not os.path.exists(scratch0) and not os.path.exists(scratch1)  # weakref.finalize ran at exit
    job = registers_exit_work.last_job
    for rank in (0, 1):
        assert (tmp_path / f"log-{rank}.txt").read_text() == f"atexit ran on rank {rank}\n"
        assert (tmp_path / f"thread-{rank}.txt").read_text() == "done"
        assert (tmp_path / f"pool-{rank}.txt").read_text() == "done"
        assert job.logs(rank).endswith(f"unflushed at exit {rank}")
    assert job.notes == []


@distributed(gpus=2, mlflow=False)
def logs_to_its_own_run(uri, experiment_id):
    import os

    import mlflow

    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment_id=experiment_id)
    mlflow.log_metric(f"loss_rank{os.environ['RANK']}", 0.5)  # starts a run of the rank's own
    return mlflow.active_run().info.run_id


def test_a_run_that_a_rank_started_ends_finished_as_in_a_plain_process(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    experiment_id = mlflow.MlflowClient(uri).create_experiment("ranks-own-runs")
    run_ids = logs_to_its_own_run.distributed(uri, experiment_id)
    client = mlflow.MlflowClient(uri)
    assert len(set(run_ids)) == 2
    for run_id in run_ids:
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.info.end_time is not None


# --- what a rank sees and says ----------------------------------------------------------------------


@distributed(gpus=1, mlflow=False)
def parse_defaults():
    import argparse
    import sys

    parser = argparse.ArgumentParser(description="a pasted script")
    parser.add_argument("--total-epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    return sys.argv, args.total_epochs, args.batch_size, parser.prog


def test_sys_argv_in_a_function_is_its_name_so_argparse_reads_defaults():
    assert parse_defaults.distributed() == [(["parse_defaults"], 3, 32, "parse_defaults")]


@distributed(gpus=2, mlflow=False)
def exits_early(how):
    import os
    import sys

    if os.environ["RANK"] == "0":
        if how == "exit":
            exit()
        sys.exit(0)
    return "trained"


@pytest.mark.parametrize("how", ["sys.exit", "exit"])
def test_a_rank_that_calls_sys_exit_0_is_noted_with_its_line(how, capsys):
    assert exits_early.distributed(how) == [None, "trained"]
    lines = Path(__file__).read_text().splitlines()
    line = 1 + lines.index("            exit()" if how == "exit" else "        sys.exit(0)")
    note = f"rank 0 called sys.exit(0) at {__file__}:{line}; it returned nothing"
    assert exits_early.last_job.notes == [note]
    assert f"sgpu_magic: {note}" in capsys.readouterr().out


CUDA_ON_CPU = {
    "set_device": "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))",  # the tutorial's ddp_setup()
    "to_cuda": "torch.ones(1).to('cuda')",
    "nccl": "torch.distributed.init_process_group('nccl')",
}


@distributed(gpus=1, mlflow=False)
def runs(code):
    import os  # noqa: F401 - for the code

    import torch
    import torch.distributed  # noqa: F401

    exec(code)


@pytest.mark.parametrize("code", CUDA_ON_CPU.values(), ids=CUDA_ON_CPU.keys())
def test_cuda_code_on_a_machine_without_gpu_gets_a_hint_under_the_root_cause(code):
    with pytest.raises(RankFailedError) as info:
        runs.distributed(code)
    first, hint = str(info.value).splitlines()[:2]
    assert first.startswith("rank 0 failed (root cause): ")
    assert hint == (
        "  hint: this machine has no GPU (the ranks ran on CPU with gloo): use "
        "sgpu_magic.runtime.device() / runtime.backend()"
    )


def test_an_error_unrelated_to_cuda_gets_no_hint():
    with pytest.raises(RankFailedError, match=r"ValueError: no gpu talk here") as info:
        runs.distributed("raise ValueError('no gpu talk here')")
    assert "hint" not in str(info.value)


# --- the first launch waits for the warming forkserver when that is sooner ---------------------------


@pytest.mark.parametrize(
    "ready, remaining_s, cold_s, expected",
    [
        (True, None, 5.0, 0.0),  # ready: warm now
        (False, 1.0, 5.0, 5.0),  # ready in 1 s, cold ranks in 5 s: wait, at most as long as a cold start
        (False, 5.0, 5.0, 5.0),
        (False, 9.0, 5.0, None),  # cold ranks would start sooner: cold now
        (False, -3.0, 5.0, 5.0),  # later than expected: still wait, up to the cold start time
    ],
)
def test_a_launch_waits_for_the_forkserver_only_when_it_will_be_ready_before_cold_ranks(
    ready, remaining_s, cold_s, expected
):
    assert warm_wait_s(ready, remaining_s, cold_s) == expected
