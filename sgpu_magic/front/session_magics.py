"""The magics of live sessions: ``%distributed_session``, ``%%distributed --session``, ``%distributed_push``,
``%distributed_pull`` (the sessions themselves: :mod:`sgpu_magic.front.session`)."""

from __future__ import annotations

import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from sgpu_magic.errors import SessionError, SpecError
from sgpu_magic.front.cell import (
    as_usage_error,
    cell_label,
    check_output_name,
    checked_source,
    ends_quiet,
    parse_gpu_ids,
    parse_line,
    parse_timeout,
)
from sgpu_magic.front.magic_help import magic_help
from sgpu_magic.front.options import PROFILE_OPTION
from sgpu_magic.front.session import Session
from sgpu_magic.front.sessions import current_session, find_session, sessions
from sgpu_magic.front.spec_options import FromConfig
from sgpu_magic.launch import release


def is_session_cell(line: str) -> bool:
    """Whether a ``%%distributed`` line asks for a live session (``--session`` or ``--session NAME``)."""
    try:
        words = shlex.split(line)
    except ValueError:
        return False
    return any(w == "--session" or w.startswith("--session=") for w in words)


def parse_ranks(text: str | None) -> list[int] | None:
    """``--ranks 0,2`` as ``[0, 2]``; ``None`` when not given. Raises UsageError for anything else."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--ranks takes rank numbers separated by commas, e.g. --ranks 0,2; got {text!r}") from None


SESSION_OPTION = argument(
    "--session",
    nargs="?",
    const="",
    default=None,
    metavar="NAME",
    help="Run the cell on a live session's ranks (%%distributed_session start; default: the latest); "
    "with --ranks I,J, --timeout, --profile and -o only.",
)
RANKS_OPTION = argument("--ranks", default=None, metavar="I,J", help="With --session: run only on these ranks.")
"""The options of ``%%distributed`` that pick a live session's ranks (both parsers show them)."""


@magic_arguments(name="%distributed")
@SESSION_OPTION
@RANKS_OPTION
@argument("--timeout", default=None, help="Seconds before the cell is interrupted (its state stays), or 'none'.")
@PROFILE_OPTION
@argument("-o", "--output", default=None, metavar="NAME", help="Store the cell's Job (results, logs) in this variable.")
def _session_cell_options(line: str, cell: str) -> None:
    """The options of a ``%%distributed --session`` cell."""


def run_session_cell(shell, line: str, cell: str):
    """The body of ``%%distributed --session ...``: run the cell on the session's ranks; rank 0's value (or the
    first rank run's) is the cell's output."""
    args = parse_line(_session_cell_options.parser, line, "%%distributed --session")
    check_output_name(args.output)
    with as_usage_error(SessionError):
        session = find_session(args.session)
        session.check_usable()
    label = cell_label(shell)
    source = checked_source(cell, shell.transform_cell(cell), label)
    with as_usage_error(SessionError, SpecError):
        timeout_s = parse_timeout(args.timeout, None)
        job = session.submit_cell(
            source,
            shell.user_ns,
            parse_ranks(args.ranks),
            timeout_s,
            filename=f"<{label}>",  # the cell's In[N] while it runs (IPython 9)
            display_name=label,
            quiet=ends_quiet(source),
            profile=args.profile,
        )
    if args.output:
        shell.user_ns[args.output] = job
    values = session.follow(job)
    return values[0] if values else None


@magics_class
class SessionMagics(Magics):
    """``%distributed_session``, ``%distributed_push``, ``%distributed_pull``."""

    @magic_arguments(name="distributed_session")
    @argument("action", choices=["start", "status", "recover", "restart", "stop"], help="What to do.")
    @argument(
        "name", nargs="?", default=None, help="The session's name (start: default s1, s2, ...; else: the latest)."
    )
    @argument("--gpus", type=int, default=None, help="start: number of ranks (default: every GPU, at least 1).")
    @argument("--gpu-type", default=None, help="start: GPU model to require, e.g. H100.")
    @argument("--gpu-ids", default=None, metavar="I,J", help="start: physical GPU indices, one per rank.")
    @argument(
        "--cluster",
        default=None,
        metavar="ADDRESS",
        help="start: run the ranks on a Ray cluster ('auto', 'ray://host:10001' or host:port).",
    )
    @argument(
        "--idle-timeout",
        default=None,
        metavar="S",
        help="start: stop the session after S seconds without a cell "
        "(default: DistributedMagics.session_idle_timeout_s, None = never).",
    )
    @argument("--no-widgets", action="store_true", help="start: plain [rank N] text instead of the panel.")
    @argument("--no-mlflow", action="store_true", help="start: no MLflow run (by default one for the session).")
    @argument(
        "--mlflow-per-cell",
        action="store_true",
        help="start: also a child MLflow run per cell, with its params and logs (DistributedMagics.mlflow_per_cell).",
    )
    @argument(
        "--detach",
        action="store_true",
        help="start: run the ranks under your run keeper: the session and its state outlive this kernel, and "
        "%%distributed_attach gives it back in any of your kernels (idle timeout default 2 h).",
    )
    @argument("--all", action="store_true", help="stop: every session of this kernel.")
    @argument("-o", "--output", default=None, metavar="NAME", help="start: store the Session in this variable.")
    @magic_help(
        "%distributed_session",
        examples="""
        %distributed_session start --gpus 2 -o sess     # ranks wait for cells; sess.run_cell(...), sess.pull(...)
        %distributed_session start --gpus 2 --detach    # outlives the kernel: %distributed_attach --last
        %distributed_session status
        %distributed_session recover                    # ranks blocked in a collective return; state kept
        %distributed_session restart                    # fresh ranks (their state is lost)
        %distributed_session stop                       # or: stop NAME, stop --all
        """,
    )
    @line_magic
    def distributed_session(self, line: str):
        """Start, show, restart or stop a live session: ranks that keep their namespace from cell to cell.

        After ``start``, ``%%distributed --session`` cells run on its ranks; each rank keeps what a cell makes
        (models, optimizers, the process group) for the next. The session holds its GPUs until it stops, the
        idle timeout passes, or the kernel ends.
        """
        args = parse_line(self.distributed_session.parser, line, "%distributed_session")
        check_output_name(args.output)
        with as_usage_error(SessionError, SpecError):
            if args.action == "start":
                return self._start(args)
            if args.action == "status":
                return self._status(args.name)
            if args.action == "recover":
                print(find_session(args.name).recover())
                return None
            chosen = [s for s in sessions() if s.state.value != "stopped"] if args.all else [find_session(args.name)]
            for session in chosen:
                session.restart() if args.action == "restart" else session.stop()
                print(session.status())
            if not chosen:
                print("no live session to stop")
            if args.action == "stop":
                for line in release("%distributed_session stop"):  # what the kernel kept warm goes too
                    print(f"sgpu_magic: gave back {line}")
        return None

    def _start(self, args):
        try:
            idle = parse_timeout(args.idle_timeout, None) if args.idle_timeout is not None else None
        except UsageError:
            raise UsageError(
                f"--idle-timeout takes seconds > 0 (or 'none'), e.g. --idle-timeout 600; got {args.idle_timeout!r}"
            ) from None
        session = Session(
            gpus=args.gpus,
            gpu_type=args.gpu_type,
            gpu_ids=parse_gpu_ids(args.gpu_ids),
            cluster=args.cluster,
            idle_timeout=idle if args.idle_timeout is not None else FromConfig("session_idle_timeout_s", None),  # type: ignore[arg-type]
            widgets=False if args.no_widgets else FromConfig("widgets", None),  # type: ignore[arg-type]
            mlflow=False if args.no_mlflow else FromConfig("mlflow", True),  # type: ignore[arg-type]
            mlflow_per_cell=True if args.mlflow_per_cell else FromConfig("mlflow_per_cell", False),  # type: ignore[arg-type]
            name=args.name,
            detach=args.detach,
        )
        if args.output:
            assert self.shell is not None  # a magic runs in the shell it is registered with
            self.shell.user_ns[args.output] = session
        print(session.status())
        return None

    @staticmethod
    def _status(name: str | None) -> None:
        chosen = [find_session(name)] if name else sessions()
        for session in chosen:
            print(session.status())
        if not chosen:
            print("no session in this kernel; start one with %distributed_session start --gpus N")

    @magic_arguments(name="distributed_debug")
    @argument("--rank", type=int, default=None, help="The rank to debug (default: the root cause of the failure).")
    @argument("--session", default=None, metavar="NAME", help="The session (default: the latest live one).")
    @argument("--job", default=None, metavar="ID", help="A failed job (not a session): show what its ranks saved.")
    @magic_help(
        "%distributed_debug",
        examples="""
        %distributed_debug                  # pdb in the root-cause rank of the session's failed cell
        %distributed_debug --rank 1         # in rank 1 instead; q, c or Interrupt leave it
        %distributed_debug --job a1b2c3     # a failed job: its traceback and the failing frame's locals
        """,
    )
    @line_magic
    def distributed_debug(self, line: str) -> None:
        """Post-mortem debugging of one rank: after a live session's cell failed, pdb opens in the rank at the frame
        that raised, with the rank's namespace and its prompt in the notebook (as IPython's %debug); the other
        ranks wait idle, and leaving pdb (q, c, Interrupt) returns everything to idle. For a failed job whose
        ranks are gone, it shows the traceback and the locals the rank saved when it failed."""
        args = parse_line(self.distributed_debug.parser, line, "%distributed_debug")
        if args.job:
            show_saved_failure(args.job, args.rank)
            return
        with as_usage_error(SessionError):
            session = find_session(args.session) if args.session else _session_to_debug()
            if session is not None:
                session.debug(args.rank)
                return
        show_saved_failure(None, args.rank)

    @magic_arguments(name="distributed_push")
    @argument("names", nargs="+", help="Names in the kernel's namespace to copy into every rank's namespace.")
    @argument("--session", default=None, metavar="NAME", help="The session (default: the latest).")
    @magic_help(
        "%distributed_push",
        examples="""
        lr, steps = 1e-3, 100
        %distributed_push lr steps                      # every rank now has its own copy of lr and steps
        """,
    )
    @line_magic
    def distributed_push(self, line: str) -> None:
        """Copy kernel values into every rank's namespace of a live session (by value: later changes in the kernel
        do not reach the ranks until pushed again)."""
        args = parse_line(self.distributed_push.parser, line, "%distributed_push")
        assert self.shell is not None  # a magic runs in the shell it is registered with
        missing = [n for n in args.names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"%distributed_push: no name {', '.join(map(repr, missing))} in the kernel's namespace")
        with as_usage_error(SessionError):
            session = find_session(args.session)
            session.push(**{n: self.shell.user_ns[n] for n in args.names})
        print(f"sgpu_magic: {', '.join(args.names)} copied to the {session.world_size} ranks of session {session.name}")

    @magic_arguments(name="distributed_pull")
    @argument("name", help="The name to read from the ranks' namespaces.")
    @argument("--rank", type=int, default=None, help="Only this rank's value (default: a list, one per rank).")
    @argument("--session", default=None, metavar="NAME", help="The session (default: the latest).")
    @argument("-o", "--output", default=None, metavar="NAME", help="Also store the value in this kernel variable.")
    @magic_help(
        "%distributed_pull",
        examples="""
        %distributed_pull loss                          # [2.31, 2.29]: one value per rank
        %distributed_pull model_state --rank 0 -o state # rank 0's value, tensors on the CPU, as `state`
        """,
    )
    @line_magic
    def distributed_pull(self, line: str):
        """Copy a value from the ranks of a live session into the kernel (tensors on the CPU): one rank's with
        ``--rank``, else a list with one value per rank. The value is the magic's output."""
        args = parse_line(self.distributed_pull.parser, line, "%distributed_pull")
        check_output_name(args.output)
        with as_usage_error(SessionError):
            value = find_session(args.session).pull(args.name, rank=args.rank)
        if args.output:
            assert self.shell is not None  # a magic runs in the shell it is registered with
            self.shell.user_ns[args.output] = value
        return value


def _latest_failed_job():
    """The kernel's latest failed job (not a session cell), or ``None``."""
    from sgpu_magic.job.handle import jobs
    from sgpu_magic.job.state import JobState

    failed = [job for job in jobs() if job.state is JobState.FAILED and job.title.startswith("job ")]
    return failed[-1] if failed else None


def _session_to_debug():
    """The live session whose last cell failed, when that failure is the kernel's latest (a job that failed after
    it is what ``%distributed_debug`` looks at then); ``None``: debug the latest failed job."""
    session = current_session()
    cell = session.last_failed_cell() if session is not None else None
    if cell is None:
        job = _latest_failed_job()
        return session if job is None else None  # no failed job either: the session says there is nothing
    job = _latest_failed_job()
    if job is not None and (job.status.ended_s or 0.0) > (cell.status.ended_s or 0.0):
        return None
    return session


def _failed_job(job_id: str | None):
    """The job ``%distributed_debug --job`` names, else the kernel's latest failed job (none: a UsageError)."""
    from sgpu_magic.front.job_table import find_job

    if job_id:
        return find_job(job_id)
    job = _latest_failed_job()
    if job is None:
        raise UsageError(
            "no failed cell or job to debug in this kernel; %distributed_debug opens pdb in a live session's rank "
            "after one of its cells failed (--session NAME), or shows what a failed job's ranks saved (--job ID)"
        )
    return job


def show_saved_failure(job_id: str | None, rank: int | None) -> None:
    """A failed job's ranks are gone: print the root-cause rank's (or ``rank``'s) traceback and saved locals."""
    from sgpu_magic.errors import RankFailedError, SgpuError

    job = _failed_job(job_id)
    error = job.exception()
    if rank is None:
        rank = error.root_cause.rank if isinstance(error, RankFailedError) else job.ranks[0]
    with as_usage_error(IndexError, SgpuError):
        saved = job.failure_locals(rank)
    print(
        f"sgpu_magic: the ranks of {job.title} are gone (it was not a live session), so no debugger can attach; "
        f"what rank {rank} saved when it failed (--job ID for another job, --session NAME for a session's cell):"
    )
    if isinstance(error, RankFailedError):
        failure = next((f for f in [error.root_cause, *error.others] if f.rank == rank), None)
        if failure is not None and failure.traceback:
            print(failure.traceback.rstrip())
    print(f"locals of the failing frame (job.failure_locals({rank})):")
    for name, text in saved.items():
        print(f"  {name} = {text}")
    if not saved:
        print("  (none)")
