"""Rank side of MLflow tracking: a rank never ends the job's MLflow run, and flushes its async logging.

The kernel creates the job's run while the ranks start (never on the launch's path) and writes its identity into
the run directory (``mlflow.json``, whose path the ranks get as ``SGPU_MAGIC_MLFLOW_RUN_FILE``). A rank adopts it
when it first needs it: once its code imports mlflow, or its first :func:`sgpu_magic.runtime.log_metric` point goes
to MLflow (waiting for the file, at most :data:`RUN_WAIT_S`, if the run is not made yet). It then sets
``MLFLOW_TRACKING_URI``, ``MLFLOW_RUN_ID``, ``MLFLOW_EXPERIMENT_ID``, ``MLFLOW_EXPERIMENT_NAME`` (and
``MLFLOW_REGISTRY_URI``) in its environment, as the ranks' environment had them when the kernel made the run before
the launch, and ``SGPU_MAGIC_MLFLOW_RUN_ID`` (which MLflow does not consume). A rank that calls ``mlflow.log_metric``
adopts that run, and one that runs ``with mlflow.start_run(): ...`` or ``mlflow.end_run()`` would
mark it FINISHED while the other ranks still run (or FAILED for one rank's error). So, once
``mlflow.tracking.client`` is imported in a rank, ``MlflowClient.set_terminated`` skips that one
run; the kernel sets the run's final status when the job ends. mlflow itself is not imported
here (it takes seconds): a post-import hook patches it when the rank's code imports it.

Once ``mlflow`` itself is imported in a tracked rank, three of its fluent functions are wrapped:

- ``mlflow.log_metric`` / ``mlflow.log_metrics`` log to MLflow as before, then record the same points in the
  rank's metrics file (:mod:`sgpu_magic._util.metrics`), so the panel and ``job.metrics()`` show them;
- ``mlflow.start_run()`` with no ``run_id`` and no run of the user's own active opens this rank's child run
  (``<run_name or "rank"> <r>``, tag ``sgpu_magic.rank``, nested under the job's run) instead of resuming the
  job's one run, so code written for one process (``with mlflow.start_run(): mlflow.log_param("seed",
  seed)``) logs per-rank params without clashing. ``start_run(run_id=...)`` and ``parent_run_id=...`` do what
  MLflow does.

:func:`sgpu_magic.runtime.log_metric` points reach MLflow through :func:`forward_metrics`, from the metrics
writer's thread.
"""

from __future__ import annotations

import functools
import os
import sys
import time

from sgpu_magic._compat.imports import import_mlflow
from sgpu_magic._compat.mlflow import tracking_store_built
from sgpu_magic._util.imports import after_import
from sgpu_magic._util.metrics import WRITER, Point
from sgpu_magic._util.mlflow_run import RUN_FILE_ENV, RUN_ID_ENV, job_run_id, run_env  # noqa: F401 - run_env: for Ray

_CLIENT_MODULE = "mlflow.tracking.client"
_FLUENT_MODULE = "mlflow"
RANK_TAG = "sgpu_magic.rank"
"""The tag of a rank's own run (``mlflow.start_run()`` in a rank), its value the rank."""


def _patch(module, run_id: str) -> None:
    cls = module.MlflowClient
    original = cls.set_terminated
    if getattr(original, "__sgpu_guarded__", None) == run_id:
        return

    @functools.wraps(original)
    def set_terminated(self, run_id_arg, *args, **kwargs):
        if run_id_arg == run_id:
            return None  # the kernel owns this run's status
        return original(self, run_id_arg, *args, **kwargs)

    set_terminated.__sgpu_guarded__ = run_id  # type: ignore[attr-defined] # a marker on the function object
    cls.set_terminated = set_terminated


def guard_job_run() -> None:
    """In a tracked rank (``SGPU_MAGIC_MLFLOW_RUN_FILE`` or ``SGPU_MAGIC_MLFLOW_RUN_ID`` set), once mlflow is
    imported: adopt the job's run (:func:`job_run_id`), keep this process from ending it, record
    ``mlflow.log_metric(s)`` points in the metrics file, turn ``mlflow.start_run()`` into the rank's child run; and
    send :func:`sgpu_magic.runtime.log_metric` points to MLflow."""
    job_run_id.cache_clear()  # a warm rank forked from a process that resolved one already (never: but cheap)
    if not os.environ.get(RUN_ID_ENV) and not os.environ.get(RUN_FILE_ENV):
        WRITER.forward = None
        return
    WRITER.forward = forward_metrics
    after_import(_CLIENT_MODULE, _patch_once_known)
    after_import(_FLUENT_MODULE, _patch_fluent_once_known)


def _patch_once_known(module) -> None:
    run_id = job_run_id()
    if run_id is not None:
        _patch(module, run_id)


def _patch_fluent_once_known(mlflow) -> None:
    run_id = job_run_id()
    if run_id is not None:
        _patch_fluent(mlflow, run_id)


def _record(metrics: dict, step, timestamp) -> None:
    """Record points MLflow has just accepted in the metrics file (with the step MLflow stores: 0 when none)."""
    time_ms = int(timestamp) if timestamp is not None else int(time.time() * 1000)
    for key, value in metrics.items():
        try:
            WRITER.record(str(key), float(value), int(step or 0), time_ms, None, forward=False)
        except (TypeError, ValueError):
            continue  # MLflow took it but it is no number here (a str "1.5"): the file keeps numbers only


def _patch_fluent(mlflow, job_run: str) -> None:
    """Wrap ``mlflow.log_metric``, ``mlflow.log_metrics`` and ``mlflow.start_run`` (see the module docstring)."""
    if getattr(mlflow.start_run, "__sgpu_guarded__", None) == job_run:
        return
    log_metric, log_metrics, start_run = mlflow.log_metric, mlflow.log_metrics, mlflow.start_run
    if hasattr(start_run, "__sgpu_guarded__"):  # wrapped for another run (a session rank): wrap MLflow's own
        log_metric, log_metrics, start_run = log_metric.__wrapped__, log_metrics.__wrapped__, start_run.__wrapped__

    @functools.wraps(log_metric)
    def log_metric_too(key, value, step=None, *args, **kwargs):
        result = log_metric(key, value, step, *args, **kwargs)
        _record({key: value}, step, kwargs.get("timestamp"))
        return result

    @functools.wraps(log_metrics)
    def log_metrics_too(metrics, step=None, *args, **kwargs):
        result = log_metrics(metrics, step, *args, **kwargs)
        _record(metrics, step, kwargs.get("timestamp"))
        return result

    @functools.wraps(start_run)
    def start_rank_run(run_id=None, experiment_id=None, run_name=None, nested=False, *args, **kwargs):
        active = mlflow.active_run()
        if run_id is not None or args or kwargs.get("parent_run_id") or (active and active.info.run_id != job_run):
            return start_run(run_id, experiment_id, run_name, nested, *args, **kwargs)
        child = _create_rank_run(mlflow, job_run, experiment_id, run_name, kwargs)
        return start_run(child, nested=active is not None, log_system_metrics=kwargs.get("log_system_metrics"))

    start_rank_run.__sgpu_guarded__ = job_run  # type: ignore[attr-defined] # a marker on the function object
    mlflow.log_metric, mlflow.log_metrics, mlflow.start_run = log_metric_too, log_metrics_too, start_rank_run
    _keep_job_run_default(sys.modules["mlflow.tracking.fluent"], mlflow, job_run)


def _keep_job_run_default(fluent, mlflow, job_run: str) -> None:
    """MLflow's ``end_run`` unsets ``MLFLOW_RUN_ID``, after which a bare ``mlflow.log_metric`` would create a new
    top-level run; in a rank it sets it back once no run is active, so such calls keep logging to the job's run.
    Wrapped where ``with mlflow.start_run():`` ends it too (the fluent module's own ``end_run``)."""
    end_run = getattr(fluent.end_run, "__wrapped__", fluent.end_run)

    @functools.wraps(end_run)
    def end_run_keeping_the_job_run(*args, **kwargs):
        try:
            return end_run(*args, **kwargs)
        finally:
            if mlflow.active_run() is None:
                os.environ["MLFLOW_RUN_ID"] = job_run

    fluent.end_run = mlflow.end_run = end_run_keeping_the_job_run


def _create_rank_run(mlflow, job_run_id: str, experiment_id, run_name, kwargs: dict) -> str:
    """Create this rank's child run of the job's run; its id."""
    rank = os.environ.get("RANK", "0")
    tags = {
        **(kwargs.get("tags") or {}),
        "mlflow.parentRunId": job_run_id,
        RANK_TAG: rank,
        "sgpu_magic.job_id": os.environ.get("SGPU_MAGIC_JOB_ID", ""),
    }
    if kwargs.get("description"):
        tags["mlflow.note.content"] = kwargs["description"]
    experiment = experiment_id or os.environ.get("MLFLOW_EXPERIMENT_ID")
    client = mlflow.MlflowClient()
    if experiment is None:
        experiment = client.get_run(job_run_id).info.experiment_id
    run = client.create_run(str(experiment), run_name=f"{run_name or 'rank'} {rank}", tags=tags)
    return str(run.info.run_id)


@functools.cache
def _client(mlflow):
    """One ``MlflowClient`` for the forwarded batches (making one looks up the registry: milliseconds)."""
    return mlflow.MlflowClient()


def forward_metrics(batch: list[tuple[str | None, Point]]) -> None:
    """Log a batch of :func:`sgpu_magic.runtime.log_metric` points to MLflow (to each point's run, else the job's),
    synchronously, from the metrics writer's thread; imports mlflow on the first batch (adopting the job's run:
    :func:`job_run_id`). Without a run (tracking could not start) the points stay in the metrics file only. A
    failure is written to the rank's log, never raised."""
    job_run = job_run_id()
    if job_run is None:
        return
    try:
        mlflow, entities = import_mlflow("mlflow.entities")  # only once a point is logged; never beside another thread
        metric = entities.Metric
        client = _client(mlflow)
        by_run: dict[str, list] = {}
        for run_id, (name, value, step, time_ms) in batch:
            by_run.setdefault(run_id or job_run, []).append(metric(name, value, time_ms, step))
        for run_id, metrics in by_run.items():
            for start in range(0, len(metrics), 1000):  # MLflow's limit per batch
                client.log_batch(run_id, metrics=metrics[start : start + 1000], synchronous=True)
    except Exception as exc:  # noqa: BLE001 - the rank's code goes on; the file has the points
        _complain(f"{len(batch)} metric points could not be logged to MLflow ({type(exc).__name__}: {exc})")


def _complain(text: str) -> None:
    try:
        print(f"sgpu_magic: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def flush_async_logging() -> None:
    """Wait until MLflow's async logging queue of this rank is written (``mlflow.flush_async_logging()``).

    Ranks of a tracked job log asynchronously (``MLFLOW_ENABLE_ASYNC_LOGGING``, set by the kernel), so
    ``mlflow.log_metric`` returns at once and a background thread writes the points in batches; this
    runs when the rank's code has ended, before the rank reports, so no point is lost. It does nothing
    when the rank never imported mlflow or never logged (building a store would cost seconds). A
    failure is written to the rank's log, never raised: the user code's outcome stands.
    """
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or not hasattr(mlflow, "flush_async_logging") or not tracking_store_built():
        return
    try:
        mlflow.flush_async_logging()
    except Exception as exc:  # noqa: BLE001
        try:
            print(
                f"sgpu_magic: MLflow's async logging could not be flushed ({type(exc).__name__}: {exc}); "
                f"metrics logged last may be missing from the run",
                file=sys.stderr,
                flush=True,
            )
        except OSError:
            pass


_RUN_OPERATIONS = ("mlflow.utils.async_logging.run_operations", "RunOperations")


def settled_value(value):
    """``value``, except that MLflow's async-logging future becomes ``None`` once its points are written.

    With async logging ``mlflow.log_metric(...)`` returns a ``RunOperations`` future instead of ``None``;
    a cell ending with that call would otherwise make rank 0 send back an object that cannot be pickled.
    The rank gets what synchronous logging returns, as the code was written for.
    """
    kind = type(value)
    if (kind.__module__, kind.__qualname__) != _RUN_OPERATIONS:
        return value
    try:
        value.wait()
    except Exception as exc:  # noqa: BLE001 - the points' fate is MLflow's; the value is None either way
        print(
            f"sgpu_magic: MLflow could not log the points of the last call ({type(exc).__name__}: {exc})",
            file=sys.stderr,
            flush=True,
        )
    return None
