"""pdb's input and output between a session's ranks and the notebook: post-mortem (``%distributed_debug``) and
``runtime.breakpoint()`` in a running cell.

A rank in pdb sends ``debug_out`` frames (its output), a ``debug_input`` frame each time pdb reads a line and a
``debug_end`` frame when it stops prompting; the session's reader thread queues them on the request
(:attr:`Request.stream`). :class:`DebugRelay` shows them and asks the user for each line, from the thread that
follows the cell (the kernel's main thread, so the prompt is the cell's input box). One rank is served at a
time: a second rank's breakpoint waits until the first one's pdb stops prompting.
"""

from __future__ import annotations

import collections
import queue
from collections.abc import Callable
from typing import TYPE_CHECKING

from sgpu_magic.job.follow import JobSink
from sgpu_magic.wire.session import DebugFrame, DebugLine

if TYPE_CHECKING:
    from sgpu_magic.job.handle import Job
    from sgpu_magic.session.channel import Channel, Request

Write = Callable[[str], None]
ReadLine = Callable[[str], str]


class DebugRelay(JobSink):
    """Serves the pdb sessions of one request's ranks (see the module docstring).

    Args:
        channel: where the lines the user types go.
        write: shows pdb's output (complete lines); ``read_line(prompt)``: asks the user for one line.
        request: the request whose ranks may stop in pdb (a cell's; set by the session when it is sent).
    """

    needs_every_line = False

    def __init__(self, channel: Channel, write: Write, read_line: ReadLine) -> None:
        self.channel, self.write, self.read_line = channel, write, read_line
        self.request: Request | None = None
        self.active: int | None = None
        self._prompts: dict[int, str] = {}
        self._stash: collections.deque[DebugFrame] = collections.deque()
        self._job: Job | None = None

    def finished(self, job: Job) -> None:
        """The cell has ended: its request (replies, queues) and any frame stashed for it go."""
        self.request = None
        self._stash.clear()

    def tick(self, job: Job) -> None:
        """On each poll of the cell's job: serve what the ranks sent (blocks while the user types a line)."""
        self._job = job
        if self.request is not None:
            self.serve(self.request, block=False)

    def _activity(self, text: str) -> None:
        """Say in the cell's panel header which rank is in pdb (``""``: none)."""
        job = self._job
        if job is None:
            return
        job.activity = text
        show = getattr(job.view, "show_activity", None)
        if show is not None:
            show(job)

    def serve(self, request: Request, block: bool) -> None:
        """Show and answer the queued frames of ``request``; with ``block``, until its replies are all in."""
        while True:
            item = self._next(request, block)
            if item is None:
                return
            rank = item.rank
            if self.active is not None and rank != self.active:
                self._stash.append(item)  # another rank's breakpoint waits for this one's pdb
                continue
            self._handle(rank, item)

    def _handle(self, rank: int, item: DebugFrame) -> None:
        kind = item.kind
        if self.active is None and kind != "debug_end" and self.request is not None:
            self._activity(f"rank {rank} in debugger")
            self.write(
                f"sgpu_magic: rank {rank} stopped in pdb (c continues, q detaches; the other ranks wait in "
                f"their next collective)\n"
            )
        if kind != "debug_end":
            self.active = rank
        if kind == "debug_out":
            shown, _, self._prompts[rank] = (self._prompts.get(rank, "") + item.text).rpartition("\n")
            if shown:
                self.write(shown + "\n")
        elif kind == "debug_input":
            prompt = self._prompts.pop(rank, "")
            line = _ask(self.read_line, f"[rank {rank}] {prompt}" if self.request is not None else prompt)
            self.channel.send((rank,), DebugLine(line))
        elif kind == "debug_end":
            self.active = None
            self._activity("")

    def _next(self, request: Request, block: bool) -> DebugFrame | None:
        for item in list(self._stash):
            if self.active is None or item.rank == self.active:
                self._stash.remove(item)
                return item
        while True:
            try:
                return request.stream.get(timeout=0.1) if block else request.stream.get_nowait()
            except queue.Empty:
                if not block or (request.done.is_set() and request.stream.empty()):
                    return None


def _ask(read_line: ReadLine, prompt: str) -> str:
    """One line for pdb from the user; ``q`` (leave it) on an interrupt or end of input."""
    try:
        return read_line(prompt)
    except (KeyboardInterrupt, EOFError):
        return "q"


def write_output(text: str) -> None:
    """Show pdb's output in the cell (the kernel's stdout)."""
    print(text, end="", flush=True)


def read_line(prompt: str) -> str:
    """``input(prompt)`` as the kernel has it now (ipykernel replaces it while a cell runs: a frontend prompt)."""
    import builtins

    return builtins.input(prompt)
