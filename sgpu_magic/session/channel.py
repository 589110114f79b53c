"""The kernel's end of a session's channel: one command FIFO and one reply FIFO per rank, and the requests on it.

A third FIFO per rank, its control FIFO, reaches a thread of the rank even while its main thread is blocked in a
collective (:meth:`SessionChannel.release`, for ``Session.recover()``).

The FIFOs are made by the kernel in the session's private run directory before the ranks start
(:meth:`SessionChannel.make`), and opened read-write by the kernel, so neither side's ``open`` blocks; a rank
sees end of file on its command FIFO when the kernel is gone. One request is outstanding at a time (a cell, a
push, a pull, a stop): :class:`Request` collects one reply per rank it was sent to. Replies are read by the
session's reader thread (:meth:`SessionChannel.read_ready`).
"""

from __future__ import annotations

import os
import queue
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from sgpu_magic._util.frames import read_frame, write_frame
from sgpu_magic.rundir import RunDir, make_private_dir, make_private_fifo, open_private_fifo
from sgpu_magic.status import StatusWriter
from sgpu_magic.wire import StopReason
from sgpu_magic.wire.session import DebugFrame, Frame, ReleasePeers, Reply, SessionCommand, decode_frame, encode_command

if TYPE_CHECKING:
    from sgpu_magic.job.handle import Job


@dataclass
class Request:
    """One request to some ranks and their replies.

    Attributes:
        seq: its number (replies carry it; a late reply to an earlier request is dropped).
        ranks: the ranks it was sent to.
        replies: ``{rank: reply}`` as they arrive.
        values: ``{rank: pickled value}`` of a pull.
        run_dir: the cell's run directory (``None`` for push, pull, stop).
        deadline: monotonic time after which a cell is interrupted as timed out (``None``: no timeout).
        reason: why it was interrupted (``interrupted``, ``cancelled``, ``timed_out``), else ``None``.
        grace_end: monotonic time by which interrupted ranks must reply, else the session breaks.
    """

    seq: int
    ranks: tuple[int, ...]
    replies: dict[int, Reply] = field(default_factory=dict)
    values: dict[int, bytes] = field(default_factory=dict)
    run_dir: RunDir | None = None
    writer: StatusWriter | None = None
    """The cell's status writer (``None`` for push, pull, stop)."""
    wake: Callable[[], None] | None = None
    """Wakes the cell's follower when a rank sent a frame before its reply (``None`` for push, pull, stop)."""
    deadline: float | None = None
    reason: StopReason | None = None
    """Why the cell's ranks were interrupted (the first reason wins), ``None`` while they were not."""
    grace_end: float | None = None
    failed_at: float | None = None
    """Monotonic time the first rank raised in the cell: the others are interrupted ``FAILURE_GRACE_S`` later."""
    started_s: float = field(default_factory=time.time)
    done: threading.Event = field(default_factory=threading.Event)
    stream: queue.Queue[DebugFrame] = field(default_factory=queue.Queue)
    """Frames a rank sends before its reply (a debugger's output and its requests for a line)."""

    @property
    def missing(self) -> list[int]:
        """The ranks that have not replied yet."""
        return [r for r in self.ranks if r not in self.replies]


class Channel(Protocol):
    """What a session needs of its channel to the ranks: :class:`SessionChannel` on this machine,
    :class:`~sgpu_magic.launch.ray.session_channel.RaySessionChannel` on a Ray cluster."""

    def make(self) -> None: ...
    def reopen(self) -> None: ...
    def attach(self, job: Job) -> None: ...
    def send(self, ranks: tuple[int, ...], cmd: SessionCommand, seq: int = 0) -> None: ...
    def read_ready(self, timeout_s: float) -> list[tuple[int, Frame, bytes | None]]: ...
    def interrupt(self, rank: int, pid: int) -> None: ...

    releases: bool
    """Whether :meth:`release` reaches the ranks' connections (``Session.recover()``)."""

    def release(self, peers: dict[int, int]) -> None: ...
    def close(self) -> None: ...


class SessionChannel:
    """The FIFOs of one session's ranks, opened by the kernel.

    Raises (``make``): OSError when the FIFOs cannot be made in the run directory.
    """

    def __init__(self, run_dir: RunDir, world_size: int) -> None:
        self.run_dir = run_dir
        self.world_size = world_size
        self._commands: dict[int, int] = {}
        self._replies: dict[int, int] = {}
        self._controls: dict[int, int] = {}
        self._send_lock = threading.Lock()

    def make(self) -> None:
        """Make and open every rank's three FIFOs (before the ranks start)."""
        make_private_dir(self.run_dir.session_dir)
        for rank in range(self.world_size):
            for path, fds in (
                (self.run_dir.session_command(rank), self._commands),
                (self.run_dir.session_reply(rank), self._replies),
                (self.run_dir.session_control(rank), self._controls),
            ):
                make_private_fifo(path)
                fds[rank] = open_private_fifo(path, os.O_RDWR)

    def reopen(self) -> None:
        """Open every rank's three FIFOs again, made by the kernel that started a detached session (its ranks wait
        for this kernel), and drop what the reply FIFOs hold: replies that kernel never read.

        Raises:
            OSError: a FIFO is gone or not private (:func:`~sgpu_magic.rundir.open_private_fifo`).
        """
        for rank in range(self.world_size):
            for path, fds in (
                (self.run_dir.session_command(rank), self._commands),
                (self.run_dir.session_reply(rank), self._replies),
                (self.run_dir.session_control(rank), self._controls),
            ):
                fds[rank] = open_private_fifo(path, os.O_RDWR)
            fd = self._replies[rank]
            os.set_blocking(fd, False)
            try:
                while os.read(fd, 1 << 16):
                    pass
            except BlockingIOError:
                pass
            finally:
                os.set_blocking(fd, True)

    def attach(self, job: Job) -> None:
        """The session's job is submitted (nothing to do: the FIFOs were made before)."""

    def interrupt(self, rank: int, pid: int) -> None:
        """SIGINT to ``rank`` (process ``pid``): ``KeyboardInterrupt`` in the cell it runs."""
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            pass

    releases = True

    def release(self, peers: dict[int, int]) -> None:
        """Ask every rank's control thread to close its connections to the other ranks (``peers``: ``{rank: pid}``),
        which returns a collective that waits for them (:mod:`sgpu_magic.rank.recover`).

        Raises:
            OSError: the channel is closed.
        """
        with self._send_lock:
            for rank, fd in self._controls.items():
                others = tuple(pid for r, pid in sorted(peers.items()) if r != rank)
                os.write(fd, ReleasePeers(others).encode())

    def send(self, ranks: tuple[int, ...], cmd: SessionCommand, seq: int = 0) -> None:
        """Send ``cmd`` (of request ``seq``) to each of ``ranks`` (one frame each).

        Raises:
            OSError: the channel is closed.
        """
        data = encode_command(cmd, seq)
        with self._send_lock:
            for rank in ranks:
                write_frame(self._commands[rank], data)

    def read_ready(self, timeout_s: float) -> list[tuple[int, Frame, bytes | None]]:
        """Wait up to ``timeout_s`` for replies; each waiting one as ``(rank, frame, pickled value or None)``.

        Raises:
            RecordError: a rank sent a frame this version does not read (the session breaks, saying it).
        """
        by_fd = {fd: rank for rank, fd in self._replies.items()}
        if not by_fd:
            return []
        try:
            ready, _, _ = select.select(list(by_fd), [], [], timeout_s)
        except (OSError, ValueError):  # closed meanwhile (the session stopped)
            return []
        out = []
        for fd in ready:
            frame = read_frame(fd)
            if frame is None:
                continue
            reply = decode_frame(frame)
            value = bytes(read_frame(fd) or b"") if reply.has_value else None
            out.append((by_fd[fd], reply, value))
        return out

    def close(self) -> None:
        """Close the kernel's ends: ranks still serving see end of file and leave their loop."""
        with self._send_lock:
            for fd in [*self._commands.values(), *self._replies.values(), *self._controls.values()]:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._commands.clear()
            self._replies.clear()
            self._controls.clear()


def new_channel(run_dir: RunDir, world_size: int, cluster: str | None) -> Channel:
    """The channel of a session whose run directory is ``run_dir``: FIFOs here, or through the rank actors of
    the Ray cluster ``cluster`` (the FIFOs are then on the ranks' nodes)."""
    from sgpu_magic.launch import session_channel_for

    return session_channel_for(run_dir, world_size, cluster) or SessionChannel(run_dir, world_size)
