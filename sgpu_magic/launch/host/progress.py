"""The hang detector: a job whose ranks all run but none has written a log byte or logged a metric point for
``stuck_after_s`` seconds is *possibly stuck*; the launch host then takes the ranks' stacks (py-spy, as for a
timeout: :mod:`sgpu_magic.launch.stacks`) and reports both in ``status.json``'s ``stuck``
(:class:`~sgpu_magic.status.StuckReport`). The report goes when any rank writes again.

Progress is read from the sizes of the ranks' log and metrics files (one ``stat`` each per check, about once a
second). While the job stays quiet the stacks are taken again every ``stuck_after_s`` (at least
:data:`RESTACK_MIN_S`), so the report names where the ranks are now.
"""

from __future__ import annotations

import os
import threading
import time

from sgpu_magic.launch.stacks import CodeMap, take_stacks
from sgpu_magic.rundir import RunDir

RESTACK_MIN_S = 10.0
"""While a job stays quiet, its stacks are taken again at most this often."""


class ProgressWatch:
    """Watches one job's log and metrics files; :meth:`check` about once a second, :meth:`report` for the status."""

    def __init__(self, rd: RunDir, world_size: int, stuck_after_s: float | None) -> None:
        self.rd, self.stuck_after_s = rd, stuck_after_s
        self.files = [rd.log_file(r) for r in range(world_size)] + [rd.metrics_file(r) for r in range(world_size)]
        self.sizes: list[int] = []
        self.quiet_since = time.monotonic()
        self.quiet_since_s = time.time()
        self.stuck = False
        self.stacks: dict[int, str] = {}
        self._stacked_at = 0.0
        self._taking: threading.Thread | None = None

    def _sizes(self) -> list[int]:
        out = []
        for path in self.files:
            try:
                out.append(os.stat(path).st_size)
            except OSError:
                out.append(-1)
        return out

    def restart(self) -> None:
        """A new attempt started: its ranks have the full quiet time again."""
        self.sizes, self.stuck, self.stacks = self._sizes(), False, {}
        self.quiet_since, self.quiet_since_s = time.monotonic(), time.time()

    def check(self, pids: dict[int, int]) -> bool:
        """Look for progress; take stacks when the job has been quiet too long. Whether the report changed."""
        if self.stuck_after_s is None:
            return False
        sizes, now = self._sizes(), time.monotonic()
        if sizes != self.sizes:
            self.sizes, self.quiet_since, self.quiet_since_s = sizes, now, time.time()
            changed, self.stuck, self.stacks = self.stuck, False, {}
            return changed
        if now - self.quiet_since < self.stuck_after_s:
            return False
        changed = not self.stuck
        self.stuck = True
        if self._taking is None and now - self._stacked_at >= max(self.stuck_after_s, RESTACK_MIN_S):
            self._stacked_at = now
            self._taking = threading.Thread(target=self._take, args=(dict(pids),), daemon=True)
            self._taking.start()
        elif self._taking is not None and not self._taking.is_alive():
            self._taking, changed = None, True  # new stacks to report
        return changed

    def _take(self, pids: dict[int, int]) -> None:
        stacks = take_stacks(pids, CodeMap.read(self.rd.code_map_file))
        if self.stuck:
            self.stacks = {rank: stack.where for rank, stack in stacks.items()}

    def report(self) -> dict | None:
        """``status.json``'s ``stuck``: ``{"quiet_since_s", "stuck_after_s", "stacks"}``, or ``None``."""
        if not self.stuck:
            return None
        return {
            "quiet_since_s": self.quiet_since_s,
            "stuck_after_s": self.stuck_after_s,
            "stacks": {str(r): where for r, where in self.stacks.items()},
        }
