"""A job's ``status.json``: its one writer (:class:`StatusWriter`), the typed view readers take of it
(:class:`HostStatus`) and its parts: each rank's sampled usage (:class:`RankUsage`) and the hang detector's report
(:class:`StuckReport`). The file's name, its atomic write and its final states are :mod:`sgpu_magic.rundir`'s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sgpu_magic.rundir import RunDir, read_json, write_status
from sgpu_magic.wire import RunState, StopReason, read_state
from sgpu_magic.wire.errors import FailedAttempt, ObservedFailure, TeardownEnd


@dataclass(frozen=True)
class RankUsage:
    """One rank's CPU, memory and GPU as the launch host last sampled them (about once a second; see
    :mod:`sgpu_magic.launch.usage` and :mod:`sgpu_magic.launch.gpu`).

    Attributes:
        cpu_percent: CPU use since the previous sample, in percent of one core (200.0: two cores busy).
        rss_bytes: the rank process's resident memory, in bytes.
        peak_rss_bytes: the most resident memory it has had so far, in bytes (the kernel's high-water mark).
        time_s: epoch seconds of the sample.
        gpu_percent: its GPU's utilisation in percent (NVML); ``None`` without a GPU or NVML.
        gpu_memory_bytes, gpu_memory_total_bytes: memory in use on its GPU (its own process's where NVML lists it,
            else the device's), and the device's total, in bytes; ``None`` without NVML.
        gpu_power_w: its GPU's power draw in watts; ``None`` without NVML.
        peak_gpu_memory_bytes: the most GPU memory sampled so far, in bytes; ``None`` without NVML.
    """

    cpu_percent: float
    rss_bytes: int
    peak_rss_bytes: int
    time_s: float
    gpu_percent: float | None = None
    gpu_memory_bytes: int | None = None
    gpu_memory_total_bytes: int | None = None
    gpu_power_w: float | None = None
    peak_gpu_memory_bytes: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> RankUsage:
        gpu = {k: d.get(k) for k in _GPU_KEYS}
        return cls(float(d["cpu_percent"]), int(d["rss_bytes"]), int(d["peak_rss_bytes"]), float(d["time_s"]), **gpu)

    def as_dict(self) -> dict[str, float]:
        out = {
            "cpu_percent": self.cpu_percent,
            "rss_bytes": self.rss_bytes,
            "peak_rss_bytes": self.peak_rss_bytes,
            "time_s": self.time_s,
        }
        return out | {k: getattr(self, k) for k in _GPU_KEYS if getattr(self, k) is not None}


_GPU_KEYS = ("gpu_percent", "gpu_memory_bytes", "gpu_memory_total_bytes", "gpu_power_w", "peak_gpu_memory_bytes")


@dataclass(frozen=True)
class StuckReport:
    """The hang detector (:mod:`sgpu_magic.launch.progress`; the launch host's or the Ray supervisor's) found no
    progress: no rank has written
    a log byte or a metric point since ``quiet_since_s`` (epoch seconds), for at least ``stuck_after_s`` seconds,
    while every rank still runs. ``stacks``: ``{rank: where}`` as for a timeout (``{}`` until py-spy has answered)."""

    quiet_since_s: float
    stuck_after_s: float
    stacks: dict[int, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict | None) -> StuckReport | None:
        if not d:
            return None
        stacks = {int(k): str(v) for k, v in (d.get("stacks") or {}).items()}
        return cls(float(d["quiet_since_s"]), float(d["stuck_after_s"]), stacks)

    def to_json(self) -> dict[str, Any]:
        return {
            "quiet_since_s": self.quiet_since_s,
            "stuck_after_s": self.stuck_after_s,
            "stacks": {str(r): where for r, where in self.stacks.items()},
        }


@dataclass(frozen=True)
class HostStatus:
    """A job's ``status.json`` as its launcher (the launch host or the Ray supervisor) last wrote it: the typed
    view the Job handle, the panel and tracking read. Keys the file lacks take the defaults below.

    Attributes:
        state: the run's :class:`~sgpu_magic.wire.RunState`; ``stop_reason``: why its launcher stopped it
            (:class:`~sgpu_magic.wire.StopReason`), ``None`` when it was not stopped.
        started_s, ended_s: epoch seconds when the ranks started and the job ended (``None`` before).
        attempt: the attempt that runs (or ran last), from 1; ``attempts``: the failed ones before it
            (:class:`~sgpu_magic.wire.errors.FailedAttempt`).
        exitcodes: ``{rank: exit code}`` once the ranks ended (negative: killed by that signal).
        failures: the failures the launcher observed (:class:`~sgpu_magic.wire.errors.ObservedFailure`).
        log_lines: ``{rank: lines}`` in each log once the job ended (a view that skipped shows the count).
        teardown_ended: ranks the teardown grace ended (:class:`~sgpu_magic.wire.errors.TeardownEnd`).
        waiting: why a Ray job waits for the cluster's resources; ``host_lost``, ``launch_error``: why it failed.
        pids: ``{rank: process id}`` of the current attempt's ranks on the launch host's machine (``{}`` on Ray).
        stacks: ``{rank: where}`` for the ranks still running when the job timed out or was cancelled, taken just
            before they were stopped, e.g. ``{0: "dist.broadcast at Cell In[4] line 7"}`` (their whole stacks:
            ``stacks/rank_<r>.txt``); ``{}`` when no rank was running then.
        rank_outcomes: a live session's cell: ``{rank: "returned" | "raised" | "interrupted" | "did not return"}``
            (its ranks do not exit, so ``exitcodes`` says nothing of them).
        usage: ``{rank: RankUsage}``: each rank's CPU %, RSS and peak RSS, sampled about once a second by the launch
            host while the job runs (on Ray: by each rank's agent on its node), the last sample once it has ended;
            ``{}`` before the first sample and for a session's cell.
        stuck: the hang detector's report while the job is possibly stuck (:class:`StuckReport`), else ``None``.
    """

    state: RunState = RunState.PENDING
    stop_reason: StopReason | None = None
    started_s: float | None = None
    ended_s: float | None = None
    attempt: int = 1
    attempts: tuple[FailedAttempt, ...] = ()
    exitcodes: dict = field(default_factory=dict)
    failures: tuple[ObservedFailure, ...] = ()
    log_lines: dict = field(default_factory=dict)
    teardown_ended: tuple[TeardownEnd, ...] = ()
    waiting: str | None = None
    host_lost: str | None = None
    launch_error: str | None = None
    pids: dict[int, int] = field(default_factory=dict)
    stacks: dict[int, str] = field(default_factory=dict)
    rank_outcomes: dict = field(default_factory=dict)
    usage: dict[int, RankUsage] = field(default_factory=dict)
    stuck: StuckReport | None = None

    @classmethod
    def from_dict(cls, status: dict) -> HostStatus:
        """Read a ``status.json`` object (any schema, see :data:`~sgpu_magic.rundir.STATUS_SCHEMA`).

        Raises:
            RecordError: its state is not one this version knows (:func:`~sgpu_magic.wire.read_state`), or a failure,
                attempt or teardown entry is mangled.
        """
        state, stop_reason = read_state(status)
        return cls(
            state=state,
            stop_reason=stop_reason,
            started_s=status.get("started_s"),
            ended_s=status.get("ended_s"),
            attempt=int(status.get("attempt", 1)),
            attempts=tuple(FailedAttempt.from_json(a) for a in status.get("attempts") or ()),
            exitcodes={int(k): v for k, v in (status.get("exitcodes") or {}).items()},
            failures=tuple(ObservedFailure.from_json(f) for f in status.get("failures") or ()),
            log_lines=dict(status.get("log_lines") or {}),
            teardown_ended=tuple(TeardownEnd.from_json(e) for e in status.get("teardown_ended") or ()),
            waiting=status.get("waiting"),
            host_lost=status.get("host_lost"),
            launch_error=status.get("launch_error"),
            pids={int(k): int(v) for k, v in (status.get("pids") or {}).items()},
            stacks={int(k): str(v) for k, v in (status.get("stacks") or {}).items()},
            rank_outcomes={int(k): v for k, v in (status.get("rank_outcomes") or {}).items()},
            usage={int(k): RankUsage.from_dict(v) for k, v in (status.get("usage") or {}).items()},
            stuck=StuckReport.from_dict(status.get("stuck")),
        )

    @classmethod
    def read(cls, run_dir: RunDir) -> HostStatus:
        """``run_dir``'s ``status.json`` as last written (a file not written yet: a pending job's).

        Raises:
            RecordError: its state is not one this version knows, or an entry is mangled (:meth:`from_dict`).
        """
        return cls.from_dict(read_json(run_dir.status_file) or {})

    @property
    def final(self) -> bool:
        return self.state.final

    @property
    def interrupted(self) -> bool:
        """Cancelled because the kernel was interrupted (the job's state is ``CANCELLED``)."""
        return self.stop_reason is StopReason.INTERRUPTED


class StatusWriter:
    """The one writer of a job's ``status.json``, used by every launcher (the launch host's jobs, the Ray
    supervisor, a live session's cells, the kernel for a job that never reached its launcher).

    It holds the status as a dict (:attr:`status`, which the launcher may change in place before the next
    :meth:`write`) and makes "the final status is the last write" structural: once :meth:`finish` has written
    a final state, every later :meth:`write`, :meth:`update` and :meth:`finish` is refused (returns ``False``),
    so a reader that saw a final state never sees it change.

    A write that fails (a full disk that even :func:`write_status`'s fallback did not cover) is remembered
    (:attr:`unwritten`) and reported once through ``on_error``; the launcher calls :meth:`write` again later.

    Args:
        run_dir: the job's run directory.
        on_error: called with the ``OSError`` of the first failed write in a row; default: raise it.
        state: the run's first state (``STARTING`` for a launcher's job); ``None``: none yet.
        final_only: write the file once, at :meth:`finish` (the record a run leaves for post-mortems); until then
            each change is only kept in :attr:`status` and told to ``on_change`` (a session cell, whose follower
            is in the same process as its writer: :class:`sgpu_magic.job.follow.MemoryFeed`).
        on_change: called with a copy of the status after each change (each :meth:`update` and the
            :meth:`finish`, also when its write failed), under the writer's lock, so in the order of the changes
            (it must not call the writer); default: nothing. A change made to :attr:`status` in place and written
            with :meth:`write` is not told.
        **initial: the status's first other keys (not written until :meth:`write` or :meth:`update`).

    The state is only ever given typed (a :class:`~sgpu_magic.wire.RunState`, or the
    :class:`~sgpu_magic.wire.StopReason` a run ends for), and written as the file's ``state`` / ``stop_reason``.
    """

    def __init__(
        self,
        run_dir: RunDir,
        on_error: Callable[[OSError], None] | None = None,
        state: RunState | None = None,
        final_only: bool = False,
        on_change: Callable[[dict[str, Any]], None] | None = None,
        **initial: Any,
    ) -> None:
        self.run_dir = run_dir
        self.status: dict[str, Any] = dict(initial) | ({} if state is None else {"state": state.value})
        self.finished = False
        self.unwritten = False
        self._on_error = on_error
        self._final_only = final_only
        self._on_change = on_change
        self._lock = threading.Lock()

    def write(self) -> bool:
        """Write :attr:`status` as it is now; ``False`` when the job has finished (nothing is written) or the
        write failed (see ``on_error``)."""
        with self._lock:
            return self._write_locked()

    def update(self, state: RunState | None = None, **change: Any) -> bool:
        """Merge ``change`` (and ``state``, a state before the final one) into the status and write it; ``False``
        (nothing changed) once finished.

        Raises:
            ValueError: ``state`` is final (a run ends through :meth:`finish`).
        """
        if state is not None and state.final:
            raise ValueError(f"{state} is a final state: a run ends through StatusWriter.finish")
        with self._lock:
            if self.finished:
                return False
            self.status.update(change)
            if state is not None:
                self.status["state"] = state.value
            try:
                return self._write_locked()
            finally:
                self._told()

    def finish(self, end: RunState | StopReason, **change: Any) -> bool:
        """Write the final status: the final state ``end`` (or the one a run stopped for ``end`` ends in, with its
        ``stop_reason``), ``ended_s`` (now, unless given) and ``change``; later writes are refused. ``False`` when the
        job had finished already.

        Raises:
            ValueError: ``end`` is a state before the final one.
        """
        state = end.state if isinstance(end, StopReason) else end
        if not state.final:
            raise ValueError(f"{state} is not a final state; one of {[s.name for s in RunState if s.final]}")
        with self._lock:
            if self.finished:
                return False
            self.status.update(change)
            self.status["state"] = state.value
            if isinstance(end, StopReason):
                self.status["stop_reason"] = end.value
            self.status.setdefault("ended_s", time.time())
            self.finished = True  # a failed write is retried by write(), which must then still go through
            try:
                self._write_locked(final=True)
            finally:
                self._told()  # the final state reaches the reader in memory even when the file could not be written
            return True

    def _told(self) -> None:
        """Tell ``on_change`` the status (a copy), under the lock: it sees the changes in the order they were made, so
        a final state it was told is never followed by an earlier one."""
        if self._on_change is not None:
            self._on_change(dict(self.status))

    def _write_locked(self, final: bool = False) -> bool:
        if not isinstance(self.status.get("state", ""), str):  # set in the dict by hand: the writer takes it typed
            raise TypeError(f"status['state'] = {self.status['state']!r}: give a state to StatusWriter.update/finish")
        if self.finished and not final and not self.unwritten:
            return False
        if self._final_only and not self.finished:
            return True  # kept in memory (told to on_change) until the final write
        try:
            write_status(self.run_dir, self.status)
        except OSError as exc:
            if self._on_error is None:
                raise
            if not self.unwritten:
                self._on_error(exc)
            self.unwritten = True
            return False
        self.unwritten = False
        return True
