"""Live sessions in a real Jupyter kernel (jupyter_client): the notebook's Interrupt keeps the state, the idle
timeout releases the session's GPU leases, a SIGKILLed kernel leaves no rank behind, MLflow runs end right."""

from __future__ import annotations

import os
import re
import signal

import pytest

from helpers import wait_for, wait_gone
from kernel_utils import collect, execute, start_kernel, stop_kernel

pytestmark = pytest.mark.slow


def value(kc, expr: str) -> str:
    out = execute(kc, expr)
    assert out.error is None, out.error
    return out.results[-1]


@pytest.fixture
def kernel(tmp_path):
    km, kc = start_kernel(env={"SGPU_MAGIC_FAKE_GPUS": "4 x H100", "SGPU_MAGIC_LEASE_DIR": str(tmp_path / "leases")})
    yield km, kc
    stop_kernel(km, kc)


def test_no_session_then_state_interrupt_and_idle_timeout_in_a_kernel(kernel, tmp_path):
    km, kc = kernel
    out = execute(kc, "%%distributed --session\n1")  # IPython prints a UsageError (no traceback)
    assert (
        "UsageError: no live session in this kernel; start one with %distributed_session start --gpus N" in out.stderr
    )

    out = execute(kc, "%distributed_session start --gpus 2 --no-mlflow --idle-timeout 3 -o sess")
    assert out.error is None, out.error
    assert "session s1: idle, world_size=2" in out.stdout
    assert value(kc, "sess.job.gpus") == "[0, 1]"  # the session holds its two (fake) GPUs' leases
    out = execute(kc, "%%distributed --session\nimport os\nw = int(os.environ['RANK']) + 40\nw")
    assert out.error is None, out.error
    assert out.results == ["40"]

    # the notebook's Interrupt during a session cell: CellInterruptedError, the ranks and their state stay
    marker = tmp_path / "in-cell"
    msg_id = kc.execute(
        f"%%distributed --session\nimport time, pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "while True:\n    time.sleep(0.01)"
    )
    wait_for(marker.exists, 60, "the session cell to start")
    km.interrupt_kernel()
    out = collect(kc, msg_id, 60)
    assert out.error is not None and out.error["ename"] == "CellInterruptedError", out.error
    assert "the ranks and their state are kept" in out.error["evalue"]
    out = execute(kc, "%%distributed --session\nw + 1")
    assert out.error is None and out.results == ["41"], out

    # nothing runs for 3 s: the session stops by itself and gives its GPUs back
    wait_for(lambda: value(kc, "sess.job.state.value") == "'succeeded'", 60, "the idle timeout to end the ranks")
    assert value(kc, "sess.state.value") == "'stopped'"
    holders = value(
        kc,
        "from sgpu_magic.launch.leases import LeaseRegistry\n[h['job_id'] for h in LeaseRegistry().snapshot()['holders']]",
    )
    assert holders == "[]"
    out = execute(kc, "%%distributed --session\nw")
    assert "UsageError: no live session in this kernel" in out.stderr


def test_kernel_sigkill_leaves_no_session_rank(tmp_path):
    km, kc = start_kernel()
    try:
        out = execute(kc, "%distributed_session start --gpus 2 -o sess")
        assert out.error is None, out.error
        pids = [int(p) for p in value(kc, "sorted(sess.pids.values())").strip("[]").split(", ")]
        run_id = value(kc, "sess.job.mlflow_run_id").strip("'")
        out = execute(kc, "%%distributed --session\nx = 1\nx")
        assert out.error is None and out.results == ["1"], out
        os.kill(km.provisioner.pid, signal.SIGKILL)
        assert wait_gone(pids, 10.0) == []
    finally:
        stop_kernel(km, kc)
    from mlflow import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    wait_for(lambda: client.get_run(run_id).info.status != "RUNNING", 30, "the session's MLflow run to end")
    assert client.get_run(run_id).info.status == "KILLED"
    children = client.search_runs([client.get_run(run_id).info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    assert children == []  # a session is one run: its cells make none by default


def test_kernel_sigkill_mid_cell_leaves_no_mlflow_run_of_the_session_running(tmp_path):
    """With a child run per cell (``--mlflow-per-cell``), a kernel SIGKILLed while a cell runs leaves the session's
    run and the running cell's child run KILLED (the launch host ends them on its way out), the ended cell's
    FINISHED: none RUNNING."""
    from mlflow import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    km, kc = start_kernel()
    try:
        out = execute(kc, "%distributed_session start --gpus 2 --mlflow-per-cell -o sess")
        assert out.error is None, out.error
        pids = [int(p) for p in value(kc, "sorted(sess.pids.values())").strip("[]").split(", ")]
        run_id = value(kc, "sess.job.mlflow_run_id").strip("'")
        experiment = client.get_run(run_id).info.experiment_id
        out = execute(kc, "%%distributed --session\nx = 1\nx")
        assert out.error is None and out.results == ["1"], out
        kc.execute("%%distributed --session\nimport time\ntime.sleep(600)")

        def cells() -> list[str]:
            found = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{run_id}'")
            return sorted(c.info.status for c in found)

        wait_for(lambda: cells() == ["FINISHED", "RUNNING"], 60, "the running cell's child run")
        os.kill(km.provisioner.pid, signal.SIGKILL)
        assert wait_gone(pids, 10.0) == []
    finally:
        stop_kernel(km, kc)
    wait_for(lambda: client.get_run(run_id).info.status != "RUNNING", 30, "the session's MLflow run to end")
    assert client.get_run(run_id).info.status == "KILLED"
    assert cells() == ["FINISHED", "KILLED"]


def _debug(kc, code: str, answers: list[str], timeout_s: float = 120):
    """Run ``code`` answering each of the kernel's input requests (a pdb prompt) with the next of ``answers``;
    return (stdout text, the prompts asked)."""
    import queue

    msg_id = kc.execute(code, allow_stdin=True)
    prompts, pending = [], list(answers)
    while True:
        try:
            request = kc.get_stdin_msg(timeout=0.05)
        except queue.Empty:
            request = None
        if request is not None and request["msg_type"] == "input_request":
            prompts.append(request["content"]["prompt"])
            kc.input(pending.pop(0) if pending else "q")
        try:
            reply = kc.get_shell_msg(timeout=0.01)
        except queue.Empty:
            continue
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    out = collect(kc, msg_id, timeout_s)
    return out, prompts


def test_post_mortem_debugger_in_a_session_rank_and_a_jobs_saved_locals(kernel):
    km, kc = kernel
    out = execute(kc, "%distributed_session start --gpus 2 --no-mlflow -o sess")
    assert out.error is None, out.error
    out = execute(
        kc,
        "%%distributed --session\nimport os\ndef f(a):\n    secret = a * 2\n    return 1 / (a - 3)\n"
        "x = f(3 if os.environ['RANK'] == '1' else 1)",
    )
    assert out.error is not None and out.error["ename"] == "RankFailedError"
    assert "rank 1 failed (root cause): ZeroDivisionError: division by zero" in out.error["evalue"]
    out, prompts = _debug(kc, "%distributed_debug", ["p secret", "p a", "q"])
    assert prompts == ["(Pdb) "] * 3, prompts
    assert "pdb in rank 1 of session s1, where its last cell failed" in out.stdout
    assert "Cell In[3]>(5)f()" in out.stdout and "-> return 1 / (a - 3)" in out.stdout, out.stdout
    assert "\n6\n3\n" in out.stdout, out.stdout
    out = execute(kc, "%%distributed --session\nf(0) if os.environ['RANK'] == '0' else 'ok'")
    assert out.error is None and out.results == ["-0.3333333333333333"], out  # the ranks are idle and usable

    out = execute(kc, "%distributed_debug")
    assert "UsageError: the last cell of session s1 did not fail: there is nothing to debug" in out.stderr, out
    out = execute(kc, "%distributed_debug --rank 7")
    assert "UsageError: ranks [7] are not in session s1 (world_size=2); give ranks from 0 to 1, e.g. --rank 0" in (
        out.stderr
    ), out
    assert "pdb in rank" not in out.stdout
    out = execute(kc, "%distributed_debug --rank 1")
    assert "UsageError: rank 1's last cell did not fail: there is nothing to debug" in out.stderr, out
    assert "pdb in rank" not in out.stdout  # the banner comes once pdb has opened, not before a refusal
    out = execute(kc, "%%distributed --session\n1 / 0")  # the session's last cell fails; a job fails after it
    assert out.error is not None and out.error["ename"] == "RankFailedError"

    out = execute(
        kc,
        "from sgpu_magic import distributed\n@distributed(gpus=2, mlflow=False)\ndef g(n):\n    import os\n"
        "    items = list(range(n))\n    if os.environ['RANK'] == '0':\n        raise KeyError('missing')\n    return n\n"
        "try:\n    g.distributed(4)\nexcept Exception as e:\n    print(type(e).__name__)",
    )
    assert "RankFailedError" in out.stdout, out
    assert value(kc, "g.last_job.failure_locals(0)") == "{'n': '4', 'items': '[0, 1, 2, 3]'}"
    out = execute(kc, "%distributed_debug")  # the latest failure is the job's, not the live session's cell
    assert "the ranks of job" in out.stdout and "are gone" in out.stdout, out
    assert "(--job ID for another job, --session NAME for a session's cell)" in out.stdout, out
    assert "  items = [0, 1, 2, 3]" in out.stdout and "KeyError: 'missing'" in out.stdout, out
    execute(kc, "%distributed_session stop")


def test_a_breakpoint_in_rank_1_stops_it_and_c_or_q_let_the_all_reduce_finish(kernel):
    km, kc = kernel
    out = execute(kc, "%distributed_session start --gpus 2 --no-mlflow -o sess")
    assert out.error is None, out.error
    out = execute(
        kc,
        "%%distributed --session\nimport torch, torch.distributed as dist\nfrom sgpu_magic import runtime\n"
        "dist.init_process_group('gloo')",
    )
    assert out.error is None, out.error
    cell = (
        "%%distributed --session\nx = torch.ones(1) * (dist.get_rank() + 1)\nruntime.breakpoint(rank=1)\n"
        "y = x * 10\ndist.all_reduce(y)\ny.item()"
    )
    out, prompts = _debug(kc, cell, ["p x", "c"])
    assert out.error is None, out.error
    assert prompts == ["[rank 1] (Pdb) ", "[rank 1] (Pdb) "], prompts
    assert "sgpu_magic: rank 1 stopped in pdb" in out.stdout and "tensor([2.])" in out.stdout, out.stdout
    assert out.results == ["30.0"], out  # the all_reduce finished with both ranks' values
    out, prompts = _debug(kc, cell, ["q"])  # q detaches: the rank runs on and its peer's collective completes
    assert out.error is None and out.results == ["30.0"], out
    out = execute(kc, "%%distributed --session\ndist.get_rank()")
    assert out.error is None and out.results == ["0"], out
    # every rank stops: one pdb at a time, the second rank's prompts wait until the first one continues
    out, prompts = _debug(kc, cell.replace("rank=1", "rank=None"), ["p x", "c", "p x", "c"])
    assert out.error is None and out.results == ["30.0"], out
    first, second = prompts[0][:8], prompts[2][:8]
    assert prompts == [f"{first} (Pdb) "] * 2 + [f"{second} (Pdb) "] * 2 and {first, second} == {"[rank 0]", "[rank 1]"}
    assert out.stdout.count("stopped in pdb") == 2 and "tensor([1.])" in out.stdout and "tensor([2.])" in out.stdout


HUNG = (
    "%%distributed --session\nimport pathlib\nif rank == 0:\n    pathlib.Path({marker!r}).touch()\n"
    "    dist.all_reduce(t)\n"
)


ALL_REDUCE = "sess.run_cell('x = torch.ones(2) * (rank + 1)\\ndist.all_reduce(x)\\nx.tolist()')"


def _hang_and_interrupt(km, kc, marker) -> dict:
    """A cell whose rank 0 enters an all-reduce that rank 1 never enters, then the notebook's Interrupt; its error."""
    msg_id = kc.execute(HUNG.format(marker=str(marker)))
    wait_for(marker.exists, 60, "rank 0 to enter the all-reduce")
    km.interrupt_kernel()
    out = collect(kc, msg_id, 60)
    assert out.error is not None, out
    return out.error


def test_recover_releases_a_rank_blocked_in_a_collective_and_keeps_every_ranks_state(kernel, tmp_path):
    """The most common SPMD mistake (a collective under ``if rank == 0:``) and Interrupt: the session names where
    rank 0 waits; ``%distributed_session recover`` returns it with every rank's model and optimizer intact, and
    the next cell's all-reduce is right. Then the same with automatic recovery (the default)."""
    km, kc = kernel
    out = execute(kc, "%config DistributedMagics.session_auto_recover = False")
    assert out.error is None, out.error
    out = execute(kc, "%distributed_session start --gpus 2 --no-mlflow -o sess")
    assert out.error is None, out.error
    setup = (
        "%%distributed --session\nimport torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "rank = dist.get_rank()\ntorch.manual_seed(rank)\nmodel = torch.nn.Linear(8, 4)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nmodel(torch.ones(2, 8)).sum().backward()\nopt.step()\n"
        "t = torch.ones(3) * (rank + 1)\n"
        "def checksum():\n    return float(sum(p.double().sum() for p in model.parameters()))\n"
    )
    out = execute(kc, setup)
    assert out.error is None, out.error
    before = value(kc, "sess.run_cell('checksum()')")  # one per rank (the magic shows rank 0's value)
    assert len(set(before.strip("[]").split(", "))) == 2, before

    error = _hang_and_interrupt(km, kc, tmp_path / "hung-1")
    assert error["ename"] == "CellInterruptedError", error
    assert re.search(
        r"session s1 is broken: rank\(s\) 0 did not return within 5 s of the interrupt \(blocked outside Python: "
        r"rank 0: dist\.all_reduce at Cell In\[\d+\] line 5\); run %distributed_session recover \(or sess\.recover\(\)\) "
        r"to release it and keep every rank's state",
        error["evalue"],
    ), error["evalue"]
    out = execute(kc, "%%distributed --session\n1")
    assert "UsageError: session s1 is broken" in out.stderr, out

    out = execute(kc, "%distributed_session recover")
    assert out.error is None, out
    assert re.search(
        r"session s1 recovered in \d+\.\d s \(session s1 cell \d+\): rank 0 \(in dist\.all_reduce at Cell In\[\d+\] "
        r"line 5\) returned; the default process group \(gloo\) was made again on every rank; every rank's namespace "
        r"is kept; values that were in the aborted collective may differ between ranks: t \(rank 0\); a DDP or FSDP "
        r"model wrapped before holds the old group: wrap it again",
        out.stdout,
    ), out.stdout
    assert value(kc, "sess.state.value") == "'idle'"
    assert value(kc, "sess.run_cell('checksum()')") == before  # every rank's weights, as before the fault
    assert value(kc, ALL_REDUCE) == "[[3.0, 3.0], [3.0, 3.0]]"

    # recovery by itself: the interrupted cell's error says what was done, and the session is idle at once
    out = execute(kc, "sess.auto_recover = True")
    assert out.error is None, out.error
    error = _hang_and_interrupt(km, kc, tmp_path / "hung-2")
    assert error["ename"] == "CellInterruptedError", error
    assert re.search(
        r"was interrupted; session s1 recovered in \d+\.\d s .*: rank 0 \(in dist\.all_reduce", error["evalue"]
    )
    assert value(kc, "sess.state.value") == "'idle'"
    assert value(kc, "sess.run_cell('checksum()')") == before
    assert value(kc, ALL_REDUCE) == "[[3.0, 3.0], [3.0, 3.0]]"

    out = execute(kc, "%distributed_session recover")
    assert "UsageError: session s1 has nothing to recover: it is idle" in out.stderr, out
    pids = value(kc, "list(sess.pids.values())")
    out = execute(kc, "%distributed_session stop")
    assert out.error is None, out.error
    assert wait_gone([int(p) for p in pids.strip("[]").split(",")]) == []
