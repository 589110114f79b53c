"""RunDir: private directories, atomic writes, one name per file."""

import os
import stat

import pytest

from sgpu_magic.rundir import RunDir, atomic_write_json, make_private_dir, read_json


def test_create_is_private_and_names_every_file(tmp_path):
    rd = RunDir.create(tmp_path)
    assert stat.S_IMODE(rd.path.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "runs").stat().st_mode) == 0o700
    assert rd.log_file(1) == rd.path / "logs" / "rank_1.log"
    assert rd.result_file(0).parent.is_dir() and rd.error_file(0).parent.is_dir()
    assert rd.job_id == rd.path.name


def test_atomic_write_leaves_no_temporary_and_is_private(tmp_path):
    path = tmp_path / "status.json"
    atomic_write_json(path, {"state": "running"})
    atomic_write_json(path, {"state": "succeeded"})
    assert read_json(path) == {"state": "succeeded"}
    assert os.listdir(tmp_path) == ["status.json"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_read_json_missing_is_none(tmp_path):
    assert read_json(tmp_path / "nope.json") is None


def test_loose_permissions_are_tightened(tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    make_private_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory owned by another user")
def test_directory_of_another_user_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir()
    os.chown(d, 12345, 12345)
    with pytest.raises(PermissionError, match=r"owned by uid 12345, not by you; set SGPU_MAGIC_HOME"):
        make_private_dir(d)


def test_status_writer_makes_the_final_status_the_last_write(tmp_path):
    from sgpu_magic.launch.machine import finish_job
    from sgpu_magic.status import StatusWriter
    from sgpu_magic.wire import RunState

    rd = RunDir.create(tmp_path)
    rd.payload_file.write_bytes(b"code")
    rd.log_file(0).write_text("one\ntwo\n")
    writer = StatusWriter(rd, state=RunState.STARTING, started_s=1.0)
    assert writer.update(state=RunState.RUNNING, pids={"0": 123})
    assert read_json(rd.status_file)["state"] == "running"
    assert finish_job(writer, RunState.SUCCEEDED, 1, exitcodes={"0": 0})
    final = read_json(rd.status_file)
    assert final["state"] == "succeeded" and final["log_lines"] == {"0": 2} and final["schema"] == 2
    assert "stop_reason" not in final
    assert final["ended_s"] >= final["started_s"] and not rd.payload_file.exists()
    # every later write is refused and changes nothing on disk
    writer.status["state"] = "running"
    assert not writer.write()
    assert not writer.update(state=RunState.RUNNING)
    assert not writer.finish(RunState.FAILED)
    assert not finish_job(writer, RunState.FAILED, 1)
    assert read_json(rd.status_file) == final


def test_a_final_only_status_writer_tells_each_change_to_its_memory_feed_and_writes_the_file_once(
    tmp_path, monkeypatch
):
    """A session cell's writer: each change reaches the follower's MemoryFeed (a new stamp, a woken wait) and no
    file is written until the final status, which is written once (as any writer's) and told too."""
    import threading

    from sgpu_magic.job import follow
    from sgpu_magic.job.follow import MemoryFeed
    from sgpu_magic.status import StatusWriter
    from sgpu_magic.wire import RunState

    monkeypatch.setattr(follow, "PUMP_INTERVAL_S", 600.0)  # a wait ends on the change, not on its timeout
    rd = RunDir.create(tmp_path)
    feed = MemoryFeed()
    assert feed.read() == {"state": "pending"}
    writer = StatusWriter(rd, final_only=True, on_change=feed.changed)
    stamp = feed.stamp()
    waiter = threading.Thread(target=feed.wait, daemon=True)
    waiter.start()
    assert writer.update(state=RunState.RUNNING, pids={"0": 123})
    waiter.join(60)
    assert not waiter.is_alive() and feed.stamp() != stamp
    assert feed.read() == {"state": "running", "pids": {"0": 123}} and not rd.status_file.exists()
    stamp = feed.stamp()
    feed.wake()  # a frame beside the status (a debugger's): a new stamp, the same status
    assert feed.stamp() != stamp and feed.read()["state"] == "running"
    assert writer.finish(RunState.SUCCEEDED, rank_outcomes={"0": "returned"})
    final = read_json(rd.status_file)
    told = feed.read()
    assert final["state"] == "succeeded" and final["pids"] == {"0": 123} and told | {"schema": final["schema"]} == final
    assert not writer.update(state=RunState.RUNNING) and feed.read() is told
    # a final write that fails still reaches the reader in memory (the cell ends; its record is what is missing)
    failed: list[OSError] = []
    feed = MemoryFeed()
    (tmp_path / "gone").mkdir()
    gone = RunDir(tmp_path / "gone")
    writer = StatusWriter(gone, on_error=failed.append, final_only=True, on_change=feed.changed)
    (tmp_path / "gone").rmdir()
    assert writer.finish(RunState.FAILED) and feed.read()["state"] == "failed" and len(failed) == 1


def test_status_writer_refuses_a_state_that_is_not_final(tmp_path):
    from sgpu_magic.status import StatusWriter
    from sgpu_magic.wire import RunState

    writer = StatusWriter(RunDir.create(tmp_path))
    with pytest.raises(ValueError) as err:
        writer.finish(RunState.RUNNING)
    assert str(err.value) == (
        "JobState.RUNNING is not a final state; one of ['SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT']"
    )
    with pytest.raises(ValueError) as err:
        writer.update(state=RunState.SUCCEEDED)
    assert str(err.value) == "JobState.SUCCEEDED is a final state: a run ends through StatusWriter.finish"
    assert not writer.finished and not writer.run_dir.status_file.exists()


def test_a_run_stopped_for_a_reason_ends_in_its_state_with_the_reason_recorded(tmp_path):
    """A kernel interrupt is a cancel (state cancelled, stop reason interrupted); a schema 1 file's pseudo-state
    ``interrupted`` reads the same; a state this version does not know is refused naming it."""
    from sgpu_magic.errors import RecordError
    from sgpu_magic.status import HostStatus, StatusWriter
    from sgpu_magic.wire import RunState, StopReason, read_state

    rd = RunDir.create(tmp_path)
    assert StatusWriter(rd).finish(StopReason.INTERRUPTED)
    final = read_json(rd.status_file)
    assert (final["state"], final["stop_reason"]) == ("cancelled", "interrupted")
    status = HostStatus.from_dict(final)
    assert (status.state, status.stop_reason, status.interrupted, status.final) == (
        RunState.CANCELLED,
        StopReason.INTERRUPTED,
        True,
        True,
    )
    assert read_state({"schema": 1, "state": "interrupted"}) == (RunState.CANCELLED, StopReason.INTERRUPTED)
    assert [r.state for r in StopReason] == [
        RunState.CANCELLED,
        RunState.CANCELLED,
        RunState.TIMED_OUT,
        RunState.FAILED,
    ]
    with pytest.raises(RecordError) as err:
        read_state({"state": "paused"})
    assert str(err.value) == (
        "status.json has state 'paused' / stop reason None, which this sgpu_magic does not know: the run was written "
        "by a newer sgpu_magic; use that version to read it (pip install -U sgpu_magic)"
    )


def test_status_writer_retries_a_failed_write_and_reports_it_once(tmp_path):
    from sgpu_magic.status import StatusWriter
    from sgpu_magic.wire import RunState

    rd = RunDir.create(tmp_path)
    rd.status_file.mkdir()  # a write cannot replace a directory: each write fails with an OSError
    errors: list[OSError] = []
    writer = StatusWriter(rd, on_error=errors.append, state=RunState.RUNNING)
    assert not writer.write() and not writer.write()
    assert len(errors) == 1 and writer.unwritten
    assert writer.finish(RunState.FAILED, launch_error="x") and writer.unwritten  # final, but not on disk yet
    rd.status_file.rmdir()
    assert writer.write() and not writer.unwritten  # the retry writes the final status
    assert read_json(rd.status_file)["state"] == "failed"
    assert not writer.write()


def test_a_session_cells_files_take_the_sessions_reserve_on_a_full_disk(tmp_path):
    """A lean cell directory holds no reserve of its own; a write in it that meets ENOSPC frees the session's
    (through the cell's .reserve-of link), a job's own reserve first where it has one."""
    from sgpu_magic.rundir import RESERVE_NAME, release_reserve

    session = RunDir.create(tmp_path)
    cell = RunDir.create(tmp_path, lean=True, reserve_of=session.path)
    assert (session.path / RESERVE_NAME).stat().st_size > 0 and not (cell.path / RESERVE_NAME).exists()
    assert release_reserve(cell.error_file(0)) is True
    assert not (session.path / RESERVE_NAME).exists()
    assert release_reserve(cell.error_file(0)) is False  # spent: the next write fails as the disk says
    assert release_reserve(RunDir.create(tmp_path, lean=True).error_file(0)) is False  # no link: nothing to free


def test_a_new_run_directory_whose_id_is_taken_draws_another(tmp_path, monkeypatch):
    """Two run directories drawn in the same second with the same 3 random bytes (found by a 5,000-cell session
    soak as FileExistsError): the second draws again; an id the caller names is never replaced."""
    import secrets

    import sgpu_magic.rundir as rundir

    drawn = iter(["abcdef", "abcdef", "abcdef", "123456"])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(drawn))
    monkeypatch.setattr(rundir.time, "strftime", lambda fmt: "20261204-222147")
    first = RunDir.create(tmp_path)
    second = RunDir.create(tmp_path, lean=True)
    assert first.job_id == "20261204-222147-abcdef" and second.job_id == "20261204-222147-123456"
    with pytest.raises(FileExistsError):
        RunDir.create(tmp_path, job_id=first.job_id)
