"""The kernel's side of a live session: N ranks that keep their namespace from cell to cell.

The session's ranks are one long job of the launch host (payload kind ``session``; see
:mod:`sgpu_magic.rank.session`): started from the warm forkserver, holding the session's GPU leases, stopped
all together when one dies (torch elastic), and ended with the kernel like any job. Each cell is a
:class:`~sgpu_magic.job.handle.Job` of its own (its run directory, logs, panel, MLflow child run, results and
errors) whose launcher is the cell's :class:`~sgpu_magic.session.execution.CellExecution`: launching sends the
cell to the ranks over the session's channel, and the session's reader thread keeps the cell's status from the
ranks' replies in memory (written to its ``status.json`` once, when it ends), so the layers above follow a cell
as they follow a job, without a file or a FIFO in between.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from sgpu_magic._util.interrupts import held_interrupt
from sgpu_magic.errors import SessionError
from sgpu_magic.job.follow import JobSink
from sgpu_magic.job.handle import Job
from sgpu_magic.job.start import start as start_job
from sgpu_magic.job.start import submit
from sgpu_magic.launch.stacks import CodeMap, RankStack, take_stacks
from sgpu_magic.rundir import RunDir
from sgpu_magic.session.channel import Channel, Request, new_channel
from sgpu_magic.session.execution import CellExecution
from sgpu_magic.session.outcome import (
    cell_status,
    death_message,
    mlflow_run,
    recovered_message,
    stuck_message,
)
from sgpu_magic.session.relay import DebugRelay, ReadLine, Write, read_line, write_output
from sgpu_magic.spec import LaunchSpec
from sgpu_magic.status import StatusWriter
from sgpu_magic.wire import RunState, StopReason
from sgpu_magic.wire.payload import Payload, SessionRanks
from sgpu_magic.wire.session import (
    Debug,
    DebugFrame,
    Frame,
    Pull,
    Push,
    Regroup,
    Reply,
    RunCell,
    SessionCommand,
    SessionRecord,
    Stop,
    Ungroup,
)

INTERRUPT_GRACE_S = 5.0
"""How long ranks interrupted in a cell may take to return before the session is declared broken."""

FAILURE_GRACE_S = 5.0
"""How long the other ranks of a cell may go on after one rank raised, before they are interrupted (as torchrun
stops a job's other ranks when one fails: in SPMD code they are most likely waiting for the failed one)."""

READ_TICK_S = 0.1
"""How often the reader thread checks deadlines, the ranks' liveness and the idle timeout when nothing arrives."""

RECOVER_TIMEOUT_S = 10.0
"""How long each step of :meth:`SessionCore.recover` may take (the blocked ranks' return, then each rank's destroy
and re-creation of the process group) before the session is left broken (a restart is then the way on)."""

KEPT_CELLS = 100
"""A session keeps the handles of its last this many cells (:attr:`SessionCore.jobs`); a cell leaves the kernel's
job list (``%distributed_jobs``) when it ends, so a long session's kernel does not grow with its cells."""

LIVE_VIEW_CELLS = 10
"""Of those, the last this many keep their views whole; an older cell's panel drops its closed widget objects
(:meth:`~sgpu_magic.job.handle.Job.release_views`: its snapshot, results, logs and metrics stay), so a long session's
kept cells hold a third of the memory."""


@dataclass
class Stuck:
    """Ranks of a cell that did not return from its interrupt (the session is broken until they do).

    Attributes:
        seq: the cell's request number (their late replies carry it).
        ranks: the ranks that did not return.
        label: the cell's name (``session s1 cell 3``).
        stacks: ``{rank: RankStack}`` taken when the interrupt's grace ended (where each waited).
        returned: the ranks whose late reply has come since.
    """

    seq: int
    ranks: tuple[int, ...]
    label: str
    stacks: dict[int, RankStack]
    returned: set[int] = field(default_factory=set)

    @property
    def in_collectives(self) -> bool:
        """Whether every stuck rank was seen waiting in a ``torch.distributed`` call."""
        return all(r in self.stacks and self.stacks[r].in_collective for r in self.ranks)


class SessionState(enum.Enum):
    """Life cycle of a session: STARTING, IDLE, BUSY (a cell or request runs), BROKEN (needs restart), STOPPED."""

    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    BROKEN = "broken"
    STOPPED = "stopped"


SinkFactory = Callable[[LaunchSpec, "JobSink | None"], list[JobSink]]
"""``(spec, the session's MLflow tracking sink or None) -> sinks`` for the session and for each cell."""


class SessionCore:
    """The ranks, the channel and the reader thread of one session (the public face is
    :class:`sgpu_magic.front.session.Session`).

    Args:
        spec: the session's ranks (``gpus``, ``gpu_type``, ``gpu_ids``, ``widgets``, ``mlflow``); its timeout is
            ignored (a session lives until stopped).
        make_sinks: builds the sinks of the session's job and of each cell (see :data:`SinkFactory`).
        name: the session's name (``%%distributed --session NAME``).
        idle_timeout_s: stop the session after this many seconds without a cell; ``None``: never.
        lease_dir: the GPU lease registry (``None``: the default one).
    """

    def __init__(
        self,
        spec: LaunchSpec,
        make_sinks: SinkFactory,
        name: str,
        idle_timeout_s: float | None = None,
        lease_dir: str | None = None,
    ) -> None:
        self.spec = replace(spec, timeout_s=None, max_restarts=0, name=f"session {name}")
        self.make_sinks, self.name = make_sinks, name
        self.idle_timeout_s, self.lease_dir = idle_timeout_s, lease_dir
        self.job: Job | None = None
        self.jobs: collections.deque[Job] = collections.deque(maxlen=KEPT_CELLS)
        self.cells_run = 0
        """Cells (and ``run`` calls) made so far: the next is cell ``cells_run + 1``."""
        self.state = SessionState.STOPPED
        self.broken: str | None = None
        self.pids: dict[int, int] = {}
        self.on_idle_stop: Callable[[str], None] | None = None
        self.debug_io: tuple[Write, ReadLine] = (write_output, read_line)
        """How a rank's pdb talks to the user: ``(write(text), read_line(prompt))``; the kernel's output and input()."""
        self._names: dict[int, set[str]] = {}
        self._channel: Channel | None = None
        self._request: Request | None = None
        self._seq = 0
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._last_active = time.monotonic()
        self._parent_run: JobSink | None = None
        self.mlflow_per_cell = False
        """Whether each cell gets a child MLflow run of the session's (else a cell makes no MLflow write)."""
        self.stuck: Stuck | None = None
        """The ranks that did not return from the last cell's interrupt (what :meth:`recover` releases)."""
        self._generation = 0

    @property
    def stopped(self) -> bool:
        return self.state is SessionState.STOPPED

    @property
    def world_size(self) -> int:
        return self.spec.gpus

    # -- start and stop

    def start(self) -> None:
        """Start the ranks and wait until each is ready (or the session job fails: :class:`SessionError`)."""
        self.broken, self._names, self.pids, self.stuck = None, {}, {}, None
        self.state = SessionState.STARTING

        def make_channel(rd: RunDir) -> None:
            self._channel = new_channel(rd, self.world_size, self.spec.cluster)
            self._channel.make()

        sinks = self.make_sinks(self.spec, None)
        # a detached session's ranks outlive the kernel, waiting for the next one at most idle_timeout_s
        ranks = SessionRanks(detached=True, idle_timeout_s=self.idle_timeout_s) if self.spec.detach else SessionRanks()
        payload = Payload(ranks)
        self.job = start_job(
            self.spec,
            lambda warn: payload,
            sinks,
            background=True,
            lease_dir=self.lease_dir,
            before_launch=make_channel,
        )
        self.job.title = self.spec.name  # "session s1", in its summary line, panel header and %distributed_jobs
        assert self._channel is not None  # made before the launch
        self._channel.attach(self.job)
        request = self._new_request(tuple(range(self.world_size)))
        self._start_reader(self._channel)
        try:
            self._wait(request)
        except BaseException:
            self._end_job()
            raise
        self.pids = {r: reply.pid for r, reply in request.replies.items() if reply.pid is not None}
        self._parent_run = mlflow_run(sinks)  # made by the session job's launch, which has happened now
        self.state = SessionState.IDLE
        self._last_active = time.monotonic()
        if self.spec.detach:  # what a kernel attaching to it needs beside the job's attach record
            RunDir(self.job.run_dir).write_session(SessionRecord(self.name, self.idle_timeout_s))

    def adopt(self, job: Job) -> None:
        """Take over a detached session that another kernel started (:func:`sgpu_magic.attach`): ``job`` is its
        session job, attached (followed from here; its status names the ranks' pids). The ranks' FIFOs are opened
        again, what the kernel before left unread in the reply FIFOs is dropped, and requests are numbered from the
        clock, so a reply to that kernel's last request cannot answer one of this kernel's."""
        self.broken, self._names, self.stuck, self.pids = None, {}, None, dict(job.status.pids)
        self.job = job
        channel = new_channel(RunDir(job.run_dir), self.world_size, self.spec.cluster)
        channel.reopen()
        channel.attach(job)
        self._channel = channel
        self._seq = time.time_ns() // 1_000_000
        self._parent_run = mlflow_run(job.events.sinks)
        self.state = SessionState.IDLE
        self._last_active = time.monotonic()
        self._start_reader(channel)

    def _start_reader(self, channel: Channel) -> None:
        """The reader thread of this start (or take-over) of the session, on ``channel``."""
        self._reader = threading.Thread(
            target=self._read_loop, args=(channel,), name=f"sgpu_magic session {self.name}", daemon=True
        )
        self._reader.start()

    def stop(self, grace_s: float = 5.0) -> None:
        """Ask idle ranks to leave their loop (a busy or broken session's ranks are stopped outright), then end the
        session's job: every rank gone, leases released, the MLflow run ended. Does nothing once stopped."""
        if self.state is SessionState.STOPPED:
            return
        graceful = self.state is SessionState.IDLE
        self.state = SessionState.STOPPED  # the reader thread ends
        if graceful and self._channel is not None:
            try:
                self._channel.send(tuple(range(self.world_size)), Stop())
            except OSError:
                graceful = False
        self._end_job(grace_s if graceful else 0.0)

    def _end_job(self, grace_s: float = 0.0) -> None:
        self.state = SessionState.STOPPED
        if self.job is not None:
            if grace_s:
                self.job.wait(grace_s)
            if not self.job.done():
                self.job.cancel()
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(READ_TICK_S * 20)  # it ends within a tick (STOPPED); then no read races the close below
        if self._channel is not None:
            self._channel.close()
        with self._lock:
            request, self._request = self._request, None
        if request is not None:
            request.done.set()

    # -- requests

    def _new_request(
        self,
        ranks: tuple[int, ...],
        run_dir: RunDir | None = None,
        writer: StatusWriter | None = None,
        wake: Callable[[], None] | None = None,
    ) -> Request:
        """The session's next request (a cell's with its ``run_dir``, status ``writer`` and follower's ``wake``, made
        whole before the reader thread can see it); :class:`SessionError` while another one runs."""
        with self._lock:
            if self._request is not None:
                raise SessionError(
                    f"session {self.name} is busy with another cell or request; wait for it or interrupt it "
                    f"(%distributed_session status shows it)"
                )
            self._seq += 1
            self._request = Request(self._seq, ranks, run_dir=run_dir, writer=writer, wake=wake)
            return self._request

    def _wait(self, request: Request) -> None:
        """Wait for ``request``'s replies; :class:`SessionError` when the session breaks or stops meanwhile."""
        while not request.done.wait(READ_TICK_S):
            if self._reader is None or not self._reader.is_alive():
                raise SessionError(
                    f"session {self.name} lost its reader thread (see the kernel's log); run %distributed_session "
                    f"restart (or sess.restart()) for fresh ranks"
                )
        if request.missing:
            raise SessionError(self.broken or f"session {self.name} was stopped before every rank replied")

    def check_usable(self) -> None:
        """Raise :class:`SessionError` unless the session can take a cell now."""
        if self.state is SessionState.BROKEN:
            raise SessionError(self.broken or f"session {self.name} is broken")
        if self.state is SessionState.STOPPED:
            raise SessionError(
                f"session {self.name} is stopped; start it again with %distributed_session restart "
                f"(or sess.restart()): fresh ranks, empty namespaces"
            )

    def check_ranks(self, ranks: Sequence[int] | None, example: str = "--ranks 0,1") -> tuple[int, ...]:
        """The ranks a cell runs on (all by default); :class:`SessionError` naming a rank outside the world, with
        ``example`` as the option to give (``--rank 1`` where one rank is asked for)."""
        if ranks is None:
            return tuple(range(self.world_size))
        chosen = tuple(sorted(set(ranks)))
        bad = [r for r in chosen if not isinstance(r, int) or not 0 <= r < self.world_size]
        if bad or not chosen:
            raise SessionError(
                f"ranks {list(ranks)} are not in session {self.name} (world_size={self.world_size}); give ranks "
                f"from 0 to {self.world_size - 1}, e.g. {example}"
            )
        return chosen

    def names_everywhere(self, ranks: tuple[int, ...]) -> set[str]:
        """Names that every one of ``ranks`` has in its namespace (the kernel need not send them)."""
        sets = [self._names.get(r, set()) for r in ranks]
        return set.intersection(*sets) if sets else set()

    def request(self, cmd: Push | Pull, ranks: tuple[int, ...], what: str) -> Request:
        """Send a push or pull (``what``: ``the push of big``, for messages) to ``ranks`` and wait for every reply.

        An interrupt meanwhile is held until the ranks have replied (a rank does not stop in the middle of a
        push or pull, and a frame cut in two would leave its channel out of step), then raised as
        ``KeyboardInterrupt`` saying that the request completed; a second interrupt gives up at once: while
        sending, the session is then broken (restart); while waiting, their late replies are dropped.

        Raises:
            SessionError: the session is not usable, or it broke or stopped meanwhile.
            KeyboardInterrupt: interrupted (see above).
        """
        self.check_usable()
        request = self._new_request(ranks)
        self.state = SessionState.BUSY
        with held_interrupt() as interrupted:
            self._send(request, cmd, what)
            try:
                self._wait(request)
            except KeyboardInterrupt:
                self._abandon(request)
                if self.state is SessionState.BUSY:
                    self.state = SessionState.IDLE
                raise KeyboardInterrupt(
                    f"{what} was given up on a second interrupt; the ranks finish it in their own time"
                ) from None
        if interrupted():
            raise KeyboardInterrupt(f"{what} was interrupted after it reached the ranks: it completed on every rank")
        return request

    def debug(self, rank: int, write: Callable[[str], None], read_line: Callable[[str], str]) -> None:
        """pdb in rank ``rank`` at the frame where its last cell failed: ``write(text)`` shows its output,
        ``read_line(prompt)`` asks the user for each line (``q`` on an interrupt or end of input). The other
        ranks stay idle. Raises :class:`SessionError` when the rank's last cell did not fail."""
        ranks = self.check_ranks([rank], example="--rank 0")
        self.check_usable()
        request = self._new_request(ranks)
        self.state = SessionState.BUSY
        assert self._channel is not None  # usable: started
        self._channel.send(ranks, Debug(), request.seq)
        DebugRelay(self._channel, write, read_line).serve(request, block=True)
        reply = request.replies.get(rank)
        if reply is None or not reply.ok:
            raise SessionError(
                f"{(reply and reply.error) or 'the debugger did not start'} (session {self.name}); "
                f"%distributed_debug opens the debugger after a cell failed"
            )

    # -- cells

    def run_job(
        self,
        build_payload: Callable[[set[str], Callable[[str], None]], Payload],
        ranks: tuple[int, ...],
        timeout_s: float | None,
        label: str,
        profile_steps: int | None = None,
    ) -> Job:
        """Make the Job of one cell (its run directory and sinks); the caller follows it (``job.follow()``).

        ``build_payload(names the ranks have, warn)`` captures the cell; ``warn`` shows a capture warning in the
        cell's view. ``profile_steps``: profile that many of the cell's steps (:mod:`sgpu_magic.rank.profile`)."""
        self.check_usable()
        assert self.job is not None  # usable: started
        spec = replace(
            self.spec,
            timeout_s=timeout_s,
            name=label,
            mlflow=self.spec.mlflow and self.mlflow_per_cell,
            profile_steps=profile_steps,
            detach=False,  # a cell runs on the session's ranks: only the session is a detached run to attach to
        )
        sinks = self.make_sinks(spec, self._parent_run)
        payload = build_payload(self.names_everywhere(ranks), getattr(sinks[-1], "warn", _no_warning))
        if profile_steps is not None:
            payload.profile_steps = profile_steps
        assert self._channel is not None  # usable: started
        relay = DebugRelay(self._channel, *self.debug_io)  # serves runtime.breakpoint() while the cell runs
        execution = CellExecution(
            self.send_cell, self.interrupt, lambda: not self.stopped, str(self.job.run_dir), ranks, timeout_s, relay
        )
        sinks.insert(0, relay)
        plan = replace(self.job.plan, candidates=())  # the session holds the GPUs: a cell leases none
        job = submit(
            spec,
            plan,
            payload,
            lambda: execution,
            sinks,
            ranks=ranks,
            lean=True,
            listed=False,
            reserve_of=self.job.run_dir,
            feed=execution.feed,
        )
        job.title = label  # the summary line says "session s1 cell 3 failed ..." (it is shown once the cell ends)
        job.summary_on_success = False  # a cell that succeeded shows its output only, as in IPython
        self.jobs.append(job)
        if len(self.jobs) > LIVE_VIEW_CELLS:  # that cell's panel is long out of sight: its widget objects go
            self.jobs[-LIVE_VIEW_CELLS - 1].release_views()
        self.cells_run += 1
        return job

    def send_cell(self, execution: CellExecution, run_dir: RunDir) -> Request:
        """Hand a cell to its ranks (called by the cell's Job through its :class:`CellExecution`); its request.
        Its status is kept in memory, in the execution's feed, until it ends."""
        self.check_usable()
        feed = execution.feed
        writer = StatusWriter(run_dir, on_error=_record_unwritten, final_only=True, on_change=feed.changed)
        request = self._new_request(execution.ranks, run_dir, writer, feed.wake)
        timeout_s = execution.timeout_s
        request.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.state = SessionState.BUSY
        writer.update(
            state=RunState.RUNNING, started_s=request.started_s, pids={str(r): self.pids[r] for r in execution.ranks}
        )
        with held_interrupt() as interrupted:
            self._send(request, RunCell(str(run_dir.path)), "the cell")
        if interrupted():  # the notebook's Interrupt came while the cell was being sent: it interrupts the cell
            self.interrupt(StopReason.INTERRUPTED)
        return request

    def _send(self, request: Request, cmd: SessionCommand, what: str) -> None:
        """Send ``cmd`` (with ``request``'s seq) to its ranks, inside :func:`held_interrupt` (a frame cut in two
        would leave the channel out of step). A second interrupt cuts it anyway: the session is then broken and the
        ``KeyboardInterrupt`` goes on."""
        assert self._channel is not None  # usable: started
        try:
            self._channel.send(request.ranks, cmd, request.seq)
        except KeyboardInterrupt:
            self.broken = (
                f"session {self.name} is broken: a second interrupt cut {what} in the middle of sending it to "
                f"the ranks; run %distributed_session restart (or sess.restart()) for fresh ranks"
            )
            self.state = SessionState.BROKEN
            self._complete(request, self.broken)
            raise

    def interrupt(self, reason: StopReason = StopReason.INTERRUPTED) -> bool:
        """``KeyboardInterrupt`` in every rank running the current cell; whether a cell was running."""
        with self._lock:
            request = self._request
        if request is None or request.run_dir is None or self._channel is None:
            return False
        request.reason = request.reason or reason
        if request.grace_end is None:
            request.grace_end = time.monotonic() + INTERRUPT_GRACE_S
        for rank in request.missing:
            self._channel.interrupt(rank, self.pids[rank])
        return True

    # -- recovery

    @property
    def can_recover(self) -> bool:
        """Whether :meth:`recover` can reach the ranks' connections (a session on this machine, not on Ray)."""
        return self._channel is not None and self._channel.releases

    def recover(self, timeout_s: float = RECOVER_TIMEOUT_S) -> str:
        """Return the ranks that did not come back from an interrupt (blocked in a collective) to their loop,
        keeping every rank's namespace, and make the world's process group again; a report of what was done.

        Steps, each bounded by ``timeout_s``: every rank's control thread closes its connections to the other
        ranks (gloo's pairs; NCCL: its communicators are aborted), so a blocked collective raises and its cell ends;
        every rank destroys its default process group; every rank (when any had one) calls ``init_process_group``
        with the same backend on the job's rendezvous store under a new prefix (:mod:`sgpu_magic.rank.recover`).

        Raises:
            SessionError: nothing to recover (the session is not broken by ranks that did not return); the session
                runs on a Ray cluster; a rank died (restart); or a step did not finish in time (the session stays
                broken: a rank blocked outside ``torch.distributed`` does not return this way).
        """
        stuck = self.stuck
        if self.state is not SessionState.BROKEN or stuck is None:
            why = self.broken if self.state is SessionState.BROKEN else f"it is {self.state.value}"
            raise SessionError(
                f"session {self.name} has nothing to recover: {why}. recover() releases ranks that did not return "
                f"from an interrupt (a collective waiting for its peers)"
            )
        assert self._channel is not None and self.job is not None  # broken by stuck ranks: started
        if self.job.done():
            raise SessionError(death_message(self.name, self.job))
        started = time.monotonic()
        waiting = tuple(r for r in stuck.ranks if r not in stuck.returned)
        with self._lock:
            self._request = request = Request(stuck.seq, waiting)
        for rank in stuck.returned:
            request.replies[rank] = Reply(stuck.seq, rank, ok=False)
        if not self._channel.releases:
            self._abandon(request)
            raise SessionError(
                f"session {self.name} runs on a Ray cluster, where recover() cannot reach its ranks' connections; "
                f"run %distributed_session restart (or sess.restart()) for fresh ranks (their state is lost)"
            )
        self._channel.release(self.pids)
        if not waiting:
            self._abandon(request)
        elif not self._wait_for(request, timeout_s):
            self._abandon(request)
            raise SessionError(self._not_recovered(stuck, request.missing, timeout_s))
        everyone = tuple(range(self.world_size))
        replies = self._ask(Ungroup(), everyone, timeout_s, stuck)
        backends = sorted({reply.backend for reply in replies if reply.backend})
        backend = backends[0] if backends else None
        if backend is not None:
            self._generation += 1
            replies = self._ask(Regroup(backend, self._generation), everyone, timeout_s, stuck)
            errors = sorted((r.rank, r.error or "") for r in replies if not r.ok)
            if errors:
                self.broken = (
                    f"session {self.name} needs a restart: its process group could not be made again after "
                    f"recover (rank {errors[0][0]}: {errors[0][1]}); run %distributed_session restart "
                    f"(or sess.restart()) for fresh ranks"
                )
                raise SessionError(self.broken)
        self.stuck, self.broken = None, None
        self.state = SessionState.IDLE
        self._last_active = time.monotonic()
        return recovered_message(self.name, stuck, backend, time.monotonic() - started)

    def _wait_for(self, request: Request, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``request``'s replies (read by the reader thread); whether every one came."""
        deadline = time.monotonic() + timeout_s
        while not request.done.wait(READ_TICK_S):
            if time.monotonic() > deadline or self._reader is None or not self._reader.is_alive():
                return False
            if self.job is not None and self.job.done():
                return False
        return not request.missing

    def _abandon(self, request: Request) -> None:
        with self._lock:
            if self._request is request:
                self._request = None

    def _ask(self, cmd: Ungroup | Regroup, ranks: tuple[int, ...], timeout_s: float, stuck: Stuck) -> list[Reply]:
        """One step of :meth:`recover`: ``cmd`` to ``ranks``, every reply within ``timeout_s`` (else
        :class:`SessionError`, the session still broken)."""
        with self._lock:
            self._seq += 1
            self._request = request = Request(self._seq, ranks)
        assert self._channel is not None
        self._channel.send(ranks, cmd, request.seq)
        if not self._wait_for(request, timeout_s):
            self._abandon(request)
            raise SessionError(self._not_recovered(stuck, request.missing, timeout_s, type(cmd).__name__.lower()))
        return [reply for _, reply in sorted(request.replies.items())]

    def _not_recovered(self, stuck: Stuck, missing: list[int], timeout_s: float, step: str = "") -> str:
        if self.job is not None and self.job.done():
            self.broken = death_message(self.name, self.job)
            return self.broken
        ranks = ", ".join(map(str, missing))
        what = (
            f"rank(s) {ranks} did not return within {timeout_s:g} s of their connections to the other ranks being "
            f"closed (blocked outside torch.distributed"
            + (f": {_where(stuck, missing)}" if _where(stuck, missing) else "")
            + ")"
            if not step
            else f"rank(s) {ranks} did not answer {step} within {timeout_s:g} s"
        )
        self.broken = (
            f"session {self.name} could not be recovered: {what}; run %distributed_session restart "
            f"(or sess.restart()) for fresh ranks (their state is lost)"
        )
        return self.broken

    # -- the reader thread

    def _read_loop(self, channel: Channel) -> None:
        """The reader thread of one start of the session: it ends when that start's channel is replaced or closed."""
        try:
            while self.state is not SessionState.STOPPED and self._channel is channel:
                for rank, reply, value in channel.read_ready(READ_TICK_S):
                    self._on_reply(rank, reply, value)
                self._check_deadlines()
                self._check_ranks_alive()
                self._check_idle()
        except Exception as exc:  # noqa: BLE001 - a broken channel breaks the session, said to whoever waits
            if self.state is SessionState.STOPPED or self._channel is not channel:
                return
            self.broken = (
                f"session {self.name} is broken: its channel to the ranks failed ({type(exc).__name__}: {exc}); run "
                f"%distributed_session restart (or sess.restart()) for fresh ranks"
            )
            self.state = SessionState.BROKEN
            request = self._request
            if request is not None:
                self._complete(request, self.broken)

    def _on_reply(self, rank: int, reply: Frame, value: bytes | None) -> None:
        with self._lock:
            request = self._request
        if isinstance(reply, DebugFrame):  # a debugger's output or its request for a line: the reply comes later
            if request is not None and reply.seq == request.seq:
                request.stream.put(reply)
                if request.wake is not None:
                    request.wake()  # the cell's follower serves it (DebugRelay.tick) at once
            return
        self._names[rank] = set(reply.names)
        stuck = self.stuck
        if stuck is not None and reply.seq == stuck.seq and rank in stuck.ranks:
            stuck.returned.add(rank)  # a rank blocked past the interrupt's grace has come back to its loop
        if reply.pid is not None and request is not None and self.state is SessionState.STARTING:
            reply = replace(reply, seq=request.seq)  # a rank's first word answers the start
        if request is None or reply.seq != request.seq:
            return  # a late reply to a request that was given up
        request.replies[rank] = reply
        if value is not None:
            request.values[rank] = value
        if request.run_dir is not None and reply.raised:
            request.failed_at = request.failed_at or time.monotonic()  # the others get FAILURE_GRACE_S
        if not request.missing:
            self._complete(request)

    def _complete(self, request: Request, broken: str | None = None) -> None:
        """End ``request``: the session takes the next one first, then the cell's final status is written (the
        cell's follower wakes on it and may send the next cell at once)."""
        with self._lock:
            if self._request is request:
                self._request = None
        if self.state is SessionState.BUSY:
            self.state = SessionState.IDLE
        self._last_active = time.monotonic()
        if request.writer is not None:
            end, status = cell_status(request, broken)
            request.writer.finish(end, **status)
        request.done.set()

    def _check_deadlines(self) -> None:
        request = self._request
        if request is None:
            return
        now = time.monotonic()
        if request.deadline is not None and now > request.deadline and request.reason is None:
            self.interrupt(StopReason.TIMED_OUT)
        elif request.failed_at is not None and now > request.failed_at + FAILURE_GRACE_S and request.reason is None:
            # the cell has failed; the ranks still in it are most likely waiting for a peer
            self.interrupt(StopReason.FAILED)
        elif request.grace_end is not None and now > request.grace_end and request.missing:
            stuck = self._take_stuck(request)
            recoverable = self._channel is not None and self._channel.releases
            self.broken = stuck_message(self.name, request, INTERRUPT_GRACE_S, FAILURE_GRACE_S, stuck, recoverable)
            self.stuck = stuck
            self.state = SessionState.BROKEN
            self._complete(request, self.broken)

    def _take_stuck(self, request: Request) -> Stuck:
        """The ranks of ``request`` that did not return, and where each waits (py-spy, bounded)."""
        missing = tuple(request.missing)
        code = CodeMap.read(request.run_dir.code_map_file) if request.run_dir is not None else CodeMap()
        try:
            stacks = take_stacks({r: self.pids[r] for r in missing if r in self.pids}, code)
        except Exception:  # noqa: BLE001 - where they wait is a help, not a condition of the message
            stacks = {}
        label = request.run_dir.job_id if request.run_dir is not None else f"request {request.seq}"
        for job in reversed(self.jobs):
            if request.run_dir is not None and job.run_dir == request.run_dir.path:
                label = job.spec.name or label
                break
        return Stuck(request.seq, missing, label, stacks)

    def _check_ranks_alive(self) -> None:
        job = self.job
        if job is None or self.state in (SessionState.BROKEN, SessionState.STOPPED) or not job.done():
            return
        self.broken = death_message(self.name, job)
        self.state = SessionState.BROKEN
        request = self._request
        if request is not None:
            self._complete(request, self.broken)

    def _check_idle(self) -> None:
        if self.idle_timeout_s is None or self.state is not SessionState.IDLE:
            return
        if time.monotonic() - self._last_active < self.idle_timeout_s:
            return
        message = (
            f"session {self.name} stopped after {self.idle_timeout_s:g} s without a cell (idle timeout); its ranks "
            f"and GPUs are released; %distributed_session restart starts it again (fresh state)"
        )
        self.stop()  # ends this loop: the ranks get "stop", and their job ends
        if self.on_idle_stop is not None:
            self.on_idle_stop(message)


def _where(stuck: Stuck, ranks: list[int]) -> str:
    """``rank 0: time.sleep at Cell In[4] line 3`` for the ``ranks`` of ``stuck`` whose stacks were taken."""
    return "; ".join(f"rank {r}: {stuck.stacks[r].where}" for r in ranks if r in stuck.stacks)


def _record_unwritten(exc: OSError) -> None:
    """A cell's final ``status.json`` could not be written (a full disk past the session's reserve): the cell ends as
    its ranks replied (its status is in memory); only its record for post-mortems is missing, which the log says."""
    logging.getLogger("sgpu_magic").warning(f"sgpu_magic: a session cell's status.json could not be written: {exc}")


def _no_warning(text: str) -> None:
    """Where a cell's capture warnings go when its view takes none."""
