"""A job's life cycle as the layers above see it (:class:`JobState`), read from the launch host's status."""

from __future__ import annotations

import enum
from typing import Any


class JobState(enum.Enum):
    """Life cycle of a job. Final states: SUCCEEDED, FAILED, CANCELLED, TIMED_OUT."""

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def final(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.TIMED_OUT)

    @property
    def label(self) -> str:
        """The state in words, as the panel, the summary line and the job table show it: ``timed out``."""
        return self.value.replace("_", " ")


def state_from_status(status: dict[str, Any]) -> JobState:
    """The host writes JobState values, plus ``interrupted`` (a cancel caused by a kernel interrupt)."""
    raw = status.get("state", "pending")
    return JobState.CANCELLED if raw == "interrupted" else JobState(raw)
