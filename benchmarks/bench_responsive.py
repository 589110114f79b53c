"""Responsiveness: how long the user waits for an answer when something is wrong or is stopped.

The speed parts of tests that used to assert on wall-clock time (tests/integration/test_cases_decorator.py, C05,
C08, C15, the restart loop and the timeout case; tests/kernel/test_kernel.py, C11's interrupt;
tests/kernel/test_kernel_jobs.py, the lease of a SIGKILLed kernel): the tests keep the behaviour, the figures are
here, each against the bound the test used to hold. Every figure is measured in real kernels (2 CPU ranks), the
median of the repetitions:

- refuse_argument_s: ``fn.distributed(lock)`` raising CaptureError (nothing starts);
- refuse_port_s: ``@distributed(port=<a port in use>)`` raising ResourceError;
- rank_exit_to_error_s: a job whose rank 1 exits before the rendezvous, to RankFailedError;
- rank_error_to_error_s: a job whose rank 0 raises while rank 1 waits in a barrier, to RankFailedError;
- timeout_overrun_s: a ``timeout=2`` job of sleeping ranks, from its timeout to JobTimeoutError;
- interrupt_to_idle_s: the kernel's interrupt, while 2 ranks with DataLoader workers run, to the kernel's idle;
- kernel_kill_to_start_s: SIGKILL of a kernel that holds 6 of 8 (fake) GPUs, to the start of another kernel's
  job that waited for them.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import time

from .common import Context, Section, Table, Target, fmt, fmt_range, median

DEFINE = """\
import os, threading, time
stats_lock = threading.Lock()

@distributed(gpus=2, **_KW)
def takes_lock(lock):
    return 1

@distributed(gpus=2, port={port}, **_KW)
def pinned():
    return "should not start"

@distributed(gpus=2, **_KW)
def lonely():
    import os
    import torch.distributed as dist
    if os.environ["RANK"] == "1":
        os._exit(3)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    dist.barrier()

@distributed(gpus=2, **_KW)
def raises():
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 fails")
    dist.barrier()

@distributed(gpus=2, timeout=2, **_KW)
def sleepy():
    import time
    time.sleep(600)

def _time_error(call, expected):
    t0 = time.perf_counter()
    try:
        call()
    except expected:
        return time.perf_counter() - t0
    raise AssertionError(f"{{call}} did not raise {{expected}}")
"""

MEASURE = """\
from sgpu_magic.errors import CaptureError, JobTimeoutError, RankFailedError, ResourceError
_emit(
    refuse_argument_s=_time_error(lambda: takes_lock.distributed(stats_lock), CaptureError),
    refuse_port_s=_time_error(pinned.distributed, ResourceError),
    rank_exit_to_error_s=_time_error(lonely.distributed, RankFailedError),
    rank_error_to_error_s=_time_error(raises.distributed, RankFailedError),
    timeout_overrun_s=_time_error(sleepy.distributed, JobTimeoutError) - 2.0,
)
"""

INTERRUPTED = """\
%%distributed --gpus 2 {flags}
import os, time, torch
from torch.utils.data import DataLoader, Dataset
class Slow(Dataset):
    def __len__(self): return 10**6
    def __getitem__(self, i):
        time.sleep(0.01)
        return i
open(os.path.join({marks!r}, str(os.getpid())), "w").close()
for batch in DataLoader(Slow(), num_workers=2):
    pass
"""

HOLD = """\
%%distributed --gpus 6 --background -o held {flags}
import time
time.sleep(3600)
"""

WAITS = """\
%%distributed --gpus 6 --background -o waiting {flags}
import time
time.time()
"""

BOUNDS_S = {
    "refuse_argument_s": 2.0,
    "refuse_port_s": 5.0,
    "rank_exit_to_error_s": 60.0,
    "rank_error_to_error_s": 60.0,
    "timeout_overrun_s": 8.0,
    "interrupt_to_idle_s": 5.0,
    "kernel_kill_to_start_s": 10.0,
}
"""The bound each figure's test used to assert (seconds)."""


def _busy_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def _wait_idle(kernel, msg_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            msg = kernel.kc.get_iopub_msg(timeout=1.0)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status":
            if msg["content"]["execution_state"] == "idle":
                return
    raise TimeoutError(f"the cell did not end within {timeout_s:g} s")


def _interrupt_to_idle_s(ctx: Context, kernel, flags: str) -> float:
    marks = ctx.workdir / f"marks-{time.monotonic_ns()}"
    marks.mkdir()
    msg_id = kernel.kc.execute(INTERRUPTED.format(flags=flags, marks=str(marks)))
    deadline = time.monotonic() + ctx.cfg.cell_timeout_s
    while len(os.listdir(marks)) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError("the ranks did not start")
        time.sleep(0.05)
    t0 = time.perf_counter()
    kernel.km.interrupt_kernel()
    _wait_idle(kernel, msg_id, 120)
    return time.perf_counter() - t0


def _kernel_kill_to_start_s(ctx: Context, flags: str) -> float:
    env = {"SGPU_MAGIC_FAKE_GPUS": "8 x H100", "SGPU_MAGIC_LEASE_DIR": str(ctx.workdir / f"leases-{time.time_ns()}")}
    holder, waiter = ctx.sgpu_kernel("holder", **env), ctx.sgpu_kernel("waiter", **env)
    holder.run(HOLD.format(flags=flags), timeout_s=ctx.cfg.cell_timeout_s)
    holder.run("while held.state.value == 'pending':\n    time.sleep(0.05)", timeout_s=ctx.cfg.cell_timeout_s)
    waiter.run(WAITS.format(flags=flags), timeout_s=ctx.cfg.cell_timeout_s)
    pid = holder.pid
    assert pid is not None
    killed_s = time.time()
    os.kill(pid, signal.SIGKILL)
    cell = waiter.run("_emit(started_s=waiting.result(timeout_s=120)[0])", timeout_s=ctx.cfg.cell_timeout_s)
    holder.kill()
    waiter.shutdown()
    return cell.data["started_s"] - killed_s


def run(ctx: Context) -> Section:
    reps = ctx.cfg.responsive_reps
    kernel = ctx.sgpu_kernel("responsive", warm=True)
    flags = kernel.run("_emit(flags=_MAGIC_FLAGS)").data.get("flags", "")
    sock = _busy_port()
    try:
        kernel.run(DEFINE.format(port=sock.getsockname()[1]), timeout_s=ctx.cfg.cell_timeout_s)
        series: dict[str, list[float]] = {name: [] for name in BOUNDS_S}
        for i in range(reps):
            data = kernel.run(MEASURE, timeout_s=ctx.cfg.cell_timeout_s).data
            for name, value in data.items():
                series[name].append(value)
            series["interrupt_to_idle_s"].append(_interrupt_to_idle_s(ctx, kernel, flags))
            print(f"  responsive: {i + 1}/{reps}", flush=True)
    finally:
        sock.close()
        kernel.shutdown()
    series["kernel_kill_to_start_s"].append(_kernel_kill_to_start_s(ctx, flags))
    return _report(series)


def _report(series: dict[str, list[float]]) -> Section:
    sec = Section(raw=series)
    rows = [[name, fmt(median(xs)), fmt_range(xs), fmt(BOUNDS_S[name], 1)] for name, xs in series.items()]
    table = Table(
        "Responsiveness: seconds until the user has an answer (2 CPU ranks)",
        ["figure", "median (s)", "min-max", "bound (s)"],
        rows,
    )
    table.notes.append(
        "each bound is the wall-clock assertion the figure's test held before the speed parts moved here"
    )
    sec.tables.append(table)
    for name, xs in series.items():
        m = median(xs)
        sec.targets.append(
            Target(f"responsive: {name}", f"< {BOUNDS_S[name]:g} s", fmt(m), None if m is None else m < BOUNDS_S[name])
        )
    return sec
