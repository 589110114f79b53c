"""launch.stacks: py-spy's stacks of real processes, read as the notebook names its code."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from sgpu_magic.errors import SgpuError
from sgpu_magic.launch.stacks import (
    CodeMap,
    Frame,
    Thread,
    answer,
    call_name,
    live_stacks,
    summary,
    take_stacks,
    where,
    write_stacks,
)
from sgpu_magic.rundir import RunDir
from sgpu_magic.status import HostStatus
from sgpu_magic.wire import RunState

from helpers import wait_for

SCRIPT = """
import time

def nap():
    print("ready", flush=True)
    while True:
        time.sleep(0.05)

nap()
"""


@pytest.fixture
def sleeper(tmp_path):
    """A Python process running a script that sleeps in a loop in ``nap`` (line 7); yields ``(pid, script path)``."""
    path = tmp_path / "nap.py"
    path.write_text(textwrap.dedent(SCRIPT).lstrip("\n"))
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    yield proc.pid, str(path)
    proc.kill()
    proc.wait()


@pytest.mark.parametrize(
    "line, inner, expected",
    [
        ("dist.broadcast(t, src=1)", (), "dist.broadcast"),
        ("x = model(batch).loss", (), "model"),
        ("print(dist.all_reduce(t))", (Frame("all_reduce", "c10d.py", "c10d.py", 1),), "dist.all_reduce"),
        ("out = dist.all_gather(parts,", (), "dist.all_gather"),  # the first line of a call spanning lines
        ("for batch in loader:", (), None),
        ("", (), None),
    ],
)
def test_call_name_is_the_call_as_written(line, inner, expected):
    assert call_name(line, inner) == expected


def test_a_cell_payload_maps_to_its_notebook_label():
    from sgpu_magic.wire.payload import Cell, Payload

    code = CodeMap.from_payload(
        Payload(
            Cell("\nimport time\ntime.sleep(1)\n", "<%%distributed cell>", cell_label="Cell In[4]"),
            sources={"/tmp/ipykernel_1/2.py": "def f():\n    return g()\n"},
            display_names={"/tmp/ipykernel_1/2.py": "Cell In[2]"},
        )
    )
    assert code.place("<%%distributed cell>", 3) == "Cell In[4] line 3"
    assert code.line_text("<%%distributed cell>", 3) == "time.sleep(1)"
    assert code.place("/tmp/ipykernel_1/2.py", 2) == "Cell In[2] line 2"
    assert code.is_user("/tmp/ipykernel_1/2.py") and code.is_user("/home/me/train.py")
    assert not code.is_user(subprocess.__file__)  # the standard library
    assert not code.is_user(pytest.__file__)  # an installed package
    assert not code.is_user("/usr/lib/x86_64-linux-gnu/libc.so.6")  # a native frame (--native)
    frames = (
        Frame("broadcast", os.path.join(os.path.dirname(pytest.__file__), "c10d.py"), "torch/c10d.py", 3151),
        Frame("<module>", "<%%distributed cell>", "<%%distributed cell>", 3),
    )
    assert where([Thread("Thread 1 (idle) (main)", frames)], code) == "time.sleep at Cell In[4] line 3"


def test_stacks_of_a_real_process_name_the_script_line_and_call(sleeper, tmp_path):
    pid, path = sleeper

    def asleep():
        stacks = take_stacks({3: pid}, CodeMap())
        return stacks if stacks[3].where.startswith("time.sleep") else None

    stacks = wait_for(asleep, 10, "the script in its sleep")
    assert stacks[3].where == f"time.sleep at {path} line 6"
    lines = stacks[3].text.splitlines()
    assert lines[0] == f"rank 3 (pid {pid}): time.sleep at {path} line 6"
    assert lines[1] == f"Thread {pid} (idle) (main)"
    assert lines[2:6] == [
        f"    nap ({path} line 6)",
        "        time.sleep(0.05)",
        f"    <module> ({path} line 8)",
        "        nap()",
    ]


def test_a_stack_that_cannot_be_taken_is_one_line_saying_why(sleeper):
    pid, _ = sleeper
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stacks = take_stacks({0: gone.pid}, CodeMap())
    assert stacks[0].where == "no stack: py-spy: the process had ended"
    assert stacks[0].text == f"rank 0 (pid {gone.pid}): no stack: py-spy: the process had ended\n"
    assert take_stacks({1: pid}, CodeMap(), timeout_s=1e-4)[1].where == "no stack: py-spy took longer than 0.0001 s"


def test_saved_stacks_are_private_files_and_summed_up(sleeper, tmp_path):
    pid, _ = sleeper
    rd = RunDir.create(tmp_path)
    where_by_rank = write_stacks(rd, take_stacks({0: pid}, CodeMap()))
    assert list(where_by_rank) == ["0"] and where_by_rank["0"].split(" at ")[0] in {"time.sleep", "nap", "print"}
    assert stat.S_IMODE(rd.stacks_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(rd.stack_file(0).stat().st_mode) == 0o600
    assert rd.stack_file(0).read_text().startswith(f"rank 0 (pid {pid}): ")
    status = HostStatus.from_dict({"state": "timed_out", "pids": {"0": pid}, "stacks": where_by_rank})
    assert status.pids == {0: pid} and status.stacks == {0: where_by_rank["0"]}
    assert summary({1: "b at y", 0: "a at x"}) == "rank 0: a at x; rank 1: b at y"


def test_the_launch_hosts_answers_and_their_absence(sleeper, tmp_path):
    """live_stacks as the Job handle runs it, with ``answer`` (the launch host's side) answering in this process."""
    pid, _ = sleeper
    rd = RunDir.create(tmp_path)
    states = iter([HostStatus(RunState.RUNNING, pids={0: pid}), HostStatus(RunState.CANCELLED)])
    running = HostStatus(RunState.RUNNING, pids={0: pid})

    stacks = live_stacks(rd, lambda: running, ask=lambda token: answer(rd, token, {0: pid}, False))
    assert list(stacks) == [0] and stacks[0].startswith(f"rank 0 (pid {pid}): ")
    assert not list(rd.path.glob(".stacks-*"))  # the answer is read and removed
    # the job ended between the kernel's look at its status and the host's: said as for an ended job
    with pytest.raises(SgpuError, match=rf"^job {rd.job_id} has ended \(cancelled\): its ranks are gone; no stacks"):
        live_stacks(rd, lambda: next(states), ask=lambda token: answer(rd, token, None, False))
    with pytest.raises(SgpuError, match=rf"^the launch host could not take the stacks of job {rd.job_id}: TypeError"):
        live_stacks(rd, lambda: running, ask=lambda token: answer(rd, token, {0: pid, "1": pid}, False))
    with pytest.raises(SgpuError, match=rf"^the launch host did not send the stacks of job {rd.job_id} within 0.05 s$"):
        live_stacks(rd, lambda: running, ask=lambda token: None, wait_s=0.05)
    with pytest.raises(SgpuError, match=rf"^job {rd.job_id} has no running ranks yet \(state starting\); take its"):
        live_stacks(rd, lambda: HostStatus(RunState.STARTING))
