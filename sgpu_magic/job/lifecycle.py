"""The machinery half of a :class:`~sgpu_magic.job.handle.Job`: its life from the GPU queue to its end.

:class:`JobLifecycle` leases the job's GPUs (queueing when it may wait), writes ``launch.json`` with what the
sinks prepare and hands the run directory to its launcher, follows the job (the status file through its FIFO, the
rank logs and metrics by offset, the launcher's liveness) and ends it once (:meth:`JobLifecycle._end`, the one
finalize sequence). :class:`~sgpu_magic.job.handle.Job` adds the public surface on top (state, logs, stacks,
metrics, results, wait, cancel); nothing outside ``sgpu_magic.job`` uses this class directly.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from sgpu_magic._util.fs import touch_private
from sgpu_magic.errors import JobCancelledError, LauncherError, ResourceError, SgpuError
from sgpu_magic.job.follow import PUMP_INTERVAL_S, Feed, JobEvents, JobSink, LogPump, MemoryFeed, StatusFeed
from sgpu_magic.job.metrics import MetricsPump
from sgpu_magic.job.outcome import stopped_error
from sgpu_magic.job.registry import forget, register
from sgpu_magic.job.state import JobState
from sgpu_magic.launch.base import Launcher
from sgpu_magic.launch.leases import Lease, LeaseRegistry, foreign_processes
from sgpu_magic.launch.resources import DevicePlan, Gpu
from sgpu_magic.rundir import RunDir, detached_index
from sgpu_magic.spec import LaunchSpec
from sgpu_magic.status import HostStatus, StatusWriter, StuckReport
from sgpu_magic.wire import GPUS_ENV, LaunchRecord, RunState, StopReason
from sgpu_magic.wire.attach import AttachRecord

if TYPE_CHECKING:
    from sgpu_magic.job.handle import Job

HOST_CHECK_S = 0.5
"""How often a followed job checks that its launch host process still runs."""

PREPARING_NOTE_S = 1.0
"""A launch whose ranks have not started after this many seconds says what its launcher is still getting ready."""

CANCEL_WAIT_S = 15.0
"""How long cancelling a job waits for its launcher to report the ranks gone."""


class JobLifecycle:
    """A job's lease, launch, following and end (see the module docstring); the base of :class:`~sgpu_magic.job.handle.Job`."""

    def __init__(
        self,
        run_dir: RunDir,
        spec: LaunchSpec,
        plan: DevicePlan,
        get_host: Callable[[], Launcher],
        sinks: Sequence[JobSink],
        registry: LeaseRegistry | None,
        feed: MemoryFeed | None = None,
    ) -> None:
        self._rd = run_dir
        self.spec = spec
        self.plan = plan
        self._feed: Feed = StatusFeed(run_dir) if feed is None else feed
        self._get_host = get_host
        self._host: Launcher | None = None
        self._registry = registry
        self._lease: Lease | None = None
        self._skipped: dict[str, str] = {}  # free GPUs the last lease try passed over: uuid -> why
        self._sinks = list(sinks)
        self.events = JobEvents(self._sinks)
        self._last_state: JobState | None = None
        self._stuck: StuckReport | None = None
        self._attempt = 1
        self._error: BaseException | None = None
        self._final_status: HostStatus | None = None
        self._parsed: tuple[dict[str, Any] | None, HostStatus] = (None, HostStatus())
        self._cancel = threading.Event()
        self._cancel_reason = StopReason.CANCELLED
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._stamp: tuple[Any, ...] | None = None
        self._last_pump = 0.0
        self._host_checked = 0.0
        self._launched_at = 0.0  # time.monotonic() of the hand-over to the launcher
        self._said_preparing = False
        self._logs = LogPump([run_dir.log_file(r) for r in range(plan.world_size)], self.events)
        self._metrics = MetricsPump([run_dir.metrics_file(r) for r in range(plan.world_size)])
        self._cwd: str = ""  # the caller's working directory and sys.path, taken by Job.start
        self._sys_path: list[str] = []
        self.background = False
        self.submitted_s = time.time()
        self.waited_s = 0.0
        self.pending_reason = ""

    job_id = property(lambda self: self._rd.job_id)
    world_size = property(lambda self: self.plan.world_size)

    @property
    def _handle(self) -> Job:
        """The :class:`~sgpu_magic.job.handle.Job` this is the machinery of (itself): what the sinks are given."""
        return cast("Job", self)

    @property
    def ended(self) -> bool:
        """Whether the job's end was seen and its sinks told (its final status is kept; no file is read)."""
        return self._final_status is not None

    def request_cancel(self, _reason: StopReason = StopReason.CANCELLED) -> None:
        """Ask for every rank to stop (or a pending job to leave the queue), without waiting.

        Safe from any thread (the panel's Stop button)."""
        self._cancel_reason = _reason
        self._cancel.set()
        if self._final_status is None and self._host is not None:
            try:
                self._host.cancel(self._rd, _reason)
            except LauncherError:
                pass

    def _status(self, stamp: tuple[Any, ...] | None = None) -> HostStatus:
        """The job's status as last written (the final one once the job has ended); ``stamp``: the status
        file's :meth:`StatusFeed.stamp` if the caller has just taken it.

        Raises:
            RecordError: the file holds a state this version does not know (:meth:`HostStatus.from_dict`).
        """
        if self._final_status is not None:
            return self._final_status
        raw = self._feed.read(stamp)
        if raw is not self._parsed[0]:  # the feed hands the same object until the file changes
            self._parsed = (raw, HostStatus.from_dict(raw))
        return self._parsed[1]

    def _end_unstarted(self, reason: StopReason) -> None:
        """End the job for ``reason`` unless it has ended already (the launcher was never asked, or was too late)."""
        if not self._status().final:
            self._write_final(reason)

    def _try_lease(self) -> bool:
        """One attempt at the GPUs (no queueing unless the job may wait). True when the job may launch."""
        if not self.plan.needs_lease or self._lease is not None:
            return True
        assert self._registry is not None  # a job whose plan needs a lease is given the registry (job.start)
        lease, why = self._registry.try_acquire(
            self.job_id,
            self.world_size,
            list(self.plan.candidates),
            explicit=self.plan.explicit,
            skip=self._skip,
            enqueue=self.spec.wait,
        )
        if lease is None:
            if not self.spec.wait:
                self._error = ResourceError(
                    f"job {self.job_id} cannot start now: {why}. Leave out --no-wait / wait=False to queue for the GPUs"
                )
                # refused before anything started: not one of the kernel's jobs (nor an ended one that pushes the
                # oldest ended job out of the list)
                forget(self)
                self._write_final(RunState.FAILED, launch_error=why)
                raise self._error
            self._set_pending(why)
            return False
        self._got_lease(lease)
        return True

    def _skip(self, free: list[Gpu]) -> dict[str, str]:
        busy = {} if self.plan.explicit else foreign_processes(free)
        self._skipped = busy
        return busy

    def _set_pending(self, why: str) -> None:
        self.pending_reason = why
        self.events.pending(self._handle, why)

    def _wait_for_lease(self) -> None:
        assert self._registry is not None  # only a job whose plan needs a lease waits for one (_try_lease)

        def on_wait(why: str) -> None:
            if why != self.pending_reason:
                self._set_pending(why)

        self._got_lease(
            self._registry.acquire(
                self.job_id,
                self.world_size,
                list(self.plan.candidates),
                explicit=self.plan.explicit,
                skip=self._skip,
                on_wait=on_wait,
                cancelled=self._cancel,
            )
        )

    def _got_lease(self, lease: Lease) -> None:
        self._lease = lease
        self.waited_s = time.time() - self.submitted_s if self.pending_reason else 0.0
        self.pending_reason = ""
        self.plan = self.plan.with_gpus(lease.gpus)
        by_uuid = {g.uuid: g for g in self.plan.candidates}
        for uuid, reason in self._skipped.items():
            self.events.warn(
                f"GPU {by_uuid[uuid].index} skipped: it runs processes outside sgpu_magic "
                f"({reason}); pass gpu_ids=[...] / --gpu-ids to use it anyway"
            )

    def _launch_record(self) -> LaunchRecord:
        """``launch.json`` as the job's spec and plan make it (before the sinks add theirs)."""
        rd, plan, spec = self._rd, self.plan, self.spec
        lease_dir = None
        if self._lease is not None:  # the launch host gives the GPUs back as soon as the ranks are gone
            assert self._registry is not None  # the lease came from it
            lease_dir = str(self._registry.dir)
        return LaunchRecord(
            job_id=rd.job_id,
            name=spec.name,
            world_size=plan.world_size,
            backend=plan.backend,
            cuda_visible_devices=plan.cuda_visible_devices,
            timeout_s=spec.timeout_s,
            port=spec.port,
            max_restarts=spec.max_restarts,
            cwd=self._cwd,
            sys_path=tuple(self._sys_path),
            env={GPUS_ENV: ",".join(str(i) for i in plan.gpu_indices)} if plan.gpus else {},
            teardown_grace_s=spec.teardown_grace_s,
            stuck_after_s=spec.stuck_after_s,
            detached=spec.detach,
            lease_dir=lease_dir,
        )

    def _launch(self) -> None:
        """Write launch.json (with what the sinks prepare; none for a job followed in memory, a session cell, whose
        ranks run already) and the empty rank logs, and hand the run dir to the launcher."""
        rd, plan, spec = self._rd, self.plan, self.spec
        launch = self._launch_record()
        prepared: list[JobSink] = []
        try:
            for sink in self._sinks:
                extra = sink.prepare(rd.job_id, spec, plan)
                prepared.append(sink)
                launch = launch.prepared(extra)
            if isinstance(self._feed, StatusFeed):  # one followed in memory (a session cell) runs on started ranks
                rd.write_launch(launch)
            for rank in range(plan.world_size):
                rd.log_file(rank).touch(mode=0o600)
            self._feed.open_signal()
            host = self._get_host()
            try:
                self._hand_over(host)
            except LauncherError:
                host = self._get_host()
                self._hand_over(host)
            self._host, self._launched_at = host, time.monotonic()
            if self._lease is not None:
                self._lease.add_process(host.pid)
        except BaseException as exc:
            for sink in prepared:
                sink.launch_failed(rd.job_id, exc)
            self._release()
            raise
        self.events.started(self._handle)
        if self._cancel.is_set():
            self.request_cancel(self._cancel_reason)

    def _hand_over(self, host: Launcher) -> None:
        """Launch on ``host``; a detached job's attach record first, so that a kernel dying right after the hand-over
        leaves a job another kernel can attach to."""
        if self.spec.detach:
            self._write_attach_record(host)
        host.launch(self._rd)

    def _write_attach_record(self, host: Launcher) -> None:
        """What another kernel needs to attach to this detached job (:attr:`RunDir.attach_file`)."""
        self._rd.write_attach(AttachRecord(self.spec, self.plan, host.pid, host.where(), self.submitted_s))
        touch_private(detached_index(self._rd.path.parent.parent) / self.job_id)

    def _release(self) -> None:
        self._feed.close_signal()
        if self._lease is not None:
            self._lease.release()

    def _write_final(self, end: RunState | StopReason, **extra: Any) -> None:
        """End a job that never reached the launch host (cancelled while pending, or refused)."""
        self._release()
        writer = StatusWriter(self._rd)
        writer.finish(end, **extra)
        status = HostStatus.from_dict(writer.status)
        self._end(status, finished=status.state is JobState.CANCELLED)

    def _end(self, status: HostStatus, finished: bool = True) -> None:
        """The one finalize sequence: keep the final status, release the lease and the status FIFO, tell the
        sinks (``state_changed``, then ``finished`` unless the job never started), wake whoever waits (and the
        Future's waiters and done callbacks)."""
        self._final_status = status
        state = status.state
        self._release()
        if state is not self._last_state:
            self._last_state = state
            self.events.state_changed(self._handle, state)
        if finished:
            self.events.finished(self._handle)
        self._done.set()
        register()  # one more ended job: the oldest beyond MAX_ENDED_JOBS leaves the list
        self._settle_future()

    def _settle_future(self) -> None:
        """What the handle does once the job has ended, after the sinks were told (``Job``: complete its Future)."""

    def _pump(self, final: bool = False) -> None:
        """Hand what the ranks wrote since the last call to the sinks; ``final``: all of it, then close the logs."""
        self._logs.pump(final)
        if self._metrics.pump(final):
            self.events.metrics_logged(self._handle)

    def _poll_once(self) -> bool:
        if self._final_status is not None:
            return True
        stamp, now = self._feed.stamp(), time.monotonic()
        if stamp == self._stamp and now - self._last_pump < PUMP_INTERVAL_S:
            return False
        self._stamp, self._last_pump = stamp, now
        self._pump()
        status = self._status(stamp)
        state = status.state
        if not self._said_preparing and status.started_s is None:
            self._say_preparing(now)
        waiting = status.waiting  # a Ray job waiting for the cluster's resources (sgpu_magic.launch.ray.cluster)
        if waiting and waiting != self.pending_reason and not state.final:
            self._set_pending(waiting)
        if status.attempt != self._attempt:
            self._attempt = status.attempt
            self.events.restarted(self._handle, self._attempt)
        if state.final:
            self._pump(final=True)
            self._end(status)
            return True
        if state is not self._last_state:
            self._last_state = state
            self.events.state_changed(self._handle, state)
        if status.stuck != self._stuck:
            self._stuck = status.stuck
            self.events.stuck_changed(self._handle)
        self.events.tick(self._handle)
        if now - self._host_checked >= HOST_CHECK_S and not self._host_alive(now):
            assert self._host is not None  # _host_alive asked it
            message = (
                f"the {'run keeper' if self.spec.detach else 'launch host'} died while job {self.job_id} ran; "
                f"see {self._host.where()} "
                f"and the rank logs in {self._rd.logs_dir}"
            )
            self._pump(final=True)
            lost = replace(status, state=RunState.FAILED, stop_reason=None, host_lost=message, ended_s=time.time())
            self._end(lost)
            raise LauncherError(message)
        return False

    def _say_preparing(self, now: float) -> None:
        """Once a launch has waited :data:`PREPARING_NOTE_S` for its ranks to start, say what the launcher is still
        getting ready (the first launch of a kernel waits for its launch host), once."""
        if self._host is None or now - self._launched_at < PREPARING_NOTE_S:
            return
        self._said_preparing = True
        why = self._host.preparing()
        if why:
            self.events.note(f"sgpu_magic: {why} ...")

    def _host_alive(self, now: float) -> bool:
        self._host_checked = now
        assert self._host is not None  # followed only once launched, through the host
        return self._host.alive()

    def _run_to_end(self) -> None:
        """Lease the GPUs (waiting in the queue) and launch, unless done already; then follow to the end."""
        if self._host is None:
            if self._lease is None and self.plan.needs_lease:
                self._wait_for_lease()
            if self._cancel.is_set():  # cancelled before its launch: start nothing
                raise JobCancelledError(f"job {self.job_id} was cancelled before it started (no rank ran)")
            self._launch()
        while not self._poll_once():
            self._feed.wait()

    def _follow_blocking(self) -> None:
        """:meth:`_run_to_end` in the calling thread; an interrupt cancels the job and raises
        :class:`~sgpu_magic.errors.JobCancelledError`."""
        try:
            self._run_to_end()
        except JobCancelledError:
            self._end_unstarted(StopReason.CANCELLED)
            raise
        except KeyboardInterrupt:
            if self._host is None:
                self._write_final(StopReason.INTERRUPTED)
            else:
                self.request_cancel(StopReason.INTERRUPTED)
                self._drain(CANCEL_WAIT_S)
            raise stopped_error(self._rd, "interrupted", self._final_status) from None

    def _follow_background(self) -> None:
        """Body of the background thread of a submitted job."""
        try:
            self._run_to_end()
        except JobCancelledError:
            self._end_unstarted(StopReason.CANCELLED)
        except BaseException as exc:  # noqa: BLE001 - recorded on the job, shown by its view
            self._error = (
                exc
                if isinstance(exc, SgpuError)
                else LauncherError(f"job {self.job_id} could not run: {type(exc).__name__}: {exc}")
            )
            if self._final_status is None:
                self._write_final(RunState.FAILED, launch_error=str(self._error))
        finally:
            self._done.set()

    def _start_background(self) -> None:
        """Follow the job from a daemon thread that runs in a copy of the caller's context, so output
        that the text view writes after the cell ended still goes to the cell that started the job."""
        self.background = True
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._follow_background,), name=f"sgpu_magic job {self.job_id}", daemon=True
        )
        self._thread.start()

    def _drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        if self._thread is not None:
            self._done.wait(timeout_s)
            return
        while self._host is not None and not self._poll_once() and time.monotonic() < deadline:
            self._feed.wait()
