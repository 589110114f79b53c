"""A job's life cycle as the layers above see it (:class:`JobState`: the one state vocabulary,
:class:`sgpu_magic.wire.RunState`, under its public name), read from its launcher's status."""

from __future__ import annotations

from typing import Any

from sgpu_magic.wire import RunState, read_state

JobState = RunState
"""Life cycle of a job: PENDING, STARTING, RUNNING, then one final state: SUCCEEDED, FAILED, CANCELLED, TIMED_OUT
(the same enum as :class:`sgpu_magic.wire.RunState`, which every launcher writes)."""


def state_from_status(status: dict[str, Any]) -> JobState:
    """The state a ``status.json`` object holds (a cancel by a kernel interrupt is CANCELLED, its stop reason
    ``interrupted``; see :func:`sgpu_magic.wire.read_state`)."""
    return read_state(status)[0]
