"""Following a job: each rank's log read by byte offset (:class:`LogFollower`), and the events a job sends to
what shows or records it (:class:`JobSink`: the panel, the text view, MLflow tracking)."""

from __future__ import annotations

import codecs
import os
from pathlib import Path
from typing import TYPE_CHECKING

from sgpu_magic.launch.resources import DevicePlan
from sgpu_magic.spec import LaunchSpec

if TYPE_CHECKING:
    from sgpu_magic.job.handle import Job
    from sgpu_magic.job.state import JobState


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
        self._file = None

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
                return skipped, self._decoder.decode(chunk[cut + 1:], final=final)
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

    def created(self, job: Job) -> None:
        """The job exists (state pending); nothing has started yet. Runs in the starting thread."""

    def pending(self, job: Job, why: str) -> None:
        """The job waits for GPUs; ``why`` says how many are free and who holds the rest."""

    def prepare(self, job_id: str, spec: LaunchSpec, plan: DevicePlan) -> dict:
        """Before launch: return ``{"env": {...}}`` for the ranks and other launch.json entries."""
        return {}

    def started(self, job: Job) -> None:
        """The job was handed to the launch host."""

    def output(self, rank: int, text: str) -> None:
        """New text from rank ``rank``'s log (stdout and stderr in order; may end mid-line)."""

    def skipped(self, rank: int, nbytes: int) -> None:
        """``nbytes`` of rank ``rank``'s log (ending at a line end) were passed over; they are in its file.
        The lines the sink holds are dropped (``nbytes`` may be 0 when the job's end reads a longer tail again)."""

    def state_changed(self, job: Job, state: JobState) -> None:
        """The job moved to ``state``."""

    def tick(self, job: Job) -> None:
        """Called on every poll of the job (about 20 times a second): flush what is buffered."""

    def restarted(self, job: Job, attempt: int) -> None:
        """A rank failed and every rank was started again (``max_restarts``); ``attempt`` counts from 1."""

    def finished(self, job: Job) -> None:
        """The job reached a final state; every line of its logs was delivered before this."""

    def launch_failed(self, job_id: str, error: BaseException) -> None:
        """The launch failed after ``prepare`` (no ``started`` or ``finished`` follows): release what
        ``prepare`` set up."""

    def run_url(self) -> str | None:
        """A link to the page of what the sink records for the job, if a server shows it now (``Job.run_url``)."""
        return None
