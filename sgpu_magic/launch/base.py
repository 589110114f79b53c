"""The :class:`Launcher` protocol: what starts a job's ranks, as the Job handle sees it.

Three launchers implement it: the kernel's client of its local launch host
(:class:`sgpu_magic.launch.client.LaunchHost`), of the user's run keeper for detached jobs
(:class:`sgpu_magic.launch.keeper.RunKeeper`) and the Ray backend
(:class:`sgpu_magic.launch.ray.launcher.RayLauncher`). Each takes a prepared run directory
(``launch.json``, ``payload.pkl``, the rank log files) and report only through it: the job's
``status.json`` (written until its final state) and each rank's log, result and error files.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from sgpu_magic._util.fs import count_lines
from sgpu_magic.errors import describe_exit
from sgpu_magic.rundir import RunDir, attempt_marker
from sgpu_magic.status import HostStatus, StatusWriter
from sgpu_magic.wire import RunState, StopReason


@runtime_checkable
class Launcher(Protocol):
    """Starts, stops and outlives the ranks of the jobs handed to it."""

    pid: int
    """The process the job's GPU lease is tied to while the ranks run (the launch host; the kernel for Ray)."""

    def launch(self, run_dir: RunDir) -> None:
        """Start the job of ``run_dir``; returns once it is handed over (the ranks start asynchronously).

        Raises:
            LauncherError: the launcher is gone (a fresh one is asked once more).
        """

    def cancel(self, run_dir: RunDir, reason: StopReason) -> None:
        """Stop every rank of the job (SIGTERM, then SIGKILL); it ends in ``reason``'s final state, with ``reason``
        as its stop reason."""

    def alive(self) -> bool:
        """Whether the launcher still runs (a job whose launcher died fails, naming :meth:`where`)."""

    def where(self) -> str:
        """Where the launcher's own diagnostics are, for error messages (a log file's path)."""

    def preparing(self) -> str | None:
        """What the launcher is still getting ready before it can start ranks (said to the user when a launch has
        waited for it a second), or ``None`` when nothing holds a launch up."""

    def stacks(self, run_dir: RunDir, status: Callable[[], HostStatus], native: bool) -> dict[int, str]:
        """Each running rank's stack of the job of ``run_dir`` (:meth:`sgpu_magic.job.handle.Job.stacks`), taken by
        py-spy where the launcher may trace the ranks; ``status`` gives the job's status now.

        Raises:
            SgpuError: the job has ended or its ranks have not started (:func:`sgpu_magic.launch.stacks.live_stacks`).
        """


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
    rd: RunDir, world_size: int, failed: list[dict[str, Any]], exitcodes: dict[str, int | None]
) -> list[dict[str, Any]]:
    """The failures of an attempt that has ended (every rank stopped), the root cause first.

    ``failed`` (``[{"rank", "exitcode", ...}]``) are the ranks the launcher saw fail. A rank that raises tears its
    process group down on its way out, so a peer can fail on the broken connection and exit first: the launcher then
    saw only the peer. So a rank that wrote an error of its own earlier than every failure seen (its error's
    ``time_s``; a rank seen dead without an error, killed by a signal, counts as the earliest) is added, and the list
    is ordered by when each failed, as the job's final error names the earliest failure its root cause.
    ``exitcodes``: the attempt's, by rank."""
    errors: dict[int, float] = {}
    for rank in range(world_size):
        error = rd.read_error(rank)
        if error is not None:
            errors[rank] = error.time_s or math.inf
    found = {int(f["rank"]): f for f in failed}
    when = {rank: errors.get(rank, -math.inf) for rank in found}
    first_seen = min(when.values(), default=math.inf)
    for rank, time_s in errors.items():
        if rank not in found and time_s < first_seen:
            code = exitcodes.get(str(rank))
            found[rank] = {"rank": rank, "exitcode": code if code is not None and code > 0 else 1, "time_s": time_s}
            when[rank] = time_s
    return sorted(found.values(), key=lambda f: (when[int(f["rank"])], int(f["rank"])))


def close_attempt(
    rd: RunDir, world_size: int, attempt: int, max_restarts: int, failed: list[dict[str, Any]]
) -> list[tuple[int, OSError]]:
    """Between attempt ``attempt`` (1-based) and the next, as every launcher restarts (``max_restarts``, torchrun's
    policy): each rank's result and exit files are dropped (the next attempt is judged on its own), its error file
    moves to ``errors/attempt_<attempt>/``, and every rank log gets the next attempt's line, naming the ``failed``
    ranks (``[{"rank", "exitcode"}]``). The ranks whose log could not be marked, with why (the restart goes on)."""
    keep = rd.attempt_errors_dir(attempt)
    for rank in range(world_size):
        rd.result_file(rank).unlink(missing_ok=True)
        rd.exit_file(rank).unlink(missing_ok=True)
        error = rd.error_file(rank)
        if error.exists():
            keep.mkdir(mode=0o700, exist_ok=True)
            os.replace(error, keep / error.name)
    why = ", ".join(f"rank {f['rank']} failed ({describe_exit(f['exitcode'])})" for f in failed)
    line = attempt_marker(attempt + 1, max_restarts + 1, why) + "\n"
    unmarked = []
    for rank in range(world_size):
        try:
            with open(rd.log_file(rank), "a") as rank_log:
                rank_log.write(line)
        except OSError as exc:
            unmarked.append((rank, exc))
    return unmarked
