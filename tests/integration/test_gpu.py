"""GPU checks: run on a machine with an NVIDIA GPU (skipped elsewhere). One GPU means one nccl rank."""

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
