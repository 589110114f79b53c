"""A run's state, the one vocabulary of every launcher and reader (:class:`RunState`), and why a run was stopped
(:class:`StopReason`), as ``status.json`` holds them (its ``state`` and ``stop_reason`` keys).

Status schema history: 1 wrote ``"state": "interrupted"`` for a run cancelled by a kernel interrupt (a pseudo-state);
2 writes ``"state": "cancelled", "stop_reason": "interrupted"``. :func:`read_state` reads both.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from sgpu_magic.errors import RecordError


class JobState(enum.Enum):
    """Life cycle of a run (a job, a session's cell): PENDING (waiting for GPUs), STARTING, RUNNING, then one final
    state: SUCCEEDED, FAILED, CANCELLED, TIMED_OUT. The one state vocabulary of every launcher and reader; public as
    :class:`sgpu_magic.JobState` (the name it prints with, as notebooks show it), :data:`RunState` in the records."""

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def final(self) -> bool:
        return self in _FINAL

    @property
    def label(self) -> str:
        """The state in words, as the panel, the summary line and the job table show it: ``timed out``."""
        return self.value.replace("_", " ")


RunState = JobState
"""The run state of the records (:class:`JobState`: the same enum, under the name a job's state prints with)."""

_FINAL = frozenset({RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED, RunState.TIMED_OUT})


class StopReason(enum.Enum):
    """Why a launcher stopped a run's ranks before they ended on their own; the run's final state follows from it
    (:attr:`state`). On the wire (the host's and keeper's ``cancel`` command, ``status.json``) as its value."""

    CANCELLED = "cancelled"
    """``job.cancel()``, the panel's Stop button, ``%distributed_stop``, or the kernel going away."""
    INTERRUPTED = "interrupted"
    """The kernel was interrupted while it waited for the run (a cancel: the run ends CANCELLED)."""
    TIMED_OUT = "timed_out"
    """The run's ``timeout_s`` passed."""
    FAILED = "failed"
    """A session cell's rank failed while its peers still ran (they would wait for it), or the launcher lost the run."""

    @property
    def state(self) -> RunState:
        """The final state a run stopped for this reason ends in."""
        return {StopReason.TIMED_OUT: RunState.TIMED_OUT, StopReason.FAILED: RunState.FAILED}.get(
            self, RunState.CANCELLED
        )

    @property
    def takes_stacks(self) -> bool:
        """Whether the launcher takes the stacks of the ranks still running before it stops them (where a run hung
        or was stopped says why; a failure's error says it already)."""
        return self is not StopReason.FAILED


def read_state(status: Mapping[str, Any]) -> tuple[RunState, StopReason | None]:
    """A ``status.json`` object's state and stop reason, of schema 1 (``"interrupted"`` as a state) or 2.

    Raises:
        RecordError: its ``state`` is not one this version knows (the message names it).
    """
    raw = status.get("state", RunState.PENDING.value)
    reason = status.get("stop_reason")
    if raw == StopReason.INTERRUPTED.value:  # schema 1
        return RunState.CANCELLED, StopReason.INTERRUPTED
    try:
        return RunState(raw), None if reason is None else StopReason(reason)
    except ValueError:
        raise RecordError(
            f"status.json has state {raw!r} / stop reason {reason!r}, which this sgpu_magic does not know: the run "
            "was written by a newer sgpu_magic; use that version to read it (pip install -U sgpu_magic)"
        ) from None
