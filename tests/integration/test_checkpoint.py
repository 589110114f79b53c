"""VolumeWriter / VolumeReader (sgpu_magic.checkpoint) with torch.distributed.checkpoint and real gloo ranks.

A 2-rank job saves a DTensor sharded over both ranks (plus a replicated tensor and a Python
value) with ``dcp.save`` and ``dcp.async_save``; it loads back on 1 rank (this process) and on 4
ranks (DCP resharding). A save whose coordinator is SIGKILLed before ``.metadata`` leaves a
checkpoint the reader refuses with a pinned message.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_data import CountingServer

from sgpu_magic import distributed
from sgpu_magic.checkpoint import VolumeReader, VolumeWriter, is_complete
from sgpu_magic.errors import CheckpointError, RankFailedError

ROWS, COLS = 12, 5


def expected_weight() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


@distributed(gpus=2, timeout=180)
def save_sharded(path, asynchronous, stage, die_before_metadata):
    """Save {"w": DTensor sharded by rows over 2 ranks, "b": replicated, "step": 7} to ``path``."""
    import os
    import signal

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from sgpu_magic.checkpoint import VolumeWriter

    class DiesBeforeMetadata(VolumeWriter):
        def finish(self, metadata, results):
            os.kill(os.getpid(), signal.SIGKILL)  # the coordinator dies after every shard landed

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.ones(3) * 2, "step": 7}
    writer = (DiesBeforeMetadata if die_before_metadata else VolumeWriter)(path, stage=stage)
    if asynchronous:
        dcp.async_save(state, storage_writer=writer).result()
    else:
        dcp.save(state, storage_writer=writer)
    dist.barrier()
    return sorted(os.listdir(path))


@distributed(gpus=4, timeout=180)
def load_on_four(path):
    """Load ``path`` into a DTensor sharded by rows over 4 ranks; return this rank's shard and the rest."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from sgpu_magic.checkpoint import VolumeReader

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"w": distribute_tensor(torch.zeros(12, 5), mesh, [Shard(0)]), "b": torch.zeros(3), "step": 0}
    dcp.load(state, storage_reader=VolumeReader(path))
    return {"local": state["w"].to_local(), "full": state["w"].full_tensor(), "b": state["b"], "step": state["step"]}


def load_on_one(path) -> dict:
    state = {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(3), "step": 0}
    dcp.load(state, storage_reader=VolumeReader(path), no_dist=True)
    return state


@pytest.mark.parametrize("asynchronous,stage", [(False, False), (True, True)], ids=["save-in-place", "async-staged"])
def test_two_ranks_save_and_the_checkpoint_loads_on_one_and_on_four_ranks(tmp_path, asynchronous, stage):
    path = str(tmp_path / "ckpt")
    files = save_sharded.distributed(path, asynchronous, stage, False)
    assert files[0] == files[1] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert is_complete(path)
    one = load_on_one(path)
    assert torch.equal(one["w"], expected_weight()) and torch.equal(one["b"], torch.ones(3) * 2) and one["step"] == 7
    four = load_on_four.distributed(path)
    for rank, got in enumerate(four):
        assert torch.equal(got["local"], expected_weight()[3 * rank : 3 * rank + 3])  # 12 rows / 4 ranks
        assert torch.equal(got["full"], expected_weight())
        assert torch.equal(got["b"], torch.ones(3) * 2) and got["step"] == 7


def test_a_save_killed_before_metadata_is_refused_and_never_looks_complete(tmp_path):
    path = str(tmp_path / "ckpt")
    save_sharded.distributed(path, False, False, False)
    assert is_complete(path)
    # the same directory saved again, the coordinator killed after the shards, before .metadata
    with pytest.raises(RankFailedError, match=r"rank 0 failed \(root cause\).*killed by signal SIGKILL"):
        save_sharded.distributed(path, False, False, True)
    assert sorted(os.listdir(path)) == ["__0_0.distcp", "__1_0.distcp"]  # the old .metadata went first
    assert not is_complete(path)
    incomplete = (
        r"checkpoint at .*ckpt is incomplete: 2 shard file\(s\) but no \.metadata, so the save that wrote "
        r"it did not finish \(a rank failed or was stopped mid-save\); load an earlier checkpoint"
    )
    with pytest.raises(CheckpointError, match=incomplete):
        VolumeReader(path)
    # through dcp.load with a checkpoint_id that differs from the reader's path: DCP wraps the reader's error
    with pytest.raises(BaseException, match=incomplete):  # DCP's CheckpointException is a BaseException
        dcp.load(
            {"w": torch.zeros(ROWS, COLS)},
            checkpoint_id=path,
            storage_reader=VolumeReader(_complete_copy(tmp_path)),
            no_dist=True,
        )


def _complete_copy(tmp_path) -> str:
    other = str(tmp_path / "other")
    dcp.save({"w": torch.zeros(ROWS, COLS)}, storage_writer=VolumeWriter(other), no_dist=True)
    return other


def test_a_missing_shard_or_directory_is_named(tmp_path):
    path = _complete_copy(tmp_path)
    reader = VolumeReader(path)  # made while the checkpoint was whole
    os.remove(os.path.join(path, "__0_0.distcp"))
    damaged = (
        r"checkpoint at .*other is damaged: shard file '__0_0.distcp' named in its \.metadata is missing; "
        r"load another checkpoint"
    )
    with pytest.raises(CheckpointError, match=damaged):
        VolumeReader(path)
    with pytest.raises(BaseException, match=damaged):  # found while reading: wrapped by DCP
        dcp.load({"w": torch.zeros(ROWS, COLS)}, storage_reader=reader, no_dist=True)
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*nowhere: the directory does not exist"):
        VolumeReader(tmp_path / "nowhere")
    assert not is_complete(tmp_path / "nowhere")


def test_a_checkpoint_is_read_over_http_through_local_staging(tmp_path):
    path = tmp_path / "served" / "ckpt"
    dcp.save({"w": expected_weight(), "step": 3}, storage_writer=VolumeWriter(path), no_dist=True)
    server = CountingServer(tmp_path / "served")
    try:
        staging = tmp_path / "staging"
        staging.mkdir()
        state = {"w": torch.zeros(ROWS, COLS), "step": 0}
        dcp.load(state, storage_reader=VolumeReader(server.url + "ckpt", staging_dir=staging), no_dist=True)
        assert torch.equal(state["w"], expected_weight()) and state["step"] == 3
        assert server.file_gets() == {"/ckpt/.metadata": 1, "/ckpt/__0_0.distcp": 1}
        assert [p for p in staging.rglob("*") if p.is_file()] == []  # staged copies removed after the read
    finally:
        server.close()


def test_http_is_refused_for_writing(tmp_path):
    with pytest.raises(
        CheckpointError,
        match=r"VolumeWriter: cannot write a checkpoint to http://127.0.0.1:9/x: "
        r"http\(s\) URLs are read-only here; save to a local directory or an "
        r"object store URL",
    ):
        VolumeWriter("http://127.0.0.1:9/x")
