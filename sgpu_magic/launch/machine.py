"""One job's run as its launcher drives it: :class:`RunMachine`, the only writer of a launcher's ``status.json``.

Both launchers (the launch host's :class:`~sgpu_magic.launch.host.job.HostJob`, over torch elastic, and the Ray
supervisor, :class:`~sgpu_magic.launch.ray.launcher.RayLauncher`'s, over its rank actors) are a
:class:`~sgpu_magic.launch.group.RankGroup`: each starts, polls and stops its ranks its own way, and its loop calls
:meth:`RunMachine.drive` on every turn. The machine decides and owns what the status says: the transitions
(``STARTING`` → ``RUNNING`` → a final state, through :class:`~sgpu_magic.status.StatusWriter`), one monotonic
deadline, a stop asked for, the failures of an attempt root cause first, torchrun's restart policy (``max_restarts``:
the failed attempt's record, its error files kept, the next attempt's line in every log), the ranks the teardown grace
ended, the stacks taken before a stop, the sampled usage and the hang report (:class:`~sgpu_magic.launch.progress.
ProgressWatch`), and the job's end (:func:`finish_job`). So the two launchers' jobs run, and their status files say
what happened, the same way.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sgpu_magic._util.fs import count_lines
from sgpu_magic.errors import describe_exit
from sgpu_magic.launch.group import RankGroup
from sgpu_magic.launch.progress import ProgressWatch
from sgpu_magic.launch.stacks import write_stacks
from sgpu_magic.launch.usage import SAMPLE_INTERVAL_S
from sgpu_magic.rundir import RunDir, attempt_marker
from sgpu_magic.status import RankUsage, StatusWriter, StuckReport
from sgpu_magic.wire import LaunchRecord, RunState, StopReason, read_state
from sgpu_magic.wire.errors import FailedAttempt, ObservedFailure, TeardownEnd

NOTES = frozenset(
    {
        "host_pid",
        "port",
        "cluster",
        "start_method",
        "waited_for_warm_s",
        "warm_agents",
        "forked_ranks",
        "master_addr",
        "nodes",
    }
)
"""The facts of a run that a launcher may note in its status beside what the machine owns (how its ranks were
started, where); anything else is refused, so a status key is never spelt by a launcher by hand."""

_SAME: Any = object()

log = logging.getLogger(__name__)


class RunMachine:
    """The status of one job's run, owned for its launcher.

    Args:
        run_dir: the job's run directory.
        launch: its launch record (world size, ``max_restarts``, ``timeout_s``, ``stuck_after_s``).
        group: the job's ranks, which :meth:`drive` drives (``None``: the launcher tells the machine each step).
        on_error: called with the ``OSError`` of the first failed status write in a row (the launcher writes again
            later: :meth:`write`); default: raise it.
        **notes: the first of :data:`NOTES`.

    Raises:
        ValueError: a note that is not one of :data:`NOTES`.
    """

    def __init__(
        self,
        run_dir: RunDir,
        launch: LaunchRecord,
        group: RankGroup | None = None,
        on_error: Callable[[OSError], None] | None = None,
        **notes: Any,
    ) -> None:
        self.rd, self.group = run_dir, group
        self.world_size, self.max_restarts = launch.world_size, launch.max_restarts
        self.attempt = 1
        """The attempt that runs (from 1; its ranks see ``TORCHELASTIC_RESTART_COUNT = attempt - 1``)."""
        self.started_s = time.time()
        timeout = launch.timeout_s
        self.deadline = None if timeout is None else time.monotonic() + timeout
        """When the job times out (``time.monotonic()``): from when its launcher took it, so a clock step of the
        machine moves it not."""
        self.failures: list[ObservedFailure] = []
        self.attempts: list[FailedAttempt] = []
        self.pids: dict[int, int] | None = None
        """The running attempt's ranks (``{rank: pid}``); ``None`` until the first has started."""
        self._stop_reason: StopReason | None = None
        self.progress = ProgressWatch(
            run_dir, self.world_size, launch.stuck_after_s, take=None if group is None else group.take_stacks
        )
        self._progress_at = 0.0
        _check_notes(notes)
        self._writer = StatusWriter(run_dir, on_error, state=RunState.STARTING, started_s=self.started_s, **notes)

    @property
    def state(self) -> RunState:
        """The run's state as last set."""
        return read_state(self._writer.status)[0]

    @property
    def finished(self) -> bool:
        return self._writer.finished

    @property
    def unwritten(self) -> bool:
        """The last write of the status failed; the launcher writes it again (:meth:`write`)."""
        return self._writer.unwritten

    def request_stop(self, reason: StopReason) -> None:
        """Stop the job for ``reason`` on the launcher's next :meth:`drive` (from any thread)."""
        self._stop_reason = reason

    def stop_due(self) -> StopReason | None:
        """Why the job must stop now: a stop asked for (:meth:`request_stop`), or the deadline passed."""
        if self._stop_reason is not None:
            return self._stop_reason
        if self.deadline is not None and time.monotonic() > self.deadline:
            return StopReason.TIMED_OUT
        return None

    def start_attempt(self) -> None:
        """Start the ranks of :attr:`attempt` (:meth:`RankGroup.start_ranks`); the status says they run."""
        assert self.group is not None  # a machine that drives its ranks
        started = self.group.start_ranks(self.attempt)
        self.pids = dict(started.pids)
        self.progress.restart()
        self.running(started.pids, started.port, **started.notes)

    def drive(self) -> bool:
        """One look at the job, on every turn of its launcher's loop: an attempt whose ranks all succeeded ends the
        job, one whose ranks failed fails it when no restart is left (``max_restarts``); then, past the deadline or
        asked to stop, the job is stopped (:meth:`stop`); else a failed attempt is restarted, and while the ranks run
        their usage and the hang report are sampled. So ranks that ended in the turn a stop came end the job as they
        ended. Whether the job has ended."""
        assert self.group is not None and self.pids is not None  # its first attempt has started
        seen = self.group.poll_ranks()
        if seen is not None and not (seen and self.failed(seen)):
            self.finish(RunState.FAILED if seen else RunState.SUCCEEDED)
            return True
        reason = self.stop_due()
        if reason is not None:
            self.stop(reason)
            return True
        if seen:
            for rank, exc in self.restart(self.group.stop_ranks()):
                log.warning(f"sgpu_magic: could not mark attempt {self.attempt} in rank {rank}'s log ({exc})")
            self.start_attempt()
            return False
        self._sample()
        return False

    def stop(self, reason: StopReason, stacks: bool = True, launch_error: str | None = None) -> None:
        """Stop the job for ``reason``: when it timed out or was cancelled (and ``stacks``), the stacks of the ranks
        still running are taken first (into ``stacks/`` and the status), then its ranks are stopped and the job ends
        (:meth:`finish`); ``launch_error``: why the launcher could not go on with it (its status says it)."""
        if self.group is not None and not self.finished:
            if stacks and reason.takes_stacks and self.pids is not None:
                self._save_stacks()
            self.group.stop_ranks()  # also ranks of an attempt that failed to start all of them
        self.finish(reason, None, **({} if launch_error is None else {"launch_error": launch_error}))

    def _save_stacks(self) -> None:
        """Before a timed-out or cancelled job's ranks are stopped: the stacks of those still running into ``stacks/``
        and their summary into the status (``{rank: where}``); a failure is logged, never raised (the ranks are stopped
        all the same)."""
        assert self.group is not None
        try:
            running = self.group.running_pids()
            summary = write_stacks(self.rd, self.group.take_stacks(running)) if running else {}
        except Exception as exc:  # noqa: BLE001 - the stop goes on without them; the launcher's log says why
            log.warning(f"sgpu_magic: could not take the stacks of job {self.rd.job_id}: {exc!r}")
            return
        if summary:
            self._writer.status["stacks"] = summary

    def _sample(self) -> None:
        """The ranks' usage when the group has new figures, and about once a second whether the job is possibly
        stuck, written together."""
        assert self.group is not None and self.pids is not None
        usage, stuck = self.group.sample_usage(), _SAME
        now = time.monotonic()
        if now - self._progress_at >= SAMPLE_INTERVAL_S:
            self._progress_at = now
            if self.progress.check(self.pids):
                stuck = self.progress.report()
        if usage is not None or stuck is not _SAME:
            self.sampled(usage, stuck)

    def write(self) -> bool:
        """Write the status as it is now (again, after a failed write); ``False`` once finished."""
        return self._writer.write()

    def note(self, **notes: Any) -> None:
        """Note facts of :data:`NOTES` (written with the next change).

        Raises:
            ValueError: one that is not in :data:`NOTES`."""
        _check_notes(notes)
        self._writer.status.update(notes)

    def waiting(self, why: str | None) -> None:
        """Why the ranks wait to start (a Ray cluster's resources), written now; ``None``: they wait no longer."""
        if why is None:
            self._writer.status.pop("waiting", None)
        else:
            self._writer.update(waiting=why)

    def running(self, pids: Mapping[int, int], port: int | None, **notes: Any) -> None:
        """Every rank of :attr:`attempt` has started: ``pids`` (``{rank: pid}`` where the launcher's machine has
        them), the rendezvous ``port``."""
        self.note(**notes)
        self._writer.update(
            state=RunState.RUNNING,
            attempt=self.attempt,
            port=port,
            pids={str(rank): pid for rank, pid in sorted(pids.items())},
        )

    def sampled(self, usage: Mapping[int, RankUsage] | None = None, stuck: StuckReport | None = _SAME) -> None:
        """The ranks' latest usage (``None``: unchanged) and the hang report (``None``: not stuck; left out:
        unchanged), written now."""
        status = self._writer.status
        if usage is not None:
            status["usage"] = {str(rank): u.as_dict() for rank, u in sorted(usage.items())}
        if stuck is None:
            status.pop("stuck", None)
        elif stuck is not _SAME:
            status["stuck"] = stuck.to_json()
        self._writer.write()

    def grace_ended(self, entries: Iterable[TeardownEnd]) -> None:
        """Ranks the teardown grace ended (written with the final status)."""
        written = [e.to_json() for e in entries]
        if written:
            self._writer.status.setdefault("teardown_ended", []).extend(written)

    def failed(self, failures: Iterable[ObservedFailure]) -> bool:
        """The launcher saw :attr:`attempt` fail (``failures``: the ranks it saw fail, at once); whether torchrun's
        policy restarts it (an attempt is left of ``max_restarts``: call :meth:`restart` once its ranks are
        stopped), else the job fails (:meth:`finish`)."""
        self.failures = list(failures)
        return self.attempt <= self.max_restarts

    def restart(self, exitcodes: Mapping[int, int | None]) -> list[tuple[int, OSError]]:
        """Between the failed :attr:`attempt` (its ranks stopped, ``exitcodes`` theirs) and the next: its record goes
        into ``attempts`` (failures root cause first), its files are put aside (:func:`close_attempt`) and
        :attr:`attempt` counts on. The ranks whose log could not be marked, with why (the restart goes on)."""
        failed = root_cause_first(self.rd, self.world_size, self.failures, exitcodes)
        self.attempts.append(FailedAttempt(self.attempt, tuple(failed), time.time(), dict(exitcodes)))
        self._writer.status["attempts"] = [a.to_json() for a in self.attempts]
        self._writer.status.pop("stuck", None)  # the next attempt is judged on its own
        self.failures = []
        unmarked = close_attempt(self.rd, self.world_size, self.attempt, self.max_restarts, failed)
        self.attempt += 1
        return unmarked

    def finish(
        self, end: RunState | StopReason, exitcodes: Mapping[int, int | None] | None = None, **change: Any
    ) -> bool:
        """End the job (:func:`finish_job`): its final state or the reason it was stopped for, the ranks'
        ``exitcodes`` (given by its group's :meth:`~RankGroup.end_ranks`, which is done first, when the machine has
        one) and the failures seen; ``change``: ``launch_error`` (why the launcher could not run it). ``False`` when
        it had ended already."""
        if self.finished:
            return False
        if self.group is not None:
            exitcodes = self.group.end_ranks()
        status = self._writer.status
        status.pop("stuck", None)
        status.pop("waiting", None)
        if self.failures:
            status["failures"] = [f.to_json() for f in self.failures]
        if exitcodes is not None:
            change["exitcodes"] = {str(rank): code for rank, code in sorted(exitcodes.items())}
        return finish_job(self._writer, end, self.world_size, **change)


def fail_unstarted(run_dir: RunDir, exc: BaseException) -> None:
    """End a job its launcher could not take (its launch record unreadable, the cluster refused): its final status
    says why (``launch_error``), which the kernel raises.

    Raises:
        OSError: the status cannot be written either (the caller logs both)."""
    StatusWriter(run_dir).finish(RunState.FAILED, launch_error=f"{type(exc).__name__}: {exc}")


def _check_notes(notes: Mapping[str, Any]) -> None:
    unknown = sorted(set(notes) - NOTES)
    if unknown:
        raise ValueError(f"{unknown} are not notes a launcher takes ({sorted(NOTES)}); the run machine owns the rest")


def finish_job(writer: StatusWriter, end: RunState | StopReason, world_size: int, **change: Any) -> bool:
    """The end every launcher gives a job once its ranks are gone: the payload (a pickle: code) is deleted,
    each rank log's line count is recorded (``log_lines``), and the final status is written, last, through
    ``writer`` (:meth:`StatusWriter.finish`), so a kernel that reads it finds the run dir in its final form.
    Whatever else must precede the final status (leases given back, logs pulled) is done by the caller first.

    Returns:
        ``False`` when the job had been finished already (nothing is written).
    """
    if writer.finished:
        return False
    run_dir = writer.run_dir
    try:
        run_dir.payload_file.unlink()
    except FileNotFoundError:
        pass
    log_lines = count_lines([run_dir.log_file(r) for r in range(world_size)])
    return writer.finish(end, log_lines=log_lines, **change)


def root_cause_first(
    rd: RunDir, world_size: int, failed: Iterable[ObservedFailure], exitcodes: Mapping[int, int | None]
) -> list[ObservedFailure]:
    """The failures of an attempt that has ended (every rank stopped), the root cause first.

    ``failed`` are the ranks the launcher saw fail. A rank that raises tears its process group down on its way out,
    so a peer can fail on the broken connection and exit first: the launcher then saw only the peer. So a rank that
    wrote an error of its own earlier than every failure seen (its error's ``time_s``; a rank seen dead without an
    error, killed by a signal, counts as the earliest) is added, and the list is ordered by when each failed, as the
    job's final error names the earliest failure its root cause. ``exitcodes``: the attempt's, by rank."""
    errors: dict[int, float] = {}
    for rank in range(world_size):
        error = rd.read_error(rank)
        if error is not None:
            errors[rank] = error.time_s or math.inf
    found = {f.rank: f for f in failed}
    when = {rank: errors.get(rank, -math.inf) for rank in found}
    first_seen = min(when.values(), default=math.inf)
    for rank, time_s in errors.items():
        if rank not in found and time_s < first_seen:
            code = exitcodes.get(rank)
            found[rank] = ObservedFailure(rank, code if code is not None and code > 0 else 1, time_s)
            when[rank] = time_s
    return sorted(found.values(), key=lambda f: (when[f.rank], f.rank))


def close_attempt(
    rd: RunDir, world_size: int, attempt: int, max_restarts: int, failed: Iterable[ObservedFailure]
) -> list[tuple[int, OSError]]:
    """Between attempt ``attempt`` (1-based) and the next, as every launcher restarts (``max_restarts``, torchrun's
    policy): each rank's result and exit files are dropped (the next attempt is judged on its own), its error file
    moves to ``errors/attempt_<attempt>/``, and every rank log gets the next attempt's line, naming the ``failed``
    ranks. The ranks whose log could not be marked, with why (the restart goes on)."""
    keep = rd.attempt_errors_dir(attempt)
    for rank in range(world_size):
        rd.result_file(rank).unlink(missing_ok=True)
        rd.exit_file(rank).unlink(missing_ok=True)
        error = rd.error_file(rank)
        if error.exists():
            keep.mkdir(mode=0o700, exist_ok=True)
            os.replace(error, keep / error.name)
    why = ", ".join(f"rank {f.rank} failed ({describe_exit(f.exitcode)})" for f in failed)
    line = attempt_marker(attempt + 1, max_restarts + 1, why) + "\n"
    unmarked = []
    for rank in range(world_size):
        try:
            with open(rd.log_file(rank), "a") as rank_log:
                rank_log.write(line)
        except OSError as exc:
            unmarked.append((rank, exc))
    return unmarked
