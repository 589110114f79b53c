"""Rank side of MLflow tracking: a rank never ends the job's MLflow run, and flushes its async logging.

The kernel creates the job's run and passes it to the ranks as ``MLFLOW_RUN_ID`` (and
``SGPU_MAGIC_MLFLOW_RUN_ID``, which MLflow does not consume). A rank that calls ``mlflow.log_metric``
adopts that run, and one that runs ``with mlflow.start_run(): ...`` or ``mlflow.end_run()`` would
mark it FINISHED while the other ranks still run (or FAILED for one rank's error). So, once
``mlflow.tracking.client`` is imported in a rank, ``MlflowClient.set_terminated`` skips that one
run; the kernel sets the run's final status when the job ends. mlflow itself is not imported
here (it takes seconds): a post-import hook patches it when the rank's code imports it.
"""

from __future__ import annotations

import functools
import os
import sys

from sgpu_magic._util.imports import AfterImport

RUN_ID_ENV = "SGPU_MAGIC_MLFLOW_RUN_ID"
_CLIENT_MODULE = "mlflow.tracking.client"


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
    """Keep this process from ending the job's run (``SGPU_MAGIC_MLFLOW_RUN_ID``), now or once mlflow is imported."""
    run_id = os.environ.get(RUN_ID_ENV)
    if not run_id:
        return
    if _CLIENT_MODULE in sys.modules:
        _patch(sys.modules[_CLIENT_MODULE], run_id)
        return
    patch = functools.partial(_patch, run_id=run_id)
    for finder in sys.meta_path:
        if isinstance(finder, AfterImport) and finder.name == _CLIENT_MODULE:
            finder.callback = patch
            return
    sys.meta_path.insert(0, AfterImport(_CLIENT_MODULE, patch))


def _tracking_store_exists() -> bool:
    """Whether this process has built an MLflow tracking store (only then can async logging hold points).

    MLflow caches its stores on ``TrackingStoreRegistry._get_store_with_resolved_uri`` (an lru_cache);
    where that private detail differs (another mlflow version), assume a store exists.
    """
    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    registry = getattr(utils, "_tracking_store_registry", None)
    cached = getattr(type(registry), "_get_store_with_resolved_uri", None)
    try:
        return cached.cache_info().currsize > 0  # type: ignore[union-attr] # None: AttributeError, caught below
    except Exception:  # noqa: BLE001 - unknown layout: flushing is harmless
        return True


def flush_async_logging() -> None:
    """Wait until MLflow's async logging queue of this rank is written (``mlflow.flush_async_logging()``).

    Ranks of a tracked job log asynchronously (``MLFLOW_ENABLE_ASYNC_LOGGING``, set by the kernel), so
    ``mlflow.log_metric`` returns at once and a background thread writes the points in batches; this
    runs when the rank's code has ended, before the rank reports, so no point is lost. It does nothing
    when the rank never imported mlflow or never logged (building a store would cost seconds). A
    failure is written to the rank's log, never raised: the user code's outcome stands.
    """
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or not hasattr(mlflow, "flush_async_logging") or not _tracking_store_exists():
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
