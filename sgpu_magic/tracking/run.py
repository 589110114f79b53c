"""MLflow tracking: one run per job, created and ended by the kernel, off the job's path.

:class:`MlflowTracking` is a :class:`~sgpu_magic.job.follow.JobSink`. When the job is handed to its launcher it
queues the creation of one MLflow run (nested under the kernel's active run, if any) on the kernel's tracking
worker (:mod:`sgpu_magic.tracking.worker`), so neither the launch nor a kernel's first job waits for the store
(or for ``import mlflow``). The run's identity goes into the run directory (``mlflow.json``) as soon as it exists,
and a rank adopts it when it first needs it (``MLFLOW_TRACKING_URI``, ``MLFLOW_RUN_ID``, ``MLFLOW_EXPERIMENT_ID``,
``MLFLOW_EXPERIMENT_NAME`` in its environment once its code imports mlflow: see
:mod:`sgpu_magic.rank.mlflow_guard`), so plain ``mlflow.log_metric(...)`` in rank code lands in the job's run.
The run is ended on the worker too, after the result is handed back; ``job.mlflow_run_id`` waits for what is
queued for the run, so a run read through it is in its final state once the job has ended. Rank metrics are logged with MLflow's async logging by default (:data:`ASYNC_LOGGING_ENV`),
flushed before each rank reports (:func:`sgpu_magic.rank.mlflow_guard.flush_async_logging`).
Ranks never end the run (the worker makes MLflow skip ``set_terminated`` for it); the kernel
sets the final status when the job ends: FINISHED on success, FAILED when a rank fails, KILLED on
cancel, timeout or interrupt. If the kernel dies while the job runs, the launch host marks the run
KILLED on its way down. ``mlflow.start_run()`` in a rank opens that rank's child run (see
:mod:`sgpu_magic.rank.mlflow_guard`); those still RUNNING when the job ends get the job's status. At the end the rank logs (``logs/rank_N.log``), the ranks' error files
(``errors/rank_N.json``) and the stacks taken when a job timed out or was cancelled (``stacks/rank_N.txt``) are
attached as artifacts; CPU, memory, disk and network metrics (GPU
too, through NVML) are recorded with MLflow's system metrics monitor while the job runs, and each rank's peak RSS
(sampled by the launch host) as ``system/rank_<r>_peak_rss_megabytes`` when it ends (and each rank's peak GPU
memory, where NVML sampled it, as ``system/rank_<r>_peak_gpu_memory_megabytes``).

Where runs go:

- tracking URI: the kernel's (``mlflow.get_tracking_uri()``: ``mlflow.set_tracking_uri``, else
  ``MLFLOW_TRACKING_URI``, else ``sqlite:///<cwd>/mlflow.db``), made absolute for the ranks;
- experiment, as MLflow's fluent API picks it: the one set with ``mlflow.set_experiment`` in
  the kernel, else ``MLFLOW_EXPERIMENT_NAME``, else ``MLFLOW_EXPERIMENT_ID``, else one named
  after the notebook (``JPY_SESSION_NAME``'s stem), else ``DistributedMagics.mlflow_experiment``
  (``"sgpu_magic"``). A nested run goes into its parent's experiment. Experiments created here in
  a local sqlite store keep their artifacts next to the database (``<db dir>/mlruns/<name>``).

``import mlflow`` takes seconds, so nothing here imports it at module level; :func:`warm_up`
imports it in a background thread when the extension loads.

:func:`start_ui` (``%mlflow_ui``) starts a local ``mlflow server`` on 127.0.0.1 for the tracking
URI, tied to the kernel's life by a small watchdog process; from then on run links point at it.
"""

from __future__ import annotations

import concurrent.futures
import getpass
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sgpu_magic._compat.imports import import_mlflow
from sgpu_magic._compat.mlflow import active_experiment_id, stop_system_metrics
from sgpu_magic._util.kernel_log import divert_info
from sgpu_magic._util.metrics import STEP_TIME, Point
from sgpu_magic._util.redact import redact
from sgpu_magic.errors import RecordError, SgpuError
from sgpu_magic.job.follow import JobSink
from sgpu_magic.job.state import JobState
from sgpu_magic.rank.mlflow_guard import RANK_TAG, RUN_FILE_ENV
from sgpu_magic.rundir import RunDir, atomic_write_bytes
from sgpu_magic.tracking.server import run_link, start_ui
from sgpu_magic.tracking.uri import http_base, kernel_tracking_uri, notebook_path, open_client, sqlite_dir
from sgpu_magic.tracking.worker import worker
from sgpu_magic.wire.mlflow import MlflowRunRecord

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlflow import MlflowClient
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    from sgpu_magic.job.handle import Job
    from sgpu_magic.launch.resources import DevicePlan
    from sgpu_magic.spec import LaunchSpec


DEFAULT_EXPERIMENT = "sgpu_magic"
"""Experiment for jobs when neither the kernel, the environment nor a notebook name gives one."""


STORE_LOGGERS = ("mlflow.store.db.utils", "alembic.runtime.migration")
"""Loggers whose INFO lines (a new store's tables and migrations) go to the kernel log, not the cell."""


_STATUS = {JobState.SUCCEEDED: "FINISHED", JobState.FAILED: "FAILED"}  # every other final state: KILLED


_warming = threading.Event()
"""Set while :func:`warm_up`'s import of mlflow runs on the tracking worker (not the user's own import)."""


def warm_up() -> None:
    """Import mlflow (about 2 s of CPU) and the module of the tracking URI's store (:func:`import_store_module`) on
    the kernel's tracking worker, so they are done before the first tracked job's run is made there. Nothing waits
    for it: a job's launch never does, and its run is queued after it. Does nothing once mlflow is imported."""
    if "mlflow" in sys.modules:
        return

    def _import() -> None:
        try:
            (mlflow,) = import_mlflow()  # the notebook's own mlflow imports wait for it meanwhile

            uri = kernel_tracking_uri(mlflow)
            import_store_module(uri)
        except Exception:  # noqa: BLE001 - the job says so when its run cannot be made
            return
        finally:
            _warming.clear()
        if sqlite_dir(uri) is not None:
            try:  # a new local store creates its tables here (3.5 s of CPU on 2 cores), not under the first job
                divert_info(*STORE_LOGGERS)
                open_client(mlflow, uri).search_experiments(max_results=1)
            except Exception:  # noqa: BLE001 - as above
                pass

    _warming.set()
    worker().submit(_import)


def import_store_module(uri: str) -> bool:
    """Import the module of MLflow's SQL tracking store when ``uri`` names a database (``sqlite:``, ``postgresql:``,
    ``mysql:``, ``mssql:``; MLflow's default is ``sqlite:///mlflow.db``): it imports SQLAlchemy and alembic, about
    1 s of CPU that the first tracked launch pays otherwise (``MlflowClient(uri)`` imports it). Nothing is created
    or connected to. Returns whether it imported it."""
    from urllib.parse import urlsplit

    from mlflow.store.db.db_types import DATABASE_ENGINES

    if urlsplit(uri).scheme.partition("+")[0] not in DATABASE_ENGINES:
        return False
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401

    return True


_EXPERIMENTS: dict[tuple[str, str], str] = {}
"""The experiment id of each ``(tracking URI, experiment name)`` a run was made in (used on the tracking worker only):
a job's run is made without looking its experiment up again (one store round trip less per job)."""


STEP_TIME_INTERVAL_S = 1.0
"""MLflow gets one ``step_time_s/rank_<r>`` point per rank for at most this much of the run's time: the mean wall time
of the steps since the last point, at the last one's step (the metrics file, hence the panel and
``job.step_times()``, has every step), so a fast loop adds little to the store."""


def step_time_points(points: list[Point], rank: int) -> list[Point]:
    """The ``step_time_s/rank_<r>`` points MLflow gets of a rank's metric ``points`` (its metrics file, in order): the
    first step, then the mean of the steps since at the first step :data:`STEP_TIME_INTERVAL_S` or more after the
    last point, and the mean of the rest at the last step."""
    name, out = f"{STEP_TIME}/rank_{rank}", []
    due_ms, total, count = -1, 0.0, 0
    for metric, value, step, time_ms in points:
        if metric != STEP_TIME:
            continue
        total, count = total + value, count + 1
        if time_ms >= due_ms:
            out.append((name, total / count, step, time_ms))
            due_ms, total, count = time_ms + int(STEP_TIME_INTERVAL_S * 1000), 0.0, 0
        last = (step, time_ms)
    if count:
        out.append((name, total / count, *last))
    return out


def _warn(text: str) -> None:
    sys.stderr.write(f"sgpu_magic warning: {redact(text)}\n")
    sys.stderr.flush()


def _fluent_context() -> tuple[tuple[str, str] | None, str | None]:
    """``((run id, experiment id) of the active run or None, experiment set by mlflow.set_experiment)``.

    Nothing is active when mlflow has not been imported by the user (while :func:`warm_up` imports it, a user's
    own ``import mlflow`` would wait for that import to finish: so nobody can have started a run meanwhile, and
    this never waits for the import either)."""
    if "mlflow" not in sys.modules or _warming.is_set():
        return None, None
    import mlflow

    run = mlflow.active_run()
    parent = (run.info.run_id, str(run.info.experiment_id)) if run is not None else None
    return parent, active_experiment_id()


ASYNC_LOGGING_ENV = {"MLFLOW_ENABLE_ASYNC_LOGGING": "true", "MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS": "1"}
"""What tracked ranks get unless the kernel's environment sets the variable: MLflow's own async logging,
with points buffered for up to a second and written as one batch (up to 1000 per batch)."""


def rank_logging_env(kernel_env) -> dict[str, str]:
    """MLflow's async logging for the ranks (``ASYNC_LOGGING_ENV``), except the variables the kernel's
    environment already sets: ``MLFLOW_ENABLE_ASYNC_LOGGING=false`` there (or
    ``mlflow.config.enable_async_logging(False)`` in the kernel, which sets it) keeps ranks synchronous."""
    return {k: v for k, v in ASYNC_LOGGING_ENV.items() if k not in kernel_env}


class MlflowTracking(JobSink):
    """Tracks one job as one MLflow run (see the module docstring for what is recorded where).

    Args:
        default_experiment: experiment when nothing else names one (``DistributedMagics.mlflow_experiment``).
        ui: start the ``%mlflow_ui`` server for a local store when the job starts
            (``DistributedMagics.mlflow_ui``), so the job's run link works.
        parent: the run to nest this one under (a session cell's run under the session's: its
            :class:`MlflowTracking`); default: the kernel's active run, if any.

    Attributes (once the run exists, on the tracking worker): ``tracking_uri``, ``experiment_id``, ``run_id``;
    ``run_id`` stays ``None`` when tracking could not start, in which case the job runs untracked after a warning.
    """

    needs_every_line = False  # it reads no output (logs are attached from the files at the end)

    def __init__(
        self, default_experiment: str = DEFAULT_EXPERIMENT, ui: bool = False, parent: MlflowTracking | None = None
    ) -> None:
        self.default_experiment = default_experiment or DEFAULT_EXPERIMENT
        self.ui = ui
        self.tracking_uri: str | None = None
        self.experiment_id: str | None = None
        self.run_id: str | None = None
        self._experiment_name: str | None = None
        self._client: MlflowClient | None = None  # these three are set together, with run_id (_create)
        self._monitor: SystemMetricsMonitor | None = None
        self._job: Job | None = None
        self._last: concurrent.futures.Future | None = None  # the last task queued for this run
        self._made: concurrent.futures.Future | None = None  # its creation
        self._started_ms = 0
        # read here, in the thread that starts the job: MLflow's active run is thread-local, and a
        # background job prepares its run on another thread
        self._parent_run, self._chosen_experiment_id = _fluent_context()
        # and the environment's experiment as it is now: the run is made later on the tracking worker, by when the
        # notebook (or a test) may have named another one for its next job
        self._env_experiment = (os.environ.get("MLFLOW_EXPERIMENT_NAME"), os.environ.get("MLFLOW_EXPERIMENT_ID"))
        self._parent = parent

    def _queue(self, task, ends_a_run: bool = False) -> None:
        self._last = worker().submit(task, ends_a_run)

    def settle(self, timeout_s: float | None = None) -> None:
        """Wait (at most ``timeout_s``) until what is queued for this run has been written: the run made (while the
        job runs), or ended (once it has ended)."""
        if self._last is not None:
            concurrent.futures.wait([self._last], timeout_s)

    def identity(self) -> tuple[str, str] | None:
        """``(run id, experiment id)`` once the run exists, else ``None``. A child run's creation calls it on the
        worker, which made the parent's run before (tasks run in order): it must not wait there."""
        return (self.run_id, self.experiment_id) if self.run_id and self.experiment_id else None

    # -- before launch

    def created(self, job: Job) -> None:
        self._job = job

    def prepare(self, job_id: str, spec: LaunchSpec, plan: DevicePlan) -> dict:
        """Queue the run's creation; return the ranks' MLflow environment (where to find the run once it exists)."""
        assert self._job is not None  # created() came first, in the starting thread
        run_dir = RunDir(self._job.run_dir)
        run_file = run_dir.mlflow_file
        self._started_ms = int(time.time() * 1000)
        self._queue(lambda: self._create(job_id, spec, plan, run_dir))
        self._made = self._last
        env = {
            RUN_FILE_ENV: str(run_file),
            # the kernel records system metrics for the job; a rank adopting the run must not too
            "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
            **rank_logging_env(os.environ),
        }
        return {"env": env, "tracked": True}

    def attached(self, job: Job) -> None:
        """An attached detached job (:func:`sgpu_magic.attach`): take over the run the kernel that started it made,
        as its ``mlflow.json`` names it (read through the private-read check), unless that kernel ended it already;
        it is ended here with the job, as any run. None there (untracked, or that kernel died first): untracked."""
        run_dir = RunDir(job.run_dir)
        self._queue(lambda: self._adopt(job, run_dir))
        self._made = self._last

    def _adopt(self, job: Job, run_dir: RunDir) -> None:
        try:
            record = run_dir.read_mlflow_run()
        except (OSError, RecordError) as exc:
            _warn(f"the MLflow run of job {job.job_id} cannot be read ({exc}): it is not tracked from this kernel")
            return
        if record is None or not record.tracked or run_dir.mlflow_ended_file.exists():
            return
        (mlflow,) = import_mlflow()
        self._client, self.tracking_uri = mlflow.MlflowClient(record.tracking_uri), record.tracking_uri
        self.run_id, self.experiment_id = record.run_id, record.experiment_id
        self._experiment_name = record.experiment_name
        job.mlflow_run_id, job.mlflow_tracking_uri = self.run_id, self.tracking_uri

    def _create(self, job_id: str, spec: LaunchSpec, plan: DevicePlan, run_dir: RunDir) -> None:
        """On the worker: make the run, then name it where the ranks and the launch host read it (``mlflow.json``:
        no run id when it could not be made, so no rank waits for it)."""
        record = MlflowRunRecord(None, error="tracking could not start")
        try:
            self._create_run(job_id, spec, plan)
            record = MlflowRunRecord(
                self.run_id,
                self.tracking_uri,
                self.experiment_id,
                self._experiment_name,
                registry_uri=self._registry_uri(),
            )
        except Exception as exc:  # noqa: BLE001 - tracking must never stop a job
            self._terminate("FAILED", time.time())
            self.run_id = None
            _warn(f"MLflow tracking is off for job {job_id}: {type(exc).__name__}: {exc}")
        finally:
            run_dir.write_mlflow_run(record)
        job = self._job
        if self.run_id is not None and job is not None:
            job.mlflow_run_id, job.mlflow_tracking_uri = self.run_id, self.tracking_uri
            self._start_ui()  # also for a job that ended first: its panel's snapshot links the run once it can
            if not job.ended:
                self._start_monitor()

    def _registry_uri(self) -> str | None:
        """The registry URI for the ranks: the kernel's (MLflow's default: the tracking URI); ``None`` when the
        ranks get it otherwise (``MLFLOW_REGISTRY_URI`` in the kernel's environment reaches them) or resolve it.

        Where it is not set, every ``MlflowClient()`` MLflow makes (two per fluent ``log_metric``) looks
        for a Spark session, a failed ``import pyspark`` each time: 1.3 ms of a 1.5 ms ``log_metric`` here.
        """
        if "MLFLOW_REGISTRY_URI" in os.environ:  # reaches the ranks with the rest of the kernel's environment
            return None
        import mlflow

        try:
            registry = mlflow.get_registry_uri()
            same = registry == mlflow.get_tracking_uri()
        except Exception:  # noqa: BLE001 - only a speed-up: the ranks then resolve it themselves
            return None
        if not registry:
            return None
        return self.tracking_uri if same else registry

    def _create_run(self, job_id: str, spec: LaunchSpec, plan: DevicePlan) -> None:
        mlflow, entities = import_mlflow("mlflow.entities")  # at once once imported (warm_up did, or the notebook)
        Param = entities.Param

        divert_info(*STORE_LOGGERS)  # a new store's "Creating initial MLflow database tables" is not for the cell
        uri = kernel_tracking_uri(mlflow)
        client = open_client(mlflow, uri)
        parent = self._parent.identity() if self._parent is not None else self._parent_run
        experiment_id, name = self._experiment(client, uri, parent)
        notebook = notebook_path()
        tags = {"sgpu_magic.job_id": job_id, "mlflow.source.type": "NOTEBOOK" if notebook else "LOCAL"}
        if notebook:
            tags.update({"sgpu_magic.notebook": notebook, "mlflow.source.name": notebook})
        if parent is not None:
            tags["mlflow.parentRunId"] = parent[0]
        try:
            tags["mlflow.user"] = getpass.getuser()
        except Exception:  # noqa: BLE001 - no user name in some containers
            pass
        try:
            run = client.create_run(experiment_id, start_time=self._started_ms or None, run_name=spec.name, tags=tags)
        except Exception:
            if _EXPERIMENTS.get((uri, name)) != experiment_id:
                raise
            # the experiment known from an earlier run was deleted since (or its store replaced): look it up again
            # (a deleted one is refused with the remedy)
            _EXPERIMENTS.pop((uri, name), None)
            experiment_id, name = self._experiment(client, uri, parent)
            run = client.create_run(experiment_id, start_time=self._started_ms or None, run_name=spec.name, tags=tags)
        self._client, self.tracking_uri, self.run_id = client, uri, run.info.run_id
        self.experiment_id, self._experiment_name = experiment_id, name
        params = {
            "gpus": spec.gpus,
            "gpu_type": spec.gpu_type or "any",
            "device": plan.gpus[0].name if plan.gpus else "cpu",
            "world_size": plan.world_size,
            "backend": plan.backend,
            "timeout_s": "none" if spec.timeout_s is None else f"{spec.timeout_s:g}",
            "name": spec.name,
            "max_restarts": spec.max_restarts,
        }
        client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in params.items()])

    def _experiment(self, client, uri: str, parent) -> tuple[str, str]:
        """(id, name) of the experiment for the run: see the module docstring for the order."""
        chosen = parent[1] if parent is not None else self._chosen_experiment_id
        if chosen:
            return str(chosen), client.get_experiment(str(chosen)).name
        name, chosen = self._env_experiment
        if name:
            return self._get_or_create(client, uri, name), name
        if chosen:
            return chosen, client.get_experiment(chosen).name
        notebook = notebook_path()
        name = (Path(notebook).stem if notebook else "") or self.default_experiment
        return self._get_or_create(client, uri, name), name

    @staticmethod
    def _get_or_create(client, uri: str, name: str) -> str:
        from mlflow.exceptions import MlflowException

        known = _EXPERIMENTS.get((uri, name))
        if known is not None:
            return known
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            db_dir = sqlite_dir(uri)
            location = None
            if db_dir is not None:
                location = (db_dir / "mlruns" / (re.sub(r"[^\w.-]+", "_", name).strip("._") or "experiment")).as_uri()
            try:
                _EXPERIMENTS[(uri, name)] = client.create_experiment(name, artifact_location=location)
                return _EXPERIMENTS[(uri, name)]
            except MlflowException:
                experiment = client.get_experiment_by_name(name)  # created meanwhile by another kernel
                if experiment is None:
                    raise
        if experiment.lifecycle_stage != "active":
            raise SgpuError(
                f"the MLflow experiment {name!r} is deleted; restore it with "
                f"MlflowClient().restore_experiment({experiment.experiment_id!r}) or pick another "
                f"with mlflow.set_experiment(...)"
            )
        _EXPERIMENTS[(uri, name)] = experiment.experiment_id
        return experiment.experiment_id

    # -- while the job runs

    def _start_ui(self) -> None:
        """On the worker, once the run exists: the ``%mlflow_ui`` server, if configured (not waited for)."""
        assert self.tracking_uri is not None  # set with run_id (_create)
        if self.ui and http_base(self.tracking_uri) is None:
            try:
                start_ui(self.tracking_uri, wait=False)
            except Exception as exc:  # noqa: BLE001 - the link is a convenience
                _warn(f"the MLflow UI did not start: {exc}")

    def after_recorded(self, callback: Callable[[], None]) -> bool:
        """Run ``callback`` on the tracking worker once the run's creation, queued before, is done (whether it made
        the run or not); ``False`` (and nothing queued) when it is done already or was never queued."""
        if self._made is None or self._made.done():
            return False
        worker().submit(callback)  # tasks run in order: after the creation, in this thread's context
        return True

    def _start_monitor(self) -> None:
        """On the worker, once the run exists and the job still runs: the system metrics monitor."""
        assert self.tracking_uri is not None and self.run_id is not None  # set with run_id (_create)
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # its INFO lines ("Started monitoring system metrics.") would land in every cell's output
            logging.getLogger(SystemMetricsMonitor.__module__).setLevel(logging.WARNING)
            self._monitor = SystemMetricsMonitor(self.run_id, tracking_uri=self.tracking_uri)
            self._monitor.start()
        except Exception:  # noqa: BLE001 - system metrics are optional (psutil/NVML missing, ...)
            self._monitor = None

    def finished(self, job: Job) -> None:
        """Queue the run's end: stop the monitor, attach logs and error files, then set the final status and end
        time (after ``result()`` has handed the values back)."""
        self._queue(lambda: self._finish(job), ends_a_run=True)

    def _finish(self, job: Job) -> None:
        if self.run_id is None:
            return
        status = _STATUS.get(job.state, "KILLED")
        ended_s = job.status.ended_s or time.time()
        try:
            self._stop_monitor()
            final = job.status
            assert self._client is not None  # set with run_id (_create)
            self._client.set_tag(self.run_id, "sgpu_magic.state", final.state.value)
            if final.stop_reason is not None:
                self._client.set_tag(self.run_id, "sgpu_magic.stop_reason", final.stop_reason.value)
            self._log_peaks(job)
            self._log_step_times(RunDir(job.run_dir), job.world_size)
            self._log_artifacts(RunDir(job.run_dir))
            self._log_profile(job)
        except Exception as exc:  # noqa: BLE001 - the job's result matters more than its artifacts
            _warn(
                f"could not attach the logs of job {job.job_id} to MLflow run {self.run_id}: "
                f"{type(exc).__name__}: {exc}"
            )
        finally:
            self._end_rank_runs(status, ended_s)
            self._terminate(status, ended_s)
            # tells the launch host this run needs nothing from it when it exits (no mlflow import there)
            atomic_write_bytes(RunDir(job.run_dir).mlflow_ended_file, b"")  # 0600, as every run dir file

    def run_url(self) -> str | None:
        """The run's page (``job.run_url``): on the tracking server, or on the ``%mlflow_ui`` server running
        for the store now; ``None`` when there is neither, or the job is not tracked."""
        run_id, uri, experiment_id = self.run_id, self.tracking_uri, self.experiment_id
        if run_id is None or uri is None or experiment_id is None:  # not tracked, or not made yet
            return None
        return run_link(uri, experiment_id, run_id)

    def launch_failed(self, job_id: str, error: BaseException) -> None:
        """The job never started: end its run FAILED (KILLED when the launch was interrupted), once it exists."""
        status, ended_s = ("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"), time.time()

        def end() -> None:
            self._stop_monitor()
            self._terminate(status, ended_s)

        self._queue(end, ends_a_run=True)

    def _terminate(self, status: str, ended_s: float) -> None:
        if self.run_id is None or self._client is None:
            return
        try:
            self._client.set_terminated(self.run_id, status, end_time=int(ended_s * 1000))
        except Exception as exc:  # noqa: BLE001
            _warn(f"could not set MLflow run {self.run_id} to {status}: {type(exc).__name__}: {exc}")

    def _log_peaks(self, job: Job) -> None:
        """Each rank's peak RSS as sampled by the launch host (on Ray, by its agent): ``system/rank_<r>_peak_rss_megabytes``, and its peak GPU
        memory where NVML sampled it: ``system/rank_<r>_peak_gpu_memory_megabytes``."""
        from mlflow.entities import Metric

        assert self._client is not None and self.run_id is not None  # called by finished, for a tracked job
        usage = job.status.usage
        if usage:
            now_ms = int(time.time() * 1000)
            metrics = [
                Metric(f"system/rank_{r}_peak_rss_megabytes", round(u.peak_rss_bytes / 1e6, 1), now_ms, 0)
                for r, u in sorted(usage.items())
            ]
            metrics += [
                Metric(f"system/rank_{r}_peak_gpu_memory_megabytes", round(u.peak_gpu_memory_bytes / 1e6, 1), now_ms, 0)
                for r, u in sorted(usage.items())
                if u.peak_gpu_memory_bytes is not None
            ]
            self._client.log_batch(self.run_id, metrics=metrics, synchronous=True)

    def _log_step_times(self, rd: RunDir, world_size: int) -> None:
        """Each rank's step times (:func:`sgpu_magic.runtime.step`, or its optimizer's steps) as
        ``step_time_s/rank_<r>``, read from its metrics file here (:func:`step_time_points`), so no rank imports mlflow
        for them."""
        from mlflow.entities import Metric

        from sgpu_magic._util.metrics import decode_records, name_id

        assert self._client is not None and self.run_id is not None  # called by _finish, for a tracked job
        metrics = []
        for rank in range(world_size):
            path = rd.metrics_file(rank)
            if not path.exists():
                continue
            records, _ = decode_records(path.read_bytes())
            steps = records[records["name"] == name_id(STEP_TIME)].tolist()  # only these become Python objects
            points = step_time_points([(STEP_TIME, value, step, time_ms) for _, value, step, time_ms in steps], rank)
            metrics += [Metric(name, value, time_ms, step) for name, value, step, time_ms in points]
        for start in range(0, len(metrics), 1000):  # MLflow's limit per batch
            self._client.log_batch(self.run_id, metrics=metrics[start : start + 1000], synchronous=True)

    def _end_rank_runs(self, status: str, ended_s: float) -> None:
        """End the ranks' own runs (``mlflow.start_run()`` in a rank) that are still RUNNING (a rank killed inside
        its ``with`` block) with the job's status, so no run of the job is left RUNNING."""
        assert self._client is not None and self.run_id is not None and self.experiment_id is not None  # tracked
        try:
            left = self._client.search_runs(
                [self.experiment_id],
                f"tags.mlflow.parentRunId = '{self.run_id}' and tags.`{RANK_TAG}` != '' and attributes.status = 'RUNNING'",
            )
            for run in left:
                self._client.set_terminated(run.info.run_id, status, end_time=int(ended_s * 1000))
        except Exception as exc:  # noqa: BLE001 - the job's own run is ended below all the same
            _warn(f"could not end the rank runs of MLflow run {self.run_id}: {type(exc).__name__}: {exc}")

    def _stop_monitor(self) -> None:
        """Stop the system metrics monitor and log one last sample (a job shorter than the sampling
        interval would otherwise have none)."""
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        try:
            stop_system_metrics(monitor)
        except Exception:  # noqa: BLE001 - system metrics are optional
            pass

    def _log_profile(self, job: Job) -> None:
        """A profiled job's merged trace as the artifact ``profile/trace.json`` (none when no rank recorded one)."""
        if not job.profile_summary():
            return
        assert self._client is not None and self.run_id is not None  # called by finished, for a tracked job
        self._client.log_artifact(self.run_id, str(job.profile_trace()), artifact_path="profile")

    def _log_artifacts(self, rd: RunDir) -> None:
        assert self._client is not None and self.run_id is not None  # called by finished, for a tracked job
        for folder in (rd.logs_dir, rd.errors_dir, rd.stacks_dir):
            sub = folder.name
            files = sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
            for path in files:
                self._client.log_artifact(self.run_id, str(path), artifact_path=sub)
