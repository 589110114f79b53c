"""MLflow tracking: one run per job, created and ended by the kernel.

:class:`MlflowTracking` is a :class:`~sgpu_magic.job.handle.JobSink`. Before the ranks start it creates
one MLflow run (nested under the kernel's active run, if any) and hands the ranks its identity
through their environment (``MLFLOW_TRACKING_URI``, ``MLFLOW_RUN_ID``, ``MLFLOW_EXPERIMENT_ID``,
``MLFLOW_EXPERIMENT_NAME``), so plain ``mlflow.log_metric(...)`` in rank code lands in the job's
run. Rank metrics are logged with MLflow's async logging by default (:data:`ASYNC_LOGGING_ENV`),
flushed before each rank reports (:func:`sgpu_magic.rank.mlflow_guard.flush_async_logging`).
Ranks never end the run (the worker makes MLflow skip ``set_terminated`` for it); the kernel
sets the final status when the job ends: FINISHED on success, FAILED when a rank fails, KILLED on
cancel, timeout or interrupt. If the kernel dies while the job runs, the launch host marks the run
KILLED on its way down. At the end the rank logs (``logs/rank_N.log``) and the ranks' error files
(``errors/rank_N.json``) are attached as artifacts; CPU, memory, disk and network metrics (GPU
too, through NVML) are recorded with MLflow's system metrics monitor while the job runs.

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

import getpass
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from sgpu_magic.errors import SgpuError
from sgpu_magic._util.redact import redact
from sgpu_magic.job.handle import JobSink, JobState
from sgpu_magic._util.kernel_log import divert_info
from sgpu_magic.rank.mlflow_guard import RUN_ID_ENV
from sgpu_magic.rundir import RunDir, atomic_write_bytes, default_root, make_private_dir

if TYPE_CHECKING:
    from sgpu_magic.job.handle import Job
    from sgpu_magic.launch.resources import DevicePlan
    from sgpu_magic.spec import LaunchSpec

DEFAULT_EXPERIMENT = "sgpu_magic"
"""Experiment for jobs when neither the kernel, the environment nor a notebook name gives one."""


STORE_LOGGERS = ("mlflow.store.db.utils", "alembic.runtime.migration")
"""Loggers whose INFO lines (a new store's tables and migrations) go to the kernel log, not the cell."""

UI_READY_TIMEOUT_S = 120.0
_STATUS = {JobState.SUCCEEDED: "FINISHED", JobState.FAILED: "FAILED"}  # every other final state: KILLED


class MlflowUIError(SgpuError):
    """The local MLflow UI server could not be started."""


# ----------------------------------------------------------------------------- import and URIs

_warm_thread: threading.Thread | None = None


def warm_up(after: Path | None = None, max_wait_s: float = 30.0) -> None:
    """Import mlflow in a background thread (about 2 s of CPU), so the first tracked job does not wait for it.

    ``after``: start only once this file exists (the launch host's warm marker: its forkserver has
    finished preloading) or ``max_wait_s`` have passed, so that on a machine with few cores the
    import does not slow down the forkserver, nor hold the GIL while the notebook's first cell
    imports torch. A tracked job that comes earlier imports mlflow itself.
    """
    global _warm_thread
    if _warm_thread is None and "mlflow" not in sys.modules:
        def _import() -> None:
            deadline = time.monotonic() + max_wait_s
            while after is not None and not after.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            try:
                import mlflow  # noqa: F401
            except Exception:  # noqa: BLE001 - the job reports it when it needs mlflow
                pass

        _warm_thread = threading.Thread(target=_import, name="sgpu_magic-mlflow-import", daemon=True)
        _warm_thread.start()


def absolute_tracking_uri(uri: str) -> str:
    """``uri`` with a relative local path made absolute (ranks may run elsewhere than the kernel's cwd).

    ``sqlite:///mlflow.db`` -> ``sqlite:////<cwd>/mlflow.db``; ``mlruns`` -> ``/<cwd>/mlruns``;
    ``file:mlruns`` -> ``file:///<cwd>/mlruns``; server and database URIs are returned as they are.
    """
    if uri.startswith("sqlite:///"):
        path, sep, query = uri[len("sqlite:///"):].partition("?")
        if path and not path.startswith("/") and path != ":memory:":
            path = quote(os.path.abspath(unquote(path)))
            return "sqlite:///" + path + sep + query
        return uri
    parts = urlsplit(uri)
    if not parts.scheme:
        return os.path.abspath(uri)
    if parts.scheme == "file" and not parts.netloc and not parts.path.startswith("/"):
        return "file://" + quote(os.path.abspath(unquote(parts.path)))
    return uri


def _sqlite_dir(uri: str) -> Path | None:
    """The directory of a local sqlite store's database file, else ``None``."""
    if not uri.startswith("sqlite:////"):
        return None
    path = unquote(uri[len("sqlite:///"):].partition("?")[0])
    return Path(path).parent


def notebook_path() -> str | None:
    """The notebook this kernel runs, as Jupyter names it (``JPY_SESSION_NAME``), or ``None``."""
    return os.environ.get("JPY_SESSION_NAME") or None


def _http_base(uri: str) -> str | None:
    """``uri`` without credentials and trailing slash when it is an http(s) server, else ``None``."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return None
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def run_link(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page: on the tracking server for an http(s) URI, else on the ``%mlflow_ui`` server if
    one runs for this URI, else ``None``."""
    base = _http_base(tracking_uri) or ui_base_url(tracking_uri)
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}" if base else None


def _warn(text: str) -> None:
    sys.stderr.write(f"sgpu_magic warning: {redact(text)}\n")
    sys.stderr.flush()


# ----------------------------------------------------------------------------- the sink

MLFLOW_ENDED_MARK = "mlflow_ended"
"""File the kernel leaves in a run dir once it has ended the job's MLflow run."""


def _fluent_context() -> tuple[tuple[str, str] | None, str | None]:
    """``((run id, experiment id) of the active run or None, experiment set by mlflow.set_experiment)``.

    Nothing is active when mlflow has not been imported by the user."""
    if "mlflow" not in sys.modules:
        return None, None
    import mlflow
    from mlflow.tracking import fluent

    run = mlflow.active_run()
    parent = (run.info.run_id, str(run.info.experiment_id)) if run is not None else None
    return parent, getattr(fluent, "_active_experiment_id", None)


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

    Attributes (after ``prepare``): ``tracking_uri``, ``experiment_id``, ``run_id``; ``None`` when
    tracking could not start, in which case the job runs untracked after a warning.
    """

    needs_every_line = False  # it reads no output (logs are attached from the files at the end)

    def __init__(self, default_experiment: str = DEFAULT_EXPERIMENT, ui: bool = False) -> None:
        self.default_experiment = default_experiment or DEFAULT_EXPERIMENT
        self.ui = ui
        self.tracking_uri: str | None = None
        self.experiment_id: str | None = None
        self.run_id: str | None = None
        self._experiment_name: str | None = None
        self._client = None
        self._monitor = None
        # read here, in the thread that starts the job: MLflow's active run is thread-local, and a
        # background job prepares its run on another thread
        self._parent_run, self._active_experiment_id = _fluent_context()

    # -- before launch

    def prepare(self, job_id: str, spec: "LaunchSpec", plan: "DevicePlan") -> dict:
        """Create the run; return the ranks' MLflow environment and the host's ``mlflow`` entry."""
        try:
            self._create_run(job_id, spec, plan)
        except Exception as exc:  # noqa: BLE001 - tracking must never stop a job
            self._terminate("FAILED", time.time())
            self.run_id = None
            _warn(f"MLflow tracking is off for job {job_id}: {type(exc).__name__}: {exc}")
            return {}
        except BaseException:  # interrupted while the run was being set up: the job does not start
            self._terminate("KILLED", time.time())
            raise
        env = {"MLFLOW_TRACKING_URI": self.tracking_uri, "MLFLOW_RUN_ID": self.run_id,
               "MLFLOW_EXPERIMENT_ID": self.experiment_id, "MLFLOW_EXPERIMENT_NAME": self._experiment_name,
               RUN_ID_ENV: self.run_id,
               # the kernel records system metrics for the job; a rank adopting the run must not too
               "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false", **rank_logging_env(os.environ),
               **self._registry_env()}
        return {"env": env, "mlflow": {"tracking_uri": self.tracking_uri, "run_id": self.run_id,
                                       "experiment_id": self.experiment_id}}

    def _registry_env(self) -> dict[str, str]:
        """``MLFLOW_REGISTRY_URI`` for the ranks: the kernel's registry URI (MLflow's default: the tracking URI).

        Where it is not set, every ``MlflowClient()`` MLflow makes (two per fluent ``log_metric``) looks
        for a Spark session, a failed ``import pyspark`` each time: 1.3 ms of a 1.5 ms ``log_metric`` here.
        """
        if "MLFLOW_REGISTRY_URI" in os.environ:  # reaches the ranks with the rest of the kernel's environment
            return {}
        import mlflow

        try:
            registry = mlflow.get_registry_uri()
            same = registry == mlflow.get_tracking_uri()
        except Exception:  # noqa: BLE001 - only a speed-up: the ranks then resolve it themselves
            return {}
        return {"MLFLOW_REGISTRY_URI": self.tracking_uri if same else registry} if registry else {}

    def _create_run(self, job_id: str, spec: "LaunchSpec", plan: "DevicePlan") -> None:
        import mlflow
        from mlflow import MlflowClient
        from mlflow.entities import Param

        divert_info(*STORE_LOGGERS)  # a new store's "Creating initial MLflow database tables" is not for the cell
        uri = absolute_tracking_uri(mlflow.get_tracking_uri())
        client = MlflowClient(uri)
        parent = self._parent_run
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
        run = client.create_run(experiment_id, run_name=spec.name, tags=tags)
        self._client, self.tracking_uri, self.run_id = client, uri, run.info.run_id
        self.experiment_id, self._experiment_name = experiment_id, name
        params = {"gpus": spec.gpus, "gpu_type": spec.gpu_type or "any",
                  "device": plan.gpus[0].name if plan.gpus else "cpu", "world_size": plan.world_size,
                  "backend": plan.backend, "timeout_s": "none" if spec.timeout_s is None else f"{spec.timeout_s:g}",
                  "name": spec.name, "max_restarts": spec.max_restarts}
        client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in params.items()])

    def _experiment(self, client, uri: str, parent) -> tuple[str, str]:
        """(id, name) of the experiment for the run: see the module docstring for the order."""
        chosen = parent[1] if parent is not None else self._active_experiment_id
        if chosen:
            return str(chosen), client.get_experiment(str(chosen)).name
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if name:
            return self._get_or_create(client, uri, name), name
        chosen = os.environ.get("MLFLOW_EXPERIMENT_ID")
        if chosen:
            return chosen, client.get_experiment(chosen).name
        notebook = notebook_path()
        name = (Path(notebook).stem if notebook else "") or self.default_experiment
        return self._get_or_create(client, uri, name), name

    @staticmethod
    def _get_or_create(client, uri: str, name: str) -> str:
        from mlflow.exceptions import MlflowException

        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            db_dir = _sqlite_dir(uri)
            location = None
            if db_dir is not None:
                location = (db_dir / "mlruns" / (re.sub(r"[^\w.-]+", "_", name).strip("._") or "experiment")).as_uri()
            try:
                return client.create_experiment(name, artifact_location=location)
            except MlflowException:
                experiment = client.get_experiment_by_name(name)  # created meanwhile by another kernel
                if experiment is None:
                    raise
        if experiment.lifecycle_stage != "active":
            raise SgpuError(f"the MLflow experiment {name!r} is deleted; restore it with "
                            f"MlflowClient().restore_experiment({experiment.experiment_id!r}) or pick another "
                            f"with mlflow.set_experiment(...)")
        return experiment.experiment_id

    # -- while the job runs

    def started(self, job: "Job") -> None:
        """Name the run on the job (``job.mlflow_run_id``); start the system metrics monitor."""
        if self.run_id is None:
            return
        job.mlflow_run_id = self.run_id
        if self.ui and _http_base(self.tracking_uri) is None:
            try:
                start_ui(self.tracking_uri, wait=False)
            except Exception as exc:  # noqa: BLE001 - the link is a convenience
                _warn(f"the MLflow UI did not start: {exc}")
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # its INFO lines ("Started monitoring system metrics.") would land in every cell's output
            logging.getLogger(SystemMetricsMonitor.__module__).setLevel(logging.WARNING)
            self._monitor = SystemMetricsMonitor(self.run_id, tracking_uri=self.tracking_uri)
            self._monitor.start()
        except Exception:  # noqa: BLE001 - system metrics are optional (psutil/NVML missing, ...)
            self._monitor = None

    def finished(self, job: "Job") -> None:
        """Stop the monitor, attach logs and error files, then set the final status and end time."""
        if self.run_id is None:
            return
        status = _STATUS.get(job.state, "KILLED")
        ended_s = job._status().get("ended_s") or time.time()
        try:
            self._stop_monitor()
            raw = job._status().get("state", job.state.value)
            self._client.set_tag(self.run_id, "sgpu_magic.state", raw)
            self._log_artifacts(RunDir(job.run_dir))
        except Exception as exc:  # noqa: BLE001 - the job's result matters more than its artifacts
            _warn(f"could not attach the logs of job {job.job_id} to MLflow run {self.run_id}: "
                  f"{type(exc).__name__}: {exc}")
        finally:
            self._terminate(status, ended_s)
            # tells the launch host this run needs nothing from it when it exits (no mlflow import there)
            atomic_write_bytes(RunDir(job.run_dir).path / MLFLOW_ENDED_MARK, b"")  # 0600, as every run dir file

    def run_url(self) -> str | None:
        """The run's page (``job.run_url``): on the tracking server, or on the ``%mlflow_ui`` server running
        for the store now; ``None`` when there is neither, or the job is not tracked."""
        if self.run_id is None:
            return None
        return run_link(self.tracking_uri, self.experiment_id, self.run_id)

    def launch_failed(self, job_id: str, error: BaseException) -> None:
        """The job never started: end its run FAILED (KILLED when the launch was interrupted)."""
        self._stop_monitor()
        self._terminate("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED", time.time())

    def _terminate(self, status: str, ended_s: float) -> None:
        if self.run_id is None or self._client is None:
            return
        try:
            self._client.set_terminated(self.run_id, status, end_time=int(ended_s * 1000))
        except Exception as exc:  # noqa: BLE001
            _warn(f"could not set MLflow run {self.run_id} to {status}: {type(exc).__name__}: {exc}")

    def _stop_monitor(self) -> None:
        """Stop the system metrics monitor and log one last sample (a job shorter than the sampling
        interval would otherwise have none)."""
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        try:
            monitor.finish()
            monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()
        except Exception:  # noqa: BLE001 - system metrics are optional
            pass

    def _log_artifacts(self, rd: RunDir) -> None:
        for sub in ("logs", "errors"):
            folder = rd.path / sub
            files = sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
            for path in files:
                self._client.log_artifact(self.run_id, str(path), artifact_path=sub)


# ----------------------------------------------------------------------------- the local UI server

_WATCHDOG = r"""
import os, select, signal, subprocess, sys, time
kernel_pid = int(sys.argv[1])
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
server = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL)
try:
    while server.poll() is None:
        ready, _, _ = select.select([0], [], [], 0.5)
        if (ready and not os.read(0, 4096)) or os.getppid() != kernel_pid:
            break  # the kernel closed the pipe, or it is gone
finally:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(0, signal.SIGTERM)  # the server and what it started share this session's group
    except OSError:
        pass
    deadline = time.monotonic() + 2  # uvicorn stops in ~0.3 s; the CLI parent's own exit can take seconds
    while server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    me, group = os.getpid(), os.getpgid(0)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            try:
                if os.getpgid(int(entry)) == group:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass
sys.exit(server.returncode or 0)
"""
"""Runs as the UI server's parent in a session of its own: stops the server's process group when the
kernel closes the pipe or dies (checked every 0.5 s), so the server never outlives the kernel."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowUI:
    """A local ``mlflow server`` for one tracking URI on 127.0.0.1, which dies with the kernel.

    Attributes:
        backend_uri: the tracking URI it serves.
        url: ``http://127.0.0.1:<port>``.
        log_path: the server's output.
    """

    def __init__(self, backend_uri: str, port: int | None = None) -> None:
        self.backend_uri = backend_uri
        if port:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    raise MlflowUIError(f"port {port} on 127.0.0.1 is in use; pick another with --port, "
                                        f"or leave it out for a free one") from None
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        folder = make_private_dir(default_root() / "mlflow-ui")
        self.log_path = folder / f"server-{os.getpid()}-{self.port}.log"
        cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_uri,
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        # no job runner (2 processes instead of 15); no usage telemetry, whose flush held up the server's exit ~4 s
        env = {"MLFLOW_DISABLE_TELEMETRY": "true", **os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        cwd = _sqlite_dir(backend_uri) or folder
        with os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            self._proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), *cmd],
                                          stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True, env=env, cwd=str(cwd))
        self.pid = self._proc.pid
        """The watchdog's pid; the server runs in its process group (``os.killpg(pid, ...)``)."""

    def alive(self) -> bool:
        return self._proc.poll() is None

    def answers(self) -> bool:
        """Whether the server answers ``/health``."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = UI_READY_TIMEOUT_S) -> None:
        """Block until the server answers; raise :class:`MlflowUIError` if it exits or takes too long."""
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            if not self.alive():
                raise MlflowUIError(f"the MLflow UI server exited with code {self._proc.returncode}; "
                                    f"see {self.log_path}:\n{_tail(self.log_path)}")
            if time.monotonic() > deadline:
                raise MlflowUIError(f"the MLflow UI server did not answer on {self.url} within {timeout_s:g} s; "
                                    f"see {self.log_path}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop the server (its watchdog stops the whole group) and wait until it is gone."""
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass
            self._proc.wait()


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


_ui: MlflowUI | None = None
_ui_lock = threading.Lock()


def start_ui(tracking_uri: str | None = None, port: int | None = None, wait: bool = True,
             timeout_s: float = UI_READY_TIMEOUT_S) -> MlflowUI:
    """Start (or reuse) the local MLflow UI server for ``tracking_uri`` (default: the kernel's) on ``port``
    of 127.0.0.1 (default: a free one).

    One server per kernel: asking for another URI or port stops the previous one. With ``wait``,
    return once it answers (about 10 s for a fresh server).

    Raises:
        MlflowUIError: the URI is already a server, the port is in use, or the server exited or did
            not answer within ``timeout_s``.
    """
    global _ui
    if tracking_uri is None:
        import mlflow

        tracking_uri = absolute_tracking_uri(mlflow.get_tracking_uri())
    if _http_base(tracking_uri) is not None:
        raise MlflowUIError(f"the tracking URI {redact(tracking_uri)} is already an MLflow server; open it directly")
    with _ui_lock:
        ui = _ui
        if ui is None or not ui.alive() or ui.backend_uri != tracking_uri or (port and ui.port != port):
            if ui is not None:
                ui.stop()
            ui = _ui = MlflowUI(tracking_uri, port)
    if wait:
        try:
            ui.wait_ready(timeout_s)
        except MlflowUIError:
            with _ui_lock:
                if _ui is ui:
                    _ui = None
            ui.stop()
            raise
    return ui


def stop_ui() -> bool:
    """Stop the local MLflow UI server; ``False`` if none ran."""
    global _ui
    with _ui_lock:
        ui, _ui = _ui, None
    if ui is None:
        return False
    ui.stop()
    return True


def ui_base_url(tracking_uri: str) -> str | None:
    """The ``%mlflow_ui`` server's URL if one runs for ``tracking_uri``, else ``None``."""
    ui = _ui
    return ui.url if ui is not None and ui.alive() and ui.backend_uri == tracking_uri else None
