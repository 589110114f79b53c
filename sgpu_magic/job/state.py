"""A job's life cycle as the layers above see it (:class:`JobState`: the one state vocabulary,
:class:`sgpu_magic.wire.RunState`, under its public name), read from its launcher's status (:attr:`sgpu_magic.status.HostStatus.state`)."""

from __future__ import annotations

from sgpu_magic.wire.state import JobState

__all__ = ["JobState"]
