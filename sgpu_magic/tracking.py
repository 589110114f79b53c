"""MLflow tracking of jobs (placeholder until the tracking sink lands)."""

from __future__ import annotations

from .job import JobSink


class MlflowTracking(JobSink):
    """One MLflow run per job (not implemented yet: does nothing)."""
