"""The :class:`~sgpu_magic.launch.base.Launcher` of a session's cells: the session's live ranks."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from sgpu_magic.rundir import RunDir

if TYPE_CHECKING:
    from sgpu_magic.session.core import SessionCore
    from sgpu_magic.session.relay import DebugRelay
    from sgpu_magic.status import HostStatus
    from sgpu_magic.wire import StopReason


class CellLauncher:
    """The :class:`~sgpu_magic.launch.base.Launcher` of one session cell: the session's live ranks."""

    def __init__(
        self, core: SessionCore, ranks: tuple[int, ...], timeout_s: float | None, relay: DebugRelay | None = None
    ) -> None:
        self.core, self.ranks, self.timeout_s, self.relay = core, ranks, timeout_s, relay
        self.pid = os.getpid()  # a cell holds no lease of its own (the session's job does)

    def launch(self, run_dir: RunDir) -> None:
        request = self.core.send_cell(run_dir, self.ranks, self.timeout_s)
        if self.relay is not None:
            self.relay.request = request

    def cancel(self, run_dir: RunDir, reason: StopReason) -> None:
        self.core.interrupt(reason)

    def alive(self) -> bool:
        return not self.core.stopped

    def where(self) -> str:
        return str(self.core.job.run_dir) if self.core.job is not None else "(not started)"

    def preparing(self) -> str | None:
        return None  # the session's ranks are running

    def stacks(self, run_dir: RunDir, status: Callable[[], HostStatus], native: bool) -> dict[int, str]:
        """The ranks' stacks, taken by py-spy from the kernel (:func:`sgpu_magic.launch.stacks.live_stacks`)."""
        from sgpu_magic.launch.stacks import live_stacks

        return live_stacks(run_dir, status, native)
