"""What the user sees while a job runs. This module holds the plain-text view: ``[rank N]`` lines.

Carriage returns behave as in a terminal (a tqdm bar shows its latest state), so a
progress bar is not stacked into hundreds of lines.
"""

from __future__ import annotations

import sys

from .job import Job, JobSink
from .rundir import is_traceback_marker


def terminal_line(line: str) -> str:
    """What a terminal would show for ``line``: the text after its last carriage return."""
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""


def summary_line(job: Job) -> str:
    """``sgpu_magic: job <id> succeeded in 3.2 s on 2 x cpu (gloo); logs: <dir>[; MLflow run: <url>]``."""
    elapsed = f" in {job.elapsed_s:.1f} s" if job.elapsed_s is not None else ""
    link = f"; MLflow run: {job.run_url}" if getattr(job, "run_url", None) else ""
    return (f"sgpu_magic: job {job.job_id} {job.state.value}{elapsed} on {job.plan.device_kind}; "
            f"logs: {job.run_dir / 'logs'}{link}")


class TextView(JobSink):
    """Streams each rank's lines to the cell's output, prefixed ``[rank N]``; notes and warnings to stderr.

    A rank's traceback is not streamed (the marker line before it is): the kernel shows the
    root-cause traceback once, in the error it raises, and the full text stays in the log file.
    """

    def __init__(self, out=None, err=None) -> None:
        self._out = out
        self._err = err
        self._partial: dict[int, str] = {}
        self._failed_ranks: set[int] = set()

    def output(self, rank: int, text: str) -> None:
        *lines, self._partial[rank] = (self._partial.get(rank, "") + text).split("\n")
        self.lines(rank, lines)

    def lines(self, rank: int, lines: list[str]) -> None:
        """Write complete lines of rank ``rank``."""
        shown = []
        for line in lines:
            if rank in self._failed_ranks:
                continue
            if is_traceback_marker(line):
                self._failed_ranks.add(rank)
            shown.append(f"[rank {rank}] {terminal_line(line)}\n")
        if shown:
            out = self._out or sys.stdout
            out.write("".join(shown))
            out.flush()

    def finished(self, job: Job) -> None:
        for rank, rest in sorted(self._partial.items()):
            if rest:
                self.lines(rank, [rest])
        self._partial.clear()
        self.note(summary_line(job))

    def note(self, text: str) -> None:
        out = self._out or sys.stdout
        out.write(text + "\n")
        out.flush()

    def warn(self, text: str) -> None:
        err = self._err or sys.stderr
        err.write(f"sgpu_magic warning: {text}\n")
        err.flush()


def make_view(widgets: bool | None = None) -> JobSink:
    """The view for a job: the plain-text view for now (the widget panel decides with ``widgets``)."""
    return TextView()
