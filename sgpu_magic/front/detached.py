"""Detached runs (``detach=True`` / ``--detach``): listing them, attaching to one from any kernel, stopping one.

A detached job runs under the user's run keeper (:mod:`sgpu_magic.launch.keeper`), not the kernel's launch host, so
it outlives the kernel that started it. Its run directory holds everything a kernel follows a job through (status,
logs, metrics, results), so :func:`attach` rebuilds the :class:`~sgpu_magic.Job` handle and its panel from it:
every rank's lines from the first byte, then live. Only the user who started a run sees it: run directories and
the keeper folder are 0700, the keeper's socket 0600, and the attach record is read through the private-read check.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from sgpu_magic.errors import RecordError, SgpuError
from sgpu_magic.front.decorator import make_sinks
from sgpu_magic.front.sessions import sessions
from sgpu_magic.job.handle import CANCEL_WAIT_S, Job, jobs
from sgpu_magic.job.state import JobState
from sgpu_magic.launch.keeper import KeeperPaths, RunKeeper
from sgpu_magic.rundir import RunDir, default_root, detached_index
from sgpu_magic.session.core import SessionState
from sgpu_magic.status import HostStatus
from sgpu_magic.wire import GPUS_ENV, StopReason
from sgpu_magic.wire.attach import AttachRecord

if TYPE_CHECKING:
    from sgpu_magic.front.session import Session

RECENT_S = 24 * 3600.0
"""``%distributed_jobs --all`` lists detached runs that ended less than this many seconds ago (a day), and every
one still running."""


@dataclass(frozen=True)
class DetachedRun:
    """One detached run as its run directory says now.

    Attributes:
        job_id: its id (``job.job_id``; the run directory's name).
        run_dir: its run directory.
        state: its state now (``running``, ``succeeded``, ...).
        world_size: its number of ranks.
        gpus: the GPUs it runs on (``"cpu"`` without).
        started_s: when it was started (epoch seconds).
        ended_s: when it ended, or ``None`` while it runs.
        mlflow_run_id: its MLflow run, or ``None``.
    """

    job_id: str
    run_dir: Path
    state: JobState
    world_size: int
    gpus: str
    started_s: float
    ended_s: float | None
    mlflow_run_id: str | None


def _read(rd: RunDir) -> DetachedRun | None:
    try:
        launch = rd.read_launch()
        status = HostStatus.read(rd)
    except (OSError, RecordError):  # not written yet, not this user's, or not one this version reads
        return None
    if not launch.detached:
        return None
    try:
        mlflow = rd.read_mlflow_run()
    except (OSError, RecordError):  # not this user's, or not a record this version reads: the run is listed untracked
        mlflow = None
    started_s = status.started_s or rd.launch_file.stat().st_mtime
    return DetachedRun(
        job_id=rd.job_id,
        run_dir=rd.path,
        state=status.state,
        world_size=launch.world_size,
        gpus=launch.env.get(GPUS_ENV) or "cpu",
        started_s=float(started_s),
        ended_s=status.ended_s,
        mlflow_run_id=mlflow.run_id if mlflow is not None else None,
    )


def detached_runs(root: Path | None = None, recent_s: float | None = RECENT_S) -> list[DetachedRun]:
    """The user's detached runs on this machine, oldest first: every one still running, and those that ended less
    than ``recent_s`` seconds ago (``None``: all that are kept). ``root``: the sgpu_magic home.

    Raises:
        PermissionError: the keeper folder is not this user's (another user's runs are not listed).
    """
    root = root or default_root()
    runs = []
    now = time.time()
    for entry in sorted(detached_index(root).iterdir()):
        rd = RunDir(root / "runs" / entry.name)
        if not rd.path.is_dir():  # its run directory was removed: forget it
            entry.unlink(missing_ok=True)
            continue
        run = _read(rd)
        if run is None:  # not readable here (a newer sgpu_magic's run, say): kept for the version that reads it
            continue
        if recent_s is None or run.ended_s is None or now - run.ended_s <= recent_s:
            runs.append(run)
    return runs


def find_detached(part: str | None, root: Path | None = None) -> DetachedRun:
    """The one detached run whose id contains ``part``; ``None``: the latest one started.

    Raises:
        SgpuError: none, or several, match (the message lists the runs), or the user has none.
    """
    runs = detached_runs(root, recent_s=None)
    if part is None:
        if not runs:
            raise SgpuError("you have no detached run on this machine; start one with detach=True / --detach")
        return max(runs, key=lambda run: run.job_id)
    chosen = [run for run in runs if part in run.job_id]
    if len(chosen) != 1:
        known = ", ".join(run.job_id for run in runs) or "none"
        what = "matches no detached run" if not chosen else f"matches {len(chosen)} detached runs"
        raise SgpuError(
            f"{part!r} {what} of yours on this machine (detached runs: {known}); give more of the id, as "
            f"%distributed_jobs --all lists them (a job started without detach=True cannot be attached)"
        )
    return chosen[0]


def _keeper_of(run: DetachedRun, record: AttachRecord) -> RunKeeper:
    return RunKeeper(record.launcher_pid, record.launcher_log, KeeperPaths(run.run_dir.parent.parent))


def attach(job_id: str | None = None, *, widgets: bool | None = None, root: Path | None = None) -> Job | Session:
    """The :class:`~sgpu_magic.Job` of a detached run, from any kernel of the user who started it (also after that
    kernel died or restarted): its panel (or text view) is rebuilt from the run directory, every rank's lines from
    the first one, and follows it live from a background thread, as for ``fn.submit(...)``; ``job.result()``,
    ``job.cancel()``, ``job.stacks()`` and ``job.metrics()`` work as on the kernel that started it, and its MLflow
    run is ended here when it ends (unless that kernel did). A run already followed in this kernel is returned as is.

    A running detached session (``Session(detach=True)``, ``%distributed_session start --detach``) gives its
    :class:`~sgpu_magic.Session` instead: its cells run on the same ranks, with the state they kept
    (``sess.pull("model")``, ``%%distributed --session``), and it becomes this kernel's latest session.

    Args:
        job_id: the run's id (``job.job_id``), or a unique part of it; ``None``: the latest detached run started.
        widgets: the panel (True) or plain text (False); default: as the run was started.
        root: the sgpu_magic home (default :func:`sgpu_magic.rundir.default_root`).

    Raises:
        SgpuError: no detached run of yours matches ``job_id``, or several do (the message lists them).
        SessionError: a detached session's name is taken by a running session of this kernel.
        PermissionError: the run's files are not private to you (another user's, or opened up).
    """
    run = find_detached(job_id, root)
    rd = RunDir(run.run_dir)
    is_session = rd.session_file.exists() and not run.state.final
    if is_session:
        live = next((s for s in sessions() if s.job is not None and s.job.job_id == run.job_id), None)
        if live is not None and live.state is not SessionState.STOPPED:
            return live
    else:
        followed = next((job for job in jobs() if job.job_id == run.job_id and not job.ended), None)
        if followed is not None:
            return followed
    record = rd.read_attach()
    spec = record.spec if widgets is None else replace(record.spec, widgets=widgets)
    keeper = _keeper_of(run, record)
    job = Job(rd, spec, record.plan, lambda: keeper, make_sinks(spec, None))
    job.title = spec.name if is_session else f"job {rd.job_id} (attached)"  # a session's: "session train"
    job.attach(keeper, record.submitted_s)
    if is_session:
        from sgpu_magic.front.session import Session

        return Session.attached(job, rd.read_session())
    return job


def stop_detached(job_id: str, root: Path | None = None, timeout_s: float = CANCEL_WAIT_S) -> str:
    """Stop the detached run whose id contains ``job_id`` (every rank stopped, state cancelled) and wait up to
    ``timeout_s`` for it to end; returns a line saying what happened (``job <id>: cancelled``).

    Raises:
        SgpuError: no detached run of yours matches (see :func:`find_detached`).
    """
    run = find_detached(job_id, root)
    if run.state.final:
        return f"job {run.job_id} already ended: {run.state.label}"
    rd = RunDir(run.run_dir)
    keeper = _keeper_of(run, rd.read_attach())
    if not keeper.alive():
        return (
            f"job {run.job_id}: its run keeper (pid {keeper.pid}) is gone, and its ranks with it; see {keeper.where()}"
        )
    keeper.cancel(rd, StopReason.CANCELLED)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = HostStatus.read(rd).state
        if state.final:
            return f"job {run.job_id}: {state.label}"
        time.sleep(0.05)
    return f"job {run.job_id}: asked to stop; its ranks have not ended after {timeout_s:g} s (see {rd.logs_dir})"


class DetachedTable:
    """``%distributed_jobs --all``: the user's detached runs (running, and ended less than a day ago)."""

    COLUMNS = ("job", "state", "age", "world size", "GPUs", "MLflow run")

    def __init__(self, runs: list[DetachedRun]) -> None:
        now = time.time()
        self.rows = [
            (
                run.job_id,
                run.state.label,
                _age(now - run.started_s),
                str(run.world_size),
                run.gpus,
                run.mlflow_run_id or "-",
            )
            for run in runs
        ]

    def __repr__(self) -> str:
        if not self.rows:
            return "no detached runs of yours on this machine (start one with detach=True / --detach)"
        widths = [max(len(c), *(len(r[i]) for r in self.rows)) for i, c in enumerate(self.COLUMNS)]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [self.COLUMNS, *self.rows]
        )

    def _repr_html_(self) -> str:
        if not self.rows:
            return f"<p>{html.escape(repr(self))}</p>"
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in self.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
