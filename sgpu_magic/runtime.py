"""Helpers for code running inside a rank.

They read torchrun's environment contract (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK), which sgpu_magic sets for every rank as torchrun does,
so the same code also works under torchrun. Outside a job they describe a single
process: rank 0 of a world of size 1.

Example::

    import torch.distributed as dist
    from sgpu_magic import runtime
    dist.init_process_group(runtime.backend())
    model = model.to(runtime.device())
"""

from __future__ import annotations

import os

__all__ = ["get_global_rank", "get_local_rank", "get_world_size", "get_local_world_size",
           "get_node_rank", "backend", "device"]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def get_global_rank() -> int:
    """This process's global rank (``RANK``), 0 outside a job."""
    return _env_int("RANK", 0)


def get_local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``), 0 outside a job."""
    return _env_int("LOCAL_RANK", 0)


def get_world_size() -> int:
    """Number of ranks in the job (``WORLD_SIZE``), 1 outside a job."""
    return _env_int("WORLD_SIZE", 1)


def get_local_world_size() -> int:
    """Number of ranks on this node (``LOCAL_WORLD_SIZE``), 1 outside a job."""
    return _env_int("LOCAL_WORLD_SIZE", 1)


def get_node_rank() -> int:
    """Index of this node (``GROUP_RANK``, torchrun's node rank), 0 on a single machine."""
    return _env_int("GROUP_RANK", 0)


def backend() -> str:
    """The process-group backend to use: ``"nccl"`` when CUDA is available, else ``"gloo"``."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def device():
    """This rank's ``torch.device``: ``cuda:<LOCAL_RANK>`` with CUDA, else ``cpu``."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", get_local_rank() % max(1, torch.cuda.device_count()))
    return torch.device("cpu")
