"""Exception tree of sgpu_magic.

Every error sgpu_magic raises derives from :class:`SgpuError`, grouped by cause.
Bad magic input raises :class:`IPython.core.error.UsageError` instead (the magic layer
converts :class:`SpecError`), so IPython prints it without a traceback.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn


class SgpuError(Exception):
    """Root of every sgpu_magic error."""

    def _render_traceback_(self) -> list[str]:
        """IPython hook: the message alone, as for a UsageError; sgpu_magic's own frames say nothing useful."""
        return [f"{type(self).__name__}: {self}"]


class SpecError(SgpuError, ValueError):
    """A launch option (gpus, gpu_type, timeout, port, ...) is invalid. Raised before anything starts."""


class CellSyntaxError(SgpuError, SyntaxError):
    """A ``%%distributed`` cell the ranks cannot run (not Python, or IPython syntax such as ``!ls``).

    Raised before anything starts. In IPython it shows as Python shows a syntax error (the cell's
    line, a caret, the message), without the sgpu_magic and IPython frames that raised it (see
    :func:`sgpu_magic.front.cell.show_cell_syntax_errors_alone`).
    """


class ResourceError(SgpuError, RuntimeError):
    """The machine cannot provide what the job asks for (GPUs, GPU type, port)."""


class CaptureError(SgpuError, TypeError):
    """An argument or captured value cannot be sent to the ranks. Raised before anything starts."""


class RecordError(SgpuError, ValueError):
    """A record of a run directory (``launch.json``, ``status.json``) cannot be read: not sgpu_magic's, or written by
    a newer version (the message names which, and the remedy). See :mod:`sgpu_magic.wire`."""


class LauncherError(SgpuError, RuntimeError):
    """The launch host process failed or could not be started."""


class CheckpointError(SgpuError, RuntimeError):
    """A checkpoint cannot be written there, or the one there is incomplete or damaged (see ``sgpu_magic.checkpoint``)."""


class UnpicklableGlobalError(SgpuError, RuntimeError):
    """Raised inside a rank on first use of a notebook global that could not be sent."""


class JobTimeoutError(SgpuError, TimeoutError):
    """The job ran longer than its ``timeout``; every rank was stopped."""


class JobCancelledError(KeyboardInterrupt):
    """The job was cancelled or the kernel interrupted; every rank was stopped.

    A ``KeyboardInterrupt`` (not an ``Exception``), so ``except Exception`` in user code does
    not swallow an interrupt.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class SessionError(SgpuError, RuntimeError):
    """A live session cannot do what was asked: it is stopped or broken (a rank died, or did not return from an
    interrupt), no session or no such session, a rank outside its world, a name a rank lacks. The message
    names the session and the remedy; the session itself is left as it was."""


class CellInterruptedError(JobCancelledError):
    """A session cell was interrupted (the kernel's Interrupt, the panel's Stop, ``Session.interrupt()``): every
    rank running it got ``KeyboardInterrupt``; the ranks and their namespaces are kept. A ``KeyboardInterrupt``."""


def describe_exit(exitcode: int | None) -> str:
    """Render a process exit code as a phrase: ``exit code 3`` or ``killed by signal SIGKILL (9)``."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by signal {name} ({-exitcode})"
    return f"exit code {exitcode}"


@dataclass(frozen=True)
class RankFailure:
    """What one failed rank left behind.

    Attributes:
        rank: global rank.
        exitcode: process exit code; negative for a signal (``-9`` = SIGKILL).
        exc_type: exception type name raised by the rank code, or ``None`` if it left none.
        message: the exception message (``""`` when none).
        traceback: the rank's formatted traceback text, with notebook cell lines.
        log_path: the rank's log file.
        time_s: when the failure happened (epoch seconds); the earliest one is the root cause.
        cuda: the exception came from CUDA (raised through ``torch.cuda``, or naming CUDA or NCCL).
        last_lines: a rank that left no Python exception (killed by a signal, or ``os._exit``): the last lines of
            its log (at most :data:`LAST_LINES`), else ``()``.
        oom: a rank killed by SIGKILL: whether the kernel's OOM killer ended it and what shows it, or how to check
            (see :mod:`sgpu_magic.launch.forensics`); ``""`` otherwise.
        oom_killed: ``True`` when the OOM killer is known to have ended it, ``None`` when unknown.
        peak_rss_bytes: its peak resident memory as the launch host sampled it, in bytes; ``None`` when not sampled.
    """

    rank: int
    exitcode: int | None
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    log_path: str = ""
    time_s: float = 0.0
    cuda: bool = False
    last_lines: tuple[str, ...] = ()
    oom: str = ""
    oom_killed: bool | None = None
    peak_rss_bytes: int | None = None

    def what(self, max_chars: int | None = 200) -> str:
        """``ValueError: bad batch`` (first line, at most ``max_chars`` characters, cut at a word; ``None``: all of
        it), or that it left no exception."""
        if not self.exc_type:
            return "exited without a Python exception"
        lines = self.message.strip().splitlines()
        exc_type, message = self.exc_type, lines[0] if lines else ""
        if len(lines) > 1 and message.startswith(f"Caught {exc_type} in DataLoader worker") and ": " in lines[-1]:
            # torch re-raises a worker's error as "Caught ValueError in DataLoader worker process 0.\nOriginal
            # Traceback ...\nValueError: <message>": show the worker's own message
            where = message[len(f"Caught {exc_type} in ") :].rstrip(".")
            exc_type, message = lines[-1].split(": ", 1)[0], f"{lines[-1].split(': ', 1)[1]} (in {where})"
        if max_chars is not None and len(message) > max_chars:
            cut = message[: max_chars - 4]
            message = (cut.rsplit(" ", 1)[0] if " " in cut else cut) + " ..."
        return f"{exc_type}: {message}"

    def summary(self) -> str:
        """One line: ``rank 1: ValueError: bad batch (exit code 1)``."""
        return f"rank {self.rank}: {self.what()}{_ended(self.exitcode)}"

    def forensics(self) -> list[str]:
        """What a rank that died without a Python exception left: the OOM finding, its peak RSS, its last log lines."""
        lines = [self.oom] if self.oom else []
        if self.peak_rss_bytes is not None and (self.oom or self.last_lines):
            lines.append(f"peak RSS of rank {self.rank}: {self.peak_rss_bytes / 2**20:.0f} MiB")
        if self.last_lines:
            lines.append("the end of its log:")
            lines += [f"  | {line}" for line in self.last_lines]
        return lines


LAST_LINES = 10
"""Lines of a rank's log that its error shows when it died without a Python exception."""


def _ended(exitcode: int | None) -> str:
    """`` (exit code 1)``, `` (killed by signal SIGKILL (9))``; nothing for a rank that has not exited (a live
    session's rank, whose cell raised)."""
    return "" if exitcode is None else f" ({describe_exit(exitcode)})"


def rank_ranges(ranks: Iterable[int]) -> str:
    """``1-6``, ``1, 3, 5-7``: sorted ranks with runs of consecutive ones folded."""
    ranks = sorted(set(ranks))
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def _same_error(f: RankFailure, root: RankFailure) -> bool:
    """Whether rank ``f`` raised what the root cause raised (the same type and first line)."""
    return bool(f.exc_type) and f.what() == root.what()


def _secondary(f: RankFailure, root: RankFailure) -> str:
    """What a rank that failed after the root cause, with another error or none, did, without its rank."""
    if f.exitcode is not None and f.exitcode < 0:  # ended by a signal: sgpu_magic (or elastic) stopped it
        raised = f" (after raising {f.what()})" if f.exc_type else ""
        return f"stopped by sgpu_magic because rank {root.rank} failed{raised}"
    return f"stopped because rank {root.rank} failed: {f.what()}{_ended(f.exitcode)}"


def _same_line(same: list[RankFailure], root: RankFailure) -> str:
    """``failed with the same ValueError: bad batch (exit code 1)`` for every rank that raised the root cause's error,
    however it ended: those sgpu_magic then stopped in their teardown grace (a signal) are named in brackets."""
    ended = {f.exitcode for f in same}
    signalled = [f.rank for f in same if f.exitcode is not None and f.exitcode < 0]
    if not signalled:
        how = _ended(ended.pop()) if len(ended) == 1 else ""
    else:
        how = f" ({'ranks' if len(signalled) > 1 else 'rank'} {rank_ranges(signalled)} then stopped by sgpu_magic)"
    return f"failed with the same {root.what()}{how}"


def grouped_failures(root: RankFailure, others: list[RankFailure], stopped_ranks: list[int]) -> list[str]:
    """One line per kind of secondary failure, its ranks folded and the lines in rank order.

    ``ranks 1-6 failed with the same AttributeError: ... (exit code 1)``, ``rank 7 stopped by sgpu_magic
    because rank 0 failed``: every rank that raised the root cause's error is on one line, however it ended; ranks
    that sgpu_magic stopped (a signal, or still running when the job was stopped) are named as such.
    """
    same = [f for f in others if _same_error(f, root)]
    groups: dict[str, list[int]] = {_same_line(same, root): [f.rank for f in same]} if same else {}
    for f in others:
        if not _same_error(f, root):
            groups.setdefault(_secondary(f, root), []).append(f.rank)
    for rank in stopped_ranks:
        groups.setdefault(f"stopped by sgpu_magic because rank {root.rank} failed", []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: min(item[1]))
    return [f"{'ranks' if len(ranks) > 1 else 'rank'} {rank_ranges(ranks)} {what}" for what, ranks in ordered]


NO_GPU_HINT = (
    "this machine has no GPU (the ranks ran on CPU with gloo): use sgpu_magic.runtime.device() / runtime.backend()"
)
"""Shown under a root cause that came from CUDA when the job's ranks ran on CPU."""


@dataclass(eq=False)
class RankFailedError(SgpuError, RuntimeError):
    """A rank failed, and the job was stopped.

    The root cause is the earliest failure (torch elastic's rule); the other ranks follow in
    rank order, those that failed the same way in one line (:func:`grouped_failures`). In
    IPython only the root-cause rank's own traceback is shown (``_render_traceback_``), once,
    tagged with its rank.

    Attributes:
        root_cause: the :class:`RankFailure` that ended the job.
        others: other failed ranks (secondary failures).
        stopped_ranks: ranks that were still running and were stopped by sgpu_magic.
        run_dir: the job's run directory, where every rank's log stays.
        attempt_note: with ``max_restarts``, which attempt failed and how many restarts came before.
        hint: a remedy shown under the root cause (e.g. CUDA code run on a machine without a GPU), or ``""``.
    """

    root_cause: RankFailure
    others: list[RankFailure] = field(default_factory=list)
    stopped_ranks: list[int] = field(default_factory=list)
    run_dir: str = ""
    attempt_note: str = ""
    hint: str = ""

    def __post_init__(self) -> None:
        super().__init__(self._message())

    def __str__(self) -> str:
        return self._message()

    def _message(self) -> str:
        rc = self.root_cause
        lines = [f"rank {rc.rank} failed (root cause): {rc.what(None)}{_ended(rc.exitcode)}"]
        lines += [f"  {line}" for line in rc.forensics()]
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        lines += [f"  {line}" for line in grouped_failures(rc, self.others, self.stopped_ranks)]
        lines.append(f"  log of rank {rc.rank}: {rc.log_path}")
        if self.attempt_note:
            lines.append(f"  {self.attempt_note}")
        return "\n".join(lines)

    def _render_traceback_(self) -> list[str]:
        """IPython hook: the root-cause rank's traceback (when it left one), then the summary."""
        out = []
        if self.root_cause.traceback:
            out.append(f"--- traceback from rank {self.root_cause.rank} (root cause) ---")
            out += self.root_cause.traceback.rstrip("\n").splitlines()
            out.append("---")
        out += [f"{type(self).__name__}: " + self._message().splitlines()[0]]
        out += self._message().splitlines()[1:]
        return out


class Unpicklable:
    """Stands in a rank for a notebook global that could not be sent; any use raises."""

    def __init__(self, name: str, type_name: str, reason: str, warned: bool = True) -> None:
        """``reason``: why it was not sent (pickling's error); ``warned``: the kernel said so before the launch (a
        global that pickled but could not be loaded in the rank was not: its error says it all)."""
        object.__setattr__(self, "_sgpu_info", (name, type_name, reason, warned))

    def _fail(self, *args: Any, **kwargs: Any) -> NoReturn:
        name, tname, reason, warned = object.__getattribute__(self, "_sgpu_info")
        if not warned:
            raise UnpicklableGlobalError(f"global '{name}' ({tname}) {reason}")
        raise UnpicklableGlobalError(unpicklable_use_message(name, tname, reason))

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        self._fail()

    def __reduce__(self) -> tuple[Any, ...]:
        self._fail()  # e.g. returned from a rank: it cannot go back to the kernel either

    def __repr__(self) -> str:
        return f"<sgpu_magic: global {object.__getattribute__(self, '_sgpu_info')[0]!r} was not sent to the ranks>"

    __call__ = __enter__ = __exit__ = __iter__ = __len__ = __getitem__ = __setitem__ = _fail
    __bool__ = __contains__ = __add__ = __float__ = __int__ = __setattr__ = _fail


def unpicklable_message(name: str, tname: str, reason: str) -> str:
    """The warning before a launch: the global, why it cannot be pickled, and the remedy (said once, there)."""
    return (
        f"global '{name}' ({tname}) cannot be pickled ({reason}), so it is not sent to the ranks. "
        f"Create it inside the cell or function that runs on the ranks instead."
    )


def unpicklable_use_message(name: str, tname: str, reason: str) -> str:
    """The error a rank raises when it uses such a global: which one and why, pointing at the warning that gave the
    remedy before the launch (:func:`unpicklable_message`) rather than saying it again."""
    first_line = reason.splitlines()[0] if reason else ""
    why = first_line if len(first_line) <= 80 else first_line[:77] + "..."
    return (
        f"global '{name}' ({tname}) was not sent to the ranks: it cannot be pickled ({why}; see the warning before "
        f"the launch)"
    )
