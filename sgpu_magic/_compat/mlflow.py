"""MLflow's private internals. Checked against mlflow 3.17.2.

Nothing here imports MLflow: the functions look in ``sys.modules`` (only what the caller has loaded) or are given
MLflow's objects, so a rank that never imported MLflow does not start now. Every private has a fallback.
"""

from __future__ import annotations

import sys
from typing import Any


def active_experiment_id() -> str | None:
    """The experiment ``mlflow.set_experiment`` chose in this process (``mlflow.tracking.fluent``'s private
    ``_active_experiment_id``), or ``None``: none chosen, fluent MLflow not loaded, or the private missing (the
    job's run then goes to sgpu_magic's default experiment, or ``MLFLOW_EXPERIMENT_NAME`` / ``_ID``)."""
    fluent = sys.modules.get("mlflow.tracking.fluent")
    chosen = getattr(fluent, "_active_experiment_id", None)
    return None if chosen is None else str(chosen)


def tracking_store_built() -> bool:
    """Whether this process has built an MLflow tracking store (only then can async logging hold points).

    MLflow caches its stores on ``TrackingStoreRegistry._get_store_with_resolved_uri`` (an ``lru_cache``, private)
    of ``mlflow.tracking._tracking_service.utils._tracking_store_registry`` (private). MLflow not loaded:
    ``False``. A layout that differs (another MLflow): ``True`` (flushing then is harmless).
    """
    if "mlflow" not in sys.modules:
        return False
    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    registry = getattr(utils, "_tracking_store_registry", None)
    cached = getattr(type(registry), "_get_store_with_resolved_uri", None)
    try:
        return bool(cached.cache_info().currsize > 0)  # type: ignore[union-attr] # None: AttributeError, caught
    except Exception:  # noqa: BLE001 - unknown layout: flushing is harmless
        return True


def stop_system_metrics(monitor: Any) -> None:
    """Stop MLflow's ``SystemMetricsMonitor`` ``monitor`` and log one last sample, so a job shorter than the
    sampling interval has one too: ``finish()`` then its undocumented ``collect_metrics()``,
    ``aggregate_metrics()``, ``publish_metrics(...)`` and ``mlflow_logger.flush()``. Missing those: the monitor
    is only finished. Raises what ``finish()`` raises."""
    monitor.finish()
    collect = getattr(monitor, "collect_metrics", None)
    aggregate = getattr(monitor, "aggregate_metrics", None)
    publish = getattr(monitor, "publish_metrics", None)
    logger = getattr(monitor, "mlflow_logger", None)
    if collect is None or aggregate is None or publish is None or logger is None:
        return
    collect()
    publish(aggregate())
    logger.flush()
