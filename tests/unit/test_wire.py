"""The cross-process records (sgpu_magic.wire): the launch record's codec and its errors, a run directory written by the
previous version (schema 2, stored under data/run_v2) still read, and the rule that only wire/ spells their keys."""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from sgpu_magic.errors import RecordError
from sgpu_magic.rundir import RunDir, atomic_write_bytes, detached_index
from sgpu_magic.wire import LAUNCH_SCHEMA, LaunchRecord

from helpers import package_findings, wait_for

STORED_V2 = Path(__file__).with_name("data") / "run_v2" / "20261207-055109-f279ee"


def _record(**change) -> LaunchRecord:
    base = LaunchRecord(job_id="j1", world_size=2, backend="gloo", cwd="/work", sys_path=("/work", "/lib"))
    return dataclasses.replace(base, **change)


def test_a_launch_record_reads_back_as_written(tmp_path):
    rd = RunDir.create(tmp_path)
    record = _record(
        job_id=rd.job_id, env={"SGPU_MAGIC_GPUS": "0,3"}, timeout_s=30.0, port=29500, max_restarts=2, tracked=True
    )
    rd.write_launch(record)
    assert rd.launch_file.stat().st_mode & 0o777 == 0o600
    back = rd.read_launch()
    assert back == record and back.gpus == [0, 3] and back.schema == LAUNCH_SCHEMA
    assert json.loads(rd.launch_file.read_bytes())["schema"] == LAUNCH_SCHEMA


def test_a_run_directory_of_the_previous_version_still_reads(tmp_path):
    """A detached job's run directory as 0.2 (launch.json without a schema) wrote it: its record reads, and the
    detached-run listing (%distributed_jobs --all, sgpu_magic.attach) shows it as it did."""
    from sgpu_magic.front.detached import detached_runs

    home = tmp_path / "home"
    shutil.copytree(STORED_V2, home / "runs" / STORED_V2.name)
    for path in [home, home / "runs", *(home / "runs").rglob("*")]:  # git keeps no modes: private as a run is
        path.chmod(0o700 if path.is_dir() else 0o600)
    rd = RunDir(home / "runs" / STORED_V2.name)
    record = rd.read_launch()
    assert record.schema == 2 and "schema" not in json.loads(rd.launch_file.read_bytes())
    assert (record.job_id, record.name, record.world_size, record.backend, record.timeout_s) == (
        STORED_V2.name,
        "hello",
        2,
        "gloo",
        10800.0,
    )
    assert (record.detached, record.tracked, record.session, record.gpus, record.port) == (True, False, False, [], None)
    (detached_index(home) / STORED_V2.name).touch()
    (run,) = detached_runs(home, recent_s=None)
    assert (run.job_id, run.state.value, run.world_size, run.gpus) == (STORED_V2.name, "succeeded", 2, "cpu")


def test_a_launch_record_of_a_newer_version_is_refused_naming_the_remedy(tmp_path):
    """The launch host, a rank or the listing must not half-read what to run: a newer schema is refused; the detached
    listing skips such a run and keeps it for the version that reads it."""
    from sgpu_magic.front.detached import detached_runs

    rd = RunDir.create(tmp_path, job_id="newer")
    atomic_write_bytes(rd.launch_file, json.dumps({**_record(detached=True).to_json(), "schema": 99}).encode())
    with pytest.raises(RecordError) as err:
        rd.read_launch()
    assert str(err.value) == (
        f"launch.json has schema 99, newer than this sgpu_magic reads ({LAUNCH_SCHEMA}): the run was started by a "
        "newer sgpu_magic; use that version to read it (pip install -U sgpu_magic)"
    )
    entry = detached_index(tmp_path) / "newer"
    entry.touch()
    assert detached_runs(tmp_path, recent_s=None) == [] and entry.exists()


def test_the_launch_host_reports_a_launch_record_it_cannot_read_as_the_jobs_launch_error(tmp_path):
    """The host's job start reads the typed record first: a file that is not one fails the job with the reason in
    its status (the kernel raises it), before any rank starts."""
    from sgpu_magic.launch.host.job import HostJob

    rd = RunDir.create(tmp_path)
    atomic_write_bytes(rd.launch_file, json.dumps({"job_id": rd.job_id, "world_size": 1}).encode())
    with pytest.raises(RecordError, match=r"^launch.json lacks backend, cwd, sys_path: it was not written by sgpu_"):
        HostJob(rd, {}, None)
    assert not rd.status_file.exists()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "launch.json is not JSON: Expecting property name enclosed in double quotes: line 1 column 2"),
        (b"[1, 2]", "launch.json holds list, not an object"),
        (b'{"world_size": 1}', "launch.json lacks job_id, backend, cwd, sys_path: it was not written by sgpu_magic"),
    ],
)
def test_a_file_that_is_not_a_launch_record_is_refused_naming_why(raw, message):
    with pytest.raises(RecordError) as err:
        LaunchRecord.decode(raw)
    assert str(err.value).startswith(message)


def test_a_sink_that_prepares_an_unknown_launch_field_is_refused():
    record = _record(env={"A": "1"})
    assert record.prepared({"env": {"B": "2"}, "tracked": True}) == _record(env={"A": "1", "B": "2"}, tracked=True)
    with pytest.raises(RecordError) as err:
        record.prepared({"env": {}, "mlflow": True})
    assert str(err.value) == "a job sink prepared ['mlflow'] for launch.json, which has no such field"


def test_a_rank_agents_copy_has_no_env_nor_lease():
    record = _record(env={"SECRET": "x"}, lease_dir="/leases")
    agent = LaunchRecord.from_json(record.for_rank_agent(session=True).to_json())
    assert (agent.env, agent.lease_dir, agent.session, agent.job_id) == ({}, None, True, "j1")


# -- only wire/ spells a record's keys

RECORD_NAMES = {"launch", "reply", "msg", "message", "command", "cmd", "item", "payload", "part", "failure"}
STATUS_NAMES = {"status", "final"}
"""A status dict is changed by key only by its owner, the run machine (``launch/machine.py``), and its codec
(``status.py``); what reads it takes the typed :class:`~sgpu_magic.status.HostStatus`."""
STATUS_OWNERS = {"status.py", "launch/machine.py"}


_BY_HAND = {
    *("read_json", "atomic_write_json", "atomic_write_bytes", "read_private", "open"),
    *("read_text", "read_bytes", "write_text", "write_bytes"),
}
"""Calls that read or write a file's record by hand, given its path or called on it (``str(rd.mlflow_file)``, a path
for the ranks, is not one)."""


def _keyed_reads(path: Path, rel: str) -> list[str]:
    """``launch["k"]`` / ``launch.get("k")`` / ``x.launch["k"]`` (and the same of a session's frames: ``reply``,
    ``msg``, ``message``, ``command``, ``cmd``, ``item``; and of a payload: ``payload``, ``part``), a status read
    by key (``status["k"]`` read or written, ``status.get/pop/setdefault/update``; ``final`` too; but in
    :data:`STATUS_OWNERS`), a status entry (``failure``), and ``launch.json`` or a rank's error file
    read or written by hand (``read_json(rd.launch_file)``, ``read_json(rd.error_file(r))``) in one module."""
    found = []

    def named(node: ast.AST, names: set[str]) -> bool:
        return (isinstance(node, ast.Name) and node.id in names) or (
            isinstance(node, ast.Attribute) and node.attr in names
        )

    def recordlike(node: ast.AST) -> bool:
        return named(node, RECORD_NAMES)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Subscript)
            and (recordlike(node.value) or (named(node.value, STATUS_NAMES) and rel not in STATUS_OWNERS))
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, str)
        ):
            found.append(f"{rel}:{node.lineno}: [{node.slice.value!r}]")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and (
                (node.func.attr in ("get", "setdefault", "pop", "update") and recordlike(node.func.value))
                or (
                    node.func.attr in ("get", "setdefault", "pop", "update")
                    and named(node.func.value, STATUS_NAMES)
                    and rel not in STATUS_OWNERS
                )
            )
        ):
            found.append(f"{rel}:{node.lineno}: .{node.func.attr}(...)")
        elif isinstance(node, ast.Call) and rel != "rundir.py":  # a record's file read or written by hand
            called_name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            for arg in node.args:
                if isinstance(arg, ast.Attribute) and arg.attr == "launch_file":
                    found.append(f"{rel}:{node.lineno}: launch_file (read it with RunDir.read_launch)")
                if isinstance(arg, ast.Attribute) and arg.attr == "mlflow_file" and called_name in _BY_HAND:
                    found.append(f"{rel}:{node.lineno}: mlflow_file (read it with RunDir.read_mlflow_run)")
                called = arg.func if isinstance(arg, ast.Call) else None
                if isinstance(called, ast.Attribute) and called.attr in ("error_file", "exit_file"):
                    what = called.attr.split("_")[0]
                    found.append(f"{rel}:{node.lineno}: {called.attr} (read it with RunDir.read_{what})")
            owner = node.func.value if isinstance(node.func, ast.Attribute) else None
            if isinstance(owner, ast.Attribute) and owner.attr == "mlflow_file" and called_name in _BY_HAND:
                found.append(f"{rel}:{node.lineno}: mlflow_file (read it with RunDir.read_mlflow_run)")
    return found


def test_no_module_outside_wire_reads_a_record_by_key_or_by_hand():
    # status.py holds status.json's codec (HostStatus.from_dict, StatusWriter), as wire/ holds the other records'
    found = package_findings(_keyed_reads, skip=lambda rel: rel.startswith("wire/") or rel == "status.py")
    assert found == [], "a record read by key or by hand outside sgpu_magic/wire (use its typed record):\n" + "\n".join(
        found
    )


def test_the_keyed_read_check_finds_each_kind(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "def f(launch, self, rd):\n"
        "    a = launch['world_size']\n"
        "    b = self.launch.get('port')\n"
        "    launch.update({'x': 1})\n"
        "    c = read_json(rd.launch_file, private=True)\n"
        "    ok = launch.world_size, other['world_size'], rd.launch_file.stat(), rd.error_file(0).exists()\n"
        "    e = json.loads(rd.error_file(1).read_bytes()), read_json(rd.error_file(2))\n"
        "    f = reply['ok'], msg.get('op'), item[0], read_json(rd.exit_file(0))\n"
        "    status['usage'] = {}; g = status['usage'], self.status.get('stuck'), status.pop('waiting', None)\n"
        "    h = read_json(rd.mlflow_file, private=True), str(rd.mlflow_file)\n"
        "    i = json.loads(rd.mlflow_file.read_text()), rd.mlflow_file.exists(), atomic_write_bytes(rd.mlflow_file, b'')\n"
    )
    assert sorted(_keyed_reads(module, "m.py")) == sorted(
        [
            "m.py:2: ['world_size']",
            "m.py:3: .get(...)",
            "m.py:4: .update(...)",
            "m.py:5: launch_file (read it with RunDir.read_launch)",
            "m.py:7: error_file (read it with RunDir.read_error)",
            "m.py:8: ['ok']",
            "m.py:8: .get(...)",
            "m.py:8: exit_file (read it with RunDir.read_exit)",
            "m.py:9: ['usage']",
            "m.py:9: ['usage']",
            "m.py:9: .get(...)",
            "m.py:9: .pop(...)",
            "m.py:10: mlflow_file (read it with RunDir.read_mlflow_run)",
            "m.py:11: mlflow_file (read it with RunDir.read_mlflow_run)",
            "m.py:11: mlflow_file (read it with RunDir.read_mlflow_run)",
        ]
    )
    owner = _keyed_reads(module, "launch/machine.py")  # the status's owner changes it by key; nothing else may
    assert len(owner) == 11 and not [line for line in owner if line.startswith("launch/machine.py:9")]


# -- mlflow.json


def test_a_jobs_mlflow_run_record_reads_back_and_gives_mlflow_its_variables(tmp_path):
    from sgpu_magic._util.mlflow_run import RUN_ID_ENV, run_env
    from sgpu_magic.rundir import RunDir
    from sgpu_magic.wire.mlflow import MlflowRunRecord

    rd = RunDir.create(tmp_path)
    assert rd.read_mlflow_run() is None and run_env(str(rd.mlflow_file), wait_s=0) == {}
    record = MlflowRunRecord("r1", "sqlite:////m.db", "7", "nb", registry_uri="sqlite:////m.db")
    rd.write_mlflow_run(record)
    assert rd.read_mlflow_run() == record and record.tracked
    assert oct(rd.mlflow_file.stat().st_mode & 0o777) == "0o600"
    assert run_env(str(rd.mlflow_file), wait_s=0) == {
        "MLFLOW_RUN_ID": "r1",
        "MLFLOW_TRACKING_URI": "sqlite:////m.db",
        "MLFLOW_EXPERIMENT_ID": "7",
        "MLFLOW_EXPERIMENT_NAME": "nb",
        "MLFLOW_REGISTRY_URI": "sqlite:////m.db",
        RUN_ID_ENV: "r1",
    }
    untracked = MlflowRunRecord(None, error="tracking could not start")
    rd.write_mlflow_run(untracked)
    assert rd.read_mlflow_run() == untracked and not untracked.tracked
    assert run_env(str(rd.mlflow_file), wait_s=0) == {} and untracked.mlflow_env() == {}


def test_an_mlflow_json_of_the_previous_version_reads_and_a_mangled_one_is_refused_naming_it(tmp_path):
    from sgpu_magic._util.mlflow_run import run_env
    from sgpu_magic.rundir import RunDir, atomic_write_json
    from sgpu_magic.wire.mlflow import MlflowRunRecord

    rd = RunDir.create(tmp_path)
    # as the previous version wrote it: no registry_uri where the kernel had none; a later key is passed over
    atomic_write_json(
        rd.mlflow_file,
        {"run_id": "r1", "tracking_uri": "file:///m", "experiment_id": "0", "experiment_name": None, "error": None,
         "later": 1},
    )  # fmt: skip
    assert rd.read_mlflow_run() == MlflowRunRecord("r1", "file:///m", "0")
    for raw, what in [
        ({"tracking_uri": "file:///m"}, "'run_id'"),
        ({"run_id": 5}, "'run_id': 5 is not a string"),
        ({"run_id": "r1", "tracking_uri": None}, "'tracking_uri'"),
        (["r1"], "a JSON list, not an object"),
    ]:
        atomic_write_json(rd.mlflow_file, raw)
        with pytest.raises(RecordError) as err:
            rd.read_mlflow_run()
        assert str(err.value) == f"mlflow.json lacks or mangles {what}; the job's MLflow run cannot be named from it"
        assert run_env(str(rd.mlflow_file), wait_s=0) == {}  # a rank goes on untracked


# -- the host's and keeper's commands


def test_every_host_command_reads_back_as_sent():
    from sgpu_magic.wire.host import Cancel, KeeperGreeting, Launch, RayTarget, Release, Stacks, decode_command
    from sgpu_magic.wire.host import encode_command as encode
    from sgpu_magic.wire.state import StopReason

    commands = [
        Launch("/runs/a", {"A": "1"}),
        Launch("/runs/b", {}, RayTarget("10.0.0.1:6379", "H100", 30.0)),
        Cancel("/runs/a", StopReason.INTERRUPTED),
        Stacks("/runs/a", "tok", native=True),
        Release("the run keeper exits"),
    ]
    for cmd in commands:
        line = encode(cmd)
        assert line.endswith(b"\n") and line.count(b"\n") == 1 and decode_command(line) == cmd
    assert decode_command(b'{"op": "cancel", "run_dir": "/r"}') == Cancel("/r", StopReason.CANCELLED)
    greeting = KeeperGreeting(12, "/k.log", "2 x cpu")
    assert KeeperGreeting.decode(greeting.encode()) == greeting


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b'{"op": "pause", "run_dir": "/r"}', "a host command has the op 'pause', which this sgpu_magic does not know"),
        (b'{"op": "stacks", "run_dir": "/r"}', "a host command lacks 'token'"),
        (
            b'{"op": "cancel", "run_dir": "/r", "reason": "bored"}',
            "a host command line is not one this sgpu_magic reads",
        ),
        (b"not json", "a host command line is not one this sgpu_magic reads (Expecting value"),
    ],
)
def test_a_host_command_this_version_does_not_know_is_refused_naming_it(line, message):
    from sgpu_magic.wire.host import decode_command

    with pytest.raises(RecordError) as err:
        decode_command(line)
    assert str(err.value).startswith(message) and str(err.value).endswith(repr(line))


def test_the_launch_host_logs_a_command_it_cannot_read_and_serves_the_next(tmp_path, caplog):
    """A kernel of a newer version (or a stray writer on the pipe) must not take the host down: the line is logged
    and skipped; the next command is handled (a stacks request for a job the host does not hold is answered)."""
    from sgpu_magic.launch.host.process import Host
    from sgpu_magic.wire.host import Stacks, encode_command

    rd = RunDir.create(tmp_path)
    host = Host(None, None)
    with caplog.at_level("WARNING", logger="sgpu_magic.launch.host.process"):
        rest = host.handle_lines(b'{"op": "pause"}\n' + encode_command(Stacks(str(rd.path), "t1")) + b'{"op": "ca')
    assert rest == b'{"op": "ca'
    assert [r.getMessage() for r in caplog.records] == [
        "sgpu_magic host: a host command has the op 'pause', which this sgpu_magic does not know: "
        'b\'{"op": "pause"}\''
    ]
    from sgpu_magic.rundir import read_json

    assert wait_for(lambda: read_json(rd.stacks_reply_file("t1")), 30, "the host's answer") == {"ended": True}


def test_a_rank_error_reads_back_and_one_of_an_older_release_too(tmp_path):
    from sgpu_magic.wire import RankError

    rd = RunDir.create(tmp_path)
    error = RankError(1, "ValueError", "bad batch", "Traceback ...", 12.5, cuda=True, saved_locals={"x": "3"})
    rd.write_error(error)
    assert rd.read_error(1) == error and rd.read_error(0) is None
    atomic_write_bytes(rd.error_file(0), b'{"rank": 0, "exc_type": "SystemExit", "message": "2"}')  # no time_s, cuda
    assert rd.read_error(0) == RankError(0, "SystemExit", "2")
    atomic_write_bytes(rd.error_file(0), b'{"rank": 0, "mess')  # caught half-written on a full disk
    assert rd.read_error(0) is None
    with pytest.raises(RecordError) as err:
        RankError.from_json({"rank": 0})
    assert str(err.value) == "a rank's error record lacks or mangles 'exc_type': not written by sgpu_magic"


def test_the_one_state_vocabulary_is_the_public_job_state_and_prints_as_it():
    """A notebook prints a job's state (the example notebooks check their outputs): the records' RunState is the
    public JobState, under that name."""
    import sgpu_magic
    from sgpu_magic.wire import RunState

    assert sgpu_magic.JobState is RunState and str(RunState.SUCCEEDED) == "JobState.SUCCEEDED"
    assert repr(RunState.CANCELLED) == "<JobState.CANCELLED: 'cancelled'>"


# -- a session's frames


def test_every_session_command_and_frame_reads_back_as_sent():
    from sgpu_magic.wire.session import (
        Debug,
        DebugFrame,
        DebugLine,
        Pull,
        Push,
        Regroup,
        ReleasePeers,
        Reply,
        RunCell,
        SessionRecord,
        Stop,
        Ungroup,
        decode_command,
        decode_frame,
        encode_command,
    )

    commands = [
        RunCell("/runs/c1"),
        Push({"x": b"\x80\x05K\x03."}),
        Pull("model"),
        Debug(),
        DebugLine("p x"),
        Stop(),
        Ungroup(),
        Regroup("gloo", 2),
    ]
    for seq, cmd in enumerate(commands, 1):
        assert decode_command(encode_command(cmd, seq)) == (seq, cmd)
    frames = [
        Reply(3, 1, names=("x", "model"), has_value=True, time_s=12.5),
        Reply(4, 0, ok=False, error="rank 0 has no name 'y'", missing=True),
        Reply(5, 1, ok=False, interrupted=True),
        Reply(6, 0, backend="gloo"),
        Reply(0, 1, pid=4242, names=()),
        DebugFrame(7, 1, "debug_out", "> cell.py(3)\n(Pdb) "),
        DebugFrame(7, 1, "debug_input"),
    ]
    for frame in frames:
        assert decode_frame(frame.encode()) == frame
    assert ReleasePeers.decode(ReleasePeers((11, 12)).encode()) == ReleasePeers((11, 12))
    assert SessionRecord.decode(SessionRecord("train", 600.0).encode()) == SessionRecord("train", 600.0)


def test_a_session_frame_of_the_previous_version_still_reads():
    """A detached session's ranks outlive the kernel that started them: the next kernel may be of a newer version,
    so the frames keep the previous version's keys (as its ranks wrote them, by hand)."""
    import pickle

    from sgpu_magic.wire.session import DebugFrame, Reply, RunCell, decode_command, decode_frame

    ready = {
        "ok": True,
        "op": "ready",
        "pid": 77,
        "seq": 0,
        "rank": 1,
        "names": ["a"],
        "has_value": False,
        "time_s": 1.0,
    }
    assert decode_frame(pickle.dumps(ready)) == Reply(0, 1, pid=77, names=("a",), time_s=1.0)
    out = {"seq": 4, "rank": 0, "stream": "debug_end", "has_value": False}
    assert decode_frame(pickle.dumps(out)) == DebugFrame(4, 0, "debug_end")
    assert decode_command(pickle.dumps({"op": "cell", "run_dir": "/r", "seq": 9})) == (9, RunCell("/r"))


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        ({"op": "pause", "seq": 1}, "a session command has the op 'pause', which this sgpu_magic does not know"),
        ({"op": "pull", "seq": 1}, "a session command lacks 'name'"),
        (["cell"], "a session command is not a frame this sgpu_magic reads (a list)"),
    ],
)
def test_a_session_command_this_version_does_not_know_is_refused_naming_it(frame, message):
    import pickle

    from sgpu_magic.wire.session import decode_command

    with pytest.raises(RecordError) as err:
        decode_command(pickle.dumps(frame))
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        ({"seq": 1, "rank": 0, "stream": "debug_pause"}, "a session rank's frame has the stream 'debug_pause'"),
        ({"seq": 1, "ok": True}, "a session rank's frame lacks 'rank'"),
        (b"\x80\x05K", "a session rank's frame is not a frame this sgpu_magic reads (UnpicklingError"),
    ],
)
def test_a_rank_frame_this_version_does_not_know_is_refused_naming_it(frame, message):
    import pickle

    from sgpu_magic.wire.session import decode_frame

    with pytest.raises(RecordError) as err:
        decode_frame(frame if isinstance(frame, bytes) else pickle.dumps(frame))
    assert str(err.value).startswith(message)


def test_a_control_line_and_a_session_record_this_version_does_not_know_are_refused(tmp_path):
    from sgpu_magic.wire.session import ReleasePeers

    with pytest.raises(RecordError, match="a control line has the op 'pause', which this sgpu_magic does not know"):
        ReleasePeers.decode(b'{"op": "pause"}')
    rd = RunDir.create(tmp_path)
    atomic_write_bytes(rd.session_file, b'{"idle_timeout_s": 5}')
    with pytest.raises(RecordError, match="not a session record this sgpu_magic reads"):
        rd.read_session()


def test_a_stacks_answer_reads_back_as_written_in_each_of_its_three_forms():
    from sgpu_magic.wire.host import StacksReply

    for reply in (StacksReply({0: "File a.py", 1: "File b.py"}), StacksReply(ended=True), StacksReply(error="E: x")):
        assert StacksReply.decode(reply.encode()) == reply
    with pytest.raises(RecordError, match="not a stacks answer this sgpu_magic reads"):
        StacksReply.decode(b'{"stacks": 3}')


# -- a rank's payload


def test_a_payload_of_each_kind_reads_back_as_written(tmp_path):
    from sgpu_magic.wire.payload import Cell, FunctionCode, FunctionRef, Payload, Script, SessionRanks

    bodies = {
        "ref": FunctionRef("train", "main"),
        "code": FunctionCode(b"\x80\x05N."),
        "cell": Cell("x = 1\nx", "<cell>", quiet=True, cell_label="Cell In[3]"),
        "script": Script("/w/train.py"),
        "session": SessionRanks(detached=True, idle_timeout_s=60.0),
    }
    for kind, body in bodies.items():
        rd = RunDir.create(tmp_path)
        payload = Payload(body, {"n": ("value", b"\x80\x05K\x03.")}, argv=["train.py", "--epochs", "1"])
        rd.write_payload(payload)
        assert rd.read_payload() == payload and payload.kind == kind
    labels, sources = Payload(bodies["cell"], display_names={"/k/2.py": "Cell In[2]"}).code_labels()
    assert labels == {"/k/2.py": "Cell In[2]", "<cell>": "Cell In[3]"} and sources == {"<cell>": "x = 1\nx"}


def test_a_payload_file_that_is_not_a_payload_is_refused_naming_the_remedy(tmp_path):
    import pickle

    rd = RunDir.create(tmp_path)
    atomic_write_bytes(rd.payload_file, pickle.dumps({"kind": "cell", "source": "1"}))  # as a version before wrote
    with pytest.raises(RecordError) as err:
        rd.read_payload()
    assert str(err.value) == (
        f"{rd.payload_file} is not a payload of this sgpu_magic (a dict); was it written by another version? "
        "Run the job again from this kernel"
    )


def test_a_rank_exit_reads_back_and_a_ray_ranks_outcome_says_whether_it_succeeded(tmp_path):
    from sgpu_magic.wire.errors import RankExit, RankOutcome, TeardownEnd

    rd = RunDir.create(tmp_path)
    rd.results_dir.mkdir(mode=0o700, exist_ok=True)
    rd.write_exit(1, RankExit("Cell In[3] line 4", "cell"))
    assert rd.read_exit(1) == RankExit("Cell In[3] line 4", "cell") and rd.read_exit(0) is None
    atomic_write_bytes(rd.exit_file(0), b"[1, 2]")  # not an exit record
    assert rd.read_exit(0) is None
    assert RankOutcome(0).succeeded and not RankOutcome(1).succeeded and not RankOutcome(-9).succeeded
    # ended by its agent at the teardown grace: with its value written it succeeded, with its error it did not
    assert RankOutcome(-15, teardown=TeardownEnd(0, "value")).succeeded
    assert not RankOutcome(-15, teardown=TeardownEnd(0, "error")).succeeded


# -- a detached job's attach record


def test_an_attach_record_reads_back_and_the_previous_versions_dict_still_reads(tmp_path):
    """attach.pkl: what a kernel rebuilds a detached job's handle from; a job the previous version started (a dict of
    the same fields) still attaches; a file that holds anything else is refused naming the remedy."""
    import pickle

    from sgpu_magic.spec import LaunchSpec
    from sgpu_magic.wire.attach import AttachRecord

    rd = RunDir.create(tmp_path)
    spec = LaunchSpec(gpus=2, name="train", detach=True)
    record = AttachRecord(spec, {"backend": "gloo"}, 4242, "/keeper.log", 12.5)
    rd.write_attach(record)
    assert oct(rd.attach_file.stat().st_mode & 0o777) == "0o600" and rd.read_attach() == record
    assert type(pickle.loads(rd.attach_file.read_bytes())) is dict  # a kernel of the previous version reads it too
    old = {
        "spec": spec,
        "plan": {"backend": "gloo"},
        "launcher_pid": 4242,
        "launcher_log": "/keeper.log",
        "submitted_s": 12.5,
    }
    atomic_write_bytes(rd.attach_file, pickle.dumps(old))
    assert rd.read_attach() == record
    atomic_write_bytes(rd.attach_file, pickle.dumps(["not", "a", "record"]))
    with pytest.raises(RecordError, match=r"^attach.pkl holds a list, not a detached job's attach record of this "):
        rd.read_attach()
    atomic_write_bytes(rd.attach_file, b"torn")
    with pytest.raises(RecordError, match=r"^attach.pkl does not read: UnpicklingError: "):
        rd.read_attach()
