"""Small helpers shared by the test files."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import psutil

PID_GONE_S = 10.0

PACKAGE = Path(__file__).resolve().parents[1] / "sgpu_magic"


def package_findings(check: Callable[[Path, str], list[str]], skip: Callable[[str], bool]) -> list[str]:
    """What ``check(path, rel)`` finds in every module of sgpu_magic (``rel``: its path in the package, with ``/``),
    in path order, leaving out the modules ``skip(rel)`` names: the walk of the source-rule tests."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not skip(rel):
            found += check(path, rel)
    return found


C01_CELL1 = """
import math
SCALE = 10
def helper(x):
    return math.sqrt(x) * SCALE
class Box:
    def __init__(self, v):
        self.v = v
"""
"""Case C01, cell 1: a notebook helper, class and global that ranks must receive by value."""


OOM_HINT = (
    r"nothing here shows the OOM killer( \(.*\))?, but it is the usual cause of a SIGKILL: look for 'Killed "
    r"process' in `dmesg` or `journalctl -k`, and compare the rank's peak RSS with the memory limit "
    r"\(`cat /sys/fs/cgroup/memory.max`, or memory.limit_in_bytes under cgroup v1\)"
)
"""The OOM hint of a SIGKILLed rank that nothing shows the OOM killer ended (``re.fullmatch`` it), the same on one
machine and on a Ray node."""


def wait_gone(pids, within_s: float = PID_GONE_S) -> list[int]:
    """Poll until none of ``pids`` exists (zombies count as existing); return those still there at the deadline."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [p for p in pids if psutil.pid_exists(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def run_dirs(sgpu_home) -> set[str]:
    """Names of the run directories under the session's sgpu_magic home."""
    runs = sgpu_home / "runs"
    return {p.name for p in runs.iterdir()} if runs.exists() else set()


def children() -> list[psutil.Process]:
    """Every descendant of the test process but multiprocessing's resource tracker: the first user of
    multiprocessing in a process (a unit test's) starts it, and it lives until that process ends; it is not
    something a job left behind."""
    mine = psutil.Process().children(recursive=True)
    return [p for p in mine if "multiprocessing.resource_tracker" not in " ".join(_cmdline_of(p))]


def _cmdline_of(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def kids() -> list[int]:
    """PIDs of every descendant of the test process."""
    return sorted(p.pid for p in psutil.Process().children(recursive=True))


def wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.05):
    """Poll ``condition()`` until it returns something truthy; fail after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def job_processes(job_id: str) -> list[int]:
    """Every live process (zombies excluded) whose environment carries ``SGPU_MAGIC_JOB_ID=<job_id>``:
    a job's ranks and whatever they started, double-forked daemons included."""
    needle = f"SGPU_MAGIC_JOB_ID={job_id}".encode()
    found = []
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0") and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    found.append(pid)
        except (OSError, psutil.Error):
            continue
    return found


def interrupt_session_cell(sess, code: str, marker, ranks=(0, 1), timeout_s: float = 60) -> BaseException | None:
    """Run ``code`` in live session ``sess`` from a thread; once every rank of ``ranks`` has touched
    ``<marker><rank>`` (the cell's code does it), interrupt the session; return what the cell raised (``None``:
    nothing)."""
    import os
    import threading

    errors: list[BaseException] = []

    def run():
        try:
            sess.run_cell(code)
        except BaseException as exc:  # noqa: BLE001 - the caller looks at it
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: all(os.path.exists(f"{marker}{r}") for r in ranks), timeout_s, "every rank to enter the cell")
    assert sess.interrupt()
    thread.join(30)
    assert not thread.is_alive(), "the interrupted cell did not end"
    assert len(errors) <= 1, errors
    return errors[0] if errors else None


TRACE_EVENT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "The Trace Event Format's JSON object form (as Perfetto and chrome://tracing load it), for the events "
    "a merged sgpu_magic profile holds: one process (pid) per rank",
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "traceEvents": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["ph", "pid"],
                "properties": {
                    "ph": {"type": "string", "minLength": 1},
                    "pid": {"type": "integer", "minimum": 0},
                    "name": {"type": "string"},
                    "ts": {"type": "number"},
                    "dur": {"type": "number", "minimum": 0},
                    "args": {"type": "object"},
                },
                "allOf": [
                    {"if": {"properties": {"ph": {"const": "X"}}}, "then": {"required": ["name", "ts", "dur"]}},
                    {"if": {"properties": {"ph": {"const": "M"}}}, "then": {"required": ["name", "args"]}},
                ],
            },
        },
    },
}
"""A JSON schema of the Trace Event Format (docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU)
for what the tests check of a merged profile trace."""


def flaky_rank(how: str, fail_attempts: int):
    """A job's code for the restart tests (max_restarts=2), on one machine and on Ray: rank 1 fails (``how``: "kill" = SIGKILL itself, "raise" = ValueError) on the
    first ``fail_attempts`` attempts."""
    import os
    import signal

    import torch.distributed as dist

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} starts attempt with restart count {attempt}", flush=True)
    if rank == 1 and attempt < fail_attempts:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"rank 1 fails on restart count {attempt}")
    dist.barrier()
    return {"rank": rank, "restart_count": attempt, "max_restarts": int(os.environ["TORCHELASTIC_MAX_RESTARTS"])}


def check_killed_once_and_restarted(flaky) -> None:
    """``flaky`` (:func:`flaky_rank`, decorated) with rank 1 killed once: every rank restarted, attempt 2 succeeds, the
    first attempt's record kept and the logs going on after the attempt's line."""
    from sgpu_magic import JobState

    results = flaky.distributed("kill", 1)
    assert results == [
        {"rank": 0, "restart_count": 1, "max_restarts": 2},
        {"rank": 1, "restart_count": 1, "max_restarts": 2},
    ]
    job = flaky.last_job
    assert job.state is JobState.SUCCEEDED and job.attempt == 2
    (first,) = job.attempts
    assert first["attempt"] == 1 and [(f["rank"], f["exitcode"]) for f in first["failures"]] == [(1, -9)]
    for rank in (0, 1):
        log = job.logs(rank).splitlines()
        starts = [i for i, line in enumerate(log) if line.startswith(f"rank {rank} starts attempt")]
        marker = log.index(
            "[sgpu_magic] attempt 2 of 3: all ranks restarted after rank 1 failed (killed by signal SIGKILL (9))"
        )
        assert log[starts[-1]] == f"rank {rank} starts attempt with restart count 1" and marker < starts[-1]
    assert "rank 1 starts attempt with restart count 0" in job.logs(1)  # the first attempt's lines stay


def check_each_failed_attempt_kept(flaky) -> None:
    """``flaky`` failing every attempt: the last one fails the job, each earlier one's errors kept."""
    import json

    import pytest

    from sgpu_magic.errors import RankFailedError

    with pytest.raises(
        RankFailedError,
        match=r"rank 1 failed \(root cause\): ValueError: rank 1 fails on restart count 2"
        r"(.|\n)*attempt 3 of 3 failed, after 2 restart\(s\); job.attempts lists "
        r"the earlier failures",
    ):
        flaky.distributed("raise", 3)
    job = flaky.last_job
    assert job.attempt == 3 and [a["attempt"] for a in job.attempts] == [1, 2]
    assert job.attempts[0]["exitcodes"][1] == 1  # rank keys are ints
    for k in (1, 2):
        kept = json.loads((job.run_dir / "errors" / f"attempt_{k}" / "rank_1.json").read_text())
        assert kept["message"] == f"rank 1 fails on restart count {k - 1}"


def run_until_killed(code: str, timeout_s: float) -> list[str]:
    """Run ``code`` in a fresh Python process, as a kernel that starts something detached, prints ``started ...`` and
    dies (``os._exit(9)``); the words of that line after ``started``."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, check=False)
    assert proc.returncode == 9, proc.stderr
    return next(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("started "))
