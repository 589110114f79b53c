"""torchrun's contract for a rank: its environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
``TORCHELASTIC_*``) as the launch host and the Ray backend give it."""

from __future__ import annotations

import functools
import os
import socket

import psutil

from sgpu_magic.wire import LaunchRecord


def torchrun_env(
    job_id: str,
    rank: int,
    world: int,
    local_rank: int,
    local_world: int,
    group_rank: int,
    group_world: int,
    master_addr: str,
    port: int,
    restart_count: int = 0,
    max_restarts: int = 0,
    agent_store: bool = True,
) -> dict[str, str]:
    """The variables torchrun gives one rank (``group_*`` = the node), plus those DeepSpeed's launcher sets
    (its CPU accelerator counts devices from ``LOCAL_SIZE``) and the job id sgpu_magic finds leftovers by.

    ``agent_store``: as torchrun, the launcher serves the rendezvous store and ranks connect to it."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(group_world),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": job_id,
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
        "LOCAL_SIZE": str(local_world),
        "CROSS_RANK": str(group_rank),
        "CROSS_SIZE": str(group_world),
        "PYTHONUNBUFFERED": "1",
        "SGPU_MAGIC_JOB_ID": job_id,
    }


def cpu_framework_env(backend: str, env: dict) -> dict[str, str]:
    """What libraries need to see a world of CPU ranks (``backend`` gloo): Accelerate's ``Accelerator()`` counts
    only GPUs under torchrun's environment and reports ``DistributedType.NO`` with one process on every rank (each
    rank then trains alone) unless ``ACCELERATE_USE_CPU`` is set, when it reports ``MULTI_CPU`` over the world. A
    variable the kernel's environment ``env`` already sets is left as it is."""
    if backend != "gloo" or "ACCELERATE_USE_CPU" in env:
        return {}
    return {"ACCELERATE_USE_CPU": "true"}


def rank_env(launch: LaunchRecord, rank: int, port: int, env: dict, restart_count: int = 0) -> dict[str, str]:
    world = launch.world_size
    out = dict(env)
    # one node; the host serves the rendezvous store (on 127.0.0.1 only)
    out.update(
        torchrun_env(
            launch.job_id,
            rank,
            world,
            rank,
            world,
            0,
            1,
            "127.0.0.1",
            port,
            restart_count,
            launch.max_restarts,
        )
    )
    out["SGPU_MAGIC_HOST_PID"] = str(os.getpid())
    if launch.cuda_visible_devices is not None:  # "" for a fake GPU inventory: ranks on CPU
        out["CUDA_VISIBLE_DEVICES"] = launch.cuda_visible_devices
    loopback = _loopback_interface()
    if loopback:  # one machine: collectives' sockets listen on loopback only, unless the kernel says otherwise
        out.setdefault("GLOO_SOCKET_IFNAME", loopback)
        out.setdefault("NCCL_SOCKET_IFNAME", loopback)
    out.update(cpu_framework_env(launch.backend, env))
    if "OMP_NUM_THREADS" not in env:  # in a rank it is read at torch start-up (a warm rank applies it by hand)
        if launch.backend == "gloo":  # CPU ranks share the cores (torchrun's 1 left 2 ranks on 2 cores 4x slower)
            out["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
        elif world > 1:  # GPU ranks: as torchrun, 1 when several ranks share the machine, else torch's default
            out["OMP_NUM_THREADS"] = "1"
    return out


@functools.lru_cache(maxsize=1)
def _loopback_interface() -> str | None:
    """Name of the network interface holding 127.0.0.1 (``lo`` on Linux), or ``None``."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
            return name
    return None
