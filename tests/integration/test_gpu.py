"""GPU checks: run on a machine with an NVIDIA GPU (skipped elsewhere). One GPU means one nccl rank."""

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_nccl_rank_returns_cpu_tensor_and_kernel_stays_cuda_free():
    from sgpu_magic import distributed

    @distributed(gpus=1)
    def allreduce():
        import torch
        import torch.distributed as dist

        from sgpu_magic import runtime

        dist.init_process_group(runtime.backend())
        t = torch.ones(4, device=runtime.device())
        dist.all_reduce(t)
        return runtime.backend(), t

    ((backend, tensor),) = allreduce.distributed()
    assert backend == "nccl"
    assert tensor.device.type == "cpu" and tensor.tolist() == [1.0] * 4
    assert not torch.cuda.is_initialized()


def test_gpu_type_is_detected_and_checked():
    from sgpu_magic.errors import ResourceError
    from sgpu_magic.launch.resources import list_gpus, plan_devices
    from sgpu_magic.spec import make_spec

    gpus = list_gpus()
    assert gpus, "NVML sees no GPU although CUDA does"
    plan = plan_devices(make_spec(1, gpu_type=gpus[0].name.split()[-1]))
    assert plan.backend == "nccl"
    with pytest.raises(ResourceError, match="matches none of the attached GPUs"):
        plan_devices(make_spec(1, gpu_type="NoSuchGPU"))


def test_each_ranks_gpu_is_sampled_and_its_peak_memory_reported(tmp_path):
    """NVML figures of the rank's GPU while it holds 1 GiB (the launch host samples about once a second), then the
    peak in the summary and as an MLflow metric; the kernel makes no CUDA context."""
    from mlflow import MlflowClient

    from sgpu_magic import distributed
    from sgpu_magic.ui.text import peak_rss_line

    from helpers import wait_for

    go = str(tmp_path / "go")

    @distributed(gpus=1)
    def hold():
        import os
        import time

        import torch

        from sgpu_magic import runtime

        block = torch.empty(1 << 30, dtype=torch.uint8, device=runtime.device())
        while not os.path.exists(go):
            time.sleep(0.05)
        return block.numel()

    job = hold.submit()
    try:
        used = wait_for(
            lambda: (u := job.status.usage.get(0)) and (u.gpu_memory_bytes or 0) >= 1 << 30 and u, 120, "a GPU sample"
        )
    finally:
        open(go, "w").close()
    assert job.result(timeout_s=120) == [1 << 30]
    assert used.gpu_memory_total_bytes > used.gpu_memory_bytes and 0 <= used.gpu_percent <= 100 and used.gpu_power_w > 0
    peak = job.status.usage[0].peak_gpu_memory_bytes
    assert peak >= 1 << 30
    assert peak_rss_line(job.status.usage)[1] == f"peak GPU memory per rank: rank 0 {peak / 2**20:.0f} MiB"
    metrics = MlflowClient().get_run(job.mlflow_run_id).data.metrics
    assert metrics["system/rank_0_peak_gpu_memory_megabytes"] == round(peak / 1e6, 1)
    assert not torch.cuda.is_initialized()


def test_an_nccl_job_runs_with_the_flight_recorder_on_and_its_dumps_are_summed_up():
    """The ranks see the flight recorder's switches pointing into the run directory; a dump the rank takes of its own
    recorder (torch's format, as on a timeout) is read back into the summary."""
    from sgpu_magic import distributed
    from sgpu_magic.launch.flight_recorder import flight_recorder_note

    @distributed(gpus=1, mlflow=False)
    def record():
        import os

        import torch
        import torch.distributed as dist
        from torch._C._distributed_c10d import _dump_nccl_trace

        from sgpu_magic import runtime

        dist.init_process_group(runtime.backend())
        t = torch.ones(4, device=runtime.device())
        dist.all_reduce(t)
        torch.cuda.synchronize()
        path = os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] + "0"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, _dump_nccl_trace())
        os.close(fd)
        dist.destroy_process_group()
        return {k: os.environ[k] for k in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT")}

    job = record.submit()
    assert job.result(timeout_s=180) == [{"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}]
    from sgpu_magic.rundir import RunDir

    note = flight_recorder_note(RunDir(job.run_dir))
    assert note.startswith(f" NCCL flight recorder ({job.run_dir / 'flight_recorder'}): rank 0: nccl:all_reduce #1 (")


def test_an_nccl_session_rank_aborts_its_communicators_and_makes_its_group_again_with_its_state():
    """What recover does on each NCCL rank (one GPU: one rank, so no peer can leave it blocked): the communicators
    are aborted through the _compat seam, the group destroyed and made again on the rendezvous store under a new
    prefix; the CUDA tensors a cell made survive, and the next all_reduce runs on the new group."""
    from sgpu_magic import Session

    session = Session(gpus=1, widgets=False, mlflow=False, name="nccl_recover")
    try:
        session.run_cell(
            "import torch, torch.distributed as dist\nfrom sgpu_magic import runtime\n"
            "dist.init_process_group('nccl')\nw = torch.arange(4.0, device=runtime.device())\ndist.all_reduce(w)\n"
            "before = w.sum().item()"
        )
        assert session.run_cell(
            "from sgpu_magic.rank.recover import abort_nccl, regroup, ungroup\nabort_nccl()\nbackend = ungroup()\n"
            "regroup(backend, 1)\nt = torch.ones(2, device=runtime.device())\ndist.all_reduce(t)\n"
            "(backend, dist.get_backend(), t.tolist(), w.sum().item() == before)"
        ) == [("nccl", "nccl", [1.0, 1.0], True)]
    finally:
        session.stop()


def test_a_profiled_nccl_job_has_device_rows_and_its_steps_are_timed():
    """``profile=`` on CUDA: the device's busy time and each top op's device time are in the figures, the trace
    has the rank's CUDA events, and an optimizer loop's steps are timed (host times: docs/guide/performance.md)."""

    from sgpu_magic import distributed

    @distributed(gpus=1, mlflow=False, widgets=False, profile=3)
    def train():
        import torch
        import torch.distributed as dist

        from sgpu_magic import runtime

        dist.init_process_group("nccl")
        device = runtime.device()
        torch.cuda.set_device(device)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1024, 1024).to(device))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(8):
            opt.zero_grad()
            model(torch.randn(256, 1024, device=device)).sum().backward()
            opt.step()
        torch.cuda.synchronize()
        dist.destroy_process_group()

    train.distributed()
    job = train.last_job
    summary = job.profile_summary()[0]
    print("gpu profile:", {k: v for k, v in summary.items() if k != "top_ops"})
    assert summary["device"] == "cuda" and summary["steps"] == 3
    assert summary["device_busy_s"] > 0 and any(op.get("self_device_s", 0) > 0 for op in summary["top_ops"])
    assert len(job.step_times()[0]) == 7
    events = json.loads(job.profile_trace().read_bytes())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # the device's kernels, as Kineto names them
