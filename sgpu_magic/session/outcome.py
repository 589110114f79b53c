"""What the session's kernel side makes of its ranks' replies: a cell's final ``status.json``, why a session broke,
and what the session's sinks say."""

from __future__ import annotations

import ast
import time
from typing import TYPE_CHECKING, Any

from sgpu_magic.errors import RankFailure, describe_exit
from sgpu_magic.job.follow import JobSink
from sgpu_magic.job.handle import Job
from sgpu_magic.rundir import RunDir
from sgpu_magic.session.channel import Request
from sgpu_magic.wire import RunState, StopReason
from sgpu_magic.wire.errors import ObservedFailure
from sgpu_magic.wire.session import Reply

if TYPE_CHECKING:
    from sgpu_magic.session.core import Stuck


def mlflow_run(sinks: list[JobSink]) -> JobSink | None:
    """The session job's MLflow tracking (the sink that names its run): the parent of each cell's run, if any."""
    return next((sink for sink in sinks if hasattr(sink, "identity")), None)


def cell_status(request: Request, broken: str | None) -> tuple[RunState | StopReason, dict[str, Any]]:
    """A cell's end (its final state, or the reason it was stopped for) and the rest of its final ``status.json``,
    from its ranks' replies (or the reason the session broke)."""
    replies = request.replies
    raised = sorted((reply.time_s or time.time(), r) for r, reply in replies.items() if reply.raised)
    failures = [ObservedFailure(r, None, t).to_json() for t, r in raised]  # the rank lives on
    interrupted = any(reply.interrupted for reply in replies.values()) or bool(request.missing)
    end: RunState | StopReason
    if broken is not None and request.reason is None:
        end = RunState.FAILED
    elif request.reason is not None and interrupted:
        end = request.reason
    else:
        end = RunState.FAILED if failures else RunState.SUCCEEDED
    rest: dict[str, Any] = {
        "started_s": request.started_s,
        "ended_s": time.time(),
        "failures": failures,
        "rank_outcomes": {str(r): outcome(replies.get(r)) for r in request.ranks},
    }
    if broken is not None:
        rest["host_lost"] = broken
    return end, rest


def outcome(reply: Reply | None) -> str:
    """How one rank ended a cell, as the panel's rank tab says it."""
    if reply is None:
        return "did not return"
    if reply.ok:
        return "returned"
    return "interrupted" if reply.interrupted else "raised"


def death_message(name: str, job: Job) -> str:
    """Why a session's job ended by itself: the rank that died first and how."""
    status = job.status
    failures = list(status.failures) or [
        ObservedFailure(r, code) for r, code in sorted(status.exitcodes.items()) if code
    ]
    if failures:
        first = failures[0]
        what = f"rank {first.rank} died ({describe_exit(first.exitcode)})"
    else:
        what = f"its ranks ended ({status.state.value})"
    return (
        f"session {name} is broken: {what}; the other ranks were stopped and the session's state is gone. Run "
        f"%distributed_session restart (or sess.restart()) for fresh ranks. Logs: {job.run_dir}"
    )


def stuck_message(
    name: str,
    request: Request,
    interrupt_grace_s: float,
    failure_grace_s: float,
    stuck: Stuck | None = None,
    recoverable: bool = False,
) -> str:
    """Why session ``name`` broke when ranks of ``request`` did not return after its interrupt: which ranks and where
    each waits (from ``stuck``'s stacks), and, when the interrupt came because other ranks had raised (reason
    ``failed``), which ones and their error; the way on: ``recover`` where the session's channel can (``recoverable``),
    else a restart."""
    ranks = ", ".join(str(r) for r in request.missing)
    failed = sorted(r for r, reply in request.replies.items() if reply.raised)
    why = "of the interrupt"
    if request.reason is StopReason.FAILED and failed and request.run_dir is not None:
        why = (
            f"of the interrupt sent {failure_grace_s:g} s after rank(s) {', '.join(map(str, failed))} raised"
            f"{_first_error(request.run_dir, failed)}"
        )
    where = "; ".join(f"rank {r}: {stuck.stacks[r].where}" for r in stuck.ranks if r in stuck.stacks) if stuck else ""
    blocked = f"blocked outside Python: {where}" if where else "blocked outside Python, e.g. in a C++ collective"
    if recoverable:
        remedy = (
            "run %distributed_session recover (or sess.recover()) to release it and keep every rank's state, or "
            "%distributed_session restart (or sess.restart()) for fresh ranks (their state is lost)"
        )
        return f"session {name} is broken: rank(s) {ranks} did not return within {interrupt_grace_s:g} s {why} ({blocked}); {remedy}"
    return (
        f"session {name} needs a restart: rank(s) {ranks} did not return within {interrupt_grace_s:g} s "
        f"{why} ({blocked} waiting for its peers); run "
        f"%distributed_session restart (or sess.restart()) for fresh ranks (their state is lost)"
    )


def recovered_message(name: str, stuck: Stuck, backend: str | None, took_s: float) -> str:
    """What :meth:`SessionCore.recover` did: the ranks released and where they waited, the process group made again,
    and the values that were inside the aborted collectives (they may differ between ranks now)."""
    released = "; ".join(
        f"rank {r}" + (f" (in {stuck.stacks[r].where})" if r in stuck.stacks else "") for r in stuck.ranks
    )
    group = (
        f"the default process group ({backend}) was made again on every rank"
        if backend
        else "no rank had a process group"
    )
    suspects = sorted({(r, arg) for r in stuck.ranks if r in stuck.stacks for arg in _call_args(stuck.stacks[r].line)})
    inconsistent = (
        "; values that were in the aborted collective may differ between ranks: "
        + ", ".join(f"{arg} (rank {r})" for r, arg in suspects)
        if suspects
        else ""
    )
    rewrap = "; a DDP or FSDP model wrapped before holds the old group: wrap it again" if backend else ""
    return (
        f"session {name} recovered in {took_s:.1f} s ({stuck.label}): {released} returned; {group}; every rank's "
        f"namespace is kept{inconsistent}{rewrap}"
    )


def _call_args(line: str) -> list[str]:
    """The positional arguments, as written, of the ``torch.distributed`` call on ``line``
    (``dist.all_reduce(t, op=...)`` -> ``["t"]``); ``[]`` when the line does not parse."""
    try:
        tree = ast.parse(line.strip())
    except SyntaxError:
        return []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            name = ast.unparse(node.func).rsplit(".", 1)[-1]
            if name in _COLLECTIVES:
                return [
                    ast.unparse(arg) for arg in node.args if isinstance(arg, ast.Name | ast.Attribute | ast.Subscript)
                ]
    return []


_COLLECTIVES = frozenset(
    "all_reduce all_gather all_gather_into_tensor all_gather_object all_to_all all_to_all_single broadcast "
    "broadcast_object_list reduce reduce_scatter reduce_scatter_tensor gather gather_object scatter scatter_object_list "
    "send recv isend irecv".split()
)


def _first_error(run_dir: RunDir, ranks: list[int]) -> str:
    """`` (RuntimeError: ...)``: the exception the first of ``ranks`` saved, for a message; ``""`` when none was."""
    error = run_dir.read_error(ranks[0])
    if error is None:
        return ""
    failure = RankFailure(rank=ranks[0], exitcode=None, exc_type=error.exc_type, message=error.message)
    return f" ({failure.what()})"
