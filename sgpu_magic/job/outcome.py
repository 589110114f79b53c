"""What an ended job leaves: the notes on how its ranks ended and the error that names the root cause."""

from __future__ import annotations

from pathlib import Path

from sgpu_magic.errors import JobCancelledError, RankFailedError, RankFailure
from sgpu_magic.rundir import RunDir, read_json


def ending_notes(rd: RunDir, status: dict, world_size: int) -> list[str]:
    """:attr:`Job.notes` from the host's status (``teardown_ended``) and the ranks' exit files."""
    notes = []
    for entry in status.get("teardown_ended", []):
        what = "returned its value" if entry.get("outcome") == "value" else "raised"
        kept = "; its value is kept" if entry.get("outcome") == "value" else ""
        notes.append(f"rank {entry['rank']} needed the teardown grace: it {what} but had not exited "
                     f"{entry.get('grace_s', 0):g} s later (teardown_grace_s), so sgpu_magic ended it "
                     f"({entry.get('signal', 'SIGTERM')}){kept}")
    for rank in range(world_size):
        ended = read_json(rd.exit_file(rank))
        if ended and ended.get("kind") != "script":  # a script's sys.exit(0) is its normal end
            notes.append(f"rank {rank} called sys.exit(0) at {ended.get('where', '?')}; it returned nothing")
    return notes


def failure_from_status(rd: RunDir, status: dict, world_size: int) -> RankFailedError:
    """Build the :class:`RankFailedError` for a failed job: the earliest failure is the root cause.

    Ranks the host saw exit with an error before it stopped the rest come first: a rank killed outright
    (SIGKILL, SIGSEGV) leaves no error file, and the exceptions it then causes in the other ranks
    (connection reset) carry earlier timestamps than the host's observation of its death.
    """
    exitcodes = {int(k): v for k, v in (status.get("exitcodes") or {}).items()}
    observed = {f["rank"]: f for f in status.get("failures", [])}
    failures = []
    for rank in range(world_size):
        err = read_json(rd.error_file(rank))
        if rank not in observed and err is None:
            continue
        seen = observed.get(rank, {})
        failures.append(RankFailure(
            rank=rank, exitcode=seen.get("exitcode", exitcodes.get(rank)),
            exc_type=err and err["exc_type"], message=(err or {}).get("message", ""),
            traceback=(err or {}).get("traceback", ""), log_path=str(rd.log_file(rank)),
            time_s=err["time_s"] if err else seen.get("time_s", float("inf")), cuda=bool((err or {}).get("cuda"))))
    if not failures:
        failures.append(RankFailure(rank=0, exitcode=exitcodes.get(0), log_path=str(rd.log_file(0))))
    failures.sort(key=lambda f: (f.rank not in observed, f.time_s, f.rank))
    failed = {f.rank for f in failures}
    stopped = [r for r in range(world_size) if r not in failed and not rd.result_file(r).exists()]
    return RankFailedError(failures[0], failures[1:], stopped, str(rd.path))


def stopped_error(job_id: str, how: str, logs: Path) -> JobCancelledError:
    """``job <id> was interrupted; every rank was stopped. Logs: <dir>`` (``how``: ``interrupted`` or
    ``cancelled``), the error of a job stopped once its ranks ran."""
    return JobCancelledError(f"job {job_id} was {how}; every rank was stopped. Logs: {logs}")
