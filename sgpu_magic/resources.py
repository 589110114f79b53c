"""Find GPUs without creating a CUDA context in the kernel, and pick a device plan.

GPUs are listed through NVML (nvidia-ml-py), honouring the kernel's
``CUDA_VISIBLE_DEVICES``. With no GPU (no driver, no NVML, or none visible) jobs run
CPU ranks on gloo.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from .errors import ResourceError
from .spec import LaunchSpec


@dataclass(frozen=True)
class Gpu:
    """One visible GPU: its NVML index, name (``NVIDIA H100 80GB HBM3``) and UUID."""

    index: int
    name: str
    uuid: str


@dataclass(frozen=True)
class DevicePlan:
    """Where the ranks of one job run.

    Attributes:
        world_size: number of ranks.
        backend: ``"nccl"`` on GPUs, ``"gloo"`` on CPU.
        gpus: the GPUs given to the job (empty on CPU); ranks see them as CUDA_VISIBLE_DEVICES.
        note: one line for the user about the choice (e.g. the CPU fallback), or ``""``.
    """

    world_size: int
    backend: str
    gpus: tuple[Gpu, ...] = ()
    note: str = ""

    @property
    def device_kind(self) -> str:
        """``2 x cpu (gloo)`` / ``8 x NVIDIA H100 80GB HBM3 (nccl)``."""
        what = self.gpus[0].name if self.gpus else "cpu"
        return f"{self.world_size} x {what} ({self.backend})"

    @property
    def cuda_visible_devices(self) -> str | None:
        return ",".join(g.uuid for g in self.gpus) if self.gpus else None


def _visible_filter(gpus: list[Gpu]) -> list[Gpu]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return gpus
    out = []
    for item in (v.strip() for v in visible.split(",") if v.strip()):
        match = [g for g in gpus if (item.isdigit() and g.index == int(item)) or g.uuid.startswith(item)]
        if not match:
            break  # CUDA stops at the first invalid entry
        out.append(match[0])
    return out


def list_gpus() -> list[Gpu]:
    """GPUs visible to the kernel, via NVML; ``[]`` when there is no NVIDIA driver."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name, uuid = pynvml.nvmlDeviceGetName(h), pynvml.nvmlDeviceGetUUID(h)
            gpus.append(Gpu(i, name.decode() if isinstance(name, bytes) else name,
                            uuid.decode() if isinstance(uuid, bytes) else uuid))
        return _visible_filter(gpus)
    finally:
        pynvml.nvmlShutdown()


def plan_devices(spec: LaunchSpec, gpus: list[Gpu] | None = None) -> DevicePlan:
    """Check ``spec`` against the machine and decide where its ranks run.

    Raises:
        ResourceError: ``gpu_type`` matches no attached GPU, or more GPUs are asked for than visible.
    """
    gpus = list_gpus() if gpus is None else gpus
    if not gpus:
        asked = f" (gpu_type {spec.gpu_type!r} ignored)" if spec.gpu_type else ""
        return DevicePlan(spec.gpus, "gloo", (), f"sgpu_magic: no GPU found; running {spec.gpus} CPU rank(s) with gloo{asked}")
    if spec.gpu_type:
        names = sorted({g.name for g in gpus})
        gpus = [g for g in gpus if spec.gpu_type.lower() in g.name.lower()]
        if not gpus:
            raise ResourceError(f"gpu_type {spec.gpu_type!r} matches none of the attached GPUs ({', '.join(names)}); "
                                f"use one of those names, or leave gpu_type out to take any GPU")
    if spec.gpus > len(gpus):
        raise ResourceError(f"gpus={spec.gpus} asked for, but only {len(gpus)} GPU(s) are visible here "
                            f"({', '.join(g.name for g in gpus)}); ask for at most {len(gpus)}")
    return DevicePlan(spec.gpus, "nccl", tuple(gpus[: spec.gpus]))


def check_port_free(port: int) -> None:
    """Raise :class:`ResourceError` when ``port`` cannot be bound on this machine (it is in use)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore: TIME_WAIT is not "in use"
        try:
            s.bind(("", port))
        except OSError as exc:
            raise ResourceError(f"port {port} is in use ({exc.strerror}); leave port out to pick a free one, "
                                f"or choose another port") from None


def free_port() -> int:
    """A TCP port that is free right now (bound to port 0, as torch elastic does)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
