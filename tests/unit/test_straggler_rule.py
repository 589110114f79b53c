"""The straggler check's rule (:func:`sgpu_magic.job.steps.find_straggler`) on made-up step records; the ranks
that record them are tested in ``tests/integration/test_steps.py``."""

from __future__ import annotations

from sgpu_magic.job.steps import MIN_STEPS, find_straggler


def steps(busy_s, collective_s=0.01, first=0):
    """``[(step, wall, in collectives)]`` for the busy times ``busy_s``."""
    return [(first + i, busy + collective_s, collective_s) for i, busy in enumerate(busy_s)]


def test_a_rank_busier_in_every_step_is_named_with_its_ratio_and_window():
    recent = {0: steps([0.010] * 30), 1: steps([0.030] * 30), 2: steps([0.011] * 30), 3: steps([0.009] * 30)}
    straggler = find_straggler(recent, 4)
    assert straggler is not None and straggler.rank == 1 and straggler.steps == 30
    assert abs(straggler.ratio - 3.0) < 1e-9 and abs(straggler.busy_s - 0.030) < 1e-9
    assert str(straggler) == (
        "straggler: rank 1 is 3.00x slower than the median rank over the last 30 steps "
        "(30.0 ms vs 10.0 ms per step outside collectives)"
    )


def test_time_waiting_in_collectives_is_not_slowness():
    """Rank 0 waits 40 ms per step for rank 1 in the collective: its steps last as long, it is not the straggler."""
    recent = {0: steps([0.010] * 20, collective_s=0.045), 1: steps([0.050] * 20, collective_s=0.005)}
    assert find_straggler(recent, 2).rank == 1


def test_a_rank_slow_in_only_some_steps_is_not_named():
    """Slowest in half the steps (a rank with less of the machine for a while): never named, however slow."""
    recent = {0: steps([0.010, 0.040] * 15), 1: steps([0.010] * 30), 2: steps([0.010] * 30)}
    assert find_straggler(recent, 3) is None
    recent[0] = steps([0.040, 0.040, 0.040, 0.010] * 8)  # 3 in 4: named
    assert find_straggler(recent, 3).rank == 0


def test_nothing_is_named_below_the_ratio_or_the_excess_or_before_every_rank_has_enough_steps():
    assert find_straggler({0: steps([0.010] * 20), 1: steps([0.0119] * 20)}, 2) is None  # 1.19x
    assert find_straggler({0: steps([0.001] * 20), 1: steps([0.005] * 20)}, 2) is None  # 5x, but 4 ms more
    short = {0: steps([0.010] * 40), 1: steps([0.050] * (MIN_STEPS - 1))}
    assert find_straggler(short, 2) is None
    assert find_straggler({0: steps([0.010] * 40), 1: steps([0.050] * 40)}, 3) is None  # rank 2 has no step yet
    assert find_straggler({0: steps([0.050] * 40)}, 1) is None  # one rank: no peer to be slower than


def test_the_medians_are_over_the_steps_every_rank_has_recorded():
    """Rank 1's newest steps have reached the kernel before rank 0's: the check compares the same steps."""
    recent = {0: steps([0.010] * 20), 1: steps([0.010] * 15 + [0.090] * 10)}
    assert find_straggler(recent, 2) is None  # steps 0-19 in common: rank 1 was slow in 5 of them
