"""Small helpers shared by the test files."""

from __future__ import annotations

import time

import psutil

PID_GONE_S = 10.0

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
