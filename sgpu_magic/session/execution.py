"""One session cell in flight (:class:`CellExecution`): what its ranks were sent and what they replied, kept in
memory, in the shape the cell's :class:`~sgpu_magic.job.handle.Job` follows (a launcher and a status feed).

Like ipyparallel's request and its ``AsyncResult``, a cell's state comes from the replies: the session's reader
thread changes it through the cell's :class:`~sgpu_magic.status.StatusWriter` (``final_only``), which writes the
cell's ``status.json`` once, when it ends (the record a post-mortem reads), and the Job's follower reads it from
the cell's :class:`~sgpu_magic.job.follow.MemoryFeed` without a file, a FIFO or a ``launch.json``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from sgpu_magic.job.follow import MemoryFeed
from sgpu_magic.rundir import RunDir

if TYPE_CHECKING:
    from sgpu_magic.session.channel import Request
    from sgpu_magic.session.relay import DebugRelay
    from sgpu_magic.status import HostStatus
    from sgpu_magic.wire import StopReason

Send = Callable[["CellExecution", RunDir], "Request"]
"""How a cell reaches its ranks: the session's ``send_cell(execution, run_dir)`` (its request)."""


class CellExecution:
    """One cell on a session's live ranks: the :class:`~sgpu_magic.launch.base.Launcher` its Job hands the run
    directory to (sending the cell), and the :class:`~sgpu_magic.job.follow.MemoryFeed` its Job follows.

    Args:
        send: sends the cell (see :data:`Send`).
        interrupt: ``KeyboardInterrupt`` in the ranks running it, for a reason (the session's ``interrupt``).
        alive: whether the session still runs.
        where: where the session's diagnostics are (its run directory).
        ranks: the ranks it runs on.
        timeout_s: interrupt it as timed out after this many seconds (``None``: no timeout).
        relay: serves ``runtime.breakpoint()`` while the cell runs (given the request once sent).
    """

    def __init__(
        self,
        send: Send,
        interrupt: Callable[[StopReason], bool],
        alive: Callable[[], bool],
        where: str,
        ranks: tuple[int, ...],
        timeout_s: float | None,
        relay: DebugRelay | None = None,
    ) -> None:
        self._send, self._interrupt, self._alive, self._where = send, interrupt, alive, where
        self.ranks, self.timeout_s, self.relay = ranks, timeout_s, relay
        self.feed = MemoryFeed()
        self.pid = os.getpid()  # a cell holds no lease of its own (the session's job does)

    def launch(self, run_dir: RunDir) -> None:
        request = self._send(self, run_dir)
        if self.relay is not None:
            self.relay.request = request

    def cancel(self, run_dir: RunDir, reason: StopReason) -> None:
        self._interrupt(reason)

    def alive(self) -> bool:
        return self._alive()

    def where(self) -> str:
        return self._where

    def preparing(self) -> str | None:
        return None  # the session's ranks are running

    def stacks(self, run_dir: RunDir, status: Callable[[], HostStatus], native: bool) -> dict[int, str]:
        """The ranks' stacks, taken by py-spy from the kernel (:func:`sgpu_magic.launch.stacks.live_stacks`)."""
        from sgpu_magic.launch.stacks import live_stacks

        return live_stacks(run_dir, status, native)
