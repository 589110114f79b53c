"""Stacks of running ranks (py-spy) in the shared IPython shell: ``job.stacks()``, ``%distributed_stacks``, and the
stacks the launch host takes when a job times out or is cancelled while ranks still run.

The hang of issue 21: rank 0 waits in ``dist.broadcast`` for rank 1, which sleeps in a loop and never sends.
"""

from __future__ import annotations

import re
import stat
import textwrap

import pytest

from sgpu_magic.errors import JobCancelledError, JobTimeoutError, SgpuError

from helpers import wait_for

HANG_TIMEOUT_S = 45
"""The hung job's timeout: long enough for 2 cold ranks on a loaded 2-core machine to get into the hang first, and
for the tests that read its live stacks after that (25 s was not, once, in a random-order CI run)."""

HANG_CELL = """
%%distributed --gpus 2 --background --no-mlflow --timeout {timeout} -o hung
import time, torch
import torch.distributed as dist
from sgpu_magic import runtime
dist.init_process_group(runtime.backend())
t = torch.zeros(1)
if runtime.get_global_rank() == 0:
    dist.broadcast(t, src=1)
print("rank 1 loops", flush=True)
while True:
    time.sleep(0.05)
"""
"""Notebook lines: 8 is rank 0's ``dist.broadcast``, 11 rank 1's ``time.sleep``."""


def _in_place(job, label: str) -> dict[int, str] | None:
    """The job's stacks once rank 0 is in its broadcast and rank 1 in its sleep, else ``None``."""
    if job.state.value != "running":
        return None
    stacks = job.stacks()
    at0, at1 = (stacks[r].splitlines()[0] for r in (0, 1))
    return stacks if at0.endswith(f"dist.broadcast at {label} line 8") and "time.sleep" in at1 else None


@pytest.fixture(scope="module")
def hung(ip):
    """The hang started from a %%distributed cell run as a notebook runs it (stored in the history, so the cell
    is In[n]); yields ``(job, "Cell In[n]")`` with both ranks in place."""
    n = ip.execution_count
    result = ip.run_cell(HANG_CELL.format(timeout=HANG_TIMEOUT_S).lstrip("\n"), store_history=True)
    assert result.error_in_exec is None, result.error_in_exec
    job, label = ip.user_ns["hung"], f"Cell In[{n}]"
    wait_for(lambda: _in_place(job, label), HANG_TIMEOUT_S - 5, "rank 0 in dist.broadcast and rank 1 in time.sleep")
    yield job, label
    job.cancel()


def test_job_stacks_show_each_ranks_call_and_notebook_line(hung):
    job, label = hung
    stacks = job.stacks()
    assert sorted(stacks) == [0, 1]
    rank0, rank1 = stacks[0].splitlines(), stacks[1].splitlines()
    assert re.fullmatch(rf"rank 0 \(pid \d+\): dist\.broadcast at {re.escape(label)} line 8", rank0[0])
    assert re.fullmatch(rf"rank 1 \(pid \d+\): time\.sleep at {re.escape(label)} line 11", rank1[0])
    # the frames: torch's broadcast inside, then the cell's line with its source, sgpu_magic's entry summed up
    assert any(line.strip().startswith("broadcast (torch/distributed/distributed_c10d.py:") for line in rank0)
    i = rank0.index(f"    <module> ({label} line 8)")
    assert rank0[i + 1] == "        dist.broadcast(t, src=1)"
    assert re.fullmatch(r"    \.\.\. \d+ frames of sgpu_magic's rank entry", rank0[-1])
    assert f"    <module> ({label} line 11)" in rank1 and "        time.sleep(0.05)" in rank1
    assert "worker.py" not in stacks[0] + stacks[1]
    assert not list(job.run_dir.glob(".stacks-*"))  # the launch host's answer, read and removed


def test_native_stacks_show_where_gloo_waits(hung):
    job, label = hung
    stacks = job.stacks(native=True)
    assert stacks[0].splitlines()[0].endswith(f"dist.broadcast at {label} line 8")
    assert "c10d::" in stacks[0]  # the C++ frames of the wait


def test_distributed_stacks_prints_the_latest_running_jobs_stacks(hung, run_cell):
    job, label = hung
    for line in ("%distributed_stacks", f"%distributed_stacks {job.job_id[-6:]}"):
        result, out, err = run_cell(line)
        assert result.error_in_exec is None, err
        assert re.search(rf"^rank 0 \(pid \d+\): dist\.broadcast at {re.escape(label)} line 8$", out, re.M), out
        assert re.search(rf"^rank 1 \(pid \d+\): time\.sleep at {re.escape(label)} line 11$", out, re.M), out


def test_timeout_names_the_running_ranks_and_where_each_was(hung):
    job, label = hung
    error = job.exception(timeout_s=HANG_TIMEOUT_S + 30)
    assert isinstance(error, JobTimeoutError)
    stacks_dir = job.run_dir / "stacks"
    assert str(error) == (
        f"job {job.job_id} ran longer than its timeout of {HANG_TIMEOUT_S} s; every rank was stopped. Where the "
        f"ranks still running were: rank 0: dist.broadcast at {label} line 8; rank 1: time.sleep at {label} line "
        f"11 (their stacks: {stacks_dir}). Logs: {job.run_dir / 'logs'}"
    )
    assert stat.S_IMODE(stacks_dir.stat().st_mode) == 0o700
    for rank, call, line in ((0, "dist.broadcast", 8), (1, "time.sleep", 11)):
        path = stacks_dir / f"rank_{rank}.txt"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_text().splitlines()[0].endswith(f"{call} at {label} line {line}")
    assert job.status.stacks == {0: f"dist.broadcast at {label} line 8", 1: f"time.sleep at {label} line 11"}


def test_stacks_of_an_ended_job_say_it_ended_and_where_its_saved_stacks_are(hung, run_cell):
    job, _ = hung
    job.wait(timeout_s=HANG_TIMEOUT_S + 30)
    saved = re.escape(str(job.run_dir / "stacks"))
    with pytest.raises(
        SgpuError,
        match=rf"^job {job.job_id} has ended \(timed_out\): its ranks are gone; the "
        rf"stacks taken when it was stopped are in {saved}$",
    ):
        job.stacks()
    result, _, _ = run_cell(f"%distributed_stacks {job.job_id}")
    assert isinstance(result.error_in_exec, SgpuError)
    assert str(result.error_in_exec) == str(pytest.raises(SgpuError, job.stacks).value)


WHEN_CANCELLED = """
from sgpu_magic import distributed

@distributed(gpus=2, timeout=120)
def stuck(go):
    import os, time, torch
    import torch.distributed as dist
    from sgpu_magic import runtime
    dist.init_process_group(runtime.backend())
    if runtime.get_global_rank() == 0:
        dist.barrier()
    while True:
        time.sleep(0.05)
"""
"""A notebook function: rank 0 waits in a barrier (cell line 10), rank 1 sleeps (cell line 12)."""


def test_cancel_of_a_running_function_saves_its_stacks_in_the_run_and_says_where_the_ranks_were(ip):
    n = ip.execution_count
    assert ip.run_cell(WHEN_CANCELLED.lstrip("\n"), store_history=True).error_in_exec is None
    job = ip.run_cell("stuck.submit(None)", store_history=True).result
    label = f"Cell In[{n}]"

    def in_place():
        if job.state.value != "running":
            return False
        stacks = job.stacks()
        return f"dist.barrier at {label} line 10" in stacks[0] and f"time.sleep at {label} line 12" in stacks[1]

    wait_for(in_place, 60, "rank 0 in dist.barrier and rank 1 in time.sleep")
    job.cancel()
    error = job.exception()
    assert isinstance(error, JobCancelledError)
    assert str(error).endswith(
        f"Where the ranks still running were: rank 0: dist.barrier at {label} line 10; rank 1: time.sleep at "
        f"{label} line 12 (their stacks: {job.run_dir / 'stacks'})."
    )
    assert (job.run_dir / "stacks" / "rank_1.txt").read_text().startswith("rank 1 (pid ")
    # and in the job's MLflow run, beside its logs
    from mlflow import MlflowClient

    artifacts = MlflowClient().list_artifacts(job.mlflow_run_id, "stacks")
    assert sorted(a.path for a in artifacts) == ["stacks/rank_0.txt", "stacks/rank_1.txt"]


def test_a_job_that_ended_on_its_own_saved_no_stacks(ip):
    ip.run_cell("from sgpu_magic import distributed\nquick = distributed(gpus=1, mlflow=False)(lambda: 1)")
    job = ip.user_ns["quick"].submit()
    assert job.result(timeout_s=60) == [1]
    assert not (job.run_dir / "stacks").exists()
    with pytest.raises(
        SgpuError,
        match=rf"^job {job.job_id} has ended \(succeeded\): its ranks are gone; no stacks "
        r"were saved \(they are taken when a job times out or is cancelled while ranks run\)$",
    ):
        job.stacks()


@pytest.mark.parametrize(
    "line, message",
    [
        (
            "%distributed_stacks nosuchjob",
            r"^'nosuchjob' matches no job of this kernel \(jobs: .*\); give more of the id, as %distributed_jobs "
            r"lists them$",
        ),
        ("%distributed_stacks --bogus", r"unrecognized arguments: --bogus"),
    ],
)
def test_distributed_stacks_refuses_bad_input(run_cell, line, message):
    from IPython.core.error import UsageError

    result, _, _ = run_cell(line)
    assert isinstance(result.error_in_exec, UsageError)
    assert re.search(message, str(result.error_in_exec)), str(result.error_in_exec)


def test_distributed_stacks_without_a_running_job_says_how_to_name_one(ip, run_cell):
    from sgpu_magic.job.handle import jobs

    for job in jobs():
        job.cancel()
    result, _, _ = run_cell("%distributed_stacks")
    latest = re.escape(jobs()[-1].job_id)
    assert re.fullmatch(
        rf"no job of this kernel is running \(the latest, {latest}, has ended: %distributed_stacks {latest} says "
        r"where its saved stacks are\); %distributed_jobs lists them",
        str(result.error_in_exec),
    )


def test_the_help_of_distributed_stacks_shows_its_options_and_examples(ip):
    doc = textwrap.dedent(ip.find_line_magic("distributed_stacks").__doc__)
    assert "%distributed_stacks [--native] [job_id]" in " ".join(doc.split())
    assert "%distributed_stacks a1b2c3 --native" in doc and "%distributed_jobs :" in doc
