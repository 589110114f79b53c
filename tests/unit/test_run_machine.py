"""The run machine: the one status owner of both launchers (the launch host's jobs and the Ray supervisor), and the
failure, attempt and teardown entries it writes, read back typed by the kernel's HostStatus."""

from __future__ import annotations

import pytest

from sgpu_magic.errors import RecordError
from sgpu_magic.launch.group import RankGroup, Started
from sgpu_magic.launch.machine import RunMachine
from sgpu_magic.launch.stacks import RankStack
from sgpu_magic.rundir import RunDir, read_json
from sgpu_magic.status import HostStatus, RankUsage, StuckReport
from sgpu_magic.wire import LaunchRecord, RankError, RunState, StopReason
from sgpu_magic.wire.errors import FailedAttempt, ObservedFailure, TeardownEnd


def _machine(tmp_path, world_size=2, max_restarts=0, timeout_s=None, **notes) -> RunMachine:
    rd = RunDir.create(tmp_path)
    for rank in range(world_size):
        rd.log_file(rank).write_text("line\n")
    launch = LaunchRecord(
        job_id=rd.job_id,
        world_size=world_size,
        backend="gloo",
        cwd=str(tmp_path),
        sys_path=(),
        max_restarts=max_restarts,
        timeout_s=timeout_s,
    )
    return RunMachine(rd, launch, **notes)


def test_a_run_goes_starting_running_succeeded_and_says_how_it_ran(tmp_path):
    machine = _machine(tmp_path, host_pid=7)
    assert not machine.rd.status_file.exists()  # nothing is written until the launcher says so
    machine.write()
    assert HostStatus.read(machine.rd).state is RunState.STARTING
    machine.running({1: 11, 0: 10}, 29500, start_method="subprocess")
    status = HostStatus.read(machine.rd)
    assert (status.state, status.attempt, status.pids) == (RunState.RUNNING, 1, {0: 10, 1: 11})
    usage = {0: RankUsage(50.0, 2**20, 2**21, 1.0)}
    machine.sampled(usage, stuck=StuckReport(1.0, 5.0, {0: "f at x.py:1"}))
    status = HostStatus.read(machine.rd)
    assert status.usage == usage and status.stuck == StuckReport(1.0, 5.0, {0: "f at x.py:1"})
    machine.sampled(usage)  # the report left out: it stands
    assert HostStatus.read(machine.rd).stuck is not None
    machine.sampled(stuck=None)  # the ranks wrote again
    assert HostStatus.read(machine.rd).stuck is None
    machine.grace_ended([TeardownEnd(1, "value", 1.0, 1.2, "SIGKILL")])
    assert machine.finish(RunState.SUCCEEDED, {0: 0, 1: 0})
    final = read_json(machine.rd.status_file)
    assert final["start_method"] == "subprocess" and final["host_pid"] == 7 and final["log_lines"] == {"0": 1, "1": 1}
    status = HostStatus.read(machine.rd)
    assert status.state is RunState.SUCCEEDED and status.exitcodes == {0: 0, 1: 0} and status.failures == ()
    assert status.teardown_ended == (TeardownEnd(1, "value", 1.0, 1.2, "SIGKILL"),)
    assert not machine.finish(RunState.FAILED)  # the final status is the last write
    assert HostStatus.read(machine.rd).state is RunState.SUCCEEDED


def test_a_failed_attempt_is_restarted_while_restarts_are_left_and_its_record_is_kept(tmp_path):
    machine = _machine(tmp_path, max_restarts=1)
    rd = machine.rd
    machine.running({0: 10, 1: 11}, 1)
    rd.write_error(RankError(1, "ValueError", "bad", time_s=5.0))  # raised before the peer the launcher saw
    rd.write_error(RankError(0, "RuntimeError", "connection reset by peer", time_s=9.0))
    machine.sampled(stuck=StuckReport(1.0, 2.0, {0: "f at x.py:1"}))  # the failed attempt was quiet a while
    assert machine.failed([ObservedFailure(0, 1, 9.0)])  # a restart is left
    assert machine.restart({0: 1, 1: 1}) == []
    assert machine.attempt == 2 and not rd.error_file(1).exists()
    assert (rd.attempt_errors_dir(1) / "rank_1.json").exists()
    assert "attempt 2 of 2" in rd.log_file(0).read_text()
    machine.running({0: 20, 1: 21}, 2)
    status = HostStatus.read(rd)
    assert status.attempt == 2 and status.failures == () and status.stuck is None  # the next attempt's own
    (attempt,) = status.attempts
    assert attempt.attempt == 1 and attempt.exitcodes == {0: 1, 1: 1}
    assert attempt.failures == (ObservedFailure(1, 1, 5.0), ObservedFailure(0, 1, 9.0))  # root cause first
    oom = ObservedFailure(1, -9, 30.0, oom="the kernel's OOM killer ended it", oom_killed=True)
    assert not machine.failed([oom])  # no restart left: the job fails
    machine.grace_ended([])  # the grace ended no rank: the status says nothing of it
    machine.finish(RunState.FAILED, {0: -15, 1: -9})
    assert HostStatus.read(rd).failures == (oom,) and "teardown_ended" not in read_json(rd.status_file)


def test_the_deadline_is_monotonic_from_when_the_launcher_took_the_job(tmp_path):
    assert _machine(tmp_path / "a").stop_due() is None
    machine = _machine(tmp_path / "c", timeout_s=3600.0)
    assert machine.stop_due() is None
    machine.deadline = 0.0  # a monotonic clock is past 0 since boot
    assert machine.stop_due() is StopReason.TIMED_OUT
    machine.request_stop(StopReason.CANCELLED)  # a stop asked for is said before the deadline
    assert machine.stop_due() is StopReason.CANCELLED


class _Ranks(RankGroup):
    """Ranks that do what the test scripts (each poll's answer in turn) and remember what the machine asked of them,
    in order: the machine's policy over any launcher's ranks, without starting a process."""

    def __init__(self, polls):
        self.polls, self.calls = list(polls), []

    def start_ranks(self, attempt):
        self.calls.append(("start", attempt))
        return Started({0: 100 * attempt, 1: 100 * attempt + 1}, 29500 + attempt, {"start_method": "subprocess"})

    def poll_ranks(self):
        self.calls.append("poll")
        return self.polls.pop(0)

    def sample_usage(self):
        return None

    def running_pids(self):
        return {1: 101}

    def take_stacks(self, ranks):
        self.calls.append(("stacks", dict(ranks)))
        if ranks == {1: 101}:
            return {1: RankStack(1, 101, "f at x.py:1", "Thread 1\n  f (x.py:1)")}
        raise OSError("py-spy is gone")

    def stop_ranks(self):
        self.calls.append("stop")
        return {0: -15, 1: -15}

    def end_ranks(self):
        self.calls.append("end")
        return {0: 0, 1: 0}


def _driven(tmp_path, polls, **launch) -> tuple[RunMachine, _Ranks]:
    rd = RunDir.create(tmp_path)
    for rank in range(2):
        rd.log_file(rank).write_text("line\n")
    ranks = _Ranks(polls)
    record = LaunchRecord(job_id=rd.job_id, world_size=2, backend="gloo", cwd=str(tmp_path), sys_path=(), **launch)
    machine = RunMachine(rd, record, ranks)
    machine.start_attempt()
    return machine, ranks


def test_the_machine_drives_a_group_through_a_restart_to_its_end(tmp_path):
    machine, ranks = _driven(tmp_path, [None, [ObservedFailure(1, 1, 5.0)], None, []], max_restarts=1)
    status = HostStatus.read(machine.rd)
    assert (status.state, status.pids) == (RunState.RUNNING, {0: 100, 1: 101})
    assert (
        read_json(machine.rd.status_file)["port"] == 29501
        and read_json(machine.rd.status_file)["start_method"] == "subprocess"
    )
    ended = [machine.drive() for _ in range(4)]
    assert ended == [False, False, False, True]
    assert ranks.calls == [("start", 1), "poll", "poll", "stop", ("start", 2), "poll", "poll", "end"]
    status = HostStatus.read(machine.rd)
    assert status.state is RunState.SUCCEEDED and status.attempt == 2 and status.exitcodes == {0: 0, 1: 0}
    assert [a.exitcodes for a in status.attempts] == [{0: -15, 1: -15}]  # what stopping the failed attempt gave
    assert "attempt 2 of 2" in machine.rd.log_file(0).read_text()


def test_a_failure_with_no_restart_left_ends_the_job_without_stopping_its_ranks_twice(tmp_path):
    machine, ranks = _driven(tmp_path, [[ObservedFailure(0, 3, 5.0)]])
    assert machine.drive()
    assert ranks.calls == [("start", 1), "poll", "end"]  # ending the ranks is the group's own (leftovers killed)
    status = HostStatus.read(machine.rd)
    assert status.state is RunState.FAILED and status.failures == (ObservedFailure(0, 3, 5.0),)
    assert not machine.finish(RunState.SUCCEEDED) and ranks.calls.count("end") == 1  # a job ends once


def test_ranks_that_ended_in_the_turn_a_stop_came_end_the_job_as_they_ended(tmp_path):
    machine, ranks = _driven(tmp_path, [[]], timeout_s=3600.0)
    machine.deadline = 0.0  # due, but the ranks had all succeeded when the machine looked
    assert machine.drive()
    assert ranks.calls == [("start", 1), "poll", "end"] and HostStatus.read(machine.rd).state is RunState.SUCCEEDED


def test_a_failed_attempt_is_not_restarted_once_a_stop_is_due(tmp_path):
    machine, ranks = _driven(tmp_path, [[ObservedFailure(0, 1, 5.0)]], max_restarts=3)
    machine.request_stop(StopReason.CANCELLED)
    assert machine.drive()
    assert ranks.calls == [("start", 1), "poll", ("stacks", {1: 101}), "stop", "end"]  # the peer still ran
    status = HostStatus.read(machine.rd)
    assert status.stop_reason is StopReason.CANCELLED and status.failures == (ObservedFailure(0, 1, 5.0),)


def test_a_job_past_its_deadline_has_its_running_ranks_stacks_taken_then_is_stopped(tmp_path):
    machine, ranks = _driven(tmp_path, [None], timeout_s=3600.0)
    machine.deadline = 0.0
    assert machine.drive()
    assert ranks.calls == [("start", 1), "poll", ("stacks", {1: 101}), "stop", "end"]
    status = read_json(machine.rd.status_file)
    assert status["stacks"] == {"1": "f at x.py:1"} and machine.rd.stack_file(1).read_text().startswith("Thread 1")
    assert HostStatus.read(machine.rd).stop_reason is StopReason.TIMED_OUT


def test_a_stop_goes_on_when_the_stacks_cannot_be_taken_and_a_kernel_gone_takes_none(tmp_path, caplog):
    machine, ranks = _driven(tmp_path / "a", [None])
    ranks.running_pids = lambda: {0: 100}  # take_stacks refuses these
    machine.request_stop(StopReason.CANCELLED)
    assert machine.drive()
    assert ranks.calls[-2:] == ["stop", "end"] and "stacks" not in read_json(machine.rd.status_file)
    assert f"could not take the stacks of job {machine.rd.job_id}: OSError('py-spy is gone')" in caplog.text
    machine, ranks = _driven(tmp_path / "b", [])
    machine.stop(StopReason.CANCELLED, stacks=False, launch_error="the kernel is gone")
    assert ranks.calls == [("start", 1), "stop", "end"]
    assert HostStatus.read(machine.rd).launch_error == "the kernel is gone"


def test_a_launcher_notes_only_the_facts_the_machine_does_not_own(tmp_path):
    with pytest.raises(ValueError, match=r"^\['state'\] are not notes a launcher takes \(\['cluster', "):
        _machine(tmp_path / "a", state="running")
    machine = _machine(tmp_path / "b")
    with pytest.raises(ValueError, match=r"^\['failures', 'usage'\] are not notes a launcher takes"):
        machine.note(usage={}, failures=[])
    machine.note(warm_agents=True, forked_ranks=2)
    machine.waiting("waiting for 2 CPU bundle(s)")
    assert read_json(machine.rd.status_file)["warm_agents"] is True
    assert HostStatus.read(machine.rd).waiting == "waiting for 2 CPU bundle(s)"
    machine.waiting(None)
    machine.finish(StopReason.CANCELLED, launch_error="stopped")
    status = HostStatus.read(machine.rd)
    assert status.waiting is None and status.stop_reason is StopReason.CANCELLED and status.launch_error == "stopped"


def test_the_status_entries_read_back_as_written_and_a_mangled_one_is_refused():
    failure = ObservedFailure(2, -9, 3.5, "nothing here shows the OOM killer", None)
    assert ObservedFailure.from_json(failure.to_json()) == failure
    assert ObservedFailure(0, 1, 1.0).to_json() == {"rank": 0, "exitcode": 1, "time_s": 1.0}  # no OOM keys
    assert ObservedFailure.from_json({"rank": 1, "exitcode": -9}).time_s == float("inf")  # unknown: not the earliest
    attempt = FailedAttempt(1, (failure,), 4.0, {0: 1, 2: -9})
    assert FailedAttempt.from_json(attempt.to_json()) == attempt
    ended = TeardownEnd(0, "error", 2.0, 2.1)
    assert TeardownEnd.from_json(ended.to_json()) == ended
    with pytest.raises(RecordError, match=r"^a failure entry of status.json lacks or mangles 'rank'$"):
        ObservedFailure.from_json({"exitcode": 1})
    with pytest.raises(RecordError, match=r"^an attempt entry of status.json lacks or mangles 'attempt'$"):
        FailedAttempt.from_json({"failures": []})
    with pytest.raises(RecordError, match=r"^a teardown entry of status.json lacks or mangles 'rank'$"):
        TeardownEnd.from_json({"outcome": "value"})
