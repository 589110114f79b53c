"""The jobs this process (the kernel) has started: what ``%distributed_jobs`` lists."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sgpu_magic.job.handle import Job

_JOBS: list[Job] = []
_JOBS_LOCK = threading.Lock()


def jobs() -> list[Job]:
    """Every job started in this process (kernel), oldest first."""
    with _JOBS_LOCK:
        return list(_JOBS)


def register(job: Job) -> None:
    """Add a job that was just created."""
    with _JOBS_LOCK:
        _JOBS.append(job)


def forget(job: object) -> None:
    """Drop a job that never started (refused before anything ran): it is not one of the kernel's jobs."""
    with _JOBS_LOCK:
        _JOBS[:] = [j for j in _JOBS if j is not job]
