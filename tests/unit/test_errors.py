"""Rendering of rank failures: root cause first, one traceback, exit codes and signals named."""

from sgpu_magic.errors import RankFailedError, RankFailure, describe_exit, grouped_failures, rank_ranges


def test_describe_exit():
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-9) == "killed by signal SIGKILL (9)"
    assert describe_exit(-11) == "killed by signal SIGSEGV (11)"


def test_rank_failed_error_renders_root_cause_once():
    root = RankFailure(
        rank=1,
        exitcode=1,
        exc_type="ValueError",
        message="bad batch",
        time_s=1.0,
        traceback='Traceback (most recent call last):\n  File "<cell>", line 3\nValueError: bad batch\n',
        log_path="/runs/x/logs/rank_1.log",
    )
    other = RankFailure(
        rank=0, exitcode=-15, exc_type="RuntimeError", message="Connection closed by peer\nmore", time_s=2.0
    )
    err = RankFailedError(root, [other], [2, 3], "/runs/x")
    text = str(err)
    assert text.splitlines()[0] == "rank 1 failed (root cause): ValueError: bad batch (exit code 1)"
    assert (
        "rank 0 stopped by sgpu_magic because rank 1 failed (after raising RuntimeError: Connection closed by peer)"
        in text
    )
    assert "ranks 2-3 stopped by sgpu_magic because rank 1 failed" in text
    assert "log of rank 1: /runs/x/logs/rank_1.log" in text
    rendered = "\n".join(err._render_traceback_())
    assert rendered.count("Traceback (most recent call last)") == 1
    assert "traceback from rank 1 (root cause)" in rendered


def test_signal_death_without_exception():
    err = RankFailedError(RankFailure(rank=0, exitcode=-9, log_path="l"))
    assert str(err).startswith(
        "rank 0 failed (root cause): exited without a Python exception (killed by signal SIGKILL (9))"
    )


def test_secondary_rank_that_exited_by_itself():
    root = RankFailure(rank=0, exitcode=1, exc_type="NameError", message="x", time_s=1.0)
    other = RankFailure(rank=1, exitcode=1, exc_type="RuntimeError", message="peer gone", time_s=2.0)
    text = str(RankFailedError(root, [other]))
    assert "rank 1 stopped because rank 0 failed: RuntimeError: peer gone (exit code 1)" in text


def test_no_empty_traceback_section_for_a_signal_death():
    err = RankFailedError(RankFailure(rank=1, exitcode=-9, log_path="l"))
    rendered = err._render_traceback_()
    assert not any(line.startswith("---") for line in rendered)
    assert (
        rendered[0]
        == "RankFailedError: rank 1 failed (root cause): exited without a Python exception (killed by signal SIGKILL (9))"
    )


def test_errors_before_launch_render_as_one_line():
    from sgpu_magic.errors import CaptureError, JobCancelledError

    assert CaptureError("argument 0 is bad")._render_traceback_() == ["CaptureError: argument 0 is bad"]
    assert issubclass(JobCancelledError, KeyboardInterrupt) and not issubclass(JobCancelledError, Exception)


def test_a_rank_killed_outright_is_the_root_cause_not_the_reset_it_caused(tmp_path):
    """Found by the checkpoint tests: rank 0 SIGKILLed itself; rank 1 then raised on the reset connection and
    wrote its error file before the host noticed rank 0's death, so rank 1 looked earlier."""
    from sgpu_magic.job.outcome import failure_from_status
    from sgpu_magic.rundir import RunDir, atomic_write_json
    from sgpu_magic.status import HostStatus

    rd = RunDir.create(tmp_path, job_id="j")
    rd.error_file(1).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        rd.error_file(1),
        {
            "rank": 1,
            "exc_type": "RuntimeError",
            "message": "Connection reset by peer",
            "traceback": "",
            "time_s": 100.0,
        },
    )
    status = {"failures": [{"rank": 0, "exitcode": -9, "time_s": 100.5}], "exitcodes": {"0": -9, "1": -15}}
    error = failure_from_status(rd, HostStatus.from_dict(status), 2)
    assert str(error).splitlines()[:2] == [
        "rank 0 failed (root cause): exited without a Python exception (killed by signal SIGKILL (9))",
        "  rank 1 stopped by sgpu_magic because rank 0 failed (after raising RuntimeError: Connection reset by peer)",
    ]
    # a rank whose own exception made it exit, seen by the host, stays the root cause over later observations
    status["failures"].append({"rank": 1, "exitcode": 1, "time_s": 100.5})
    assert str(failure_from_status(rd, HostStatus.from_dict(status), 2)).startswith(
        "rank 1 failed (root cause): RuntimeError"
    )


def test_a_data_loader_workers_error_shows_the_workers_own_message():
    wrapped = (
        "Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\nValueError: bad shard 3'
    )
    failure = RankFailure(rank=1, exitcode=1, exc_type="ValueError", message=wrapped)
    assert failure.what() == "ValueError: bad shard 3 (in DataLoader worker process 0)"


def test_rank_ranges_fold_consecutive_ranks():
    assert rank_ranges([3]) == "3"
    assert rank_ranges([6, 1, 2, 3, 4, 5]) == "1-6"
    assert rank_ranges([7, 1, 3, 5, 6]) == "1, 3, 5-7"


def test_identical_secondary_failures_are_one_line_in_rank_order():
    """Issue 18: every rank of 8 hit the same error; seven lines in arrival order became two."""

    def fails(rank, t, exitcode=1):
        return RankFailure(
            rank=rank,
            exitcode=exitcode,
            exc_type="AttributeError",
            time_s=t,
            message="'NoneType' object has no attribute 'weight'",
        )

    root = fails(0, 1.0)
    others = [fails(r, 1.0 + t) for r, t in zip([1, 2, 3, 5, 4, 6], range(1, 7))] + [
        RankFailure(rank=7, exitcode=-15, time_s=9.0)
    ]
    lines = str(RankFailedError(root, others, [], "/runs/x")).splitlines()
    assert lines[:3] == [
        "rank 0 failed (root cause): AttributeError: 'NoneType' object has no attribute 'weight' (exit code 1)",
        "  ranks 1-6 failed with the same AttributeError: 'NoneType' object has no attribute 'weight' (exit code 1)",
        "  rank 7 stopped by sgpu_magic because rank 0 failed",
    ]


def test_secondary_failures_group_by_what_happened_and_sort_by_first_rank():
    """Every rank that raised the root cause's error is on one line, however it ended (one stopped in its teardown
    grace under load included); the others by what happened to them."""
    root = RankFailure(rank=2, exitcode=1, exc_type="ValueError", message="bad batch", time_s=1.0)
    reset = {"exc_type": "RuntimeError", "message": "Connection reset by peer"}
    others = [
        RankFailure(rank=5, exitcode=1, **reset),
        RankFailure(rank=0, exitcode=1, **reset),
        RankFailure(rank=1, exitcode=-15, exc_type="ValueError", message="bad batch"),
        RankFailure(rank=4, exitcode=1, exc_type="ValueError", message="bad batch"),
        RankFailure(rank=6, exitcode=-9),
    ]
    assert grouped_failures(root, others, stopped_ranks=[3, 7]) == [
        "ranks 0, 5 stopped because rank 2 failed: RuntimeError: Connection reset by peer (exit code 1)",
        "ranks 1, 4 failed with the same ValueError: bad batch (rank 1 then stopped by sgpu_magic)",
        "ranks 3, 6-7 stopped by sgpu_magic because rank 2 failed",
    ]
    assert grouped_failures(root, [], []) == []


def test_a_long_message_is_whole_for_the_root_cause_and_cut_at_a_word_for_the_others():
    """The root cause's first line keeps its remedy, however long; other ranks' lines are cut at a word."""
    remedy = "Create it inside the cell or function that runs on the ranks instead of capturing it from the kernel."
    long = "the global 'stats_lock' (a _thread.lock) cannot be pickled for the ranks. " + remedy
    root = RankFailure(rank=1, exitcode=1, exc_type="CaptureError", message=long, time_s=1.0)
    other = RankFailure(rank=0, exitcode=1, exc_type="RuntimeError", message="x " * 150, time_s=2.0)
    text = str(RankFailedError(root, [other], [], "/runs/x"))
    assert text.splitlines()[0] == f"rank 1 failed (root cause): CaptureError: {long} (exit code 1)"
    cut = other.what()
    assert len(cut) <= len("RuntimeError: ") + 200 and cut.endswith("x ...") and "x x ..." in cut
