"""The text view: plain ``[rank N]`` lines in the cell's output, notes and warnings on stderr, and the summary line
of an ended job (used where there are no widgets, and by the panel for the summary)."""

from __future__ import annotations

import sys

from sgpu_magic.errors import describe_exit
from sgpu_magic.job.follow import JobSink
from sgpu_magic.job.handle import Job
from sgpu_magic.job.profile import NO_PROFILED_STEP
from sgpu_magic.job.state import JobState
from sgpu_magic.launch.stacks import summary
from sgpu_magic.rundir import RunDir, is_attempt_marker, is_traceback_marker
from sgpu_magic.status import RankUsage
from sgpu_magic.ui.terminal import TerminalBuffer, has_controls, terminal_line

WALL_NOTE_S = 1.0
"""The summary says the ranks' own time beside the user's wait when the two differ by this many seconds or more."""


def _duration(job: Job) -> str:
    """`` in 3.2 s`` (the user's wait); `` in 9.0 s (0.3 s in the ranks)`` when the launch itself took a while (a
    first launch waiting for its launch host); ``""`` when the ranks never started."""
    elapsed, wall = job.elapsed_s, job.wall_s
    if elapsed is None:
        return ""
    if wall is None or wall - elapsed < WALL_NOTE_S:
        return f" in {elapsed:.1f} s"
    return f" in {wall:.1f} s ({elapsed:.1f} s in the ranks)"


def summary_line(job: Job) -> str:
    """``sgpu_magic: job <id> succeeded in 3.2 s on 2 x cpu (gloo); logs: <dir>[; MLflow run: <url>]`` (``in 9.0 s
    (0.3 s in the ranks)`` where the launch took a second or more before the ranks ran)."""
    elapsed = _duration(job)
    link = f"; MLflow run: {job.run_url}" if getattr(job, "run_url", None) else ""
    return (
        f"sgpu_magic: {job.title} {job.state.label}{elapsed} on {job.plan.device_kind}; "
        f"logs: {RunDir(job.run_dir).logs_dir}{link}"
    )


MAX_METRIC_LINES = 20
"""The summary's last-value table shows this many metrics at most (then says how many more ``job.metrics()`` has)."""


def metrics_table(last: dict[str, dict[int, float]]) -> list[str]:
    """The last-value table: a heading, then one line per metric with each rank's last value (``:.4g``);
    ``[]`` when nothing was logged."""
    if not last:
        return []
    width = min(40, max(len(name) for name in last))
    lines = ["metrics, last value per rank:"]
    for name, by_rank in list(last.items())[:MAX_METRIC_LINES]:
        values = "  ".join(f"rank {rank}: {value:.4g}" for rank, value in by_rank.items())
        lines.append(f"  {name:<{width}}  {values}")
    if len(last) > MAX_METRIC_LINES:
        lines.append(f"  ... and {len(last) - MAX_METRIC_LINES} more (job.metrics())")
    return lines


def peak_rss_line(usage: dict[int, RankUsage]) -> list[str]:
    """``["peak RSS per rank: rank 0 412 MiB, rank 1 410 MiB"]`` from the launch host's samples, and the same line
    for GPU memory where NVML sampled it; ``[]`` without samples."""
    if not usage:
        return []
    lines = [
        "peak RSS per rank: " + ", ".join(f"rank {r} {u.peak_rss_bytes / 2**20:.0f} MiB" for r, u in usage.items())
    ]
    gpu = {r: u.peak_gpu_memory_bytes for r, u in usage.items() if u.peak_gpu_memory_bytes is not None}
    if gpu:
        lines.append("peak GPU memory per rank: " + ", ".join(f"rank {r} {b / 2**20:.0f} MiB" for r, b in gpu.items()))
    return lines


def stuck_line(job: Job) -> str:
    """``possibly stuck: no rank has written a log line or a metric for 300 s; rank 0: dist.broadcast at Cell In[4]
    line 7; rank 1: ...`` while the launcher's hang detector reports the running job, else ``""``."""
    report = job.status.stuck
    if report is None or job.state.final:
        return ""
    where = f"; {summary(report.stacks)}" if report.stacks else " (taking the ranks' stacks)"
    return f"possibly stuck: no rank has written a log line or a metric for {report.stuck_after_s:g} s{where}"


def straggler_lines(job: Job) -> list[str]:
    """``["straggler: rank 1 is 1.45x slower than the median rank over the last 50 steps (...)"]`` when the straggler
    check names a rank (:meth:`Job.straggler`), else ``[]``."""
    straggler = job.straggler()
    return [str(straggler)] if straggler is not None else []


def profile_lines(job: Job) -> list[str]:
    """A profiled job's table (:meth:`Job.profile_summary`): per rank, the profiled steps' wall time and its share
    in compute, collectives, data loading and idle (and the device's busy time with CUDA), then the top 10 ops of
    all ranks by self time, and where the merged trace is; one line saying so when no rank recorded a profiled
    step; ``[]`` for a job not profiled."""
    if job.spec.profile_steps is None:
        return []
    summary = job.profile_summary()
    if not summary:
        return [f"profile: {NO_PROFILED_STEP}"]
    cuda = any(s.get("device") == "cuda" for s in summary.values())
    steps = max(int(s.get("steps", 0)) for s in summary.values())
    asked = job.spec.profile_steps
    short = f", of {asked} asked: the code ended first" if steps < asked else ""
    lines = [
        f"profile of {steps} step(s) per rank{short} (torch.profiler; the merged trace: job.profile_trace()):",
        "  rank   wall ms  compute  collective   data    idle" + ("  device busy" if cuda else ""),
    ]
    for rank, s in summary.items():
        wall = float(s.get("wall_s", 0.0)) or 1e-12
        shares = [100 * float(s.get(k, 0.0)) / wall for k in ("compute_s", "collective_s", "data_s", "idle_s")]
        line = f"  {rank:>4} {wall * 1000:>9.1f}  {shares[0]:>6.1f}%  {shares[1]:>9.1f}%  {shares[2]:>5.1f}%  {shares[3]:>5.1f}%"
        if cuda:
            line += f"  {100 * float(s.get('device_busy_s', 0.0)) / wall:>10.1f}%"
        lines.append(line)
    key = "self_device_s" if cuda else "self_cpu_s"
    ops: dict[str, list[float]] = {}
    for s in summary.values():
        for op in s.get("top_ops", []):
            calls_and_time = ops.setdefault(str(op["name"]), [0, 0.0])
            calls_and_time[0] += int(op.get("calls", 0))
            calls_and_time[1] += float(op.get(key, 0.0))
    top = sorted(ops.items(), key=lambda item: item[1][1], reverse=True)[:10]
    if top:
        width = min(40, max(len(name) for name, _ in top))
        lines.append(f"top ops by self {'device' if cuda else 'CPU'} time, all ranks:")
        lines += [f"  {name[:width]:<{width}}  {calls:>6} calls  {t * 1000:>9.2f} ms" for name, (calls, t) in top]
    return lines


def summary_lines(job: Job) -> list[str]:
    """:func:`summary_line`, one ``sgpu_magic: ...`` line per note on how ranks ended (:attr:`Job.notes`), the
    straggler (:func:`straggler_lines`), each rank's peak RSS (:func:`peak_rss_line`), then the last-value table of
    the metrics the ranks logged (:func:`metrics_table`)."""
    notes = (
        job.notes
        + straggler_lines(job)
        + profile_lines(job)
        + peak_rss_line(dict(sorted(job.status.usage.items())))
        + metrics_table(job.last_metrics())
    )
    return [summary_line(job)] + [f"sgpu_magic: {note}" for note in notes]


def summary_said(job: Job) -> bool:
    """Whether the ended job's summary is said: always where the job asks (``summary_on_success``), when it did not
    succeed, and when it has notes, a straggler or a profile."""
    return (
        job.summary_on_success
        or job.state is not JobState.SUCCEEDED
        or bool(job.notes)
        or job.spec.profile_steps is not None
        or job.straggler() is not None
    )


def restart_reason(job: Job) -> str:
    """``rank 1 failed (exit code 1)`` for the attempt that ended last."""
    attempts = job.status.attempts
    failures = attempts[-1].failures if attempts else ()
    return ", ".join(f"rank {f.rank} failed ({describe_exit(f.exitcode)})" for f in failures) or "a rank failed"


_TRACEBACK_SHOWN = {
    False: "the error below shows the root cause's traceback (every rank's is in its log file)",
    True: "job.result() raises the error with the root cause's traceback (every rank's is in its log file)",
}
"""What the text view says instead of a rank's traceback, for a blocking and a background job."""

_TRACEBACK_IN_LOG = "its traceback is in its log file"
"""What it says instead when the error below will not show that traceback: an interrupted rank (the cell raises
``CellInterruptedError`` or a timeout), or a job that restarts its ranks after a failure (``max_restarts``)."""


HELD_LINES = 50
"""The text view holds back at most this many lines of a rank whose output moves the cursor up (see
:class:`TextView`)."""


class TextView(JobSink):
    """Streams each rank's lines to the cell's output, prefixed ``[rank N]``; notes and warnings to stderr.

    A stream cannot be rewritten, so once a rank's output has escape sequences other than colours (a Rich progress
    display, tqdm bars with ``position=``), its lines go through a :class:`~sgpu_magic.ui.terminal.TerminalBuffer`
    and those the cursor could still come back to (as far up as it has gone so far, at most ``HELD_LINES``) are
    held back until it cannot, or the job ends: a progress display is printed as its last frame. Other output
    streams as it comes, line by line.

    A rank's traceback is not streamed; the line announcing it says where it is: the kernel
    shows the root-cause traceback once, in the error it raises (below, or from ``job.result()``
    for a background job), and every rank's stays in its log file.
    """

    def __init__(self, out=None, err=None) -> None:
        self._out = out
        self._err = err
        self._partial: dict[int, str] = {}
        self._held: dict[int, TerminalBuffer] = {}  # the ranks whose output drives a terminal
        self._failed_ranks: set[int] = set()
        self._traceback_shown = _TRACEBACK_SHOWN[False]
        self._restarts = False
        self._stuck_said = False

    def replica(self) -> TextView:
        """A new text view, writing to the output of the cell that shows the job again."""
        return TextView()

    def started(self, job: Job) -> None:
        self._traceback_shown = _TRACEBACK_SHOWN[job.background]
        self._restarts = bool(job.spec.max_restarts)

    def output(self, rank: int, text: str) -> None:
        held = self._held.get(rank)
        if held is None and has_controls(text):  # from now on this rank's lines go through a terminal
            held = self._held[rank] = TerminalBuffer(max_lines=None)
            text = self._partial.pop(rank, "") + text
        if held is not None:
            held.write(text)
            self.lines(rank, held.take_settled(HELD_LINES))
            return
        *lines, self._partial[rank] = (self._partial.get(rank, "") + text).split("\n")
        self.lines(rank, lines)

    def lines(self, rank: int, lines: list[str]) -> None:
        """Write complete lines of rank ``rank``."""
        if rank not in self._failed_ranks and not any(
            "\r" in line or line.startswith("[sgpu_magic] rank ") for line in lines
        ):
            if lines:  # fast path: no carriage return, no traceback marker
                out = self._out or sys.stdout
                prefix = f"[rank {rank}] "
                out.write(prefix + f"\n{prefix}".join(lines) + "\n")
                out.flush()
            return
        shown = []
        for line in lines:
            if is_attempt_marker(line):  # a new attempt: this rank's lines are shown again
                self._failed_ranks.discard(rank)
            if rank in self._failed_ranks:
                continue
            if is_traceback_marker(line):
                self._failed_ranks.add(rank)
                interrupted = " raised KeyboardInterrupt;" in line
                shown_as = _TRACEBACK_IN_LOG if interrupted or self._restarts else self._traceback_shown
                line = line.replace("its traceback follows", shown_as)
            shown.append(f"[rank {rank}] {terminal_line(line)}\n")
        if shown:
            out = self._out or sys.stdout
            out.write("".join(shown))
            out.flush()

    def pending(self, job: Job, why: str) -> None:
        self.note(f"sgpu_magic: job {job.job_id} is pending, {why}")

    def stuck_changed(self, job: Job) -> None:
        """One line when the job looks stuck (once its stacks are in), and one when its ranks write again."""
        line = stuck_line(job)
        if line and job.status.stuck is not None and job.status.stuck.stacks:
            self._stuck_said = True
            self.note(f"sgpu_magic: job {job.job_id} is {line}")
        elif not line and self._stuck_said:
            self._stuck_said = False
            self.note(f"sgpu_magic: job {job.job_id} is making progress again")

    def restarted(self, job: Job, attempt: int) -> None:
        self._failed_ranks.clear()  # the new attempt's lines are shown again
        self.note(
            f"sgpu_magic: job {job.job_id}: {restart_reason(job)}; attempt {attempt} of "
            f"{job.spec.max_restarts + 1} started"
        )

    def finished(self, job: Job) -> None:
        for rank, rest in sorted(self._partial.items()):
            if rest:
                self.lines(rank, [rest])
        self._partial.clear()
        for rank, held in sorted(self._held.items()):  # what the ranks' terminals show at the end
            self.lines(rank, list(held.lines) + ([held.current] if held.current else []))
        self._held.clear()
        if summary_said(job):
            for line in summary_lines(job):
                self.note(line)
        if job.background and job.state is not JobState.SUCCEEDED:
            # nobody waits on a background job to raise its error: say what happened here
            error = job.exception()
            if error is not None:
                self.warn(str(error).splitlines()[0] + " (job.result() raises it)")

    def note(self, text: str) -> None:
        """One line for the user (e.g. the CPU fallback), on stdout."""
        out = self._out or sys.stdout
        out.write(text + "\n")
        out.flush()

    def warn(self, text: str) -> None:
        """A warning before launch (a large or unpicklable global), on stderr."""
        err = self._err or sys.stderr
        err.write(f"sgpu_magic warning: {text}\n")
        err.flush()
