"""A job's life cycle as the layers above see it (:class:`JobState`: the one state vocabulary,
:class:`sgpu_magic.wire.RunState`, under its public name), read from its launcher's status."""

from __future__ import annotations

from typing import Any

from sgpu_magic.wire import read_state
from sgpu_magic.wire.state import JobState

__all__ = ["JobState", "state_from_status"]


def state_from_status(status: dict[str, Any]) -> JobState:
    """The state a ``status.json`` object holds (a cancel by a kernel interrupt is CANCELLED, its stop reason
    ``interrupted``; see :func:`sgpu_magic.wire.read_state`)."""
    return read_state(status)[0]
