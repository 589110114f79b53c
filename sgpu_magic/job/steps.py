"""The straggler check: which rank, if any, takes longer than the others to do its share of each step.

Every rank of a synchronous job ends a step together (each waits in the step's collectives for the slowest), so
the step's wall time is about the same on every rank and says nothing of who is slow. What differs is the time a
rank spends *outside* collectives, its busy time (``step_time_s - step_collective_s``, recorded by
:mod:`sgpu_magic.rank.steps`): the straggler's is longer, and its peers wait in the collective for as long.

A rank is the straggler when, over the last ``RECENT_STEPS`` (50) steps every rank has recorded:

- the median of its busy time is more than :data:`RATIO` (1.2) times the median of the other ranks' medians, and at
  least :data:`MIN_EXCESS_S` longer (so scheduler noise on steps of a few milliseconds is never named);
- it was the busiest rank in at least :data:`CONSISTENCY` (3 in 4) of those steps: a rank that is slow because it
  has less of the machine for a while (8 ranks sharing 2 cores) is the busiest in some steps and not others, while a
  rank with more to do (an uneven shard, a slow device) is the busiest in nearly every one;
- every rank has recorded :data:`MIN_STEPS` (10) steps.

Only the slowest rank is named.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

RATIO = 1.2
"""A rank is a straggler when its median busy time is more than this many times the median rank's."""

MIN_EXCESS_S = 0.005
"""... and longer than the median rank's by at least this many seconds."""

MIN_STEPS = 10
"""No rank is named before every rank has recorded this many steps."""

CONSISTENCY = 0.75
"""... and it was the busiest rank in at least this share of the steps the medians are over."""


@dataclass(frozen=True)
class Straggler:
    """The slowest rank of a job, as the straggler check found it.

    Attributes:
        rank: the global rank.
        ratio: its median busy time over the median rank's.
        steps: the steps the medians are over (each rank's last, at most 50).
        busy_s: its median busy time per step, in seconds.
        median_s: the median rank's, in seconds.
    """

    rank: int
    ratio: float
    steps: int
    busy_s: float
    median_s: float

    def __str__(self) -> str:
        return (
            f"straggler: rank {self.rank} is {self.ratio:.2f}x slower than the median rank over the last "
            f"{self.steps} steps ({self.busy_s * 1000:.1f} ms vs {self.median_s * 1000:.1f} ms per step outside "
            f"collectives)"
        )


def find_straggler(recent: dict[int, list[tuple[int, float, float]]], world_size: int) -> Straggler | None:
    """The straggler among ``recent`` (``{rank: [(step, wall s, s in collectives)]}``, each rank's last steps:
    :meth:`sgpu_magic.job.metrics.MetricsPump.recent_steps`), or ``None`` (one rank, too few steps, or no rank slow
    enough or often enough: module docstring)."""
    if world_size < 2 or len(recent) < world_size:
        return None
    busy = {rank: {step: wall - inside for step, wall, inside in steps} for rank, steps in recent.items()}
    common = sorted(set.intersection(*(set(by_step) for by_step in busy.values())))
    if len(common) < MIN_STEPS:
        return None
    medians = {rank: statistics.median(by_step[step] for step in common) for rank, by_step in busy.items()}
    slowest = max(medians, key=lambda rank: medians[rank])
    median = statistics.median(value for rank, value in medians.items() if rank != slowest)
    if medians[slowest] - median < MIN_EXCESS_S or medians[slowest] <= RATIO * median:
        return None
    others = [by_step for rank, by_step in busy.items() if rank != slowest]
    busiest = sum(1 for step in common if all(busy[slowest][step] > by_step[step] for by_step in others))
    if busiest < CONSISTENCY * len(common):
        return None
    return Straggler(slowest, medians[slowest] / max(median, 1e-6), len(common), medians[slowest], median)
