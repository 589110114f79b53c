"""The jobs this process (the kernel) has started: what ``%distributed_jobs`` and :func:`jobs` list."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sgpu_magic.job.handle import Job

MAX_ENDED_JOBS = 100
"""The kernel's job list (:func:`jobs`, ``%distributed_jobs``) keeps every job that has not ended and the last this
many that have; older ended jobs leave it (a handle the notebook still holds keeps working). A session's cells are
not the kernel's jobs: their session keeps its last cells (``sess.jobs``), and ``%distributed_jobs`` lists the one
that runs under its session."""

_JOBS: list[Job] = []
_JOBS_LOCK = threading.Lock()


def jobs() -> list[Job]:
    """The jobs started in this process (kernel), oldest first: every one that has not ended, and the last
    :data:`MAX_ENDED_JOBS` (100) that have."""
    with _JOBS_LOCK:
        return list(_JOBS)


def register(job: Job | None = None) -> None:
    """Add ``job`` (if given) to the kernel's list, and drop the oldest ended jobs beyond :data:`MAX_ENDED_JOBS`
    (called again whenever a job ends)."""
    with _JOBS_LOCK:
        if job is not None:
            _JOBS.append(job)
        ended = [j for j in _JOBS if j.ended]
        for old in ended[: max(0, len(ended) - MAX_ENDED_JOBS)]:
            _JOBS.remove(old)


def forget(job: object) -> None:
    """Drop a job that never started (refused before anything ran): it is not one of the kernel's jobs."""
    with _JOBS_LOCK:
        _JOBS[:] = [j for j in _JOBS if j is not job]
