"""Step timing and the straggler check (issue 35): ``runtime.step()`` and the optimizer hook in real gloo ranks,
the time inside collectives, ``job.step_times()``, ``job.straggler()`` and the summary's line.

MLflow's per-rank ``step_time_s/rank_<r>`` is in ``test_tracking.py``; the check's rule itself in
``tests/unit/test_straggler_rule.py``.
"""

from __future__ import annotations

import html
import io
import json
import stat
import statistics
from contextlib import redirect_stdout

import jsonschema
import pytest

from sgpu_magic import distributed
from sgpu_magic._util.metrics import read_points
from sgpu_magic.errors import SgpuError, SpecError
from sgpu_magic.job.steps import MIN_STEPS, find_straggler
from sgpu_magic.ui.header import header_html

from helpers import TRACE_EVENT_SCHEMA


@distributed(gpus=2, mlflow=False, widgets=False)
def slow_rank_one(steps, extra_s):
    import time

    import torch
    import torch.distributed as dist

    from sgpu_magic import runtime

    dist.init_process_group("gloo")
    x = torch.ones(1000)
    for _ in range(steps):
        with runtime.step():
            y = (x * 2).sum()
            if runtime.get_global_rank() == 1:
                time.sleep(extra_s)  # rank 1's share takes 50 ms longer: rank 0 waits for it in all_reduce
            dist.all_reduce(y)
    dist.destroy_process_group()
    return float(y)


def test_a_rank_50_ms_slower_per_step_is_named_the_straggler_within_20_steps(sgpu_home):
    out = io.StringIO()
    with redirect_stdout(out):
        assert slow_rank_one.distributed(20, 0.05) == [4000.0, 4000.0]
    job = slow_rank_one.last_job
    times = job.step_times()
    assert sorted(times) == [0, 1] and [len(t) for t in times.values()] == [20, 20]
    assert all(t >= 0.05 for t in times[1])  # rank 1 sleeps 50 ms in each step
    # rank 0's steps last about as long (the collective evens them); a step rank 0 starts late (descheduled on a
    # loaded machine, or the first one, after the rendezvous) is shorter by that delay, so the median says it
    assert statistics.median(times[0]) >= 0.04
    waits = job.metrics("step_collective_s")["step_collective_s"]
    assert statistics.median(v for _, v in waits[0]) >= 0.03  # rank 0 spent its step waiting for rank 1 in all_reduce
    straggler = job.straggler()
    assert straggler is not None and straggler.rank == 1 and straggler.ratio > 1.2 and straggler.steps == 20
    assert straggler.busy_s >= 0.05
    line = str(straggler)
    assert line.startswith("straggler: rank 1 is ") and "x slower than the median rank over the last 20 steps" in line
    assert f"sgpu_magic: {line}" in out.getvalue()  # the summary says it (it is said on success too)
    assert html.escape(line) in header_html(job, job.state) and ">straggler</span>" in header_html(job, job.state)


@distributed(gpus=8, mlflow=False, widgets=False, timeout=600)
def balanced(steps):
    import torch
    import torch.distributed as dist

    from sgpu_magic import runtime

    dist.init_process_group("gloo")
    x = torch.randn(400, 400)
    for _ in range(steps):
        runtime.step()  # bare: a boundary at the top of each iteration
        y = (x @ x @ x).sum()  # about 3 ms of one core: 8 ranks share 2 here, so 10 ms or more of wall time
        dist.all_reduce(y)
    dist.destroy_process_group()


def test_a_balanced_8_rank_job_is_never_named_over_200_steps(sgpu_home):
    """Every window the panel could have seen (each rank's last 50 steps after each step) is checked, from the
    metrics files, on the loaded 2-core machine: no rank is ever named."""
    balanced.distributed(201)
    job = balanced.last_job
    assert job.straggler() is None
    by_rank = {}
    for rank in range(8):
        points = read_points(job.run_dir / "metrics" / f"rank_{rank}.bin")
        walls = {step: value for name, value, step, _ in points if name == "step_time_s"}
        inside = {step: value for name, value, step, _ in points if name == "step_collective_s"}
        by_rank[rank] = [(step, walls[step], inside[step]) for step in sorted(walls)]
    assert [len(steps) for steps in by_rank.values()] == [200] * 8  # 201 marks: the last step open is dropped
    busiest = []
    for end in range(MIN_STEPS, 201):
        window = {rank: steps[max(0, end - 50) : end] for rank, steps in by_rank.items()}
        assert find_straggler(window, 8) is None, (end, find_straggler(window, 8))
        busy = sorted(statistics.median(w - c for _, w, c in steps) for steps in window.values())
        busiest.append(busy[-1] / statistics.median(busy[:-1]))
    print(f"balanced: the slowest rank's median busy time was at most {max(busiest):.2f}x the median rank's")


@distributed(gpus=2, mlflow=False, widgets=False)
def trains_without_marks(steps):
    import torch

    model = torch.nn.Linear(4, 1)
    other = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt2 = torch.optim.SGD(other.parameters(), lr=0.1)  # a second optimizer (a GAN's) does not count steps twice
    for _ in range(steps):
        for m, o in ((model, opt), (other, opt2)):
            o.zero_grad()
            m(torch.ones(2, 4)).sum().backward()
            o.step()


def test_without_runtime_step_the_first_optimizer_s_steps_are_the_steps(sgpu_home):
    trains_without_marks.distributed(6)
    times = trains_without_marks.last_job.step_times()
    assert [len(t) for t in times.values()] == [5, 5]  # from one optimizer.step() to the next
    assert trains_without_marks.last_job.straggler() is None  # two steps short of the check's 10


@distributed(gpus=2, mlflow=False, widgets=False)
def marks_and_steps(n):
    import torch

    from sgpu_magic import runtime

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        with runtime.step():  # runtime.step() marks steps: the optimizer's are not counted as well
            opt.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            opt.step()


def test_runtime_step_wins_over_the_optimizer_hook_and_a_new_job_counts_from_zero(sgpu_home):
    marks_and_steps.distributed(3)
    marks_and_steps.distributed(4)  # the same warm rank processes' clocks begin again
    job = marks_and_steps.last_job
    assert [len(t) for t in job.step_times().values()] == [4, 4]
    assert [s for s, _ in job.metrics("step_time_s")["step_time_s"][0]] == [0, 1, 2, 3]


@distributed(gpus=2, mlflow=False, widgets=False)
def ddp_with_a_slow_rank(steps):
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sgpu_magic import runtime

    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        x = torch.randn(8, 32)
        if runtime.get_global_rank() == 1:
            time.sleep(0.04)  # a slow data shard: rank 0 waits in DDP's all-reduce, inside backward()
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()  # no runtime.step(): the optimizer's steps are the steps
    dist.destroy_process_group()


def test_a_slow_rank_of_a_ddp_loop_is_named_through_the_wait_in_backward(sgpu_home):
    ddp_with_a_slow_rank.distributed(16)
    job = ddp_with_a_slow_rank.last_job
    assert [len(t) for t in job.step_times().values()] == [15, 15]
    waits = job.metrics("step_collective_s")["step_collective_s"]
    assert statistics.median(v for _, v in waits[0]) >= 0.02  # rank 0 waited for rank 1's gradients in backward()
    straggler = job.straggler()
    assert straggler is not None and straggler.rank == 1 and straggler.steps == 15


@distributed(gpus=2, mlflow=False, widgets=False, profile=5)
def profiled_ddp(steps):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    from sgpu_magic import runtime

    dist.init_process_group("gloo")
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(64 * steps, 64), torch.randn(64 * steps, 1)), batch_size=64)
    for x, y in loader:  # the quickstart's loop: DataLoader, DDP, SGD, no runtime.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    loss = torch.ones(1)
    dist.all_reduce(loss)
    dist.destroy_process_group()
    return runtime.get_global_rank()


def test_a_profiled_job_gives_a_merged_trace_per_rank_and_a_breakdown_that_sums_to_its_wall_time(sgpu_home):
    out = io.StringIO()
    with redirect_stdout(out):
        assert profiled_ddp.distributed(10) == [0, 1]
    job = profiled_ddp.last_job
    summary = job.profile_summary()
    assert sorted(summary) == [0, 1]
    for rank, s in summary.items():
        assert s["steps"] == 5 and s["device"] == "cpu" and s["wall_s"] > 0
        parts = s["compute_s"] + s["collective_s"] + s["data_s"] + s["idle_s"]
        assert abs(parts - s["wall_s"]) <= 0.05 * s["wall_s"], (rank, s)
        assert s["compute_s"] > 0 and s["collective_s"] > 0 and s["data_s"] > 0  # DDP's all-reduce is a collective
        names = [op["name"] for op in s["top_ops"]]
        assert len(names) == 10 and "aten::addmm" in names, names
    trace = json.loads(job.profile_trace().read_bytes())
    jsonschema.validate(trace, TRACE_EVENT_SCHEMA)  # the JSON form Perfetto and chrome://tracing load
    assert job.profile_trace() == job.run_dir / "profile" / "trace.json"
    events = trace["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}  # one process per rank
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    assert all(isinstance(e.get("ts"), (int, float)) and "ph" in e for e in events if e.get("ph") == "X")
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    assert sorted(e["pid"] for e in steps) == [0] * 5 + [1] * 5
    text = out.getvalue()
    assert "sgpu_magic: profile of 5 step(s) per rank (torch.profiler; the merged trace: job.profile_trace()):" in text
    assert "top ops by self CPU time, all ranks:" in text and "aten::addmm" in text
    for mode in (
        stat.S_IMODE((job.run_dir / "profile").stat().st_mode),
        stat.S_IMODE(job.profile_trace().stat().st_mode),
    ):
        assert mode in (0o700, 0o600)


@distributed(gpus=1, mlflow=False, widgets=False, profile=3)
def too_short_to_profile():
    from sgpu_magic import runtime

    runtime.step()
    runtime.step()


def test_a_profiled_job_with_too_few_steps_says_so_and_profile_trace_names_the_remedy(sgpu_home):
    out = io.StringIO()
    with redirect_stdout(out):
        too_short_to_profile.distributed()
    job = too_short_to_profile.last_job
    assert "sgpu_magic: profile: no rank recorded a profiled step (the profiler waits one step" in out.getvalue()
    assert job.profile_summary() == {}
    with pytest.raises(SgpuError, match=r"has no profile trace: no rank recorded a profiled step .* at least 3 times"):
        job.profile_trace()
    not_profiled = distributed(gpus=1, mlflow=False, widgets=False)(too_short_to_profile.__wrapped__)
    not_profiled.distributed()
    with pytest.raises(SgpuError, match=r"was not profiled: run it with profile=STEPS"):
        not_profiled.last_job.profile_trace()
    assert not_profiled.last_job.profile_summary() == {}


def test_profile_must_be_a_number_of_steps():
    for bad in (0, -1, 1001, 2.5, "5", True):
        with pytest.raises(SpecError, match=r"profile must be a number of steps to profile between 1 and 1000"):
            distributed(gpus=1, profile=bad)


@distributed(gpus=2, mlflow=False, widgets=False)
def slow_loader_outside_the_block(steps, delay_s):
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    from sgpu_magic import runtime

    def collate(batch):
        if runtime.get_global_rank() == 1:
            time.sleep(delay_s)  # rank 1's shard is slow to load, outside the with-block
        return torch.utils.data.default_collate(batch)

    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(8 * steps, 16))
    for (x,) in DataLoader(data, batch_size=8, collate_fn=collate):
        with runtime.step():  # the docstring's loop: the batch is fetched between two blocks
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    dist.destroy_process_group()


def test_a_slow_data_shard_fetched_between_with_blocks_is_in_the_step_and_its_rank_is_named(sgpu_home):
    """A step runs from one block's entry to the next, so the batch fetched between them is part of it (found by a new
    user: with the block alone timed, rank 0's wait for rank 1 looked like rank 0's own work and nobody was named)."""
    slow_loader_outside_the_block.distributed(16, 0.04)
    job = slow_loader_outside_the_block.last_job
    times = job.step_times()
    assert [len(t) for t in times.values()] == [16, 16]  # the last block's step ends with the block
    assert statistics.median(times[1]) >= 0.04 and statistics.median(times[0]) >= 0.04
    assert job.straggler() is not None and job.straggler().rank == 1


@distributed(gpus=2, mlflow=False, widgets=False, profile=5)
def ends_inside_the_profile():
    import torch
    import torch.distributed as dist

    from sgpu_magic import runtime

    dist.init_process_group("gloo")
    for _ in range(6):  # 6 marks: 1 wait, 1 warm-up, 4 recorded, then the code ends within a fifth
        runtime.step()
        dist.all_reduce(torch.ones(8))
    dist.destroy_process_group()


def test_a_profile_cut_short_says_so_and_its_ops_are_those_of_the_recorded_steps(sgpu_home):
    out = io.StringIO()
    with redirect_stdout(out):
        ends_inside_the_profile.distributed()
    summary = ends_inside_the_profile.last_job.profile_summary()
    assert all(s["steps"] == 4 and s["asked_steps"] == 5 for s in summary.values())
    for s in summary.values():  # the all_reduce of the step the code ended in is left out, as in the breakdown
        assert [op["calls"] for op in s["top_ops"] if op["name"] == "c10d::allreduce_"] == [4]
    assert (
        "sgpu_magic: profile of 4 step(s) per rank, of 5 asked: the code ended first (torch.profiler;" in out.getvalue()
    )
