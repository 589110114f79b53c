"""Restarts (``max_restarts`` / ``--max-restarts``): torchrun's policy on real gloo ranks.

A rank that fails makes every rank stop and start again, up to ``max_restarts`` times; the ranks
read ``TORCHELASTIC_RESTART_COUNT``; each attempt's lines stay in the rank logs; the failed
attempt's error files move to ``errors/attempt_<k>/``.
"""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from sgpu_magic import JobState, distributed
from sgpu_magic.errors import SpecError
from sgpu_magic.testing import start_job
from sgpu_magic.ui.panel import Panel

from helpers import check_each_failed_attempt_kept, check_killed_once_and_restarted, flaky_rank

flaky = distributed(gpus=2, max_restarts=2, mlflow=False, timeout=180)(flaky_rank)


def test_a_rank_killed_once_is_restarted_and_attempt_2_succeeds():
    check_killed_once_and_restarted(flaky)


def test_each_failed_attempts_errors_are_kept_and_the_last_one_fails_the_job():
    check_each_failed_attempt_kept(flaky)


def test_the_panel_header_names_the_attempt():
    panel = Panel()
    job = start_job(flaky, ("raise", 1), view=panel)
    assert job.wait() is JobState.SUCCEEDED
    assert "attempt 2 of 3" in panel.header.value
    assert "rank 1 failed (exit code 1); all ranks restarted" in panel.header.value


def test_the_magic_restarts_and_says_so(ip, capsys):
    ip.user_ns["flaky_fn"] = flaky
    capsys.readouterr()
    ip.run_cell_magic(
        "distributed",
        "--gpus 2 --max-restarts 1 --no-mlflow -o restarted_job",
        "import os\n"
        "if os.environ['RANK'] == '0' and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    raise RuntimeError('first attempt fails')\n"
        "os.environ['TORCHELASTIC_RESTART_COUNT']\n",
    )
    out = capsys.readouterr().out
    job = ip.user_ns["restarted_job"]
    assert job.state is JobState.SUCCEEDED and job.results == ["1", "1"]
    assert f"sgpu_magic: job {job.job_id}: rank 0 failed (exit code 1); attempt 2 of 2 started" in out
    # the failed rank's lines are hidden after its traceback marker, and shown again from the new attempt on
    assert "[rank 0] [sgpu_magic] attempt 2 of 2: all ranks restarted after rank 0 failed (exit code 1)" in out
    assert "[rank 1] [sgpu_magic] attempt 2 of 2: all ranks restarted after rank 0 failed (exit code 1)" in out
    # the job succeeded: no error follows, so the failed attempt's rank does not point at one
    assert "[rank 0] [sgpu_magic] rank 0 raised RuntimeError; its traceback is in its log file\n" in out
    assert "the error below shows" not in out


@pytest.mark.parametrize("bad", [-1, 1001, "2", True, 1.5])
def test_bad_max_restarts_is_refused_before_anything_starts(bad):
    with pytest.raises(
        SpecError,
        match=r"max_restarts must be an int between 0 and 1000 \(restarts of the whole rank "
        r"group after a failure; 0 = none\), got ",
    ):
        distributed(gpus=2, max_restarts=bad)


def test_bad_max_restarts_in_the_magic_is_a_usage_error(ip):
    with pytest.raises(UsageError, match=r"max_restarts must be an int between 0 and 1000"):
        ip.run_cell_magic("distributed", "--gpus 2 --max-restarts -1", "1\n")
    with pytest.raises(UsageError, match=r"argument --max-restarts: invalid int value: 'x'"):
        ip.run_cell_magic("distributed", "--gpus 2 --max-restarts x", "1\n")


def test_a_rank_that_raised_before_the_failure_seen_is_named_first_and_a_killed_rank_stays_the_root_cause(tmp_path):
    """The launcher may see a peer fail first (on the connection the raising rank tore down as it left): the rank whose
    own error is earlier is then added and named first; a rank seen killed by a signal (no error of its own) stays
    the first, and a peer's later error is not added (found by CI: the panel named rank 0 for rank 1's ValueError)."""
    from sgpu_magic.launch.machine import root_cause_first
    from sgpu_magic.rundir import RunDir
    from sgpu_magic.wire import RankError
    from sgpu_magic.wire.errors import ObservedFailure

    rd = RunDir.create(tmp_path)

    def error(rank: int, time_s: float) -> None:
        rd.write_error(RankError(rank, "RuntimeError", "x", time_s=time_s))

    error(0, 20.0)
    error(1, 10.0)
    seen = [ObservedFailure(0, 1, 21.0)]
    assert root_cause_first(rd, 2, seen, {0: 1, 1: -15}) == [ObservedFailure(1, 1, 10.0), ObservedFailure(0, 1, 21.0)]
    rd.error_file(1).unlink()
    killed = [ObservedFailure(1, -9, 21.0)]
    assert root_cause_first(rd, 2, killed, {0: 1, 1: -9}) == killed
