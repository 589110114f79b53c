"""Live distributed sessions: N ranks that keep their state from cell to cell.

Example::

    from sgpu_magic import Session

    sess = Session(gpus=2)                       # ranks start from the warm forkserver and wait for cells
    sess.run_cell("import torch\\nw = torch.ones(3) * int(__import__('os').environ['RANK'])")
    sess.run_cell("w.sum().item()")              # [0.0, 3.0]: each rank kept its own w
    sess.push(lr=0.1)                            # kernel value -> every rank's namespace
    sess.pull("w", rank=1)                       # tensor([1., 1., 1.])
    sess.stop()

The same from magics: ``%distributed_session start --gpus 2``, ``%%distributed --session``,
``%distributed_push``, ``%distributed_pull`` (see :mod:`sgpu_magic.front.session_magics`). Each cell, and each
``sess.run(fn)``, is a :class:`~sgpu_magic.job.handle.Job` (panel, logs, results, MLflow child run).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from sgpu_magic import capture
from sgpu_magic.errors import (
    CaptureError,
    CellInterruptedError,
    JobCancelledError,
    JobTimeoutError,
    LauncherError,
    RankFailedError,
    SessionError,
    SpecError,
)
from sgpu_magic.front.decorator import make_sinks
from sgpu_magic.front.sessions import next_name, register, sessions
from sgpu_magic.front.spec_options import FromConfig, job_spec, resolve_config
from sgpu_magic.job.follow import JobSink
from sgpu_magic.job.handle import Job
from sgpu_magic.session.core import SessionCore, SessionState
from sgpu_magic.spec import LaunchSpec, check_profile_steps, check_timeout, shown
from sgpu_magic.wire import StopReason
from sgpu_magic.wire.payload import Payload
from sgpu_magic.wire.session import Pull, Push, SessionRecord

DETACHED_IDLE_TIMEOUT_S = 7200.0
"""A detached session's idle timeout unless one is given (2 h): its ranks end after this long without a cell, also
when no kernel is attached (each rank counts it itself)."""


class Session:
    """A live distributed session: ``gpus`` rank processes that keep one namespace each from cell to cell.

    Args:
        gpus: number of ranks (one GPU each; CPU ranks with gloo without GPUs). Default: every GPU, at least 1.
        gpu_type: GPU model to require (as ``@distributed``). Default ``None``: any.
        gpu_ids: physical GPU indices, one per rank. Default ``None``: any free GPUs.
        cluster: run the ranks on a Ray cluster (``"auto"``, ``"ray://head:10001"`` or a GCS ``host:port``), as
            ``@distributed(cluster=...)``: one actor per rank in a placement group, kept for the session's life
            (see the Ray guide page for its limits). Default ``None``: this machine's ranks.
        idle_timeout: stop the session after this many seconds without a cell (its GPUs are released);
            ``None``: never. Default: ``%config DistributedMagics.session_idle_timeout_s`` (``None``).
        widgets: the panel (True), plain text (False) or decide (None), as for ``@distributed``.
        mlflow: track the session as one MLflow run (the ranks' metrics land in it, from every cell). Default True.
        mlflow_per_cell: also a child run per cell, with the cell's params and logs (made and ended off the cell's
            path). Default: ``%config DistributedMagics.mlflow_per_cell`` (False): a cell costs no MLflow write.
        name: the session's name (``%%distributed --session NAME``). Default ``s1``, ``s2``, ...
        auto_recover: when ranks of an interrupted cell do not return and each waits in a ``torch.distributed``
            call, :meth:`recover` at once (the cell's error says so). Default:
            ``%config DistributedMagics.session_auto_recover`` (True).
        detach: run the ranks under the user's run keeper, so the session and every rank's state outlive the
            kernel: :func:`sgpu_magic.attach` in any kernel of the user gives the Session back (its cells run on the
            same ranks). A detached session's idle timeout is :data:`DETACHED_IDLE_TIMEOUT_S` (2 h) unless
            ``idle_timeout`` is given: one never reattached cannot hold its GPUs for ever. With ``cluster`` the
            keeper drives the rank actors on the Ray cluster (named, so the attaching kernel finds them).
            Default False.

    The ranks start at once (from the launch host's warm forkserver, or in Ray actors with ``cluster``), hold their
    GPU leases (or the cluster's bundles) until the session stops, and end with the kernel. Raises
    :class:`~sgpu_magic.errors.SpecError` for bad options, :class:`~sgpu_magic.errors.ResourceError` when the
    cluster cannot be reached (``cannot connect to the Ray cluster ...``) or is too small, and
    :class:`~sgpu_magic.errors.SessionError` when the ranks could not start.
    """

    def __init__(
        self,
        gpus: int | None = None,
        gpu_type: str | None = None,
        gpu_ids: Sequence[int] | None = None,
        cluster: str | None = None,
        idle_timeout: float | None = FromConfig("session_idle_timeout_s", None),  # type: ignore[assignment]
        widgets: bool | None = FromConfig("widgets", None),  # type: ignore[assignment]
        mlflow: bool = FromConfig("mlflow", True),  # type: ignore[assignment]
        name: str | None = None,
        mlflow_per_cell: bool = FromConfig("mlflow_per_cell", False),  # type: ignore[assignment]
        auto_recover: bool = FromConfig("session_auto_recover", True),  # type: ignore[assignment]
        detach: bool = False,
    ) -> None:
        spec = job_spec(
            "session",
            gpus,
            gpu_type,
            None,
            widgets=resolve_config(widgets),
            mlflow=resolve_config(mlflow),
            gpu_ids=gpu_ids,
            stuck_after_s=None,  # a session's ranks wait quietly for cells
            cluster=cluster,
            detach=detach,
        )
        idle_timeout_s = check_timeout(resolve_config(idle_timeout), "idle_timeout")
        if spec.detach and idle_timeout_s is None:
            idle_timeout_s = DETACHED_IDLE_TIMEOUT_S
        self._setup(spec, self._unique_name(name), idle_timeout_s, mlflow_per_cell, auto_recover)
        self._core.start()

    def _setup(
        self, spec: LaunchSpec, name: str, idle_timeout_s: float | None, mlflow_per_cell: object, auto_recover: object
    ) -> None:
        self.name = name
        lease_dir = resolve_config(FromConfig("lease_dir", "")) or None
        self._core = SessionCore(spec, self._sinks, self.name, idle_timeout_s, lease_dir)
        self._core.mlflow_per_cell = bool(resolve_config(mlflow_per_cell))
        self.auto_recover = bool(resolve_config(auto_recover))
        self._core.on_idle_stop = self._announce
        self._max_capture_bytes = int(resolve_config(FromConfig("max_capture_bytes", capture.DEFAULT_MAX_BYTES)))
        register(self)

    @classmethod
    def attached(cls, job: Job, record: SessionRecord) -> Session:
        """The Session of a detached session that another kernel started, taken over through its session job
        ``job`` (attached: :func:`sgpu_magic.attach`) and its session record (name, idle timeout).

        Raises:
            SessionError: this kernel runs a session of that name already.
        """
        session = cls.__new__(cls)
        cls._take_over(session, job, record)
        return session

    def _take_over(self, job: Job, record: SessionRecord) -> None:
        self._setup(
            replace(job.spec, name="session"),
            self._unique_name(record.name),
            record.idle_timeout_s,
            FromConfig("mlflow_per_cell", False),
            FromConfig("session_auto_recover", True),
        )
        self._core.adopt(job)

    @staticmethod
    def _unique_name(name: str | None) -> str:
        if name is None:
            return next_name()
        if not isinstance(name, str) or not name.isidentifier():
            raise SpecError(f"a session name is a Python identifier such as 'train'; got {shown(name)}")
        clash = [s for s in sessions() if s.name == name and s.state is not SessionState.STOPPED]
        if clash:
            raise SessionError(
                f"session {name!r} is already running in this kernel; stop it first (%distributed_session stop {name}) "
                f"or choose another name"
            )
        return name

    # -- what it is

    @property
    def state(self) -> SessionState:
        """:class:`~sgpu_magic.session.core.SessionState`: ``starting``, ``idle``, ``busy``, ``broken``, ``stopped``."""
        return self._core.state

    @property
    def world_size(self) -> int:
        return self._core.world_size

    @property
    def jobs(self) -> list[Job]:
        """One :class:`~sgpu_magic.job.handle.Job` per cell or ``run``, oldest first: the last 100
        (:data:`~sgpu_magic.session.core.KEPT_CELLS`). A cell is not one of the kernel's jobs
        (:func:`~sgpu_magic.job.registry.jobs`): ``%distributed_jobs`` lists the one that runs under its session, and
        ``%distributed_stop`` and ``%distributed_stacks`` find it there."""
        return list(self._core.jobs)

    @property
    def job(self) -> Job | None:
        """The session's own job: its ranks (``job.run_dir`` holds the session's channel)."""
        return self._core.job

    @property
    def pids(self) -> dict[int, int]:
        """``{rank: process id}`` of the live ranks."""
        return dict(self._core.pids)

    @property
    def broken(self) -> str | None:
        """Why the session needs a restart, or ``None``."""
        return self._core.broken

    def __repr__(self) -> str:
        return f"<Session {self.name} {self.state.value} world_size={self.world_size} cells={self._core.cells_run}>"

    def check_usable(self) -> None:
        """Raise :class:`~sgpu_magic.errors.SessionError` (saying why and what to do) unless a cell can run now."""
        self._core.check_usable()

    # -- cells

    def _sinks(self, spec: LaunchSpec, parent_run: JobSink | None) -> list[JobSink]:
        return make_sinks(spec, None, parent_run)

    def _announce(self, message: str) -> None:
        jobs = self._core.jobs or ([self._core.job] if self._core.job is not None else [])
        view = jobs[-1].view if jobs else None
        if view is not None and hasattr(view, "note"):
            view.note(message)

    def follow(self, job: Job) -> list[Any]:
        """Follow a cell's job (from :meth:`submit_cell`) to its end in the calling thread; its values (one per rank
        run), or its error in the session's words (see :meth:`run_cell`). Ranks left blocked in a collective are
        released first when :attr:`auto_recover` allows (the error then says what :meth:`recover` did)."""
        try:
            job.follow()
            return job.result()
        except JobCancelledError as exc:
            raise CellInterruptedError(self._interrupted_message(job, exc)) from None
        except JobTimeoutError:
            recovered = self._auto_recover()
            if self._core.broken is not None:
                raise SessionError(
                    f"{job.spec.name} ran longer than its timeout of {job.spec.timeout_s:g} s and was interrupted, "
                    f"but {self._core.broken}"
                ) from None
            raise JobTimeoutError(
                f"{job.spec.name} ran longer than its timeout of {job.spec.timeout_s:g} s and was interrupted; "
                + (f"{recovered}. " if recovered else "the ranks kept their state. ")
                + f"Logs: {job.run_dir}"
            ) from None
        except LauncherError as exc:
            recovered = self._auto_recover()
            if recovered:
                return self._failed_then_recovered(job, recovered)
            if self._core.broken is not None:
                raise SessionError(self._core.broken) from None
            raise SessionError(str(exc)) from None

    def _auto_recover(self) -> str | None:
        """:meth:`recover` when ranks are left blocked, each in a ``torch.distributed`` call, and
        :attr:`auto_recover` is on; its report, else ``None`` (also when it failed: :attr:`broken` says why)."""
        stuck = self._core.stuck
        if not self.auto_recover or stuck is None or not stuck.in_collectives or not self._core.can_recover:
            return None
        try:
            return self._core.recover()
        except SessionError:
            return None

    def _failed_then_recovered(self, job: Job, recovered: str) -> list[Any]:
        """A cell that failed on a rank while others waited for it, after those were released: the
        :class:`RankFailedError` naming the root cause, with what recover did as its hint."""
        from sgpu_magic.job.outcome import failure_from_status
        from sgpu_magic.rundir import RunDir
        from sgpu_magic.status import HostStatus

        rd = RunDir(job.run_dir)
        error = failure_from_status(rd, HostStatus.read(rd), self.world_size)
        error.hint = recovered
        raise error from None

    def _interrupted_message(self, job: Job, exc: BaseException) -> str:
        recovered = self._auto_recover()
        if recovered:
            return f"{job.spec.name} was interrupted; {recovered}. Logs: {job.run_dir}"
        if self._core.broken is not None:
            return f"{job.spec.name} was interrupted, but {self._core.broken}"
        return f"{job.spec.name} was interrupted; the ranks and their state are kept. Logs: {job.run_dir}"

    def submit_cell(
        self,
        source: str,
        namespace: dict[str, Any],
        ranks: Sequence[int] | None = None,
        timeout: float | None = None,
        filename: str | None = None,
        display_name: str | None = None,
        quiet: bool = False,
        profile: int | None = None,
    ) -> Job:
        """The Job of one cell, launched on the session's ranks (the caller follows it). See :meth:`run_cell`;
        ``profile``: as :meth:`profile`'s ``steps``."""
        chosen, timeout_s = self._core.check_ranks(ranks), check_timeout(timeout)
        profile_steps = check_profile_steps(profile)
        label = f"session {self.name} cell {self._core.cells_run + 1}"
        filename = filename or f"<{label}>"

        def build(skip: set[str], warn: Callable[[str], None]) -> Payload:
            payload = capture.capture_cell(
                source,
                namespace,
                self._max_capture_bytes,
                warn,
                skip=skip,
                ranks=len(chosen),
                filename=filename,
                quiet=quiet,
            )
            payload.display_names = {filename: display_name or label}
            return payload

        return self._core.run_job(build, chosen, timeout_s, label, profile_steps)

    def profile(
        self, source: str, steps: int = 5, ranks: Sequence[int] | None = None, timeout: float | None = None
    ) -> Job:
        """Run ``source`` as :meth:`run_cell` does, profiling ``steps`` of its steps on every rank it runs on
        (``torch.profiler``; steps as ``runtime.step()`` or the first optimizer's ``step()`` mark them, after one
        step of wait and one of warm-up: :mod:`sgpu_magic.rank.profile`); the cell's output ends with the table of
        each rank's time in compute, collectives, data loading and idle, and the top 10 ops.

        Returns:
            The cell's :class:`~sgpu_magic.Job` once it has ended: ``job.results``, ``job.profile_summary()``,
            ``job.profile_trace()`` (the merged Chrome/Perfetto trace).

        Raises:
            SpecError: ``steps`` is not an int in 1..1000. Otherwise as :meth:`run_cell`.
        """
        job = self.submit_cell(source, _user_namespace(), ranks, timeout, profile=steps)
        self.follow(job)
        return job

    def run_cell(self, source: str, ranks: Sequence[int] | None = None, timeout: float | None = None) -> list[Any]:
        """Run ``source`` on the ranks (all, or ``ranks``) in their namespaces; block until each is done.

        Names a rank lacks are captured from the kernel's namespace by value (as for jobs); names it has win.

        Args:
            source: Python code (no IPython syntax); its last expression's value comes back.
            ranks: the ranks to run it on, e.g. ``[0]``; default every rank.
            timeout: seconds before the cell is interrupted (the ranks and their state stay); ``None``: no limit.

        Returns:
            one value per rank run, in rank order (tensors on the CPU).

        Raises:
            RankFailedError: the cell raised on a rank (the ranks stay; the root cause's traceback is shown).
            CellInterruptedError: (a KeyboardInterrupt) the cell was interrupted; the state is kept.
            JobTimeoutError: the cell ran past ``timeout`` (it was interrupted; the state is kept).
            SessionError: the session is stopped or broken, or a rank is outside its world.
        """
        return self.follow(self.submit_cell(source, _user_namespace(), ranks, timeout))

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank of the live session; one value per rank, in rank order.

        ``fn`` is a plain function or an ``@distributed`` one (its ``fn.distributed()`` stays a fresh job); its
        globals are the rank's namespace, so it sees what earlier cells made there. Raises as :meth:`run_cell`,
        and :class:`~sgpu_magic.errors.CaptureError` for an argument that cannot be sent (nothing runs).
        """
        fn = getattr(fn, "__sgpu_function__", fn)
        problem = capture.function_problem(fn)
        if problem is not None:
            raise SpecError(f"Session.run takes a function: {problem}")
        call = f"{self.name}.run({getattr(fn, '__name__', 'fn')})"
        args_bytes, kwargs_bytes = capture.capture_arguments(call, args, kwargs)
        label = f"session {self.name} cell {self._core.cells_run + 1} ({getattr(fn, '__qualname__', 'function')})"
        chosen = self._core.check_ranks(None)

        def build(skip: set[str], warn: Callable[[str], None]) -> Payload:
            payload = capture.capture_function(fn, self._max_capture_bytes, warn, skip=skip, ranks=len(chosen))
            payload.args, payload.kwargs = args_bytes, kwargs_bytes
            return payload

        return self.follow(self._core.run_job(build, chosen, None, label))

    def has_failed_cell(self) -> bool:
        """Whether the session's last cell failed (``%distributed_debug`` then debugs it)."""
        from sgpu_magic.job.state import JobState

        return bool(self._core.jobs) and self._core.jobs[-1].state is JobState.FAILED

    def last_failed_cell(self) -> Job | None:
        """The session's last cell if it failed, else ``None``."""
        from sgpu_magic.job.state import JobState

        last = self._core.jobs[-1] if self._core.jobs else None
        return last if last is not None and last.state is JobState.FAILED else None

    def last_failure_rank(self) -> int:
        """The root-cause rank of the session's last cell if it failed.

        Raises:
            SessionError: the last cell did not fail (or no cell ran).
        """

        last = self.last_failed_cell()
        if last is None:
            raise SessionError(
                f"the last cell of session {self.name} did not fail: there is nothing to debug "
                f"(%distributed_debug opens pdb where a failed cell raised)"
            )
        error = last.exception()
        return error.root_cause.rank if isinstance(error, RankFailedError) else last.ranks[0]

    def debug(self, rank: int | None = None) -> None:
        """pdb in one rank at the frame where the session's last cell failed (default: its root-cause rank), with
        its prompt in the notebook (``input()``, as IPython's ``%debug``) and the rank's namespace; the other ranks
        stay idle. ``q``, ``c`` or an interrupt leave it. The line that says so comes once the rank has opened pdb.

        Raises:
            SessionError: the last cell did not fail, ``rank`` is outside the world or its last cell did not fail,
                or the session is stopped, broken or busy.
        """
        chosen = self.last_failure_rank() if rank is None else self._core.check_ranks([rank], example="--rank 0")[0]
        write, read_line = self._core.debug_io
        banner = [f"sgpu_magic: pdb in rank {chosen} of session {self.name}, where its last cell failed (q leaves it)"]

        def say_first() -> None:
            if banner:
                print(banner.pop())

        def shown(text: str) -> None:
            say_first()
            write(text)

        def asked(prompt: str) -> str:
            say_first()
            return read_line(prompt)

        self._core.debug(chosen, shown, asked)

    # -- values

    def push(self, **values: Any) -> None:
        """Copy kernel values into every rank's namespace: ``sess.push(lr=1e-3, steps=10)``.

        Raises:
            CaptureError: a value cannot be pickled (nothing is sent; the message names it).
            SessionError: the session is stopped, broken or busy.
            KeyboardInterrupt: interrupted while pickling (nothing sent), or while sending, after every rank has
                the values (the message says so); a second interrupt gives up at once.
        """
        if not values:
            raise SessionError("push needs at least one name=value, e.g. sess.push(lr=1e-3)")
        data = {}
        for name, value in values.items():
            try:
                data[name] = capture.dumps(value)
            except Exception as exc:  # noqa: BLE001 - any pickling failure is the user's value: said with its name
                raise CaptureError(
                    f"{name!r} is a {capture.type_name(value)}, which cannot be pushed to the ranks of session "
                    f"{self.name} ({type(exc).__name__}: {exc}); create it in the ranks instead, in a "
                    f"%%distributed --session cell. Nothing was sent."
                ) from None
        self._core.request(Push(data), self._core.check_ranks(None), f"the push of {', '.join(values)}")

    def pull(self, name: str, rank: int | None = None) -> Any:
        """A value from the ranks' namespaces: rank ``rank``'s (tensors on the CPU), or a list, one per rank.

        Raises:
            SessionError: a rank has no such name (the message names the rank), the value cannot be pickled on the
                rank or rebuilt in the kernel (a DDP model: pull its ``module.state_dict()``), a rank outside the
                world, or the session is stopped, broken or busy.
            KeyboardInterrupt: as for :meth:`push` (the pull completes first).
        """
        ranks = self._core.check_ranks(None if rank is None else [rank], example="--rank 0")
        request = self._core.request(Pull(name), ranks, f"the pull of {name}")
        for r in ranks:
            reply = request.replies[r]
            if not reply.ok:
                names = f"; names it has: {', '.join(sorted(reply.names)) or 'none'}"
                raise SessionError(
                    f"{reply.error or 'the pull failed'} in session {self.name}" + (names if reply.missing else "")
                )
        values = [self._unpickle(name, r, request.values[r]) for r in ranks]
        return values[0] if rank is not None else values

    def _unpickle(self, name: str, rank: int, data: bytes) -> Any:
        """A pulled value rebuilt in the kernel; an object that needs the ranks' process group (a DDP model) or
        their modules cannot be, and :class:`~sgpu_magic.errors.SessionError` says what to pull instead."""
        try:
            return pickle.loads(data)
        except Exception as exc:  # noqa: BLE001 - any failure to rebuild it is said with the remedy
            raise SessionError(
                f"{name!r} from rank {rank} of session {self.name} cannot be rebuilt in the kernel "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); pull plain values, tensors "
                f"or a state_dict instead, e.g. run 'state = model.module.state_dict()' on the ranks and pull 'state'"
            ) from None

    # -- life cycle

    def interrupt(self) -> bool:
        """``KeyboardInterrupt`` in the running cell on every rank (from another thread, or the panel's Stop); the
        ranks and their state stay. Returns whether a cell was running."""
        return self._core.interrupt(StopReason.INTERRUPTED)

    def recover(self, timeout_s: float = 10.0) -> str:
        """Release ranks that did not return from an interrupt (blocked in a collective whose peers never
        entered it) and make the world's process group again, keeping every rank's namespace: variables, models
        and optimizers survive. Returns what was done (printed by ``%distributed_session recover``).

        How (:mod:`sgpu_magic.rank.recover`): each rank's control thread closes its connections to the other
        ranks, so a blocked gloo collective raises ``Connection closed by peer`` (NCCL: the communicators are
        aborted); every rank destroys its default process group and calls ``init_process_group`` again with the
        same backend, on the job's rendezvous store under a new prefix; each step bounded by ``timeout_s``
        seconds (default 10). Values that
        were inside the aborted collective may differ between ranks (the report names them); a DDP or FSDP
        wrapper made before holds the old group: wrap the module again. Runs by itself after an interrupt when
        every blocked rank waits in ``torch.distributed`` (:attr:`auto_recover`).

        Raises:
            SessionError: nothing to recover; a session on a Ray cluster; a rank died; a rank blocked outside
                ``torch.distributed`` (e.g. in native code of its own) did not return; each says to restart.
        """
        return self._core.recover(check_timeout(timeout_s, "timeout_s") or 10.0)

    def restart(self) -> None:
        """Stop the ranks (their state is lost) and start fresh ones with the same options."""
        self._core.stop()
        self._core.start()

    def stop(self) -> None:
        """End the session: every rank stopped, GPU leases released, its MLflow run ended. Idempotent."""
        self._core.stop()

    def status(self) -> str:
        """One line: name, state, world size, cells run, and why it is broken if it is."""
        line = f"session {self.name}: {self.state.value}, world_size={self.world_size}, {self._core.cells_run} cell(s)"
        if self._core.job is not None:
            line += f", run dir {self._core.job.run_dir}"
        if self.broken:
            line += f"\n{self.broken}"
        return line


def _user_namespace() -> dict[str, Any]:
    """The kernel's namespace (IPython's ``user_ns``), else ``__main__``'s."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is not None:
        return shell.user_ns
    import __main__

    return vars(__main__)
