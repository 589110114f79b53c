"""The launch host: detached from the kernel, recovers from its own death, leaves nothing behind."""

import os
import signal
import time

import psutil
import pytest

from sgpu_magic import distributed
from sgpu_magic.errors import LauncherError
from sgpu_magic.launch.client import get_host

from helpers import wait_for


def _wait_gone(pids, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


@distributed(gpus=2)
def pid_of_rank():
    import os

    return os.getpid()


def test_host_is_not_a_child_nor_in_the_kernel_process_group():
    host = get_host()
    assert host.pid not in [c.pid for c in psutil.Process().children(recursive=True)]
    assert os.getpgid(host.pid) != os.getpgid(0)


def test_a_killed_host_is_replaced_at_the_next_launch():
    old = get_host()
    os.kill(old.pid, signal.SIGKILL)
    assert _wait_gone([old.pid]) == []
    pids = pid_of_rank.distributed()
    assert len(pids) == 2
    assert get_host().pid != old.pid
    assert _wait_gone(pids) == []


@distributed(gpus=2, timeout=120)
def sleeper(piddir):
    import os
    import time

    open(os.path.join(piddir, str(os.getpid())), "w").close()
    time.sleep(600)


def _start_sleepers(piddir):
    """Start the 2-rank ``sleeper`` job in the background; return it and its rank pids once both run."""
    from sgpu_magic.testing import start_job

    job = start_job(sleeper, (str(piddir),))
    wait_for(lambda: len(os.listdir(piddir)) >= 2, 60, "both sleeper ranks to record their pids")
    return job, [int(p) for p in os.listdir(piddir)]


def test_host_killed_during_a_job_raises_and_takes_its_ranks_along(tmp_path):
    job, pids = _start_sleepers(tmp_path)
    os.kill(get_host().pid, signal.SIGKILL)
    with pytest.raises(LauncherError, match=r"the launch host died while job .* ran; see .*host-.*\.log"):
        job.wait(timeout_s=30)
    assert _wait_gone(pids) == []
    assert len(pid_of_rank.distributed()) == 2


def test_cancel_stops_every_rank_and_result_raises_job_cancelled(tmp_path):
    from sgpu_magic import JobState
    from sgpu_magic.errors import JobCancelledError

    job, pids = _start_sleepers(tmp_path)
    job.cancel()
    assert job.state is JobState.CANCELLED
    with pytest.raises(JobCancelledError, match=r"job .* was cancelled; every rank was stopped. Logs: .*logs"):
        job.result()
    assert _wait_gone(pids) == []


def test_unpicklable_return_value_is_named():
    from sgpu_magic.errors import RankFailedError

    @distributed(gpus=1)
    def returns_generator():
        return (i for i in range(3))

    with pytest.raises(
        RankFailedError,
        match=r"TypeError: the return value of rank 0 \(builtins.generator\) cannot be "
        r"sent back to the kernel",
    ):
        returns_generator.distributed()


DDP_DESTROYED_FIRST = """import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
model(torch.randn(8, 4)).sum().backward()
dist.destroy_process_group()
dist.is_initialized()
"""


def test_a_cell_whose_ddp_model_outlives_its_process_group_does_not_hang(ip):
    """Found with notebook 04: a cell that destroys its process group while its DDP model is alive. Dropping the
    model afterwards (sgpu_magic's teardown did) can deadlock in torch (the gloo group's destructor joins its
    threads while holding the GIL that a thread needs): the rank hung in about 1 run in 5 after handing back
    its value. Teardown now leaves the cell's objects alone when there is no group. Three runs, well within
    their timeout."""
    for _ in range(3):
        ip.run_cell_magic("distributed", "--gpus 2 --timeout 60 --no-mlflow -o ddp_job", DDP_DESTROYED_FIRST)
        assert ip.user_ns["ddp_job"].results == [False, False]


def test_teardown_leaves_user_objects_alone_once_the_group_is_gone():
    from sgpu_magic.rank.worker import teardown

    dropped = []

    class Recorder:
        def __del__(self):
            dropped.append(True)

    ns = {"model": Recorder()}
    teardown(ns)  # no process group in this process
    assert "model" in ns and dropped == []


@pytest.mark.parametrize(
    "backend, world, kernel_env, expected",
    [
        ("gloo", 2, {}, str(max(1, (os.cpu_count() or 1) // 2))),  # CPU ranks share the cores
        ("nccl", 2, {}, "1"),  # several GPU ranks: 1, as torchrun sets it
        ("nccl", 1, {}, None),  # one GPU rank: torch's default, as under torchrun
        ("nccl", 4, {"OMP_NUM_THREADS": "6"}, "6"),  # the kernel's own value always wins
    ],
)
def test_omp_num_threads_follows_torchrun(backend, world, kernel_env, expected):
    from sgpu_magic.launch.env import rank_env
    from sgpu_magic.wire import LaunchRecord

    launch = LaunchRecord(job_id="j", world_size=world, backend=backend, cwd="/", sys_path=())
    assert rank_env(launch, 0, 29500, kernel_env).get("OMP_NUM_THREADS") == expected
