"""The launch host's teardown grace: a rank whose outcome is written does not hold up its job for long.

A rank writes its value (or its error) into the RunDir before anything its code made is
destroyed (see :mod:`sgpu_magic.rank.exit`); destructors, ``atexit`` handlers and the process's
exit come after. If C++ teardown wedges then (a DDP reducer joining a gloo thread that waits
for the GIL, pytorch#56297's family), the rank would never exit and its job never end. The
host ends such ranks:

- once every rank has its outcome (or has exited), each rank still running ``grace_s`` after the
  last outcome was written is ended: the job SUCCEEDS with the values, noting which rank needed it;
- a rank whose *error* is written and that still runs ``grace_s`` later is ended at once (its job
  fails anyway; ending it lets the other ranks be stopped instead of waiting in a collective).

Ending is SIGTERM, then SIGKILL ``kill_after_s`` later, as every stop path does. A rank that wedges
*before* its outcome exists is user code: the job's timeout covers it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time

import psutil

from sgpu_magic.rundir import RunDir
from sgpu_magic.wire.errors import TeardownEnd

CHECK_S = 0.1
"""How often the host looks for written outcomes of ranks that still run."""


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class TeardownGuard:
    """Ends the ranks of one job attempt that do not exit within ``grace_s`` after their outcome.

    Attributes:
        ended: ``{rank: TeardownEnd}`` for each rank it ended.
    """

    def __init__(self, run_dir: RunDir, world_size: int, grace_s: float, kill_after_s: float) -> None:
        self.run_dir, self.world_size = run_dir, world_size
        self.grace_s, self.kill_after_s = grace_s, kill_after_s
        self.reset()

    def reset(self) -> None:
        """A new attempt (``max_restarts``): nothing seen, nothing ended."""
        self.outcome_at: dict[int, tuple[float, str]] = {}  # rank -> (monotonic time first seen, kind)
        self.ended: dict[int, TeardownEnd] = {}
        self._terminated_at: dict[int, float] = {}
        self._checked = 0.0

    def check(self, pids: dict[int, int]) -> None:
        """Look at the ranks still running (every ``CHECK_S``); end those past their grace, SIGKILL the stubborn."""
        now = time.monotonic()
        if now - self._checked < CHECK_S:
            return
        self._checked = now
        running = {rank for rank, pid in pids.items() if _running(pid)}
        for rank in running - set(self.outcome_at):
            kind = _outcome(self.run_dir, rank)
            if kind is not None:
                self.outcome_at[rank] = (now, kind)
        every = all(rank in self.outcome_at or rank not in running for rank in range(self.world_size))
        last = max((seen for seen, _ in self.outcome_at.values()), default=now)
        for rank in sorted(running & set(self.outcome_at) - set(self.ended)):
            seen, kind = self.outcome_at[rank]
            since = now - (seen if kind == "error" else last)
            if since >= self.grace_s and (kind == "error" or every):
                self._end(rank, pids[rank], kind, now - seen)
        for rank, at in self._terminated_at.items():
            if rank in running and now - at >= self.kill_after_s and self.ended[rank].signal == "SIGTERM":
                self._signal(pids[rank], signal.SIGKILL)
                self.ended[rank] = dataclasses.replace(self.ended[rank], signal="SIGKILL")

    def _end(self, rank: int, pid: int, kind: str, after_s: float) -> None:
        self.ended[rank] = TeardownEnd(rank, kind, self.grace_s, round(after_s, 1))
        self._terminated_at[rank] = time.monotonic()
        self._signal(pid, signal.SIGTERM)

    @staticmethod
    def _signal(pid: int, sig: signal.Signals) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def spare(self, failures: dict) -> dict:
        """``failures`` (rank -> elastic's failure) without the ranks this guard ended after their value was
        written: their exit is teardown, not a failure."""
        return {
            rank: f for rank, f in failures.items() if rank not in self.ended or self.ended[rank].outcome != "value"
        }

    def report(self) -> list[TeardownEnd]:
        """What goes into ``status.json`` as ``teardown_ended``, in rank order."""
        return [entry for _, entry in sorted(self.ended.items())]


def _outcome(run_dir: RunDir, rank: int) -> str | None:
    if run_dir.error_file(rank).exists():
        return "error"
    return "value" if run_dir.result_file(rank).exists() else None


def wait_with_grace(
    proc: subprocess.Popen, run_dir: RunDir, rank: int, grace_s: float, kill_after_s: float
) -> tuple[int, TeardownEnd | None]:
    """Wait for one rank's process (the Ray agent's rank, a session leader) with the same grace, per rank:
    once its outcome is written it has ``grace_s`` to exit, then its session gets SIGTERM, SIGKILL
    ``kill_after_s`` later.

    Returns:
        ``(exit code, None)``, or ``(exit code, TeardownEnd)`` when it was ended (an ended rank whose outcome is a
        value has not failed).
    """
    seen = None
    while True:
        try:
            return proc.wait(timeout=CHECK_S), None
        except subprocess.TimeoutExpired:
            pass
        if seen is None:
            kind = _outcome(run_dir, rank)
            seen = None if kind is None else time.monotonic()
        elif time.monotonic() - seen >= grace_s:
            break
    ended = TeardownEnd(rank, str(kind), grace_s, round(time.monotonic() - seen, 1))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass
        try:
            return proc.wait(timeout=kill_after_s), ended
        except subprocess.TimeoutExpired:
            ended = dataclasses.replace(ended, signal="SIGKILL")
    return proc.wait(), ended
