"""Device planning: CPU fallback, gpu_type matching and counts, port checks."""

import socket

import pytest

from sgpu_magic.errors import ResourceError
from sgpu_magic.launch.resources import Gpu, check_port_free, list_gpus, plan_devices
from sgpu_magic.spec import make_spec

H100 = [Gpu(i, "NVIDIA H100 80GB HBM3", f"GPU-{i:04d}") for i in range(8)]


def test_no_gpu_runs_cpu_ranks_with_gloo_and_says_so():
    plan = plan_devices(make_spec(2), gpus=[])
    assert (plan.world_size, plan.backend, plan.gpus) == (2, "gloo", ())
    assert plan.note == "sgpu_magic: no GPU found; running 2 CPU rank(s) with gloo"
    assert plan.device_kind == "2 x cpu (gloo)"
    assert "ignored" in plan_devices(make_spec(1, gpu_type="H100"), gpus=[]).note


def test_gpu_type_matches_case_insensitive_substring():
    mixed = [Gpu(0, "NVIDIA A100-SXM4-80GB", "GPU-a"), *H100[1:3]]
    plan = plan_devices(make_spec(2, gpu_type="h100"), gpus=mixed)
    assert plan.backend == "nccl" and [g.index for g in plan.candidates] == [1, 2] and plan.gpus == ()
    assert plan.device_kind == "2 x NVIDIA H100 80GB HBM3 (nccl)"
    leased = plan.with_gpus(list(plan.candidates))
    assert leased.cuda_visible_devices == "GPU-0001,GPU-0002" and leased.gpu_indices == [1, 2]


def test_gpu_ids_pick_those_gpus_in_that_order():
    plan = plan_devices(make_spec(2, gpu_ids=[5, 3]), gpus=H100)
    assert [g.index for g in plan.candidates] == [5, 3] and plan.explicit


def test_gpu_ids_errors_name_the_bad_value_and_the_remedy():
    with pytest.raises(
        ResourceError,
        match=r"gpu_ids \[9\] are not among the visible GPUs \(indices \[0, 1, 2, 3, 4, 5, 6, 7\]\); pick from those",
    ):
        plan_devices(make_spec(2, gpu_ids=[0, 9]), gpus=H100)
    with pytest.raises(ResourceError, match=r"gpu_ids=\[0\] asked for, but no GPU is visible here; leave gpu_ids out"):
        plan_devices(make_spec(1, gpu_ids=[0]), gpus=[])


def test_fake_inventory_parses_and_runs_ranks_on_cpu(monkeypatch):
    monkeypatch.setenv("SGPU_MAGIC_FAKE_GPUS", "8 x H100")
    gpus = list_gpus()
    assert [g.index for g in gpus] == list(range(8)) and gpus[0].name == "H100 (fake)" and gpus[0].fake
    plan = plan_devices(make_spec(6))
    assert plan.backend == "gloo" and plan.device_kind == "6 x H100 (fake) (gloo)"
    assert "fake GPU inventory" in plan.note
    assert plan.with_gpus(list(plan.candidates[:6])).cuda_visible_devices == ""  # ranks see no real GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert [g.index for g in list_gpus()] == [2, 3]
    monkeypatch.setenv("SGPU_MAGIC_FAKE_GPUS", "eight")
    with pytest.raises(
        ResourceError, match=r"SGPU_MAGIC_FAKE_GPUS='eight' is not a GPU inventory; write it as '8 x H100'"
    ):
        list_gpus()


def test_gpu_type_mismatch_is_refused():
    with pytest.raises(
        ResourceError, match=r"gpu_type 'A100' matches none of the attached GPUs \(NVIDIA H100 80GB HBM3\)"
    ):
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
