"""The NCCL flight recorder's switches and the summary of its dumps, read from dumps torch itself wrote (gloo records
with the same recorder on CPU; a process group of one rank dumps twice to stand for a rank that fell behind)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sgpu_magic.launch.flight_recorder import flight_recorder_env, flight_recorder_note, read_dumps, summary
from sgpu_magic.rundir import RunDir

DUMPER = """
import os, sys, torch, torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace
folder = sys.argv[1]
store = dist.FileStore(os.path.join(folder, "..", "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
t = torch.ones(2)
def dump(name):
    fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, _dump_fr_trace())
    os.close(fd)
dist.all_reduce(t); dist.all_reduce(t)
dump("rank_1")  # the rank that fell behind: its last collective is #2
dist.broadcast(t, src=0)
dump("rank_0")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_dumps_torch_wrote_are_summed_up_with_where_sequence_numbers_differ(tmp_path):
    rd = RunDir.create(tmp_path)
    env = flight_recorder_env(rd, "nccl", {})
    folder = rd.flight_recorder_dir
    subprocess.run(
        [sys.executable, "-c", DUMPER, str(folder)],
        env={**os.environ, "TORCH_FR_BUFFER_SIZE": "100"},
        check=True,
        timeout=120,
    )
    assert sorted(read_dumps(folder)) == [0, 1]
    text = (
        "rank 0: gloo:broadcast #3 (scheduled); rank 1: gloo:all_reduce #2 (scheduled). Collective sequence numbers "
        "differ: rank 1 at #2, rank 0 at #3"
    )
    assert summary(read_dumps(folder)) == text
    assert flight_recorder_note(rd) == f" NCCL flight recorder ({folder}): {text}."
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(folder / "rank_")
    os.chmod(folder / "rank_1", 0o644)  # a dump another user could have planted is not read
    assert sorted(read_dumps(folder)) == [0]


def test_the_recorder_is_switched_on_for_nccl_jobs_only_and_never_over_the_users_settings(tmp_path):
    rd = RunDir.create(tmp_path)
    assert flight_recorder_env(rd, "gloo", {}) == {} and not rd.flight_recorder_dir.exists()
    prefix = str(rd.flight_recorder_dir / "rank_")
    assert flight_recorder_env(rd, "nccl", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}) == {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
    }
    assert oct(rd.flight_recorder_dir.stat().st_mode & 0o777) == "0o700"
    assert flight_recorder_note(rd) == "" and summary({}) == ""
