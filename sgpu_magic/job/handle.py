"""The kernel-side :class:`Job` handle: state, log following, results, cancel.

A job is followed through its RunDir: the host's ``status.json``, each rank's log file
(read by byte offset) and the ranks' result and error files.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sgpu_magic._util.metrics import STEP_TIME
from sgpu_magic.errors import SgpuError
from sgpu_magic.job.follow import JobSink, MemoryFeed, view_of
from sgpu_magic.job.lifecycle import CANCEL_WAIT_S, JobLifecycle
from sgpu_magic.job.outcome import build_error, ending_notes, load_result, stopped_error
from sgpu_magic.job.profile import merged_trace, summaries
from sgpu_magic.job.registry import jobs, register
from sgpu_magic.job.state import JobState
from sgpu_magic.job.steps import Straggler, find_straggler
from sgpu_magic.launch.base import Launcher
from sgpu_magic.launch.leases import LeaseRegistry
from sgpu_magic.launch.resources import DevicePlan
from sgpu_magic.rundir import RunDir
from sgpu_magic.spec import LaunchSpec
from sgpu_magic.status import HostStatus
from sgpu_magic.wire import StopReason

if TYPE_CHECKING:
    import numpy as np

__all__ = ["CANCEL_WAIT_S", "Job", "jobs"]


SETTLE_S = 60.0
"""The longest ``Job.mlflow_run_id`` waits for the run's queued MLflow writes (a first job may wait for mlflow's import
and a new store)."""


class Job(JobLifecycle, concurrent.futures.Future[list[Any]]):
    """A pending, running or finished distributed job: a ``concurrent.futures.Future`` of its per-rank values.

    Returned at once by ``fn.submit(...)`` and ``%%distributed --background``; a blocking
    ``fn.distributed(...)`` keeps it as ``fn.last_job``. As a Future it works with
    ``concurrent.futures.wait`` / ``as_completed`` (a failed job counts as one that
    raised, for ``FIRST_EXCEPTION``), ``add_done_callback`` (``fn(job)`` once the job has ended, from the thread
    that saw it end: a background job's own thread) and ``asyncio.wrap_future``; ``result(timeout=...)`` and
    ``exception(timeout=...)`` take the Future's keyword as well as ``timeout_s``.

    Attributes:
        job_id: unique id, also the run directory's name.
        spec: the :class:`~sgpu_magic.spec.LaunchSpec` it was started with.
        plan: where its ranks run (:class:`~sgpu_magic.launch.resources.DevicePlan`; its ``gpus`` once leased).
        run_dir: path of its run directory (logs stay there after the job).
        background: whether a background thread follows the job (``submit``), else the caller does.
        mlflow_run_id: the job's MLflow run, or ``None`` when it is not tracked. The run is made while the ranks
            start and ended after the job (off its path): reading this waits for what is queued for the run, so
            once the job has ended the run read through it is in its final state.
        mlflow_tracking_uri: the store (or server) that run is in, absolute, or ``None`` when it is not tracked.
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
        listed: bool = True,
        feed: MemoryFeed | None = None,
    ) -> None:
        concurrent.futures.Future.__init__(self)
        super().__init__(run_dir, spec, plan, get_host, sinks, registry, feed)
        self.ranks: tuple[int, ...] = tuple(range(plan.world_size) if ranks is None else ranks)
        self.title = f"job {run_dir.job_id}"
        self.summary_on_success = True
        self.activity = ""
        self._results: list[Any] | None = None
        self._mlflow_run_id: str | None = None
        self._mlflow_tracking_uri: str | None = None
        self._notes: list[str] | None = None
        self.shown_from: Job | None = None
        """The job this one shows again (:meth:`show`): its MLflow run is that job's."""
        if listed:  # not a session's cell (its session lists it), nor a second view's follower (show)
            register(self)

    job_id = property(lambda self: self._rd.job_id)
    run_dir = property(lambda self: self._rd.path)
    launcher = property(lambda self: self._host, doc="The launcher that runs the job (``None`` before its launch).")

    @property
    def mlflow_run_id(self) -> str | None:
        """See the class docstring (waits at most :data:`SETTLE_S` for the run's queued writes)."""
        if self.shown_from is not None:
            return self.shown_from.mlflow_run_id
        self._settle()
        return self._mlflow_run_id

    @mlflow_run_id.setter
    def mlflow_run_id(self, run_id: str | None) -> None:
        self._mlflow_run_id = run_id

    @property
    def mlflow_tracking_uri(self) -> str | None:
        """See the class docstring."""
        if self.shown_from is not None:
            return self.shown_from.mlflow_tracking_uri
        self._settle()
        return self._mlflow_tracking_uri

    @mlflow_tracking_uri.setter
    def mlflow_tracking_uri(self, uri: str | None) -> None:
        self._mlflow_tracking_uri = uri

    def _settle(self) -> None:
        for sink in self._sinks:
            sink.settle(SETTLE_S)

    @property
    def run_url(self) -> str | None:
        """The run page of the job's MLflow run where a server shows it now (see the class docstring)."""
        if self.shown_from is not None:
            return self.shown_from.run_url
        return next((url for sink in self._sinks if (url := sink.run_url()) is not None), None)

    def after_run_made(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` (from the tracking worker) once the job's MLflow run, still being made, exists (or
        could not be made); ``False`` when there is no such run in the making (then nothing is called)."""
        return any(sink.after_recorded(callback) for sink in self._sinks)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def view(self) -> JobSink | None:
        """What shows the job (the panel or the text view), or ``None``."""
        return self.events.view

    @property
    def gpus(self) -> list[int]:
        """Physical indices of the GPUs leased to the job (``[]`` on CPU or before they are leased)."""
        return self.plan.gpu_indices

    @property
    def rank_exitcodes(self) -> dict[int, int | None]:
        """Exit code of each rank once the job ended (negative: killed by that signal); ``{}`` before."""
        return dict(self._status().exitcodes)

    @property
    def elapsed_s(self) -> float | None:
        """Seconds from the ranks' start to the job's end (or to now while it runs); ``None`` before start."""
        status = self._status()
        if status.started_s is None:
            return None
        return (status.ended_s or time.time()) - status.started_s

    @property
    def wall_s(self) -> float | None:
        """Seconds the user waited: from the call (or the cell) to the job's end, or to now while it runs, less the
        time it queued for its GPUs (:attr:`waited_s`); ``None`` before the ranks started. Beside
        :attr:`elapsed_s` it shows what a launch spent before its ranks ran (a first launch's launch host)."""
        status = self._status()
        if status.started_s is None:
            return None
        return (status.ended_s or time.time()) - self.submitted_s - self.waited_s

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
        if self._host is not None:  # where the launcher may trace its ranks (the launch host: it is their tracer)
            return self._host.stacks(self._rd, lambda: self.status, native)
        from sgpu_magic.launch.stacks import live_stacks

        return live_stacks(self._rd, lambda: self.status, native)  # not launched yet: says so

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
        self._settle_metrics()
        return self._metrics.snapshot(name)

    def metric_arrays(self, name: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """The points of metric ``name`` (as :meth:`metrics` holds them) as numpy arrays, for plotting:
        ``{rank: (steps, values)}``, both ``float64``, ranks sorted; ``{}`` when ``name`` was never logged.

        Example::

            for rank, (steps, values) in job.metric_arrays("loss").items():
                plt.plot(steps, values, label=f"rank {rank}")
        """
        self._settle_metrics()
        return self._metrics.arrays(name)

    def _settle_metrics(self) -> None:
        """Once the job has ended, read whatever the ranks' files gained after the follower's last read."""
        if self.done():
            self._metrics.pump(final=True)

    def last_metrics(self) -> dict[str, dict[int, float]]:
        """``{name: {rank: last value}}`` of every metric logged so far (the summary's table)."""
        return self._metrics.last_values()

    def release_views(self) -> None:
        """Drop what the ended job's views held only to show it live (:meth:`JobSink.release`): its results,
        logs, metrics and snapshot stay. Nothing happens to a job that has not ended."""
        if self.done():
            for sink in self._sinks:
                sink.release()

    def step_times(self) -> dict[int, list[float]]:
        """Each rank's step times so far: the wall time of every step it marked (``runtime.step()``, else each
        ``optimizer.step()`` of its first optimizer: :mod:`sgpu_magic.rank.steps`), in seconds, in order.

        Read as :meth:`metrics` reads ``step_time_s`` (so past 2000 steps an evenly spaced sample, with the last).

        Returns:
            ``{rank: [seconds per step, ...]}``, ranks sorted; ``{}`` when no step was recorded.

        Example::

            {rank: sum(times) / len(times) for rank, times in job.step_times().items()}   # mean s per step
        """
        self._settle_metrics()
        by_rank = self._metrics.snapshot(STEP_TIME).get(STEP_TIME, {})
        return {rank: [value for _, value in points] for rank, points in by_rank.items()}

    def straggler(self) -> Straggler | None:
        """The rank that is slower than the others over the last 50 steps, if one is
        (:func:`sgpu_magic.job.steps.find_straggler`: its median time per step outside collectives is more than 1.2x
        the median rank's, and 5 ms or more longer); ``None`` otherwise, and before every rank has 10 steps.
        ``str()`` of it is the line the panel's header and the summary show (``straggler: rank 1 is 1.45x slower
        than the median rank over the last 50 steps (...)``)."""
        self._settle_metrics()
        return find_straggler(self._metrics.recent_steps(), self.world_size)

    def profile_trace(self) -> Path:
        """The path of the job's merged profile trace (``profile/trace.json`` in its run directory): every rank's
        ``torch.profiler`` trace of the profiled steps, one process per rank, in the Chrome trace format that
        Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open. Made on the first call once the job has ended
        (waits for it), then kept; a tracked job's MLflow run has it as the artifact ``profile/trace.json``.

        Raises:
            SgpuError: the job was not profiled (``profile=STEPS`` / ``--profile``), or no rank recorded a profiled
                step; the message says why and what to do.
        """
        if self.spec.profile_steps is None:
            raise SgpuError(
                f"job {self.job_id} was not profiled: run it with profile=STEPS (@distributed(..., profile=5)) or "
                f"%%distributed --profile 5"
            )
        self.wait()
        return merged_trace(self._rd, self.world_size, self.job_id)

    def profile_summary(self) -> dict[int, dict[str, Any]]:
        """Each rank's profile of the profiled steps, as the cell's table shows it: ``{rank: {"rank", "steps" (recorded),
        "asked_steps", "device" ("cpu" or "cuda"), "wall_s", "compute_s", "collective_s", "data_s", "idle_s",
        "top_ops": [{"name", "calls", "self_cpu_s", "cpu_s"}, ...], "save_s" (the rank's time to save it)}}``
        (seconds; ``"device_busy_s"`` and each op's ``"self_device_s"`` with CUDA; :mod:`sgpu_magic.rank.profile`
        says how the time is split). ``{}`` for a job not profiled, or before its
        ranks have saved their profiles."""
        return summaries(self._rd, self.world_size) if self.spec.profile_steps is not None else {}

    def failure_locals(self, rank: int) -> dict[str, str]:
        """The locals of the frame where rank ``rank`` failed, as ``{name: repr}`` (at most 50, each repr about 200
        characters at most), saved by the rank with its error, so they outlive its process.

        Raises:
            IndexError: ``rank`` is not in the job.
            SgpuError: rank ``rank`` did not fail (or left no error file); the message names it.
        """
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is not in this job (world_size={self.world_size})")
        error = self._rd.read_error(rank)
        if error is None:
            raise SgpuError(f"rank {rank} of {self.title} did not fail with a Python exception: it saved no locals")
        return dict(error.saved_locals)

    @property
    def attempt(self) -> int:
        """Which attempt runs (or ran last): 1, then 2 after the first restart (see ``max_restarts``)."""
        return self._status().attempt

    @property
    def attempts(self) -> list[dict[str, Any]]:
        """The failed attempts before the current one: ``[{"attempt": 1, "failures": [{"rank", "exitcode",
        "time_s"}], "ended_s", "exitcodes"}]``; their error files are in ``<run_dir>/errors/attempt_<k>/``."""
        return [
            a.to_json() | {"exitcodes": dict(a.exitcodes)}  # ranks as ints, as rank_exitcodes gives them
            for a in self._status().attempts
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

    @property
    def status(self) -> HostStatus:
        """The job's status record as its launcher last wrote it (typed; see :class:`~sgpu_magic.status.HostStatus`)."""
        return self._status()

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
        return self._status().state

    def done(self) -> bool:
        """Whether the job has ended (succeeded, failed, cancelled or timed out)."""
        return self.state.final

    def running(self) -> bool:
        """Whether its ranks are starting or running (``concurrent.futures.Future.running``)."""
        return self.state in (JobState.STARTING, JobState.RUNNING)

    def cancelled(self) -> bool:
        """Whether the job ended cancelled (or interrupted)."""
        return self.state is JobState.CANCELLED

    def _settle_future(self) -> None:
        """Complete the Future side once the job has ended: its waiters wake, its done callbacks run."""
        if concurrent.futures.Future.done(self):  # the Future side is completed once, by the first end seen
            return
        error = None if self.state is JobState.SUCCEEDED else self.exception(timeout_s=0)
        if error is None:  # the values stay in the run directory until result() reads them
            concurrent.futures.Future.set_result(self, [])
        else:
            concurrent.futures.Future.set_exception(self, error)

    def start(self, background: bool = False) -> None:
        """Take the first try for the GPUs in the calling thread (so ``wait=False`` refuses at once); then launch
        a blocking job here, or start the thread that launches and follows a background one (creating its
        MLflow run can take seconds). An interrupt before the launch ends the job as ``interrupted``."""
        self._cwd, self._sys_path = os.getcwd(), list(sys.path)
        self.events.created(self)
        try:
            if self._try_lease() and not background:
                self._launch()
        except KeyboardInterrupt:
            self._end_unstarted(StopReason.INTERRUPTED)
            raise
        if background:
            self._start_background()

    def attach(self, launcher: Launcher, submitted_s: float) -> None:
        """Follow a detached job that another kernel started (:func:`sgpu_magic.attach`), held by ``launcher``
        (the run keeper): the sinks are told it was created, attached and started, then a background thread follows
        it from the first byte of each rank's log, as for a submitted job (``submitted_s``: when it was started)."""
        self.follow_from_start(launcher, submitted_s, attached=True)

    def show(self, view: JobSink | None = None) -> None:
        """Show the job's panel (or its text view) again, in the output of the cell that calls this: rebuilt from
        the run directory (every rank's lines from the first, the metrics, the state, the MLflow link) and following
        the job live from a background thread while it runs; an ended job shows its final panel. For a page
        reopened while a blocking cell ran, which cannot restore that cell's panel (``docs/guide/detached.md``), or
        a cleared output. The job's own view and MLflow run are left as they are; the new panel's Stop button stops
        the job.

        Args:
            view: what shows it (a new ``Panel`` or ``TextView``); default: a new one like the job's own.

        Raises:
            SgpuError: the job has not been handed to its launcher yet (it waits for GPUs), or it has no view.
        """
        own = view_of(self._sinks)
        fresh = view if view is not None else own.replica() if own is not None else None
        if fresh is None:
            raise SgpuError(f"{self.title} has no panel or text view to show again")
        host = self._host
        if host is None:
            raise SgpuError(f"{self.title} has not started yet (state {self.state.value}); show it once it runs")
        feed = self._feed.another() if isinstance(self._feed, MemoryFeed) else None  # a running session cell's
        follower = Job(self._rd, self.spec, self.plan, lambda: host, [fresh], ranks=self.ranks, listed=False, feed=feed)
        follower.title, follower.shown_from = self.title, self
        follower.follow_from_start(host, self.submitted_s)

    def follow_from_start(self, launcher: Launcher, submitted_s: float, attached: bool = False) -> None:
        """Follow a job already handed to ``launcher`` from the first byte of each rank's log, from a background
        thread (``submitted_s``: when it was started): the sinks are told it was created (and, ``attached``, that
        it is a detached job another kernel started), then that it started."""
        self._host, self._launched_at, self.submitted_s = launcher, time.monotonic(), submitted_s
        self._said_preparing = True  # its launcher was ready long ago
        self.events.created(self)
        if attached:
            self.events.attached(self)
            self._feed.open_signal()  # (a second view's follower polls: the status FIFO is the job's own follower's)
        self.events.started(self)
        self._start_background()

    @property
    def detached(self) -> bool:
        """Whether the job runs under the run keeper (``detach=True``), so it outlives the kernel."""
        return self.spec.detach

    def wait(self, timeout_s: float | None = None) -> JobState:
        """Block until the job ends or ``timeout_s`` seconds pass; return its state.

        For a submitted (background) job an interrupt only stops the waiting (the job goes on;
        use :meth:`cancel`). For the job of a blocking call, interrupting cancels it and raises
        :class:`~sgpu_magic.errors.JobCancelledError` (a KeyboardInterrupt).
        """
        if threading.current_thread() is self._thread or (self._thread is None and self.ended):
            return self.state  # a sink asking from the following thread, or a blocking job whose end was seen
        # (a blocking job whose status is final but whose end nobody has seen yet is polled once below: its sinks
        # are told, its panel leaves its snapshot and its MLflow run is ended, before its values are handed back)
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
            self.cancel(_reason=StopReason.INTERRUPTED)
            raise stopped_error(self._rd, "interrupted", self._final_status) from None
        return self.state

    def cancel(self, _reason: StopReason = StopReason.CANCELLED) -> bool:
        """Stop every rank (SIGTERM, then SIGKILL) and wait until they are gone; state becomes CANCELLED.

        A job still waiting for GPUs leaves the queue. Nothing happens to a job that has ended. Returns whether the
        job was still to end (``False``: it had ended already)."""
        if self.done():
            return False
        self.request_cancel(_reason)
        if self._host is None and self._thread is None:
            self._write_final(_reason)
            return True
        self._drain(CANCEL_WAIT_S)
        return True

    def exception(self, timeout: float | None = None, *, timeout_s: float | None = None) -> BaseException | None:
        """Wait for the job (at most ``timeout_s`` seconds; ``timeout`` is the Future's name for it, also the first
        positional argument); return its error (``None`` on success).

        Raises:
            TimeoutError: ``timeout_s`` passed before the job ended.
        """
        timeout_s = timeout if timeout_s is None else timeout_s
        self.wait(timeout_s)
        if not self.done():
            raise TimeoutError(f"job {self.job_id} is still {self.state.label} after {timeout_s:g} s")
        if self._error is None and self.state is not JobState.SUCCEEDED:
            self._error = build_error(self._rd, self._status(), self.spec, self.plan)
        return self._error

    def result(self, timeout: float | None = None, *, timeout_s: float | None = None) -> list[Any]:
        """Wait for the job (at most ``timeout_s`` seconds; ``timeout`` is the Future's name for it, also the first
        positional argument); return one value per rank that ran it (:attr:`ranks`), in rank order (tensors on CPU).

        Raises:
            RankFailedError: a rank failed; shows the root-cause rank's traceback and log path.
            JobTimeoutError: the job ran past its timeout.
            JobCancelledError: (a KeyboardInterrupt) the job was interrupted or cancelled.
            ResourceError: the job could not get its GPUs (``wait=False``).
            TimeoutError: ``timeout_s`` passed before the job ended.
        """
        error = self.exception(timeout_s=timeout if timeout_s is None else timeout_s)
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
