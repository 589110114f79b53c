"""Crash forensics and the hang detector (issue 21), with real ranks in the shared IPython shell.

A rank killed by a signal leaves no Python exception: its error carries the end of its log, its peak RSS and, for a
SIGKILL, whether the kernel's OOM killer ended it. A job whose ranks all run but write nothing for
``stuck_after_s`` is reported possibly stuck, with each rank's stack, until a rank writes again.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from sgpu_magic import distributed
from sgpu_magic.errors import JobCancelledError, RankFailedError
from sgpu_magic.front.decorator import function_payload, start
from sgpu_magic.launch.forensics import memory_cgroup_file
from sgpu_magic.ui.panel import Panel

from helpers import OOM_HINT, wait_for

KILLED = """
%%distributed --gpus 1 --no-mlflow --timeout 120
import os
print("about to crash", flush=True)
os.kill(os.getpid(), 9)
"""

SEGFAULT = """
%%distributed --gpus 1 --no-mlflow --timeout 120
import ctypes
print("about to crash", flush=True)
ctypes.string_at(0)
"""


def _error(run_cell, cell: str) -> RankFailedError:
    result, _, err = run_cell(cell.lstrip("\n"))
    assert isinstance(result.error_in_exec, RankFailedError), (result.error_in_exec, err)
    return result.error_in_exec


@pytest.mark.slow  # the module's first job starts the launch host
def test_a_sigkilled_rank_names_its_last_log_line_its_peak_rss_and_how_to_check_for_the_oom_killer(run_cell):
    error = _error(run_cell, KILLED)
    root = error.root_cause
    assert root.exitcode == -9 and root.exc_type is None
    assert root.last_lines[-1] == "about to crash"
    assert root.oom_killed is None  # nothing shows the OOM killer: the hint says how to check
    assert re.fullmatch(OOM_HINT, root.oom), root.oom
    assert root.peak_rss_bytes is None or root.peak_rss_bytes > 0
    lines = str(error).splitlines()
    assert lines[0] == "rank 0 failed (root cause): exited without a Python exception (killed by signal SIGKILL (9))"
    assert lines[1] == f"  {root.oom}"
    assert "  the end of its log:" in lines and "    | about to crash" in lines
    assert lines[-1] == f"  log of rank 0: {root.log_path}"


def test_a_segfaulted_rank_names_its_last_log_line_and_no_oom_hint(run_cell):
    error = _error(run_cell, SEGFAULT)
    root = error.root_cause
    assert root.exitcode == -11 and root.oom == "" and root.oom_killed is None
    assert root.last_lines[:2] == ("about to crash", "Fatal Python error: Segmentation fault")
    assert root.last_lines[-1].endswith("in <module>")  # faulthandler's frames of the cell, not of sgpu_magic
    assert str(error).splitlines()[0] == (
        "rank 0 failed (root cause): exited without a Python exception (killed by signal SIGSEGV (11))"
    )
    assert "    | about to crash" in str(error).splitlines()


def _memory_limited_cgroup(limit_bytes: int) -> Path:
    """A new child of this process's memory cgroup limited to ``limit_bytes``, or skip where none can be made."""
    here = memory_cgroup_file("self")
    if here is None:
        pytest.skip("no memory cgroup to read here")
    child = here.parent / f"sgpu_oom_{secrets.token_hex(3)}"
    limit = "memory.limit_in_bytes" if here.name == "memory.oom_control" else "memory.max"
    try:
        child.mkdir()
        (child / limit).write_text(str(limit_bytes))
    except OSError as exc:
        pytest.skip(f"cannot make a memory-limited cgroup here ({exc}); the OOM path needs a writable cgroup")
    return child


OOM = """
%%distributed --gpus 1 --no-mlflow --timeout 120
import os
with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
print("about to allocate", flush=True)
hog = bytearray(1 << 30)
"""


def test_a_rank_the_oom_killer_ends_says_so(ip, run_cell):
    cgroup = _memory_limited_cgroup(256 << 20)
    ip.user_ns["cgroup"] = str(cgroup)
    try:
        error = _error(run_cell, OOM)
    finally:
        cgroup.rmdir()
    root = error.root_cause
    assert root.exitcode == -9 and root.oom_killed is True, root.oom
    assert re.match(
        r"the kernel's OOM killer (ended it \(kernel log: '.*Killed process \d+ |fired in its memory cgroup)", root.oom
    ), root.oom
    assert root.last_lines[-1] == "about to allocate"
    assert str(error).splitlines()[1] == f"  {root.oom}"


STUCK = """
%%distributed --gpus 2 --background --no-mlflow --timeout 300 -o stuck_job
import os, threading, time, torch
import torch.distributed as dist
from sgpu_magic import runtime
dist.init_process_group(runtime.backend())
t = torch.zeros(1)
print("ready", flush=True)
if runtime.get_global_rank() == 0:
    dist.broadcast(t, src=1)
resume = threading.Event()
def watch():
    while not os.path.exists(go):
        time.sleep(0.1)
    resume.set()
threading.Thread(target=watch, daemon=True).start()
resume.wait()
print("resumed", flush=True)
threading.Event().wait()
"""
"""Notebook lines: 9 is rank 0's ``dist.broadcast``, 16 rank 1's ``resume.wait`` (until the file ``go`` exists)."""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_a_quiet_job_is_possibly_stuck_with_each_ranks_stack_until_it_writes_again(ip, capsys, tmp_path):
    go = tmp_path / "go"
    ip.user_ns["go"] = str(go)
    ip.run_line_magic("config", "DistributedMagics.stuck_after_s = 2")
    try:
        n = ip.execution_count
        result = ip.run_cell(STUCK.lstrip("\n"), store_history=True)
        assert result.error_in_exec is None, result.error_in_exec
    finally:
        ip.run_line_magic("config", "DistributedMagics.stuck_after_s = 300")
    job, label = ip.user_ns["stuck_job"], f"Cell In[{n}]"
    pids = {}
    try:
        expected = {0: f"dist.broadcast at {label} line 9", 1: f"resume.wait at {label} line 16"}
        wait_for(lambda: job.status.stuck and job.status.stuck.stacks == expected, 90, "the stuck report")
        pids = dict(job.status.pids)
        assert job.status.stuck.stuck_after_s == 2 and job.state.value == "running"
        said = []
        wait_for(lambda: said.append(capsys.readouterr().out) or "is possibly stuck" in "".join(said), 30, "the line")
        line = next(x for x in "".join(said).splitlines() if "is possibly stuck" in x)
        assert line == (
            f"sgpu_magic: job {job.job_id} is possibly stuck: no rank has written a log line or a metric for 2 s; "
            f"rank 0: dist.broadcast at {label} line 9; rank 1: resume.wait at {label} line 16"
        )
        go.touch()  # rank 1 writes again: the report goes
        wait_for(lambda: job.status.stuck is None, 60, "the stuck report to clear")
        wait_for(lambda: said.append(capsys.readouterr().out) or "making progress again" in "".join(said), 30, "it")
    finally:
        job.cancel()
    assert isinstance(job.exception(timeout_s=60), JobCancelledError)
    wait_for(lambda: not [p for p in pids.values() if _alive(p)], 30, "every rank to be gone")
    assert job.status.stuck is None


def test_a_bad_stuck_after_s_is_refused_naming_it(ip, run_cell):
    from IPython.core.error import UsageError

    ip.run_line_magic("config", "DistributedMagics.stuck_after_s = -1.0")
    try:
        result, _, _ = run_cell("%%distributed --gpus 1 --no-mlflow\nprint(1)")
    finally:
        ip.run_line_magic("config", "DistributedMagics.stuck_after_s = 300")
    assert isinstance(result.error_in_exec, UsageError)
    assert str(result.error_in_exec) == "stuck_after_s must be a number of seconds > 0, or None for no limit; got -1.0"


@distributed(gpus=1, mlflow=False, widgets=True)
def quiet_until_go(folder):
    import os
    import threading
    import time

    print("ready", flush=True)
    go = threading.Event()

    def watch():
        while not os.path.exists(os.path.join(folder, "go")):
            time.sleep(0.1)
        go.set()

    threading.Thread(target=watch, daemon=True).start()
    go.wait()
    print("resumed", flush=True)
    return 1


@pytest.mark.slow
def test_the_panel_header_shows_the_possibly_stuck_badge_until_the_rank_writes_again(tmp_path):
    panel = Panel()
    spec = replace(quiet_until_go.spec, stuck_after_s=1.0)
    job = start(spec, lambda warn: function_payload(quiet_until_go, (str(tmp_path),), {}, warn), panel, background=True)
    try:
        header = wait_for(lambda: "go.wait at" in (value := panel.header.value) and value, 90, "the stuck badge")
        assert ">possibly stuck</span>" in header
        assert (
            "possibly stuck: no rank has written a log line or a metric for 1 s; rank 0: go.wait at "
            f"{__file__} line " in header
        )
    finally:
        (tmp_path / "go").touch()
    assert job.result(timeout_s=60) == [1]
    assert "possibly stuck" not in panel.header.value
