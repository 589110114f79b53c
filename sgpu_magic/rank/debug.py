"""Post-mortem debugging of one rank, with pdb's input and output carried over the session's channel.

``failure_locals(exc)`` is what a failing rank saves with its error (a job's ranks are gone when the user asks):
the repr of the innermost user frame's locals. ``post_mortem(...)`` runs :class:`pdb.Pdb` in a live session's rank
at the frame where its last cell failed; pdb's output goes to the kernel as ``debug_out`` frames, and each line
pdb reads is asked for with a ``debug_input`` frame and comes back as a ``debug_line`` command, so the notebook
shows the prompt in the cell's input box (as IPython's ``%debug`` does) and the other ranks stay idle.
"""

from __future__ import annotations

import contextlib
import io
import os
import pdb
import reprlib
import sys
import types
from collections.abc import Iterator

from sgpu_magic._util.frames import read_frame, write_frame
from sgpu_magic.errors import RecordError
from sgpu_magic.wire.session import DebugFrame, DebugKind, DebugLine, Reply, decode_command

MAX_LOCALS = 50
"""How many locals a failure keeps (the first ones, in the frame's order)."""

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 200
_REPR.maxlevel = 3


def _package() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_frames(tb: types.TracebackType | None) -> list[tuple[types.FrameType, int]]:
    """``(frame, line)`` of every frame of ``tb`` outside sgpu_magic's own code, outermost first."""
    package, out = _package(), []
    while tb is not None:
        if not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(package):
            out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return out


def failure_locals(exc: BaseException) -> dict[str, str]:
    """The innermost user frame's locals of ``exc``'s traceback as ``{name: repr}``, modules left out (at most
    :data:`MAX_LOCALS`,
    each repr at most about 200 characters; a repr that raises is described by its type)."""
    frames = user_frames(exc.__traceback__)
    if not frames:
        return {}
    out = {}
    for name, value in list(frames[-1][0].f_locals.items())[:MAX_LOCALS]:
        if name.startswith("__") or isinstance(value, types.ModuleType):
            continue
        try:
            out[name] = _REPR.repr(value)
        except Exception:  # noqa: BLE001 - a broken __repr__ is the user's; say what the value is
            out[name] = f"<{type(value).__qualname__} object (its repr raised)>"
    return out


class _ChannelIO(io.TextIOBase):
    """pdb's stdin and stdout over a session rank's FIFOs (``replies``, ``commands``): writes go to the kernel as
    :class:`~sgpu_magic.wire.session.DebugFrame` s of the command ``head`` answers; a line read is asked of the
    kernel, which sends a :class:`~sgpu_magic.wire.session.DebugLine`."""

    def __init__(self, replies: int, commands: int, head: Reply) -> None:
        self._replies, self._commands, self._head = replies, commands, head

    def _send(self, kind: DebugKind, text: str = "") -> None:
        write_frame(self._replies, DebugFrame(self._head.seq, self._head.rank, kind, text).encode())

    def write(self, text: str) -> int:
        if text:
            self._send("debug_out", text)
        return len(text)

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override] # a text stream reads str
        self._send("debug_input")
        frame = read_frame(self._commands)
        try:
            cmd = None if frame is None else decode_command(frame)[1]
        except RecordError:
            cmd = None
        if not isinstance(cmd, DebugLine):  # the kernel is gone, or it sent no line: leave the debugger
            return "q\n"
        return cmd.line.rstrip("\n") + "\n"

    def flush(self) -> None:
        pass

    def end(self) -> None:
        """Tell the kernel that this pdb session stopped prompting (the rank runs on)."""
        self._send("debug_end")


class _Detaching(pdb.Pdb):
    """pdb whose ``q`` detaches instead of raising ``BdbQuit``: the rank runs on, so a collective its peers wait
    in completes (a cell that raised there would leave them stuck until the collective's timeout)."""

    def do_quit(self, arg: str) -> bool:
        self.clear_all_breaks()
        self.set_continue()
        return True

    do_q = do_exit = do_quit

    def interaction(self, frame, tb) -> None:
        try:
            super().interaction(frame, tb)
        finally:
            self._end()

    def _end(self) -> None:
        end = getattr(self.stdout, "end", None)
        if end is not None:
            end()


_CELL: tuple[int, int, Reply] | None = None
"""While a session cell runs: its channel (the reply and command FIFOs) and the reply its frames go before."""


@contextlib.contextmanager
def cell_channel(replies: int, commands: int, head: Reply) -> Iterator[None]:
    """Let :func:`breakpoint_here` reach the kernel while the session cell whose reply will be ``head`` runs."""
    global _CELL
    _CELL = (replies, commands, head)
    try:
        yield
    finally:
        _CELL = None


def breakpoint_here(frame: types.FrameType) -> None:
    """Stop in pdb at ``frame`` (the caller of ``runtime.breakpoint``), its I/O in the notebook cell that runs.

    Outside a live session's cell (a job, whose ranks have no channel to the kernel) it says so on stderr and
    returns."""
    cell = _CELL
    if cell is None:
        print(
            "sgpu_magic: runtime.breakpoint() stops a rank only in a live session's cell "
            "(%distributed_session start); ignored here",
            file=sys.stderr,
            flush=True,
        )
        return
    # nosigint: pdb's `c` would leave its own SIGINT handler, and the next interrupt of a cell would stop the rank
    # in pdb instead of raising KeyboardInterrupt (the session's interrupt then breaks the session)
    channel = _ChannelIO(*cell)
    debugger = _Detaching(stdin=channel, stdout=channel, nosigint=True)  # type: ignore[arg-type]
    debugger.use_rawinput = False
    debugger.set_trace(frame)


def post_mortem(exc: BaseException, replies: int, commands: int, head: Reply) -> None:
    """Run pdb at the innermost user frame of ``exc``'s traceback, its I/O over the channel (``replies`` and
    ``commands`` are the rank's FIFO descriptors; ``head``: the reply of the debug command, whose ``seq`` and
    ``rank`` each frame carries)."""
    channel = _ChannelIO(replies, commands, head)
    debugger = pdb.Pdb(stdin=channel, stdout=channel, nosigint=True)  # type: ignore[arg-type] # a text stream
    debugger.use_rawinput = False
    tb = exc.__traceback__
    frames = user_frames(tb)
    while tb is not None and frames and tb.tb_frame is not frames[0][0]:
        tb = tb.tb_next  # start at the user's outermost frame: sgpu_magic's own frames are not the user's
    debugger.reset()
    debugger.interaction(None, tb)
