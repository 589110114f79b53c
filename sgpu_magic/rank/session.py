"""A rank of a live session: the loop that runs cells in one persistent namespace until the session stops.

Started like any rank (:mod:`sgpu_magic.rank.worker`, payload kind ``session``). It opens its two FIFOs in the
session's run directory (0600 in a 0700 folder, checked before use: commands are pickles), says ``ready``, and
then serves one command at a time from the kernel:

- ``cell``: run the cell (or function) whose payload is in the cell's own run directory, in this rank's
  namespace. Names the namespace lacks come from the payload's captured globals; names it has win. Its output
  goes to the cell's log file (and stays there: a thread printing between cells writes to the latest cell's
  log); its value or error is written to the cell's run directory as for a job.
- ``push``: set names in the namespace; ``pull``: send a name's value back (tensors on the CPU);
  ``stop``: leave the loop (the rank then ends as a job's rank does).
- ``ungroup`` / ``regroup``: the last steps of ``Session.recover()`` (:mod:`sgpu_magic.rank.recover`): destroy the
  default process group, then make it again on the job's rendezvous store.

A third FIFO, the control FIFO, is read by a daemon thread, so that the kernel reaches a rank whose main thread is
blocked in a collective (:func:`sgpu_magic.rank.recover.start_control_thread`).

SIGINT raises ``KeyboardInterrupt`` only while a cell runs (the kernel's interrupt of that cell); between cells
it is ignored. When the kernel's end of the command FIFO closes (the kernel is gone), the rank waits for the launch
host to stop it.

A detached session's rank (``Session(detach=True)``, under the run keeper) outlives its kernel: it holds its command
and control FIFOs open itself, so a kernel that goes away is not an end of file, and it waits, with its namespace,
for the commands of the next kernel that attaches (:func:`sgpu_magic.attach`); a reply that finds no kernel is
dropped (the cell's outcome is in its run directory). It ends after ``idle_timeout_s`` seconds without a command.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from dataclasses import replace
from typing import NoReturn

from sgpu_magic._util.frames import read_frame, write_frame
from sgpu_magic._util.metrics import WRITER as METRICS
from sgpu_magic.errors import RecordError
from sgpu_magic.rank.payload import dump_result, load_globals, redirect_output, run_payload, write_error
from sgpu_magic.rundir import RunDir, atomic_write_bytes, open_private_fifo
from sgpu_magic.wire.payload import Payload
from sgpu_magic.wire.session import (
    Debug,
    Pull,
    Push,
    Regroup,
    Reply,
    RunCell,
    SessionCommand,
    Stop,
    Ungroup,
    decode_command,
)


class _Running:
    """Whether a cell runs now: SIGINT raises ``KeyboardInterrupt`` in it, and does nothing between cells.

    ``failure``: the exception of the last cell if it failed (kept, with its frames, for ``%distributed_debug``)."""

    def __init__(self) -> None:
        self.cell = False
        self.failure: BaseException | None = None

    def on_sigint(self, signum: int, frame: object) -> None:
        if self.cell:
            raise KeyboardInterrupt


def _names(ns: dict) -> list[str]:
    """The user's names in the namespace (what the kernel then need not capture for this rank)."""
    return [name for name in ns if not name.startswith("__")]


def _run_cell(cmd: RunCell, base: Reply, ns: dict, running: _Running, fds: tuple[int, int]) -> Reply:
    """Run one cell (or function) of the session; write its value or error into its run directory. ``fds``: the
    rank's reply and command FIFOs, for a ``runtime.breakpoint()`` in the cell."""
    from sgpu_magic.rank.debug import cell_channel

    rank = base.rank
    rd = RunDir(cmd.run_dir)
    _flush()
    METRICS.use(rd.metrics_file(rank))
    redirect_output(rd.log_file(rank))
    reply = base
    payload: Payload | None = None
    running.failure = None
    grad_mode = _grad_mode()
    try:
        payload = rd.read_payload()
        load_globals(payload, ns, keep=True)  # the rank's own names win
        held: list = []
        running.cell = True
        try:
            with cell_channel(fds[0], fds[1], base):
                value = run_payload(payload, ns, held, rd)
        finally:
            running.cell = False
            held.clear()
        atomic_write_bytes(rd.result_file(rank), dump_result(value, rank))
    except BaseException as exc:  # noqa: BLE001 - a cell's error fails the cell, never the session
        running.cell = False
        reply = replace(base, ok=False, interrupted=isinstance(exc, KeyboardInterrupt))
        if reply.interrupted:
            _restore_grad_mode(grad_mode)
        running.failure = exc
        try:
            write_error(rd, rank, exc, payload.display_names if payload is not None else None)
        except OSError:  # a disk full even past the session's reserve: the cell fails unexplained, the rank lives on
            pass
    _flush()
    try:  # the cell's points are in its metrics file before its reply: the kernel reads them on the final status
        METRICS.flush()
    except Exception as exc:  # noqa: BLE001 - the points are lost, the cell's outcome is not; its log says why
        print(f"sgpu_magic: metrics could not be written ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
    return reply


def _grad_mode() -> bool | None:
    """torch's grad mode before a cell (``None`` while the rank has not imported torch)."""
    torch = sys.modules.get("torch")
    return None if torch is None else bool(torch.is_grad_enabled())


def _restore_grad_mode(enabled: bool | None) -> None:
    """An interrupted cell leaves torch's grad mode as it found it: an interrupt that lands inside
    ``with torch.no_grad():`` between its ``set_grad_enabled(False)`` and the block left grad off for every later
    cell of the rank (its next ``backward()`` raised while the other ranks waited for it in DDP's all-reduce)."""
    torch = sys.modules.get("torch")
    if enabled is not None and torch is not None:
        torch.set_grad_enabled(enabled)


def _push(cmd: Push, base: Reply, ns: dict) -> Reply:
    import cloudpickle

    for name, data in cmd.values.items():
        ns[name] = cloudpickle.loads(data)
    return base


def _pull(cmd: Pull, base: Reply, ns: dict) -> tuple[Reply, bytes | None]:
    if cmd.name not in ns:
        return replace(base, ok=False, error=f"rank {base.rank} has no name {cmd.name!r}", missing=True), None
    try:
        return base, dump_result(ns[cmd.name], base.rank, cmd.name)
    except TypeError as exc:
        return replace(base, ok=False, error=str(exc)), None


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _debug(base: Reply, running: _Running, replies: int, commands: int) -> Reply:
    """pdb at the frame where this rank's last cell failed, its I/O over the channel (:mod:`sgpu_magic.rank.debug`)."""
    from sgpu_magic.rank.debug import post_mortem

    if running.failure is None:
        return replace(base, ok=False, error=f"rank {base.rank}'s last cell did not fail: there is nothing to debug")
    _flush()
    post_mortem(running.failure, replies, commands, base)
    return base


def _ungroup(base: Reply) -> Reply:
    from sgpu_magic.rank.recover import ungroup

    return replace(base, backend=ungroup())


def _regroup(cmd: Regroup, base: Reply) -> Reply:
    from sgpu_magic.rank.recover import regroup

    try:
        regroup(cmd.backend, cmd.generation)
    except Exception as exc:  # noqa: BLE001 - said to the kernel, which says the session needs a restart
        return replace(base, ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return base


def _serve_one(
    cmd: SessionCommand, base: Reply, ns: dict, running: _Running, fds: tuple[int, int]
) -> tuple[Reply, bytes | None]:
    if isinstance(cmd, RunCell):
        return _run_cell(cmd, base, ns, running, fds), None
    if isinstance(cmd, Push):
        return _push(cmd, base, ns), None
    if isinstance(cmd, Pull):
        return _pull(cmd, base, ns)
    if isinstance(cmd, Debug):
        return _debug(base, running, *fds), None
    if isinstance(cmd, Ungroup):
        return _ungroup(base), None
    if isinstance(cmd, Regroup):
        return _regroup(cmd, base), None
    return replace(base, ok=False, error=f"a {type(cmd).__name__} command is not one a session rank serves now"), None


def _reply(fd: int, reply: Reply, value: bytes | None, ns: dict) -> None:
    reply = replace(reply, names=tuple(_names(ns)), has_value=value is not None, time_s=time.time())
    write_frame(fd, reply.encode())
    if value is not None:
        write_frame(fd, value)


def _wait_to_be_stopped() -> NoReturn:
    """The kernel is gone: wait for the launch host (which sees that within a second) to stop this rank, so the
    session ends as killed, not as a session that finished (its MLflow run KILLED). A rank whose host is gone too
    dies with it (PR_SET_PDEATHSIG)."""
    while True:
        signal.pause()


def serve(run_dir: RunDir, ns: dict, detached: bool = False, idle_timeout_s: float | None = None) -> None:
    """The session loop of this rank (``RANK`` from the environment) until ``stop`` or the kernel is gone; for a
    ``detached`` session's rank, until ``stop`` or ``idle_timeout_s`` seconds without a command (see the module
    docstring)."""
    rank = int(os.environ["RANK"])
    keep_open = os.O_RDWR if detached else os.O_RDONLY  # a detached rank is a writer itself: no end of file
    commands = open_private_fifo(run_dir.session_command(rank), keep_open)
    replies = open_private_fifo(run_dir.session_reply(rank), os.O_WRONLY)
    if run_dir.session_control(rank).exists():  # made by the kernel's channel on this machine (not on Ray)
        from sgpu_magic.rank.recover import start_control_thread

        start_control_thread(open_private_fifo(run_dir.session_control(rank), keep_open))
    running = _Running()
    signal.signal(signal.SIGINT, running.on_sigint)
    # a rank started by a Ray actor's thread inherits that thread's blocked SIGINT: the interrupt would never land
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _reply(replies, Reply(0, rank, pid=os.getpid()), None, ns)
    while True:
        if detached and not _command_within(commands, idle_timeout_s):
            print(
                f"sgpu_magic: no command for {idle_timeout_s:g} s (the detached session's idle timeout): this rank ends",
                file=sys.stderr,
                flush=True,
            )
            return
        try:
            frame = read_frame(commands)
        except KeyboardInterrupt:  # cannot happen (SIGINT raises only in a cell); kept for safety
            continue
        if frame is None:  # the kernel's end closed: it is gone, and the launch host stops this rank (KILLED)
            _wait_to_be_stopped()
        try:
            seq, cmd = decode_command(frame)
        except RecordError as exc:  # a newer kernel's command: said in the rank's log, the rank serves the next
            print(f"sgpu_magic: {exc}", file=sys.stderr, flush=True)
            continue
        base = Reply(seq, rank)
        if isinstance(cmd, Stop):
            _answer(detached, replies, base, None, ns)
            return
        reply, value = _serve_one(cmd, base, ns, running, (replies, commands))
        _answer(detached, replies, reply, value, ns)


def _command_within(fd: int, timeout_s: float | None) -> bool:
    """Whether a command comes on ``fd`` within ``timeout_s`` seconds (``None``: wait for one)."""
    ready, _, _ = select.select([fd], [], [], timeout_s)
    return bool(ready)


def _answer(detached: bool, fd: int, reply: Reply, value: bytes | None, ns: dict) -> None:
    """:func:`_reply`; a detached rank whose kernel has gone drops it (no reader: ``BrokenPipeError``), and waits for
    the next kernel."""
    try:
        _reply(fd, reply, value, ns)
    except BrokenPipeError:
        if not detached:
            raise
