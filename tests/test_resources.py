"""Device planning: CPU fallback, gpu_type matching and counts, port checks."""

import socket

import pytest

from sgpu_magic.errors import ResourceError
from sgpu_magic.resources import Gpu, check_port_free, list_gpus, plan_devices
from sgpu_magic.spec import make_spec

H100 = [Gpu(i, "NVIDIA H100 80GB HBM3", f"GPU-{i:04d}") for i in range(8)]


def test_no_gpu_runs_cpu_ranks_with_gloo_and_says_so():
    plan = plan_devices(make_spec(2), gpus=[])
    assert (plan.world_size, plan.backend, plan.gpus) == (2, "gloo", ())
    assert plan.note == "sgpu_magic: no GPU found; running 2 CPU rank(s) with gloo"
    assert plan.device_kind == "2 x cpu (gloo)"
    assert "ignored" in plan_devices(make_spec(1, gpu_type="H100"), gpus=[]).note


def test_gpu_type_matches_case_insensitive_substring():
    plan = plan_devices(make_spec(2, gpu_type="h100"), gpus=H100)
    assert plan.backend == "nccl" and [g.index for g in plan.gpus] == [0, 1]
    assert plan.cuda_visible_devices == "GPU-0000,GPU-0001"
    assert plan.device_kind == "2 x NVIDIA H100 80GB HBM3 (nccl)"


def test_gpu_type_mismatch_is_refused():
    with pytest.raises(ResourceError, match=r"gpu_type 'A100' matches none of the attached GPUs \(NVIDIA H100 80GB HBM3\)"):
        plan_devices(make_spec(1, gpu_type="A100"), gpus=H100)


def test_too_many_gpus_is_refused():
    with pytest.raises(ResourceError, match=r"gpus=9 asked for, but only 8 GPU\(s\) are visible here"):
        plan_devices(make_spec(9), gpus=H100)


def test_list_gpus_without_driver_is_empty_on_this_machine():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert list_gpus() == []


def test_busy_port_is_refused():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ResourceError, match=rf"port {port} is in use"):
            check_port_free(port)
