"""What the session's kernel side makes of its ranks' replies: a cell's final ``status.json``, why a session broke,
and what the session's sinks say."""

from __future__ import annotations

import time
from typing import Any

from sgpu_magic.errors import RankFailure, describe_exit
from sgpu_magic.job.follow import JobSink
from sgpu_magic.job.handle import Job
from sgpu_magic.rundir import RunDir, read_json
from sgpu_magic.session.channel import Request


def mlflow_run(sinks: list[JobSink]) -> JobSink | None:
    """The session job's MLflow tracking (the sink that names its run): the parent of each cell's run, if any."""
    return next((sink for sink in sinks if hasattr(sink, "identity")), None)


def cell_status(request: Request, broken: str | None) -> dict[str, Any]:
    """A cell's final ``status.json`` from its ranks' replies (or the reason the session broke)."""
    replies = request.replies
    failures = sorted(
        (
            {"rank": r, "exitcode": None, "time_s": reply.get("time_s", time.time())}  # the rank lives on
            for r, reply in replies.items()
            if not reply.get("ok") and not reply.get("interrupted")
        ),
        key=lambda f: f["time_s"],
    )
    interrupted = any(reply.get("interrupted") for reply in replies.values()) or bool(request.missing)
    if broken is not None and request.reason is None:
        state = "failed"
    elif request.reason is not None and interrupted:
        state = request.reason
    else:
        state = "failed" if failures else "succeeded"
    status: dict[str, Any] = {
        "state": state,
        "started_s": request.started_s,
        "ended_s": time.time(),
        "failures": failures,
        "rank_outcomes": {str(r): outcome(replies.get(r)) for r in request.ranks},
    }
    if broken is not None:
        status["host_lost"] = broken
    return status


def outcome(reply: dict[str, Any] | None) -> str:
    """How one rank ended a cell, as the panel's rank tab says it."""
    if reply is None:
        return "did not return"
    if reply.get("ok"):
        return "returned"
    return "interrupted" if reply.get("interrupted") else "raised"


def death_message(name: str, job: Job) -> str:
    """Why a session's job ended by itself: the rank that died first and how."""
    status = job.status
    failures = list(status.failures) or [
        {"rank": r, "exitcode": code} for r, code in sorted(status.exitcodes.items()) if code
    ]
    if failures:
        first = failures[0]
        what = f"rank {first['rank']} died ({describe_exit(first.get('exitcode'))})"
    else:
        what = f"its ranks ended ({status.state})"
    return (
        f"session {name} is broken: {what}; the other ranks were stopped and the session's state is gone. Run "
        f"%distributed_session restart (or sess.restart()) for fresh ranks. Logs: {job.run_dir}"
    )


def stuck_message(name: str, request: Request, interrupt_grace_s: float, failure_grace_s: float) -> str:
    """Why session ``name`` broke when ranks of ``request`` did not return after its interrupt: which ranks, and,
    when the interrupt came because other ranks had raised (reason ``failed``), which ones and their error."""
    stuck = ", ".join(str(r) for r in request.missing)
    failed = sorted(r for r, reply in request.replies.items() if not reply.get("ok") and not reply.get("interrupted"))
    why = "of the interrupt"
    if request.reason == "failed" and failed and request.run_dir is not None:
        why = (
            f"of the interrupt sent {failure_grace_s:g} s after rank(s) {', '.join(map(str, failed))} raised"
            f"{_first_error(request.run_dir, failed)}"
        )
    return (
        f"session {name} needs a restart: rank(s) {stuck} did not return within {interrupt_grace_s:g} s "
        f"{why} (blocked outside Python, e.g. in a C++ collective waiting for its peers); run "
        f"%distributed_session restart (or sess.restart()) for fresh ranks (their state is lost)"
    )


def _first_error(run_dir: RunDir, ranks: list[int]) -> str:
    """`` (RuntimeError: ...)``: the exception the first of ``ranks`` saved, for a message; ``""`` when none was."""
    error = read_json(run_dir.error_file(ranks[0]))
    if not error:
        return ""
    failure = RankFailure(
        rank=ranks[0], exitcode=None, exc_type=error.get("exc_type"), message=error.get("message", "")
    )
    return f" ({failure.what()})"
