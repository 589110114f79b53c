"""What a launcher's ranks are to the run machine: :class:`RankGroup`, torch elastic's ``PContext`` shape one level up
(start, poll, pids, stop, close), so that one :class:`~sgpu_magic.launch.machine.RunMachine` drives the ranks of
either launcher the same way.

The launch host's :class:`~sgpu_magic.launch.host.job.HostJob` is one over torch elastic (a ``PContext`` per attempt);
the Ray supervisor (:mod:`sgpu_magic.launch.ray.launcher`) is one over its rank actors. Each keeps its own loop (the
host's ``select`` over all its jobs, the supervisor's thread per job) and calls
:meth:`RunMachine.drive <sgpu_magic.launch.machine.RunMachine.drive>` on every turn; the machine decides what happens
(the timeout, a stop, a restart, the end) and says it in the status.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgpu_magic.launch.stacks import RankStack
    from sgpu_magic.status import RankUsage
    from sgpu_magic.wire.errors import ObservedFailure


@dataclass(frozen=True)
class Started:
    """An attempt's ranks have all started: ``pids`` (``{rank: pid}``, where their launcher's machine has them), the
    rendezvous ``port`` and the facts of how they were started (:data:`~sgpu_magic.launch.machine.NOTES`)."""

    pids: Mapping[int, int]
    port: int | None
    notes: Mapping[str, Any] = field(default_factory=dict)


class RankGroup(ABC):
    """One job's ranks as its launcher runs them, attempt after attempt (torch elastic's ``PContext``, one level up).

    The machine calls :meth:`start_ranks` for each attempt, :meth:`poll_ranks` and :meth:`sample_usage` on each turn of
    the launcher's loop, :meth:`running_pids` and :meth:`take_stacks` before it stops a job that timed out or was
    cancelled, :meth:`stop_ranks` between attempts and to stop a job (also before any attempt has started, or one
    whose start failed part-way), and :meth:`end_ranks` before the final status (once, unless it raised: the
    launcher's error path ends the job again). All from the launcher's loop, except :meth:`take_stacks`, which the
    hang detector also calls from its own thread. A method may block for a moment (the Ray supervisor's poll waits
    up to 50 ms for an outcome) but never for the job's length."""

    @abstractmethod
    def start_ranks(self, attempt: int) -> Started:
        """Start every rank of ``attempt`` (from 1; torchrun's ``TORCHELASTIC_RESTART_COUNT`` is ``attempt - 1``)."""

    @abstractmethod
    def poll_ranks(self) -> list[ObservedFailure] | None:
        """``None`` while the attempt runs on; ``[]`` once every rank has succeeded; else the ranks seen fail (all
        those seen by now, at once; the machine puts the root cause first)."""

    @abstractmethod
    def sample_usage(self) -> Mapping[int, RankUsage] | None:
        """The ranks' latest usage figures when new ones are due (about once a second), else ``None``."""

    @abstractmethod
    def running_pids(self) -> dict[int, int]:
        """``{rank: pid}`` of the ranks of the attempt that still run."""

    @abstractmethod
    def take_stacks(self, ranks: Mapping[int, int]) -> dict[int, RankStack]:
        """The stacks of ``ranks`` (``{rank: pid}``) that still run; a rank that is gone is left out."""

    @abstractmethod
    def stop_ranks(self) -> dict[int, int | None]:
        """Stop every rank of the attempt that still runs (as its launcher stops a rank: torch elastic's SIGTERM, then
        SIGKILL; a Ray agent's SIGKILL) and wait for them, a bounded time; the attempt's exit codes (``None``: one that
        could not be stopped in that time). Nothing started: nothing to stop (``{}``)."""

    @abstractmethod
    def end_ranks(self) -> dict[int, int | None]:
        """What the launcher does once the job is over, before its final status is written (leftovers killed, leases
        given back, logs copied, actors ended or kept warm); the last attempt's exit codes (``{}``: none started)."""
