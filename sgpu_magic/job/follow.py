"""Following a job: each rank's log read by byte offset (:class:`LogFollower`), and the events a job sends to
what shows or records it (:class:`JobSink`: the panel, the text view, MLflow tracking)."""

from __future__ import annotations

import codecs
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from sgpu_magic.launch.resources import DevicePlan
from sgpu_magic.rundir import RunDir, open_private_fifo, read_json
from sgpu_magic.spec import LaunchSpec
from sgpu_magic.wire import RunState

if TYPE_CHECKING:
    from sgpu_magic.job.handle import Job
    from sgpu_magic.job.state import JobState


POLL_INTERVAL_S = 0.01
"""How often a followed job's status file is checked (an os.stat) when its status FIFO could not be made;
with the FIFO the follower sleeps until the launch host signals a status write (or ``PUMP_INTERVAL_S``)."""


PUMP_INTERVAL_S = 0.05
"""How often the rank logs are read (and the launch host's liveness checked) while nothing else changes."""


ON_SCREEN_READ_S = 0.2
"""How often a log on screen is read when no sink needs every line (the panel shows it at most 5 times a second)."""


OFF_SCREEN_READ_S = 5.0
"""How often the logs of ranks not on screen are read, when no sink needs every line (the panel
refreshes tabs off screen every 5 s, and a tab at once when it is selected)."""
TAIL_MIN_BYTES = 64 * 1024
"""Below this much new output a log is read whole; above it, from where its last lines start (the
first window read back from the end; later windows fit the lines seen so far)."""


class LogFollower:
    """Follows one rank's log file by byte offset and returns the new text (UTF-8 decoded incrementally).

    The file is kept open from its first read until :meth:`close` (logs are only appended to), so a
    read with nothing new costs one ``fstat``.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.skipped_total = 0
        """Bytes passed over so far (they are only in the log file)."""
        self._line_bytes = 0.0  # mean length of the lines read from the tail last time
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._file: IO[bytes] | None = None

    def _open(self):
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # noqa: SIM115 - kept open until close()
            except FileNotFoundError:
                return None
        return self._file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def read(self, final: bool = False) -> str:
        """Text written since the last call; with ``final`` also a trailing incomplete character."""
        f = self._open()
        if f is None or os.fstat(f.fileno()).st_size <= self.offset:
            chunk = b""
        else:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        return self._decoder.decode(chunk, final=final)

    def read_tail(self, min_lines: int, final: bool = False) -> tuple[int, str]:
        """Like :meth:`read`, but when much was written, skip to the last ``min_lines`` complete lines.

        Returns ``(skipped_bytes, text)``: the bytes passed over (they end at a line end) and the
        text after them. A view that shows only the last lines reads a few hundred KB however
        fast the rank writes.
        """
        f = self._open()
        if f is None:
            return 0, ""
        size = os.fstat(f.fileno()).st_size
        if size - self.offset <= TAIL_MIN_BYTES:
            return 0, self.read(final)
        # a window that holds min_lines lines of the length seen so far (a fifth more), at least 4 KiB
        want = max(4096, int(min_lines * self._line_bytes * 1.2)) if self._line_bytes else TAIL_MIN_BYTES
        while True:
            start = max(self.offset, size - want)
            f.seek(start)
            chunk = f.read(size - start)
            cut = chunk.find(b"\n") if start > self.offset else -1
            lines = chunk.count(b"\n", cut + 1) if cut >= 0 else 0
            if lines:
                self._line_bytes = (len(chunk) - cut - 1) / lines
            if cut >= 0 and lines >= min_lines:
                skipped = start + cut + 1 - self.offset
                self.skipped_total += skipped
                self.offset = start + len(chunk)
                self._decoder.reset()  # the skipped bytes end at a newline: no character is cut
                return skipped, self._decoder.decode(chunk[cut + 1 :], final=final)
            if start == self.offset:
                self.offset += len(chunk)
                return 0, self._decoder.decode(chunk, final=final)
            want *= 4

    def reread_tail(self, min_lines: int) -> tuple[int, str]:
        """The last ``min_lines`` complete lines of the whole log (and any unfinished last line), read
        again from the file, after :meth:`read_tail` passed over the middle with fewer lines.

        Returns ``(skipped_bytes, text)`` like :meth:`read_tail`; ``skipped_bytes`` counts only bytes
        not reported as skipped before, so the sum over calls stays the bytes before the text.
        """
        before = self.skipped_total
        self.offset, self.skipped_total = 0, 0
        self._decoder.reset()
        skipped, text = self.read_tail(min_lines, final=True)
        return max(0, skipped - before), text


class JobSink:
    """Receives one job's events; subclass and override what you need.

    The panel, the text view and MLflow tracking are sinks. ``created`` runs in the thread
    that started the job; the other events come from the thread that follows it (the calling
    thread for a blocking call, a background thread for a submitted job). ``prepare`` runs
    once the job holds its GPUs, before the ranks start.
    """

    needs_every_line = True
    """False for a sink that shows only the last ``tail_lines`` lines of each rank: when every sink
    says so, the job skips over the middle of fast logs (see :meth:`skipped`)."""
    tail_lines = 0
    """Lines of each rank the sink keeps at the end (read from the log's tail when it skips)."""
    live_tail_lines = 0
    """Lines of each rank the sink shows while the job runs (0: ``tail_lines``); the logs are read from
    their tail with this many lines, and once more with ``tail_lines`` when the job ends."""

    def ranks_on_screen(self) -> set[int] | None:
        """Ranks whose output is shown right now (read every ``ON_SCREEN_READ_S``); the others are read
        every ``OFF_SCREEN_READ_S`` when no sink needs every line. ``None``: all of them."""
        return None

    def replica(self) -> JobSink | None:
        """A new view like this one, not shown yet (:meth:`Job.show <sgpu_magic.job.handle.Job.show>` shows the
        job again with it); ``None``: this sink is not a view."""
        return None

    def created(self, job: Job) -> None:
        """The job exists (state pending); nothing has started yet. Runs in the starting thread."""

    def pending(self, job: Job, why: str) -> None:
        """The job waits for GPUs; ``why`` says how many are free and who holds the rest."""

    def prepare(self, job_id: str, spec: LaunchSpec, plan: DevicePlan) -> dict:
        """Before launch: return ``{"env": {...}}`` for the ranks and other fields of the job's
        :class:`~sgpu_magic.wire.LaunchRecord` (``launch.json``), by their names there."""
        return {}

    def started(self, job: Job) -> None:
        """The job was handed to the launch host."""

    def attached(self, job: Job) -> None:
        """The job is a detached one started by another kernel (:meth:`Job.attach`), followed from here on: no
        :meth:`prepare` came (its launch.json and MLflow run were made by that kernel); :meth:`started` follows."""

    def output(self, rank: int, text: str) -> None:
        """New text from rank ``rank``'s log (stdout and stderr in order; may end mid-line)."""

    def skipped(self, rank: int, nbytes: int) -> None:
        """``nbytes`` of rank ``rank``'s log (ending at a line end) were passed over; they are in its file.
        The lines the sink holds are dropped (``nbytes`` may be 0 when the job's end reads a longer tail again)."""

    def state_changed(self, job: Job, state: JobState) -> None:
        """The job moved to ``state``."""

    def tick(self, job: Job) -> None:
        """Called on every poll of the job (about 20 times a second): flush what is buffered."""

    def metrics_logged(self, job: Job) -> None:
        """The ranks logged new metric points (read at most every 0.2 s): see :meth:`Job.metrics`."""

    def restarted(self, job: Job, attempt: int) -> None:
        """A rank failed and every rank was started again (``max_restarts``); ``attempt`` counts from 1."""

    def stuck_changed(self, job: Job) -> None:
        """The launcher's hang detector changed its report: ``job.status.stuck`` (``None``: progress again)."""

    def finished(self, job: Job) -> None:
        """The job reached a final state; every line of its logs was delivered before this."""

    def release(self) -> None:
        """The ended job will not be shown again (a live session's cell, ten cells later): drop what only its live
        view needed (the panel's widget objects). Called at most once, after :meth:`finished`."""

    def launch_failed(self, job_id: str, error: BaseException) -> None:
        """The launch failed after ``prepare`` (no ``started`` or ``finished`` follows): release what
        ``prepare`` set up."""

    def settle(self, timeout_s: float | None = None) -> None:
        """Wait (at most ``timeout_s``) until what the sink records for the job elsewhere has been written (MLflow
        tracking writes off the job's path); ``Job.mlflow_run_id`` calls it."""

    def run_url(self) -> str | None:
        """A link to the page of what the sink records for the job, if a server shows it now (``Job.run_url``)."""
        return None

    def after_recorded(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` (from another thread) once what the sink records elsewhere for the job exists (its
        MLflow run, made off the job's path), if it is still being made; whether it was (``False``: nothing is
        called). The panel's snapshot of a job that ended first gets its run link so."""
        return False


def view_of(sinks: Sequence[JobSink]) -> JobSink | None:
    """The job's view among its sinks: the last one (the panel or the text view; ``front.decorator`` and sessions
    put it last), ``None`` without sinks. The one place that knows where the view is."""
    return sinks[-1] if sinks else None


class JobEvents(JobSink):
    """A job's events, typed: each method hands the event to every sink in order (what the job emits and the log
    pump calls); :attr:`view` is the sink that shows the job, which :meth:`note` and :meth:`warn` reach."""

    def __init__(self, sinks: Sequence[JobSink]) -> None:
        self.sinks = list(sinks)
        self.view = view_of(self.sinks)

    def note(self, text: str) -> None:
        """A line for the user, through the view (if it shows notes)."""
        note = getattr(self.view, "note", None)
        if note is not None:
            note(text)

    def warn(self, text: str) -> None:
        """A warning for the user, through the view (if it shows warnings)."""
        warn = getattr(self.view, "warn", None)
        if warn is not None:
            warn(text)

    def created(self, job: Job) -> None:
        for sink in self.sinks:
            sink.created(job)

    def pending(self, job: Job, why: str) -> None:
        for sink in self.sinks:
            sink.pending(job, why)

    def started(self, job: Job) -> None:
        for sink in self.sinks:
            sink.started(job)

    def attached(self, job: Job) -> None:
        for sink in self.sinks:
            sink.attached(job)

    def output(self, rank: int, text: str) -> None:
        for sink in self.sinks:
            sink.output(rank, text)

    def skipped(self, rank: int, nbytes: int) -> None:
        for sink in self.sinks:
            sink.skipped(rank, nbytes)

    def state_changed(self, job: Job, state: JobState) -> None:
        for sink in self.sinks:
            sink.state_changed(job, state)

    def tick(self, job: Job) -> None:
        for sink in self.sinks:
            sink.tick(job)

    def metrics_logged(self, job: Job) -> None:
        for sink in self.sinks:
            sink.metrics_logged(job)

    def restarted(self, job: Job, attempt: int) -> None:
        for sink in self.sinks:
            sink.restarted(job, attempt)

    def stuck_changed(self, job: Job) -> None:
        for sink in self.sinks:
            sink.stuck_changed(job)

    def finished(self, job: Job) -> None:
        for sink in self.sinks:
            sink.finished(job)


class StatusFeed:
    """A job's ``status.json`` as its launcher last wrote it, re-read only when the file was replaced; and the
    job's status FIFO, which the launch host writes a byte to after each write, so the follower sleeps on it
    instead of polling."""

    def __init__(self, run_dir: RunDir) -> None:
        self._rd = run_dir
        self.path = run_dir.status_file
        self._path_str = str(self.path)  # stat-ed every poll: no pathlib on that path
        self._cache: tuple[tuple[Any, ...] | None, float, dict[str, Any]] | None = None
        self.signal_fd: int | None = None

    def stamp(self) -> tuple | None:
        """``(inode, mtime_ns, size)`` of the status file; ``None`` before it is written."""
        try:
            st = os.stat(self._path_str)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size  # each write is a rename: a new inode

    def read(self, stamp: tuple | None = None) -> dict:
        """The status as last written; ``stamp``: :meth:`stamp` if the caller has just taken it."""
        stamp, now = stamp or self.stamp(), time.monotonic()
        cached = self._cache
        # a replaced file has a new stamp; the age bound covers a reused inode with the same times
        if stamp is not None and cached is not None and cached[0] == stamp and now - cached[1] < PUMP_INTERVAL_S:
            return cached[2]
        status = read_json(self.path)
        if status is None:  # not written yet, or caught half-rewritten in place (full disk): keep the last one
            return cached[2] if cached is not None else {"state": RunState.PENDING.value}
        self._cache = (stamp, now, status)
        return status

    def open_signal(self) -> None:
        """Make the job's status FIFO and hold it open for reading and writing (so it never reads as
        closed); without it the follower polls every ``POLL_INTERVAL_S``."""
        path = self._rd.status_signal
        try:
            os.mkfifo(path, 0o600)
            self.signal_fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        except FileExistsError:  # an attached job's: left by the kernel that started it
            try:
                self.signal_fd = open_private_fifo(path, os.O_RDWR | os.O_NONBLOCK)
            except OSError:
                self.signal_fd = None
        except (OSError, AttributeError):  # a file system without FIFOs
            self.signal_fd = None

    def close_signal(self) -> None:
        """Close the FIFO and remove it: a FIFO left in the run directory would block whoever copies it."""
        fd, self.signal_fd = self.signal_fd, None
        if fd is not None:
            os.close(fd)
            self._rd.status_signal.unlink(missing_ok=True)

    def wait(self) -> None:
        """Sleep until the launch host writes the job's status, or ``PUMP_INTERVAL_S`` (time to read the
        logs again) passes."""
        fd = self.signal_fd
        if fd is None:
            time.sleep(POLL_INTERVAL_S)
            return
        try:
            ready, _, _ = select.select([fd], [], [], PUMP_INTERVAL_S)
            if ready:
                os.read(fd, 4096)
        except (OSError, ValueError):  # closed by the thread that saw the job end
            time.sleep(POLL_INTERVAL_S)


class MemoryFeed:
    """A job's status kept in memory by its writer in this process (a session cell's, from its ranks' replies:
    :class:`~sgpu_magic.status.StatusWriter` with ``final_only``), in the shape of :class:`StatusFeed`: no file
    is read and no FIFO made; the follower sleeps on an event that each change (and :meth:`wake`) sets."""

    def __init__(self, status: dict[str, Any] | None = None) -> None:
        self._status: dict[str, Any] = {"state": RunState.PENDING.value} if status is None else status
        self._version = 0
        self._event = threading.Event()
        self._others: list[MemoryFeed] = []
        self._lock = threading.Lock()

    def another(self) -> MemoryFeed:
        """A feed of the same status for a second follower (``job.show()``), told each later change as this one is."""
        with self._lock:  # no change falls between the copy and the subscription
            other = MemoryFeed(self._status)
            self._others.append(other)
        return other

    def changed(self, status: dict[str, Any]) -> None:
        """The writer's ``on_change``: ``status`` is the job's status now."""
        with self._lock:
            self._status = status
            others = list(self._others)
            self._wake()
        for other in others:
            other.changed(status)

    def wake(self) -> None:
        """Wake the follower for a full poll (its sinks' ``tick``) although the status has not changed: what the
        ranks sent beside it (a debugger's frame) waits to be served."""
        with self._lock:
            self._wake()

    def _wake(self) -> None:
        self._version += 1
        self._event.set()

    def stamp(self) -> tuple:
        return (self._version,)

    def read(self, stamp: tuple | None = None) -> dict:
        return self._status

    def open_signal(self) -> None:
        """Nothing to open (see :meth:`StatusFeed.open_signal`)."""

    def close_signal(self) -> None:
        """Nothing to close."""

    def wait(self) -> None:
        """Sleep until the status changes (or :meth:`wake`), or ``PUMP_INTERVAL_S`` passes."""
        self._event.wait(PUMP_INTERVAL_S)
        self._event.clear()  # a change after this sets it again: the poll that follows reads what came before


Feed = StatusFeed | MemoryFeed
"""Where a followed job's status comes from: its ``status.json`` (another process writes it), or memory."""


class LogPump:
    """Hands what each rank wrote to the sinks (``events.output(rank, text)``, ``events.skipped(...)``): every
    line, or, when no sink needs them all, only the last lines of each log (read from its tail), reading the
    logs of ranks not on screen less often."""

    def __init__(self, paths: list[Path], events: JobEvents) -> None:
        self._followers = [LogFollower(path) for path in paths]
        self._sinks, self._events = events.sinks, events
        sinks = events.sinks
        # every line to each sink, or (when no sink needs them all) only the last tail_lines lines
        self._tail_lines = None if any(s.needs_every_line for s in sinks) else max([s.tail_lines for s in sinks] + [1])
        self._live_tail_lines = (
            None if self._tail_lines is None else max([s.live_tail_lines or s.tail_lines for s in sinks] + [1])
        )
        self._read_at = [0.0] * len(paths)

    def pump(self, final: bool = False) -> None:
        """What the ranks wrote since the last call; ``final``: all of it, then close the logs."""
        try:
            self._read(final)
        finally:
            if final:
                for follower in self._followers:
                    follower.close()

    def _read(self, final: bool) -> None:
        tail = self._tail_lines
        if tail is None:
            for rank, follower in enumerate(self._followers):
                text = follower.read(final)
                if text:
                    self._events.output(rank, text)
            return
        live = self._live_tail_lines
        assert live is not None  # set whenever _tail_lines is
        now = time.monotonic()
        on_screen = None
        if not final:
            shown = [sink.ranks_on_screen() for sink in self._sinks]
            on_screen = None if any(s is None for s in shown) else set().union(*(s for s in shown if s is not None))
        for rank, follower in enumerate(self._followers):
            every_s = ON_SCREEN_READ_S if on_screen is None or rank in on_screen else OFF_SCREEN_READ_S
            if not final and now - self._read_at[rank] < every_s:
                continue
            self._read_at[rank] = now
            if final and follower.skipped_total and live < tail:
                # while running only the last live lines were read: the sinks keep the last tail lines,
                # read again (the skip clears what they hold)
                skipped, text = follower.reread_tail(tail)
                self._events.skipped(rank, skipped)
            else:
                skipped, text = follower.read_tail(tail if final else live, final)
                if skipped:
                    self._events.skipped(rank, skipped)
            if text:
                self._events.output(rank, text)
