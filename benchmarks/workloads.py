"""Rank-side code of the peers that cannot take a function defined in a notebook.

``torchrun`` runs this file as a script (``python workloads.py trivial OUTDIR``) and
``torch.multiprocessing.spawn`` imports :func:`spawn_trivial` from it by reference (a
function defined in a notebook cannot be passed to spawn). The job is the same trivial job
sgpu_magic and notebook_launcher run from a notebook cell: init a gloo process group, one
all_reduce, destroy the group, hand back the rank.
"""

from __future__ import annotations

import os
import sys


def _trivial_job() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert int(t.item()) == dist.get_world_size()
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


def trivial_torchrun(outdir: str) -> None:
    """torchrun rank: run the trivial job and leave the rank in ``OUTDIR/rank_<rank>``."""
    rank = _trivial_job()
    with open(os.path.join(outdir, f"rank_{rank}"), "w") as f:
        f.write(str(rank))


def spawn_trivial(index: int, world_size: int, port: int, results) -> None:
    """torch.multiprocessing.spawn rank: the trivial job; the rank goes back through ``results`` (a SimpleQueue)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(index),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(index),
    )
    results.put(_trivial_job())


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "trivial":
        sys.exit("usage: workloads.py trivial OUTDIR")
    trivial_torchrun(sys.argv[2])
