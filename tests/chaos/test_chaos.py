"""The fault-injection suite's short version (see tests/chaos/suite.py): every fault kind once, in a real kernel.

The long version (``tests/chaos/suite.py --jobs 150``) draws faults at random; its table is in
RELIABILITY.md. Here each kind runs once with a 64 MB flood; any broken invariant fails the test
with the list of problems per fault.
"""

from __future__ import annotations

import pytest

from suite import FAULTS, run_suite, table

pytestmark = pytest.mark.slow


def test_every_fault_kind_ends_cleanly_and_the_next_job_succeeds(tmp_path):
    lines = []
    outcomes = run_suite(None, seed=1, flood_bytes=64 << 20, workdir=tmp_path, log=lines.append)
    print("\n".join(lines))
    print(table(outcomes))
    ran = {o.fault for o in outcomes}
    assert ran >= set(FAULTS) - {"disk_full"}, ran
    failed = {o.fault: o.problems for o in outcomes if not o.ok}
    assert not failed, failed
