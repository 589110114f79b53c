"""What an ended job leaves: the notes on how its ranks ended and the error that names the root cause."""

from __future__ import annotations

import pickle
from typing import Any

from sgpu_magic.errors import (
    LAST_LINES,
    NO_GPU_HINT,
    CellInterruptedError,
    JobCancelledError,
    JobTimeoutError,
    LauncherError,
    RankFailedError,
    RankFailure,
    SgpuError,
    rank_ranges,
)
from sgpu_magic.job.state import JobState
from sgpu_magic.launch.flight_recorder import flight_recorder_note
from sgpu_magic.launch.resources import DevicePlan
from sgpu_magic.launch.stacks import summary
from sgpu_magic.rundir import RunDir, read_private
from sgpu_magic.spec import LaunchSpec
from sgpu_magic.status import HostStatus
from sgpu_magic.wire import StopReason


def ending_notes(rd: RunDir, status: HostStatus, world_size: int) -> list[str]:
    """:attr:`Job.notes` from the host's status (``teardown_ended``) and the ranks' exit files."""
    notes = []
    for entry in status.teardown_ended:
        what = "returned its value" if entry.outcome == "value" else "raised"
        kept = "; its value is kept" if entry.outcome == "value" else ""
        notes.append(
            f"rank {entry.rank} needed the teardown grace: it {what} but had not exited "
            f"{entry.grace_s:g} s later (teardown_grace_s), so sgpu_magic ended it ({entry.signal}){kept}"
        )
    for rank in range(world_size):
        ended = rd.read_exit(rank)
        if ended is not None and ended.kind != "script":  # a script's sys.exit(0) is its normal end
            notes.append(f"rank {rank} called sys.exit(0) at {ended.where}; it returned nothing")
    return notes


def failure_from_status(rd: RunDir, status: HostStatus, world_size: int) -> RankFailedError:
    """Build the :class:`RankFailedError` for a failed job: the earliest failure is the root cause.

    Ranks the host saw exit with an error before it stopped the rest come first: a rank killed outright
    (SIGKILL, SIGSEGV) leaves no error file, and the exceptions it then causes in the other ranks
    (connection reset) carry earlier timestamps than the host's observation of its death.
    """
    exitcodes = status.exitcodes
    observed = {f.rank: f for f in status.failures}
    usage = status.usage
    failures = []
    for rank in range(world_size):
        err = rd.read_error(rank)
        if rank not in observed and err is None:
            continue
        seen = observed.get(rank)
        failures.append(
            RankFailure(
                last_lines=log_tail(rd.log_file(rank)) if err is None or not err.traceback else (),
                oom=seen.oom if seen else "",
                oom_killed=seen.oom_killed if seen else None,
                peak_rss_bytes=usage[rank].peak_rss_bytes if rank in usage else None,
                rank=rank,
                exitcode=seen.exitcode if seen else exitcodes.get(rank),
                exc_type=err.exc_type if err else None,
                message=err.message if err else "",
                traceback=err.traceback if err else "",
                log_path=str(rd.log_file(rank)),
                time_s=err.time_s if err else seen.time_s if seen else float("inf"),
                cuda=bool(err and err.cuda),
            )
        )
    if not failures:
        failures.append(RankFailure(rank=0, exitcode=exitcodes.get(0), log_path=str(rd.log_file(0))))
    failures.sort(key=lambda f: (f.rank not in observed, f.time_s, f.rank))
    failed = {f.rank for f in failures}
    ran = list(status.rank_outcomes) or range(world_size)  # a session cell: its ranks
    stopped = [r for r in ran if r not in failed and not rd.result_file(r).exists()]
    return RankFailedError(failures[0], failures[1:], stopped, str(rd.path))


def log_tail(path, lines: int = LAST_LINES, max_bytes: int = 64 * 1024) -> tuple[str, ...]:
    """The last ``lines`` non-empty lines of a rank's log (read from its last ``max_bytes``); ``()`` if unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return ()
    kept = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n") if line.strip()]
    fatal = [i for i, line in enumerate(kept) if line.startswith(FATAL)]
    if fatal:  # faulthandler's dump (a segfault): the lines before it, its first line, the frames of the user's code
        frames = [line for line in kept[fatal[-1] + 1 :] if line.startswith('  File "')]
        mine = frames[: min(4, next((i for i, f in enumerate(frames) if _RANK_ENTRY in f), 4))]
        kept = kept[: fatal[-1] + 1][-(lines - len(mine)) :] + mine
    return tuple(line if len(line) <= 300 else line[:297] + "..." for line in kept[-lines:])


FATAL = "Fatal Python error: "
"""How faulthandler's dump of a crashed rank (a segfault) begins in its log."""

_RANK_ENTRY = "/sgpu_magic/rank/"


def stopped_error(rd: RunDir, how: str, status: HostStatus | None = None) -> JobCancelledError:
    """``job <id> was interrupted; every rank was stopped. Logs: <dir>`` (``how``: ``interrupted`` or
    ``cancelled``), the error of a job stopped once its ranks ran; with its final ``status``, also where the ranks
    still running then were (``Where the ranks still running were: rank 0: ...``)."""
    if status is not None and status.rank_outcomes:  # a live session's cell: its ranks live on
        return CellInterruptedError(cell_stopped_message(rd, f"was {how}", status))
    where = _still_running(rd, status) if status is not None else ""
    return JobCancelledError(f"job {rd.job_id} was {how}; every rank was stopped. Logs: {rd.logs_dir}.{where}")


def cell_stopped_message(rd: RunDir, what: str, status: HostStatus) -> str:
    """A live session's cell that was stopped (``what``: ``was interrupted``, ``ran longer than its timeout of
    60 s``): the session's ranks live on with their state, unless the session broke on the way (a rank that did not
    return from the interrupt: ``status.host_lost`` says so)."""
    if status.host_lost:
        return f"the cell {what}, but {status.host_lost}"
    return f"the cell {what}; the session's ranks stopped running it and keep their state. Logs: {rd.logs_dir}."


def load_result(rd: RunDir, rank: int) -> Any:
    """Rank ``rank``'s returned value, unpickled from its private result file.

    Raises:
        SgpuError: the rank left no result, or it cannot be unpickled in the kernel.
    """
    path = rd.result_file(rank)
    try:
        data = read_private(path, rd.path)
    except FileNotFoundError:
        raise SgpuError(f"rank {rank} exited 0 but left no result; see {rd.log_file(rank)}") from None
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise SgpuError(
            f"the result of rank {rank} cannot be unpickled in the kernel "
            f"({type(exc).__name__}: {exc}); return plain Python, numpy or torch values"
        ) from exc


def _still_running(rd: RunDir, status: HostStatus) -> str:
    """`` Where the ranks still running were: rank 0: dist.broadcast at Cell In[4] line 7; ... (their stacks:
    <dir>).`` from the summary its launcher took before it stopped them
    (:meth:`sgpu_magic.launch.machine.RunMachine.stop`), else ``""``."""
    where = status.stacks
    if not where:
        return ""
    return f" Where the ranks still running were: {summary(where)} (their stacks: {rd.stacks_dir})."


def build_error(rd: RunDir, status: HostStatus, spec: LaunchSpec, plan: DevicePlan) -> BaseException:
    """The error of a job that ended without succeeding, from its final ``status``: a timeout, a cancel (or
    interrupt), a lost launcher, a launch that failed, or the :class:`RankFailedError` naming the root cause."""
    state, reason, job_id = status.state, status.stop_reason, rd.job_id
    if state is JobState.TIMED_OUT and status.rank_outcomes:
        return JobTimeoutError(cell_stopped_message(rd, f"ran longer than its timeout of {spec.timeout_s:g} s", status))
    if state is JobState.TIMED_OUT:
        return JobTimeoutError(
            f"job {job_id} ran longer than its timeout of {spec.timeout_s:g} s; every rank was stopped."
            f"{_still_running(rd, status)}{flight_recorder_note(rd)} Logs: {rd.logs_dir}"
        )
    if state is JobState.CANCELLED:
        how = "interrupted" if reason is StopReason.INTERRUPTED else "cancelled"
        if status.started_s is None:
            return JobCancelledError(f"job {job_id} was {how} before it started (no rank ran)")
        return stopped_error(rd, how, status)
    if status.host_lost:
        return LauncherError(status.host_lost)
    if status.launch_error:
        return LauncherError(f"job {job_id} could not start: {status.launch_error}")
    error = failure_from_status(rd, status, plan.world_size)
    if error.root_cause.cuda and plan.backend == "gloo" and plan.cluster is None:
        error.hint = NO_GPU_HINT
    elif plan.backend == "nccl":
        error.hint = flight_recorder_note(rd).strip()
    left = sorted(r for r, code in status.exitcodes.items() if code == 0)
    if left and not error.hint and "by peer" in error.root_cause.message:  # gloo's words for a peer that left
        error.hint = (
            f"{'ranks' if len(left) > 1 else 'rank'} {rank_ranges(left)} returned while the others still ran: a rank that leaves before the collectives its "
            f"peers still call (a barrier, an all-reduce) makes them fail like this; check that every rank runs the "
            f"same collectives"
        )
    if status.attempts:
        error.attempt_note = (
            f"attempt {status.attempt} of {spec.max_restarts + 1} failed, after "
            f"{len(status.attempts)} restart(s); job.attempts lists the earlier failures"
        )
    return error
