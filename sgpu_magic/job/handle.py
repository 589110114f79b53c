"""The kernel-side :class:`Job` handle: state, log following, results, cancel.

A job is followed through its RunDir: the host's ``status.json``, each rank's log file
(read by byte offset) and the ranks' result and error files.
"""

from __future__ import annotations

import contextvars
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sgpu_magic.errors import JobCancelledError, LauncherError, ResourceError, SgpuError
from sgpu_magic.job.follow import PUMP_INTERVAL_S, JobSink, LogPump, StatusFeed
from sgpu_magic.job.metrics import MetricsPump
from sgpu_magic.job.outcome import build_error, ending_notes, load_result, stopped_error
from sgpu_magic.job.state import JobState, state_from_status
from sgpu_magic.launch.base import Launcher
from sgpu_magic.launch.client import LaunchHost
from sgpu_magic.launch.leases import Lease, LeaseRegistry, foreign_processes
from sgpu_magic.launch.resources import DevicePlan, Gpu
from sgpu_magic.rundir import HostStatus, RunDir, atomic_write_json, read_json
from sgpu_magic.spec import LaunchSpec

HOST_CHECK_S = 0.5
"""How often a followed job checks that its launch host process still runs."""


CANCEL_WAIT_S = 15.0


MAX_ENDED_JOBS = 100
"""The kernel's job list (:func:`jobs`, ``%distributed_jobs``) keeps every job that has not ended and the last this
many that have; older ended jobs leave it (a handle the notebook still holds keeps working)."""


_JOBS: list[Job] = []


_JOBS_LOCK = threading.Lock()


def jobs() -> list[Job]:
    """The jobs started in this process (kernel), oldest first: every one that has not ended, and the last
    :data:`MAX_ENDED_JOBS` (100) that have."""
    with _JOBS_LOCK:
        return list(_JOBS)


def _register(job: Job | None = None) -> None:
    """Add ``job`` (if given) to the kernel's list, and drop the oldest ended jobs beyond :data:`MAX_ENDED_JOBS`."""
    with _JOBS_LOCK:
        if job is not None:
            _JOBS.append(job)
        ended = [j for j in _JOBS if j.ended]
        for old in ended[: max(0, len(ended) - MAX_ENDED_JOBS)]:
            _JOBS.remove(old)


class Job:
    """A pending, running or finished distributed job (future-like).

    Returned at once by ``fn.submit(...)`` and ``%%distributed --background``; a blocking
    ``fn.distributed(...)`` keeps it as ``fn.last_job``.

    Attributes:
        job_id: unique id, also the run directory's name.
        spec: the :class:`~sgpu_magic.spec.LaunchSpec` it was started with.
        plan: where its ranks run (:class:`~sgpu_magic.launch.resources.DevicePlan`; its ``gpus`` once leased).
        run_dir: path of its run directory (logs stay there after the job).
        background: whether a background thread follows the job (``submit``), else the caller does.
        mlflow_run_id: the job's MLflow run, or ``None`` when it is not tracked.
        title: how messages name it: ``job <id>``, or ``session s1 cell 3`` for a session's cell.
        activity: what a running job's ranks do that its state does not say (``rank 0 in debugger``), or ``""``;
            the panel's header shows it.
        summary_on_success: whether the text view ends a succeeded job with its summary line (a session's cells
            do not: their output is the cell's, as in IPython).
        ranks: the ranks that run it, in order (every rank of the world, except for a session cell run on some).
        run_url: a link to that run's page on its tracking server, or on the ``%mlflow_ui`` server
            once one runs for its store (also for a job started before it), else ``None``.
        waited_s: seconds the job waited in the queue for its GPUs.
    """

    def __init__(
        self,
        run_dir: RunDir,
        spec: LaunchSpec,
        plan: DevicePlan,
        get_host: Callable[[], Launcher],
        sinks: Sequence[JobSink] = (),
        registry: LeaseRegistry | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        self._rd = run_dir
        self.ranks: tuple[int, ...] = tuple(range(plan.world_size) if ranks is None else ranks)
        self.title = f"job {run_dir.job_id}"
        self.summary_on_success = True
        self.activity = ""
        self._feed = StatusFeed(run_dir)
        self.spec = spec
        self.plan = plan
        self._get_host = get_host
        self._host: Launcher | None = None
        self._registry = registry
        self._lease: Lease | None = None
        self._skipped: dict[str, str] = {}  # free GPUs the last lease try passed over: uuid -> why
        self._sinks = list(sinks)
        self._last_state: JobState | None = None
        self._attempt = 1
        self._results: list[Any] | None = None
        self._error: BaseException | None = None
        self._final_status: dict[str, Any] | None = None
        self._cancel = threading.Event()
        self._cancel_reason = "cancelled"
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._stamp: tuple[Any, ...] | None = None
        self._last_pump = 0.0
        self._host_checked = 0.0
        self._logs = LogPump([run_dir.log_file(r) for r in range(plan.world_size)], self._sinks, self._emit)
        self._metrics = MetricsPump([run_dir.metrics_file(r) for r in range(plan.world_size)])
        self.background = False
        self.submitted_s = time.time()
        self.waited_s = 0.0
        self.pending_reason = ""
        self.mlflow_run_id: str | None = None
        self._notes: list[str] | None = None
        _register(self)

    job_id = property(lambda self: self._rd.job_id)
    run_dir = property(lambda self: self._rd.path)

    @property
    def run_url(self) -> str | None:
        """The run page of the job's MLflow run where a server shows it now (see the class docstring)."""
        return next((url for sink in self._sinks if (url := sink.run_url()) is not None), None)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def view(self) -> JobSink | None:
        """What shows the job (the panel or the text view: its last sink), or ``None``."""
        return self._sinks[-1] if self._sinks else None

    @property
    def gpus(self) -> list[int]:
        """Physical indices of the GPUs leased to the job (``[]`` on CPU or before they are leased)."""
        return self.plan.gpu_indices

    @property
    def rank_exitcodes(self) -> dict[int, int | None]:
        """Exit code of each rank once the job ended (negative: killed by that signal); ``{}`` before."""
        return {int(k): v for k, v in (self._status().get("exitcodes") or {}).items()}

    @property
    def elapsed_s(self) -> float | None:
        """Seconds from the ranks' start to the job's end (or to now while it runs); ``None`` before start."""
        status = self._status()
        if "started_s" not in status:
            return None
        elapsed_s: float = status.get("ended_s", time.time()) - status["started_s"]
        return elapsed_s

    @property
    def log_paths(self) -> list[Path]:
        """One log file per rank, in rank order."""
        return [self._rd.log_file(r) for r in range(self.world_size)]

    def logs(self, rank: int) -> str:
        """Everything rank ``rank`` wrote to stdout and stderr so far."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is not in this job (world_size={self.world_size})")
        path = self._rd.log_file(rank)
        return path.read_text(errors="replace") if path.exists() else ""

    def stacks(self, native: bool = False) -> dict[int, str]:
        """Each running rank's Python stack now, taken from outside the rank by py-spy (no cooperation needed).

        Frames of the notebook's code read as the notebook shows them (``<module> (Cell In[4] line 7)``, followed
        by the line's source); the first line of each says where the rank is (``rank 0 (pid 4242):
        dist.broadcast at Cell In[4] line 7``). A rank whose stack cannot be taken gets one line saying why.
        The launch host runs py-spy (each rank names it its tracer, so Yama's ``ptrace_scope`` 1 lets it trace them),
        every rank at once, each dump bounded by :data:`~sgpu_magic.launch.stacks.DUMP_TIMEOUT_S` (5 s); it takes
        about 0.1 s.

        Args:
            native: also show C/C++ frames (``py-spy dump --native``), e.g. where NCCL or gloo waits; slower.

        Returns:
            ``{rank: stack text}`` in rank order, innermost frame first as py-spy prints them.

        Raises:
            SgpuError: the job has ended (the message says where the stacks saved when it timed out or was
                cancelled are), or its ranks have not started yet.

        Example::

            print(job.stacks()[0])
        """
        from sgpu_magic.launch.stacks import live_stacks

        host = self._host
        if isinstance(host, LaunchHost):  # the ranks' tracer (PR_SET_PTRACER): may trace them where the kernel may not
            return live_stacks(
                self._rd, lambda: self.status, native, lambda t: host.request_stacks(self._rd, t, native)
            )
        return live_stacks(self._rd, lambda: self.status, native)

    def metrics(self, name: str | None = None) -> dict[str, dict[int, list[tuple[int, float]]]]:
        """The metric points the ranks logged so far (``sgpu_magic.runtime.log_metric``, and ``mlflow.log_metric`` /
        ``mlflow.log_metrics`` in a tracked job), as the kernel has read them (every 0.2 s while the job runs, all of
        them once it has ended).

        Each series (one metric of one rank) holds at most :data:`~sgpu_magic.job.metrics.MAX_POINTS` (2000) points:
        past that it is downsampled to evenly spaced points, always with the first and the last point logged.

        Args:
            name: only this metric; default ``None``: every metric.

        Returns:
            ``{name: {rank: [(step, value), ...]}}``, names and ranks sorted, points in the order each rank logged
            them; ``{}`` when no point (of ``name``) was logged.

        Example::

            job.metrics("loss")   # {"loss": {0: [(0, 2.3), (1, 1.9)], 1: [(0, 2.4), (1, 2.0)]}}
        """
        return self._metrics.snapshot(name)

    def last_metrics(self) -> dict[str, dict[int, float]]:
        """``{name: {rank: last value}}`` of every metric logged so far (the summary's table)."""
        return self._metrics.last_values()

    def failure_locals(self, rank: int) -> dict[str, str]:
        """The locals of the frame where rank ``rank`` failed, as ``{name: repr}`` (at most 50, each repr about 200
        characters at most), saved by the rank with its error, so they outlive its process.

        Raises:
            IndexError: ``rank`` is not in the job.
            SgpuError: rank ``rank`` did not fail (or left no error file); the message names it.
        """
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is not in this job (world_size={self.world_size})")
        error = read_json(self._rd.error_file(rank))
        if error is None:
            raise SgpuError(f"rank {rank} of {self.title} did not fail with a Python exception: it saved no locals")
        return dict(error.get("locals") or {})

    @property
    def attempt(self) -> int:
        """Which attempt runs (or ran last): 1, then 2 after the first restart (see ``max_restarts``)."""
        return int(self._status().get("attempt", 1))

    @property
    def attempts(self) -> list[dict[str, Any]]:
        """The failed attempts before the current one: ``[{"attempt": 1, "failures": [{"rank", "exitcode",
        "time_s"}], "ended_s", "exitcodes"}]``; their error files are in ``<run_dir>/errors/attempt_<k>/``."""
        return [
            {**a, "exitcodes": {int(r): code for r, code in a.get("exitcodes", {}).items()}}
            for a in self._status().get("attempts", [])
        ]

    @property
    def notes(self) -> list[str]:
        """Once the job has ended, how ranks ended that their exit codes do not say (the panel header and the
        summary line show them): a rank that called ``sys.exit(0)``, a rank the launch host ended because it
        had not exited ``teardown_grace_s`` after its value or error was written. ``[]`` while it runs."""
        if not self.done():
            return []
        if self._notes is None:
            self._notes = ending_notes(self._rd, self._status(), self.world_size)
        return self._notes

    def _status(self, stamp: tuple[Any, ...] | None = None) -> dict[str, Any]:
        """The job's status as last written (the final one once the job has ended); ``stamp``: the status
        file's :meth:`StatusFeed.stamp` if the caller has just taken it."""
        if self._final_status is not None:
            return self._final_status
        return self._feed.read(stamp)

    @property
    def status(self) -> HostStatus:
        """The job's status record as its launcher last wrote it (typed; see :class:`~sgpu_magic.rundir.HostStatus`)."""
        return HostStatus.from_dict(self._status())

    @property
    def shown_state(self) -> JobState:
        """The state the sinks were last told of (``STARTING`` once handed to the launcher, before that
        ``PENDING``): what a view shows between two polls."""
        return self._last_state or (JobState.STARTING if self._host is not None else JobState.PENDING)

    def follow(self) -> None:
        """Follow a blocking job to its end in the calling thread: wait in the GPU queue if needed, launch,
        hand its output to the sinks. An interrupt cancels the job and raises
        :class:`~sgpu_magic.errors.JobCancelledError`. (A submitted job is followed by its own thread.)"""
        self._follow_blocking()

    @property
    def state(self) -> JobState:
        """The current :class:`JobState`."""
        return state_from_status(self._status())

    def done(self) -> bool:
        return self.state.final

    @property
    def ended(self) -> bool:
        """Whether the job's end was seen and its sinks told (its final status is kept; no file is read)."""
        return self._final_status is not None

    def _emit(self, event: str, *args: Any) -> None:
        for sink in self._sinks:
            getattr(sink, event)(*args)

    def start(self, background: bool = False) -> None:
        """Take the first try for the GPUs in the calling thread (so ``wait=False`` refuses at once); then launch
        a blocking job here, or start the thread that launches and follows a background one (creating its
        MLflow run can take seconds). An interrupt before the launch ends the job as ``interrupted``."""
        self._cwd, self._sys_path = os.getcwd(), list(sys.path)
        self._emit("created", self)
        try:
            if self._try_lease() and not background:
                self._launch()
        except KeyboardInterrupt:
            self._end_unstarted("interrupted")
            raise
        if background:
            self._start_background()

    def _end_unstarted(self, state: str) -> None:
        """End the job as ``state`` unless it has ended already (the launcher was never asked, or was too late)."""
        if not self.done():
            self._write_final(state)

    # -- start: lease GPUs, prepare the sinks, hand the run dir to the launch host

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
                self._write_final("failed", launch_error=why)
                with _JOBS_LOCK:  # refused before anything started: not one of the kernel's jobs
                    _JOBS.remove(self)
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
        self._emit("pending", self, why)

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
            if hasattr(self._sinks[-1], "warn"):
                self._sinks[-1].warn(
                    f"GPU {by_uuid[uuid].index} skipped: it runs processes outside sgpu_magic "
                    f"({reason}); pass gpu_ids=[...] / --gpu-ids to use it anyway"
                )

    def _launch(self) -> None:
        """Write launch.json (with what the sinks prepare) and hand the run dir to the launch host."""
        rd, plan, spec = self._rd, self.plan, self.spec
        launch: dict[str, Any] = {
            "job_id": rd.job_id,
            "name": spec.name,
            "world_size": plan.world_size,
            "backend": plan.backend,
            "cuda_visible_devices": plan.cuda_visible_devices,
            "timeout_s": spec.timeout_s,
            "port": spec.port,
            "max_restarts": spec.max_restarts,
            "cwd": self._cwd,
            "sys_path": self._sys_path,
            "env": {},
            "teardown_grace_s": spec.teardown_grace_s,
        }
        if plan.gpus:
            launch["env"]["SGPU_MAGIC_GPUS"] = ",".join(str(i) for i in plan.gpu_indices)
        if self._lease is not None:  # the launch host gives the GPUs back as soon as the ranks are gone
            assert self._registry is not None  # the lease came from it
            launch["lease_dir"] = str(self._registry.dir)
        prepared: list[JobSink] = []
        try:
            for sink in self._sinks:
                extra = sink.prepare(rd.job_id, spec, plan)
                prepared.append(sink)
                launch["env"].update(extra.pop("env", {}))
                launch.update(extra)
            atomic_write_json(rd.launch_file, launch)
            for rank in range(plan.world_size):
                rd.log_file(rank).touch(mode=0o600)
            self._feed.open_signal()
            host = self._get_host()
            try:
                host.launch(rd)
            except LauncherError:
                host = self._get_host()
                host.launch(rd)
            self._host = host
            if self._lease is not None:
                self._lease.add_process(host.pid)
        except BaseException as exc:
            for sink in prepared:
                sink.launch_failed(rd.job_id, exc)
            self._release()
            raise
        self._emit("started", self)
        if self._cancel.is_set():
            self.request_cancel(self._cancel_reason)

    def _release(self) -> None:
        self._feed.close_signal()
        if self._lease is not None:
            self._lease.release()

    def _write_final(self, state: str, **extra: Any) -> None:
        """End a job that never reached the launch host (cancelled while pending, or refused)."""
        self._release()
        status = {"state": state, "ended_s": time.time(), **extra}
        atomic_write_json(self._feed.path, status)
        self._end(status, finished=state_from_status(status) is JobState.CANCELLED)

    def _end(self, status: dict[str, Any], finished: bool = True) -> None:
        """The one finalize sequence: keep the final status, release the lease and the status FIFO, tell the
        sinks (``state_changed``, then ``finished`` unless the job never started), wake whoever waits."""
        self._final_status = status
        state = state_from_status(status)
        self._release()
        if state is not self._last_state:
            self._last_state = state
            self._emit("state_changed", self, state)
        if finished:
            self._emit("finished", self)
        self._done.set()
        _register()  # one more ended job: the oldest beyond MAX_ENDED_JOBS leaves the list

    # -- follow

    def _pump(self, final: bool = False) -> None:
        """Hand what the ranks wrote since the last call to the sinks; ``final``: all of it, then close the logs."""
        self._logs.pump(final)
        if self._metrics.pump(final):
            self._emit("metrics_logged", self)

    def _poll_once(self) -> bool:
        if self._final_status is not None:
            return True
        stamp, now = self._feed.stamp(), time.monotonic()
        if stamp == self._stamp and now - self._last_pump < PUMP_INTERVAL_S:
            return False
        self._stamp, self._last_pump = stamp, now
        self._pump()
        status = self._status(stamp)
        state = state_from_status(status)
        waiting = status.get("waiting")  # a Ray job waiting for the cluster's resources (sgpu_magic.launch.ray.cluster)
        if waiting and waiting != self.pending_reason and not state.final:
            self._set_pending(waiting)
        if status.get("attempt", 1) != self._attempt:
            self._attempt = status["attempt"]
            self._emit("restarted", self, self._attempt)
        if state.final:
            self._pump(final=True)
            self._end(status)
            return True
        if state is not self._last_state:
            self._last_state = state
            self._emit("state_changed", self, state)
        self._emit("tick", self)
        if now - self._host_checked >= HOST_CHECK_S and not self._host_alive(now):
            assert self._host is not None  # _host_alive asked it
            message = (
                f"the launch host died while job {self.job_id} ran; see {self._host.where()} "
                f"and the rank logs in {self._rd.logs_dir}"
            )
            self._pump(final=True)
            self._end({**status, "state": "failed", "host_lost": message, "ended_s": time.time()})
            raise LauncherError(message)
        return False

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
            self._end_unstarted("cancelled")
            raise
        except KeyboardInterrupt:
            if self._host is None:
                self._write_final("interrupted")
            else:
                self.request_cancel("interrupted")
                self._drain(CANCEL_WAIT_S)
            raise stopped_error(self._rd, "interrupted", self._final_status) from None

    def _follow_background(self) -> None:
        """Body of the background thread of a submitted job."""
        try:
            self._run_to_end()
        except JobCancelledError:
            self._end_unstarted("cancelled")
        except BaseException as exc:  # noqa: BLE001 - recorded on the job, shown by its view
            self._error = (
                exc
                if isinstance(exc, SgpuError)
                else LauncherError(f"job {self.job_id} could not run: {type(exc).__name__}: {exc}")
            )
            if self._final_status is None:
                self._write_final("failed", launch_error=str(self._error))
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

    def wait(self, timeout_s: float | None = None) -> JobState:
        """Block until the job ends or ``timeout_s`` seconds pass; return its state.

        For a submitted (background) job an interrupt only stops the waiting (the job goes on;
        use :meth:`cancel`). For the job of a blocking call, interrupting cancels it and raises
        :class:`~sgpu_magic.errors.JobCancelledError` (a KeyboardInterrupt).
        """
        if threading.current_thread() is self._thread or (self._thread is None and self.done()):
            return self.state  # a sink asking from the following thread, or a blocking job that ended
        if self._thread is not None:
            self._done.wait(timeout_s)
            return self.state
        if self._host is None:  # a blocking job not launched yet: wait for its GPUs, launch, follow
            self._follow_blocking()
            return self.state
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while not self._poll_once():
                if deadline is not None and time.monotonic() > deadline:
                    break
                self._feed.wait()
        except KeyboardInterrupt:
            self.cancel(_reason="interrupted")
            raise stopped_error(self._rd, "interrupted", self._final_status) from None
        return self.state

    def request_cancel(self, _reason: str = "cancelled") -> None:
        """Ask for every rank to stop (or a pending job to leave the queue), without waiting.

        Safe from any thread (the panel's Stop button)."""
        self._cancel_reason = _reason
        self._cancel.set()
        if self._final_status is None and self._host is not None:
            try:
                self._host.cancel(self._rd, _reason)
            except LauncherError:
                pass

    def cancel(self, _reason: str = "cancelled") -> None:
        """Stop every rank (SIGTERM, then SIGKILL) and wait until they are gone; state becomes CANCELLED.

        A job still waiting for GPUs leaves the queue. Nothing happens to a job that has ended."""
        if self.done():
            return
        self.request_cancel(_reason)
        if self._host is None and self._thread is None:
            self._write_final(_reason)
            return
        self._drain(CANCEL_WAIT_S)

    def exception(self, timeout_s: float | None = None) -> BaseException | None:
        """Wait for the job (at most ``timeout_s``); return its error (``None`` on success).

        Raises:
            TimeoutError: ``timeout_s`` passed before the job ended.
        """
        self.wait(timeout_s)
        if not self.done():
            raise TimeoutError(f"job {self.job_id} is still {self.state.label} after {timeout_s:g} s")
        if self._error is None and self.state is not JobState.SUCCEEDED:
            self._error = build_error(self._rd, self._status(), self.spec, self.plan)
        return self._error

    def result(self, timeout_s: float | None = None) -> list[Any]:
        """Wait for the job (at most ``timeout_s``); return one value per rank that ran it (:attr:`ranks`), in rank
        order (tensors on CPU).

        Raises:
            RankFailedError: a rank failed; shows the root-cause rank's traceback and log path.
            JobTimeoutError: the job ran past its timeout.
            JobCancelledError: (a KeyboardInterrupt) the job was interrupted or cancelled.
            ResourceError: the job could not get its GPUs (``wait=False``).
            TimeoutError: ``timeout_s`` passed before the job ended.
        """
        error = self.exception(timeout_s)
        if error is not None:
            raise error
        if self._results is None:
            self._results = [load_result(self._rd, r) for r in self.ranks]
        return self._results

    @property
    def results(self) -> list[Any] | None:
        """Per-rank values once the job succeeded, else ``None``."""
        if self.state is JobState.SUCCEEDED:
            return self.result()
        return None

    def __repr__(self) -> str:
        gpus = f" gpus={self.gpus}" if self.gpus else ""
        return (
            f"<Job {self.job_id} {self.state.label} world_size={self.world_size}{gpus} run_dir={str(self.run_dir)!r}>"
        )
