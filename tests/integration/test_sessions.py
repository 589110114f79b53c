"""Live sessions in a real IPython shell: state across cells, push/pull, subsets, errors, rank death, bad input."""

from __future__ import annotations

import json
import re
import threading

import psutil
import pytest
from IPython.core.error import UsageError

from sgpu_magic import Session
from sgpu_magic.errors import CaptureError, CellInterruptedError, RankFailedError, SessionError, SpecError

from helpers import interrupt_session_cell, wait_for, wait_gone


@pytest.fixture(scope="module")
def sess(ip):
    """One 2-rank session for the module (started from the shell's warm launch host), stopped at the end."""
    session = Session(gpus=2, widgets=False, mlflow=False, name="shared")
    session.run_cell(
        "import os, torch, torch.distributed as dist\n"
        "if not dist.is_initialized():\n"
        "    dist.init_process_group('gloo')\n"
        "rank = dist.get_rank()\n"
        "w = torch.ones(3) * (rank + 1)\n"
        "group_id = id(dist.group.WORLD)"
    )
    yield session
    session.stop()


def test_state_and_process_group_persist_across_cells(sess):
    values = sess.run_cell("t = w.clone()\ndist.all_reduce(t)\n(rank, t.tolist(), group_id == id(dist.group.WORLD))")
    assert values == [(0, [3.0, 3.0, 3.0], True), (1, [3.0, 3.0, 3.0], True)]
    assert sess.pull("w", rank=1).tolist() == [2.0, 2.0, 2.0]
    assert [v.tolist() for v in sess.pull("w")] == [[1.0] * 3, [2.0] * 3]


def test_a_name_the_ranks_have_wins_over_the_kernels_and_push_overrides_it(sess, ip):
    sess.run_cell("scale = 10 + rank")
    ip.user_ns["scale"] = 1000  # the ranks have their own scale: the kernel's is not sent
    assert sess.run_cell("scale") == [10, 11]
    ip.user_ns["offset"] = 5  # a name the ranks lack comes from the kernel, by value
    assert sess.run_cell("scale + offset") == [15, 16]
    sess.push(scale=7)
    assert sess.run_cell("scale") == [7, 7]


def test_magics_push_pull_and_session_cells(sess, run_cell, ip):
    ip.user_ns["lr"] = 0.25
    result, _, _ = run_cell("%distributed_push lr --session shared")
    assert result.error_in_exec is None
    result, _, _ = run_cell("%%distributed --session shared\nlr * (rank + 1)")
    assert result.result == 0.25  # rank 0's value is the cell's output
    result, _, _ = run_cell("%%distributed --session shared --ranks 1 -o cell\nlr * (rank + 1)")
    assert result.result == 0.5 and ip.user_ns["cell"].result() == [0.5]
    result, _, _ = run_cell("%distributed_pull lr -o pulled")
    assert result.result == [0.25, 0.25] and ip.user_ns["pulled"] == [0.25, 0.25]


def test_a_cell_error_fails_the_cell_and_keeps_the_ranks(sess):
    pids = sess.pids
    with pytest.raises(RankFailedError, match=r"rank 1 failed \(root cause\): ValueError: bad batch on rank 1"):
        sess.run_cell("if rank == 1:\n    raise ValueError('bad batch on rank 1')\nrank")
    assert sess.run_cell("w.sum().item()") == [3.0, 6.0]
    assert sess.pids == pids and all(psutil.pid_exists(p) for p in pids.values())


def test_each_cell_s_metrics_are_its_own(sess):
    """A session's ranks log into the metrics file of the cell that runs (a lean run directory: the rank makes
    ``metrics/``), so each cell's ``job.metrics()`` holds its own points."""
    code = "from sgpu_magic import runtime\nfor s in range(3):\n    runtime.log_metric('{name}', s + rank, step=s)"
    first = sess.submit_cell(code.format(name="a"), {})
    first.result()
    second = sess.submit_cell(code.format(name="b"), {})
    second.result()
    assert first.metrics() == {"a": {0: [(0, 0.0), (1, 1.0), (2, 2.0)], 1: [(0, 1.0), (1, 2.0), (2, 3.0)]}}
    assert sorted(second.metrics()) == ["b"]
    assert (second.run_dir / "metrics").stat().st_mode & 0o777 == 0o700


def test_a_session_cell_times_its_own_steps_and_names_its_straggler(sess):
    """Steps count per cell (the rank's clock begins again with each), and a cell's straggler is its own."""
    code = (
        "import time\nfrom sgpu_magic import runtime\n"
        "for _ in range({n}):\n"
        "    with runtime.step():\n"
        "        time.sleep({extra} if rank == 1 else 0)\n"
        "        dist.all_reduce(torch.ones(1))"
    )
    slow = sess.submit_cell(code.format(n=12, extra=0.03), {})
    slow.result()
    even = sess.submit_cell(code.format(n=3, extra=0), {})
    even.result()
    assert [len(t) for t in slow.step_times().values()] == [12, 12] and slow.straggler().rank == 1
    assert [len(t) for t in even.step_times().values()] == [3, 3] and even.straggler() is None


def test_a_profiled_session_cell_gives_its_own_trace_and_table_and_the_next_cell_is_not_profiled(
    sess, capsys, run_cell, ip
):
    code = (
        "from sgpu_magic import runtime\n"
        "for _ in range(6):\n"
        "    with runtime.step():\n"
        "        t = w @ torch.ones(3, 3)\n"
        "        dist.all_reduce(t)\n"
        "rank"
    )
    job = sess.profile(code, steps=3)
    assert job.results == [0, 1]
    summary = job.profile_summary()
    assert sorted(summary) == [0, 1] and all(s["steps"] == 3 and s["collective_s"] > 0 for s in summary.values())
    assert {e["pid"] for e in json.loads(job.profile_trace().read_bytes())["traceEvents"]} == {0, 1}
    assert "profile of 3 step(s) per rank" in capsys.readouterr().out
    plain = sess.submit_cell(code, {})
    assert plain.result() == [0, 1] and plain.profile_summary() == {}
    result, out, _ = run_cell(f"%%distributed --session shared --profile 2 -o profiled\n{code}")
    assert result.error_in_exec is None and "profile of 2 step(s) per rank" in out
    assert ip.user_ns["profiled"].profile_summary()[1]["steps"] == 2
    with pytest.raises(SpecError, match="profile must be a number of steps to profile between 1 and 1000"):
        sess.profile(code, steps=0)


def test_run_calls_a_function_in_the_ranks_namespace(sess):
    def weighted(k):
        return float(w.sum()) * k  # noqa: F821 - w lives in the ranks' namespace

    assert sess.run(weighted, 2) == [6.0, 12.0]


def test_interrupt_keeps_the_state(sess, tmp_path):
    marker = tmp_path / "started"
    code = f"import time, pathlib\npathlib.Path({str(marker)!r} + str(rank)).touch()\nwhile True:\n    time.sleep(0.01)"
    error = interrupt_session_cell(sess, code, marker)
    assert isinstance(error, CellInterruptedError), error
    assert isinstance(error, KeyboardInterrupt)
    assert "the ranks and their state are kept" in str(error)
    assert sess.run_cell("w.sum().item()") == [3.0, 6.0]


def test_when_one_rank_raises_the_ranks_still_in_the_cell_are_interrupted_and_the_state_is_kept(sess):
    """In SPMD code a rank still running a cell in which another raised is most likely waiting for it: after
    FAILURE_GRACE_S it is interrupted (as torchrun stops a job's other ranks), the cell fails naming the rank that
    raised, and the session goes on."""
    with pytest.raises(RankFailedError, match=r"rank 1 failed \(root cause\): ValueError: rank 1 gives up"):
        sess.run_cell(
            "import threading\nif rank == 1:\n    raise ValueError('rank 1 gives up')\nthreading.Event().wait()",
            timeout=120,
        )
    job = sess.jobs[-1]
    assert job.status.rank_outcomes == {0: "interrupted", 1: "raised"}
    assert sess.state.value == "idle" and sess.run_cell("w.sum().item()") == [3.0, 6.0]


def test_an_interrupted_cell_leaves_torchs_grad_mode_as_it_found_it(sess, tmp_path):
    """An interrupt that lands inside ``with torch.no_grad():`` (after its ``set_grad_enabled(False)``) must not
    leave grad off for the rank's later cells (their backward() would raise while the peers wait in all-reduce)."""
    marker = tmp_path / "off"
    code = (
        f"import pathlib, threading, torch\ntorch.set_grad_enabled(False)\n"
        f"pathlib.Path({str(marker)!r} + str(rank)).touch()\nthreading.Event().wait()"
    )
    assert isinstance(interrupt_session_cell(sess, code, marker), CellInterruptedError)
    # what the cell's panel and record say: its ranks live on (not "every rank was stopped", as for a job)
    assert str(sess.jobs[-1].exception()).startswith(
        "the cell was interrupted; the session's ranks stopped running it and keep their state. Logs: "
    )
    assert sess.run_cell("torch.is_grad_enabled()") == [True, True]


def test_an_interrupt_after_a_breakpoint_raises_in_the_cell(sess, monkeypatch, capsys):
    """pdb's ``c`` leaves no SIGINT handler of its own behind: the next interrupt still raises in the cell."""
    answers = ["c"]
    monkeypatch.setattr("builtins.input", lambda prompt="": answers.pop(0))
    assert sess.run_cell("from sgpu_magic import runtime\nruntime.breakpoint(rank=1)\nrank") == [0, 1]
    assert answers == [] and "rank 1 stopped in pdb" in capsys.readouterr().out
    from sgpu_magic.errors import JobTimeoutError

    with pytest.raises(
        JobTimeoutError, match=r"ran longer than its timeout of 0.5 s and was interrupted; the ranks kept"
    ):
        sess.run_cell("import time\nwhile True:\n    time.sleep(0.01)", timeout=0.5)
    assert sess.run_cell("rank") == [0, 1]


def test_a_cell_timeout_interrupts_the_cell_and_keeps_the_state(sess, capsys):
    from sgpu_magic.errors import JobTimeoutError

    capsys.readouterr()
    with pytest.raises(
        JobTimeoutError, match=r"ran longer than its timeout of 0.5 s and was interrupted; the ranks kept"
    ):
        sess.run_cell("import time\nwhile True:\n    time.sleep(0.01)", timeout=0.5)
    assert str(sess.jobs[-1].exception()).startswith(
        "the cell ran longer than its timeout of 0.5 s; the session's ranks stopped running it and keep their state."
    )
    out = capsys.readouterr().out  # the error shows no traceback, so the text view does not promise one
    for rank in (0, 1):
        assert (
            f"[rank {rank}] [sgpu_magic] rank {rank} raised KeyboardInterrupt; its traceback is in its log file\n"
            in out
        )
    assert "the error below shows" not in out
    assert sess.run_cell("rank") == [0, 1]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda s: s.run_cell("1", ranks=[2]), SessionError, r"ranks \[2\] are not in session shared \(world_size=2\)"),
        (
            lambda s: s.pull("nope", rank=0),
            SessionError,
            r"rank 0 has no name 'nope' in session shared; names it has: ",
        ),
        (
            lambda s: s.push(lock=threading.Lock()),
            CaptureError,
            r"^'lock' is a _thread.lock, which cannot be pushed to the ranks of session shared \(TypeError: cannot "
            r"pickle '_thread.lock' object\); create it in the ranks instead, in a %%distributed --session cell\. "
            r"Nothing was sent\.$",
        ),
        (lambda s: s.push(), SessionError, r"push needs at least one name=value"),
        (lambda s: s.run_cell("1", timeout=-1), SpecError, r"timeout must be a number of seconds > 0"),
        (lambda s: s.run(42), SpecError, r"Session.run takes a function"),
    ],
)
def test_bad_input_is_refused_and_leaves_the_session_usable(sess, call, error, message):
    with pytest.raises(error, match=message):
        call(sess)
    assert sess.run_cell("rank") == [0, 1]


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        (
            "%%distributed --session nosuch\n1",
            r"no session named 'nosuch' in this kernel \(sessions: .*shared \(idle\)",
        ),
        ("%%distributed --session shared --ranks 0,x\n1", r"--ranks takes rank numbers separated by commas"),
        ("%%distributed --session shared --ranks 3\n1", r"ranks \[3\] are not in session shared"),
        ("%distributed_pull --session nosuch w", r"no session named 'nosuch'"),
        ("%distributed_push not_defined_anywhere", r"no name 'not_defined_anywhere' in the kernel's namespace"),
        ("%distributed_session start shared --gpus 2", r"session 'shared' is already running in this kernel"),
        ("%distributed_session start --gpus 0", r"gpus must be"),
        ("%distributed_session start --gpus 1 --idle-timeout soon", r"--idle-timeout takes seconds > 0"),
        ("%distributed_session frobnicate", r"invalid choice: 'frobnicate'"),
    ],
)
def test_bad_magic_input_is_a_usage_error(sess, ip, cell, message):
    with pytest.raises(UsageError, match=message):
        if cell.startswith("%%"):
            line, body = cell[len("%%distributed ") :].split("\n", 1)
            ip.run_cell_magic("distributed", line, body)
        else:
            name, line = cell[1:].split(" ", 1)
            ip.run_line_magic(name, line)
    assert sess.run_cell("rank") == [0, 1]


def test_a_rank_that_dies_breaks_the_session_and_restart_brings_fresh_ranks(ip):
    session = Session(gpus=2, widgets=False, mlflow=False, name="fragile")
    try:
        old = session.pids
        session.run_cell("kept = 1")
        with pytest.raises(
            SessionError, match=r"session fragile is broken: rank 1 died \(exit code 3\); the other ranks"
        ):
            session.run_cell("import os\nif os.environ['RANK'] == '1':\n    os._exit(3)\nimport time\ntime.sleep(60)")
        assert wait_gone(old.values()) == []
        with pytest.raises(SessionError, match=r"session fragile is broken: .*%distributed_session restart"):
            session.run_cell("1")
        with pytest.raises(SessionError, match=r"session fragile is broken: rank 1 died"):
            session.debug()  # the rank that would be debugged has exited
        session.restart()
        with pytest.raises(RankFailedError, match=r"NameError: name 'kept' is not defined"):
            session.run_cell("kept")
        assert session.run_cell("2") == [2, 2]
    finally:
        session.stop()
    assert wait_gone(session.pids.values()) == []
    with pytest.raises(
        SessionError, match=r"session fragile is stopped; start it again with %distributed_session restart"
    ):
        session.run_cell("1")


@pytest.mark.slow
def test_a_rank_left_in_a_collective_by_a_peer_that_raised_is_released_and_the_root_cause_raised(ip):
    """Rank 1 raises before the all-reduce that rank 0 waits in (gloo: not interruptible): rank 0 is interrupted
    FAILURE_GRACE_S after, cannot return, and is released by the automatic recover; the cell raises rank 1's error
    with what recover did, the session is idle with its state, and the process group works again."""
    session = Session(gpus=2, widgets=False, mlflow=False, name="peerless")
    try:
        session.run_cell("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\nkept = 7")
        with pytest.raises(RankFailedError) as raised:
            session.run_cell(
                "if dist.get_rank() == 1:\n    raise RuntimeError('rank 1 skips the all-reduce')\n"
                "dist.all_reduce(torch.ones(1))",
                timeout=300,
            )
        text = str(raised.value)
        assert "rank 1 failed (root cause): RuntimeError: rank 1 skips the all-reduce" in text, text
        assert re.search(
            r"hint: session peerless recovered in \d+\.\d s \(session peerless cell 2\): rank 0 \(in "
            r"dist\.all_reduce at session peerless cell 2 line 3\) returned; the default process group \(gloo\) was "
            r"made again on every rank",
            text,
        ), text
        assert session.state.value == "idle"
        assert session.run_cell("t = torch.ones(1) * kept\ndist.all_reduce(t)\nt.item()") == [14.0, 14.0]
    finally:
        session.stop()
    assert wait_gone(session.pids.values()) == []


@pytest.mark.slow
def test_without_auto_recover_a_rank_left_in_a_collective_breaks_the_session_naming_both(ip):
    session = Session(gpus=2, widgets=False, mlflow=False, name="peerless2", auto_recover=False)
    try:
        session.run_cell("import torch, torch.distributed as dist\ndist.init_process_group('gloo')")
        with pytest.raises(SessionError) as raised:
            session.run_cell(
                "if dist.get_rank() == 1:\n    raise RuntimeError('rank 1 skips the all-reduce')\n"
                "dist.all_reduce(torch.ones(1))",
                timeout=300,
            )
        assert str(raised.value).startswith(
            "session peerless2 is broken: rank(s) 0 did not return within 5 s of the interrupt sent 5 s after "
            "rank(s) 1 raised (RuntimeError: rank 1 skips the all-reduce) (blocked outside Python: rank 0: "
            "dist.all_reduce at session peerless2 cell 2 line 3); run %distributed_session recover (or sess.recover()) "
            "to release it and keep every rank's state, or %distributed_session restart"
        ), raised.value
        assert session.state.value == "broken"
        assert "recovered in" in session.recover()
        assert session.run_cell("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == [2.0, 2.0]
    finally:
        session.stop()
    assert wait_gone(session.pids.values()) == []


def test_recover_of_a_session_with_nothing_to_recover_says_so(sess):
    with pytest.raises(SessionError, match=r"session shared has nothing to recover: it is idle\. recover\(\) releases"):
        sess.recover()
    with pytest.raises(SpecError, match=r"timeout_s must be a number of seconds > 0"):
        sess.recover(timeout_s=-1)


def test_distributed_jobs_lists_a_running_cell_under_its_session_and_stop_finds_it_there(sess, run_cell, tmp_path):
    """A cell is its session's, not one of the kernel's jobs (``job.registry.jobs()``): ``%distributed_jobs`` lists the
    one that runs on the row under its session (its id indented), ``%distributed_stop`` and ``%distributed_stacks``
    find it by its id; an ended one is in ``sess.jobs`` only, so the kernel's list (and memory) does not grow with a
    session's cells."""
    from sgpu_magic.job.registry import jobs

    go, started = tmp_path / "go", tmp_path / "started"
    code = (
        f"import pathlib, time\npathlib.Path({str(started)!r} + str(rank)).touch()\n"
        f"while not pathlib.Path({str(go)!r}).exists():\n    time.sleep(0.01)\nrank"
    )
    cells_before = len(sess.jobs)
    job = sess.submit_cell(code, {})
    try:
        wait_for(lambda: all((tmp_path / f"started{r}").exists() for r in (0, 1)), 60, "both ranks in the cell")
        assert job not in jobs() and sess.job in jobs()
        result, _, _ = run_cell("%distributed_jobs")
        rows = repr(result.result).splitlines()[1:]
        at = next(i for i, r in enumerate(rows) if r.startswith(sess.job.job_id))
        assert rows[at].split()[1] == "running" and rows[at].endswith("session shared")
        cell_row = rows[at + 1]  # under its session, its id indented
        assert cell_row.startswith(f"  {job.job_id}") and cell_row.split()[1] == "running"
        assert cell_row.endswith(f"session shared cell {cells_before + 1}")
        assert f'<td style="padding-left: 1.5em">{job.job_id}</td>' in result.result._repr_html_()  # Jupyter's table
        result, out, _ = run_cell(f"%distributed_stacks {job.job_id[-6:]}")
        assert result.success and "rank 0" in out and "rank 1" in out
    finally:
        go.touch()
    assert job.result() == [0, 1]
    result, _, _ = run_cell("%distributed_jobs")
    assert job.job_id not in repr(result.result)
    assert sess.jobs[-1] is job and f"cells={cells_before + 1}" in repr(sess)
    result, _, _ = run_cell(f"%distributed_stop {job.job_id}")  # ended: not listed any more
    assert not result.success and f"'{job.job_id}' matches no job of this kernel" in str(result.error_in_exec)


def test_a_running_cells_state_is_in_memory_and_its_status_file_is_written_once_when_it_ends(sess, tmp_path):
    """A cell is followed from its ranks' replies in memory: while it runs its run directory has no status.json,
    no launch.json and no status FIFO, yet the job reads as running with the ranks' pids; once it ends, its
    status.json holds the final state and each rank's outcome (the record a post-mortem reads)."""
    from sgpu_magic.job.state import JobState
    from sgpu_magic.rundir import RunDir, read_json

    go, started = tmp_path / "go", tmp_path / "started"
    code = (
        f"import pathlib, time\npathlib.Path({str(started)!r} + str(rank)).touch()\n"
        f"while not pathlib.Path({str(go)!r}).exists():\n    time.sleep(0.01)\nrank"
    )
    job = sess.submit_cell(code, {})
    rd = RunDir(job.run_dir)
    try:
        wait_for(lambda: all((tmp_path / f"started{r}").exists() for r in (0, 1)), 60, "both ranks in the cell")
        assert job.state is JobState.RUNNING
        assert set(job.status.pids) == {0, 1} and set(job.status.pids.values()) == set(sess.pids.values())
        assert not rd.status_file.exists() and not rd.launch_file.exists() and not rd.status_signal.exists()
    finally:
        go.touch()
    assert job.result() == [0, 1]
    written = read_json(rd.status_file)
    assert written["state"] == "succeeded" and written["rank_outcomes"] == {"0": "returned", "1": "returned"}
    assert not rd.launch_file.exists() and not rd.status_signal.exists()


def test_debugging_needs_a_failed_cell_a_rank_in_the_world_or_a_known_job(sess, ip):
    sess.run_cell("1")
    with pytest.raises(SessionError, match=r"the last cell of session shared did not fail: there is nothing to debug"):
        sess.debug()
    with pytest.raises(
        SessionError,
        match=r"ranks \[5\] are not in session shared \(world_size=2\); give ranks from "
        r"0 to 1, e.g. --rank 0$",
    ):
        sess.debug(rank=5)
    with pytest.raises(SessionError, match=r"rank 0's last cell did not fail: there is nothing to debug"):
        sess.debug(rank=0)
    with pytest.raises(UsageError, match=r"'nosuchjob' matches no job of this kernel"):
        ip.run_line_magic("distributed_debug", "--job nosuchjob")
    assert sess.run_cell("rank") == [0, 1]


def test_a_breakpoint_in_a_job_is_said_and_skipped(ip):
    from sgpu_magic import distributed

    @distributed(gpus=1, mlflow=False, widgets=False)
    def stops():
        from sgpu_magic import runtime

        runtime.breakpoint(rank=0)
        return "ran on"

    assert stops.distributed() == ["ran on"]
    assert "runtime.breakpoint() stops a rank only in a live session's cell" in stops.last_job.logs(0)


def test_pulling_a_ddp_model_says_to_pull_its_state_dict(sess, run_cell, ip):
    ip.user_ns["offset"] = 5
    sess.run_cell("from torch.nn.parallel import DistributedDataParallel as DDP\nddp = DDP(torch.nn.Linear(2, 1))")
    with pytest.raises(
        SessionError, match=r"'ddp' from rank 0 of session shared cannot be rebuilt in the kernel .*state_dict"
    ):
        sess.pull("ddp", rank=0)
    result, out, _ = run_cell("%distributed_push offset --session shared")
    assert result.error_in_exec is None and "sgpu_magic: offset copied to the 2 ranks of session shared" in out
    assert sess.run_cell("sorted(ddp.module.state_dict())") == [["bias", "weight"], ["bias", "weight"]]


def test_pulling_a_value_that_cannot_be_pickled_names_it_and_the_ranks_keep_serving(sess):
    """A lock (TypeError from pickle) and an object whose ``__reduce__`` raises something else: each pull says what
    the value is and why, the rank lives on (an error outside TypeError once ended the rank's loop)."""
    sess.run_cell(
        "import threading\nlock = threading.Lock()\nclass Refuses:\n    def __reduce__(self):\n"
        "        raise RuntimeError('not today')\nrefuses = Refuses()"
    )
    with pytest.raises(SessionError) as raised:
        sess.pull("lock", rank=1)
    assert str(raised.value) == (
        "'lock' on rank 1 is a _thread.lock, which cannot be pickled to be pulled into the kernel (TypeError: cannot "
        "pickle '_thread.lock' object); pull plain Python, numpy or torch values (a state_dict, not a model) in "
        "session shared"
    )
    with pytest.raises(
        SessionError,
        match=r"^'refuses' on rank 0 is a __main__\.Refuses, which cannot be pickled .*"
        r"\(RuntimeError: not today\)",
    ):
        sess.pull("refuses")
    assert sess.run_cell("rank") == [0, 1]


def test_an_interrupt_while_a_push_is_being_sent_is_held_until_every_rank_has_it(sess, monkeypatch):
    """The kernel's SIGINT lands while the push's frame is being written (the first time write_frame is called):
    the frame is finished, every rank replies, then KeyboardInterrupt says so; the session is idle and usable.
    Before, the interrupt cut the frame and the session stayed busy for good."""
    import os
    import signal

    import torch

    from sgpu_magic.session import channel

    real = channel.write_frame
    sent = []

    def interrupted_write(fd, data):
        if not sent:
            os.kill(os.getpid(), signal.SIGINT)
        sent.append(len(data))
        real(fd, data)

    monkeypatch.setattr(channel, "write_frame", interrupted_write)
    with pytest.raises(KeyboardInterrupt) as raised:
        sess.push(big=torch.ones(4_000_000))
    monkeypatch.setattr(channel, "write_frame", real)
    assert str(raised.value) == "the push of big was interrupted after it reached the ranks: it completed on every rank"
    assert len(sent) == 2 and sess.state.value == "idle"
    assert sess.run_cell("float(big.sum())") == [4_000_000.0, 4_000_000.0]
    sess.run_cell("del big")


def test_an_interrupt_while_a_cell_is_being_sent_interrupts_the_cell(sess, monkeypatch, tmp_path):
    """The notebook's Interrupt lands while the kernel is still in the send of a cell whose ranks already run it (a
    loaded machine): the cell is interrupted as any running cell is, CellInterruptedError, state kept. Before, the
    KeyboardInterrupt escaped the cell's launch and left its ranks running it. Here the SIGINT comes once both ranks
    have started the cell, before the send returns."""
    import os
    import signal

    from sgpu_magic.session import channel

    real = channel.write_frame
    sent = []

    def write_then_interrupt(fd, data):
        real(fd, data)
        sent.append(len(data))
        if len(sent) == 2:  # the cell reached both ranks
            wait_for(lambda: len(list(tmp_path.glob("started_*"))) == 2, 60, "both ranks to start the cell")
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(channel, "write_frame", write_then_interrupt)
    with pytest.raises(CellInterruptedError, match=r"was interrupted; the ranks and their state are kept"):
        sess.run_cell(
            f"import pathlib, time\npathlib.Path({str(tmp_path)!r}, f'started_{{rank}}').touch()\n"
            "for _ in range(3000):\n    time.sleep(0.01)\n'not interrupted'"
        )
    monkeypatch.setattr(channel, "write_frame", real)
    assert sess.state.value == "idle" and sess.run_cell("rank") == [0, 1]
