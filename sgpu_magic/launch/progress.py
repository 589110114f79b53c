"""The hang detector: a job whose ranks all run but none has written a log byte or logged a metric point for
``stuck_after_s`` seconds is *possibly stuck*; its launcher (the launch host, or the Ray supervisor, which watches the
logs and metrics it copies from the nodes) then takes the ranks' stacks (py-spy, as for a timeout:
:mod:`sgpu_magic.launch.stacks`; on Ray each rank's agent on its node) and reports both in ``status.json``'s ``stuck``
(:class:`~sgpu_magic.status.StuckReport`). The report goes when any rank writes again.

Progress is read from the sizes of the ranks' log and metrics files (one ``stat`` each per check, about once a
second). While the job stays quiet the stacks are taken again every ``stuck_after_s`` (at least
:data:`RESTACK_MIN_S`), so the report names where the ranks are now.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from sgpu_magic.launch.stacks import CodeMap, RankStack, take_stacks
from sgpu_magic.rundir import RunDir
from sgpu_magic.status import StuckReport

RESTACK_MIN_S = 10.0
"""While a job stays quiet, its stacks are taken again at most this often."""


class ProgressWatch:
    """Watches one job's log and metrics files; :meth:`check` about once a second, :meth:`report` for the status.

    ``take``: how the ranks' stacks are taken (``{rank: pid}`` → ``{rank: RankStack}``); default: py-spy here
    (the launch host's ranks; the Ray supervisor's asks each rank's agent on its node, whose logs it copies here)."""

    def __init__(
        self,
        rd: RunDir,
        world_size: int,
        stuck_after_s: float | None,
        take: Callable[[dict[int, int]], dict[int, RankStack]] | None = None,
    ) -> None:
        self.rd, self.stuck_after_s = rd, stuck_after_s
        self._take_stacks = take or (lambda pids: take_stacks(pids, CodeMap.read(rd.code_map_file)))
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
        try:
            stacks = self._take_stacks(pids)
        except Exception:  # noqa: BLE001 - no stacks this time; the report stands without them
            stacks = {}
        if self.stuck:
            self.stacks = {rank: stack.where for rank, stack in stacks.items()}

    def report(self) -> StuckReport | None:
        """``status.json``'s ``stuck``, or ``None`` while the job is not stuck."""
        if not self.stuck or self.stuck_after_s is None:
            return None
        return StuckReport(self.quiet_since_s, self.stuck_after_s, dict(self.stacks))
