"""Find GPUs without creating a CUDA context in the kernel, and pick a device plan.

GPUs are listed through NVML (nvidia-ml-py), honouring the kernel's
``CUDA_VISIBLE_DEVICES``, with the compute processes each one runs. With no GPU (no
driver, no NVML, or none visible) jobs run CPU ranks on gloo.

Test seam: ``SGPU_MAGIC_FAKE_GPUS="8 x H100"`` declares a fake inventory (8 GPUs named
``H100 (fake)``, indices 0-7). Jobs then lease fake GPUs exactly as real ones (see
:mod:`sgpu_magic.launch.leases`), and their ranks run on CPU with gloo (``CUDA_VISIBLE_DEVICES``
is empty); the leased indices reach the ranks in ``SGPU_MAGIC_GPUS``.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, replace

from sgpu_magic.errors import ResourceError
from sgpu_magic.spec import LaunchSpec

FAKE_GPUS_ENV = "SGPU_MAGIC_FAKE_GPUS"


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU (from NVML): pid, process name, GPU memory it holds in bytes."""

    pid: int
    name: str
    used_bytes: int | None

    def describe(self) -> str:
        held = f"{self.used_bytes / 2**30:.1f} GiB" if self.used_bytes is not None else "an unknown amount of memory"
        return f"pid {self.pid} ({self.name}) holding {held}"


@dataclass(frozen=True)
class Gpu:
    """One visible GPU: its NVML index, name (``NVIDIA H100 80GB HBM3``), UUID, and the compute
    processes on it when it was listed. ``fake`` marks a GPU of the ``SGPU_MAGIC_FAKE_GPUS`` inventory."""

    index: int
    name: str
    uuid: str
    processes: tuple[GpuProcess, ...] = ()
    fake: bool = False


@dataclass(frozen=True)
class DevicePlan:
    """Where the ranks of one job run.

    Before the job holds its GPUs, ``candidates`` are those it may lease (matching
    ``gpu_type`` / ``gpu_ids``) and ``gpus`` is empty; :meth:`with_gpus` gives the plan once
    leased.

    Attributes:
        world_size: number of ranks.
        backend: ``"nccl"`` on GPUs, ``"gloo"`` on CPU (also for a fake GPU inventory).
        gpus: the GPUs leased to the job; ranks see them as CUDA_VISIBLE_DEVICES.
        note: one line for the user about the choice (e.g. the CPU fallback), or ``""``.
        candidates: the GPUs the job may lease; empty for a CPU job.
        explicit: the candidates were named by ``gpu_ids`` (take exactly those).
        cluster: the Ray cluster the ranks run on (see :mod:`sgpu_magic.launch.ray.cluster`); ``None`` = this machine.
    """

    world_size: int
    backend: str
    gpus: tuple[Gpu, ...] = ()
    note: str = ""
    candidates: tuple[Gpu, ...] = ()
    explicit: bool = False
    cluster: str | None = None

    @property
    def needs_lease(self) -> bool:
        return bool(self.candidates)

    @property
    def fake(self) -> bool:
        return bool(self.candidates) and self.candidates[0].fake

    def with_gpus(self, gpus: list[Gpu]) -> DevicePlan:
        return replace(self, gpus=tuple(gpus))

    @property
    def device_kind(self) -> str:
        """``2 x cpu (gloo)`` / ``8 x NVIDIA H100 80GB HBM3 (nccl)`` / ``4 x gpu (nccl) on Ray ray://head:10001``."""
        chosen = self.gpus or self.candidates
        what = chosen[0].name if chosen else ("gpu" if self.backend == "nccl" else "cpu")
        return f"{self.world_size} x {what} ({self.backend})" + (f" on Ray {self.cluster}" if self.cluster else "")

    @property
    def no_gpu(self) -> bool:
        """This machine has no GPU, so the ranks run on CPU with gloo (not a fake inventory, not on Ray)."""
        return not self.candidates and self.cluster is None and self.backend == "gloo"

    @property
    def gpu_indices(self) -> list[int]:
        """Physical indices of the leased GPUs, in rank order."""
        return [g.index for g in self.gpus]

    @property
    def cuda_visible_devices(self) -> str | None:
        """What the ranks get as CUDA_VISIBLE_DEVICES: the leased GPUs' UUIDs, ``""`` for fake GPUs, or
        ``None`` (left as the kernel has it) on CPU."""
        if not self.gpus:
            return None
        return "" if self.fake else ",".join(g.uuid for g in self.gpus)


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


def fake_gpus(text: str) -> list[Gpu]:
    """Parse a fake inventory such as ``"8 x H100"`` (or ``"8"``) into GPUs ``0 .. n-1``.

    Raises:
        ResourceError: the text is not ``N`` or ``N x NAME``.
    """
    match = re.fullmatch(r"\s*(\d+)\s*(?:[xX*]\s*(\S.*?))?\s*", text)
    if not match or int(match.group(1)) < 1:
        raise ResourceError(
            f"{FAKE_GPUS_ENV}={text!r} is not a GPU inventory; write it as '8 x H100' (count x name) or unset it"
        )
    name = f"{match.group(2) or 'GPU'} (fake)"
    return [Gpu(i, name, f"FAKE-GPU-{i}", fake=True) for i in range(int(match.group(1)))]


def _processes(pynvml, handle) -> tuple[GpuProcess, ...]:
    try:
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except pynvml.NVMLError:
        return ()
    out = []
    for p in procs:
        try:
            import psutil

            name = psutil.Process(p.pid).name()
        except Exception:  # noqa: BLE001 - another user's or a container's process
            name = "unknown"
        used = getattr(p, "usedGpuMemory", None)
        out.append(GpuProcess(p.pid, name, used if isinstance(used, int) else None))
    return tuple(out)


def list_gpus() -> list[Gpu]:
    """GPUs visible to the kernel, via NVML, with their compute processes; ``[]`` when there is no
    NVIDIA driver. ``SGPU_MAGIC_FAKE_GPUS`` replaces the inventory (see the module docstring)."""
    fake = os.environ.get(FAKE_GPUS_ENV, "").strip()
    if fake:
        return _visible_filter(fake_gpus(fake))
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
            gpus.append(
                Gpu(
                    i,
                    name.decode() if isinstance(name, bytes) else name,
                    uuid.decode() if isinstance(uuid, bytes) else uuid,
                    _processes(pynvml, h),
                )
            )
        return _visible_filter(gpus)
    finally:
        pynvml.nvmlShutdown()


def plan_devices(spec: LaunchSpec, gpus: list[Gpu] | None = None) -> DevicePlan:
    """Check ``spec`` against the machine and decide where its ranks run (before leasing).

    Raises:
        ResourceError: ``gpu_type`` matches no attached GPU, ``gpu_ids`` names a GPU that is not
            visible, or more GPUs are asked for than visible.
    """
    gpus = list_gpus() if gpus is None else gpus
    if not gpus:
        if spec.gpu_ids is not None:
            raise ResourceError(
                f"gpu_ids={list(spec.gpu_ids)} asked for, but no GPU is visible here; "
                f"leave gpu_ids out to run {spec.gpus} CPU rank(s)"
            )
        asked = f" (gpu_type {spec.gpu_type!r} ignored)" if spec.gpu_type else ""
        return DevicePlan(
            spec.gpus, "gloo", (), f"sgpu_magic: no GPU found; running {spec.gpus} CPU rank(s) with gloo{asked}"
        )
    if spec.gpu_type:
        names = sorted({g.name for g in gpus})
        gpus = [g for g in gpus if spec.gpu_type.lower() in g.name.lower()]
        if not gpus:
            raise ResourceError(
                f"gpu_type {spec.gpu_type!r} matches none of the attached GPUs ({', '.join(names)}); "
                f"use one of those names, or leave gpu_type out to take any GPU"
            )
    if spec.gpu_ids is not None:
        by_index = {g.index: g for g in gpus}
        missing = [i for i in spec.gpu_ids if i not in by_index]
        if missing:
            raise ResourceError(
                f"gpu_ids {missing} are not among the visible GPUs (indices "
                f"{sorted(by_index)}{', of gpu_type ' + repr(spec.gpu_type) if spec.gpu_type else ''}); "
                f"pick from those"
            )
        gpus = [by_index[i] for i in spec.gpu_ids]
    if spec.gpus > len(gpus):
        raise ResourceError(
            f"gpus={spec.gpus} asked for, but only {len(gpus)} GPU(s) are visible here "
            f"({', '.join(g.name for g in gpus)}); ask for at most {len(gpus)}"
        )
    note = ""
    if gpus[0].fake:
        note = (
            f"sgpu_magic: fake GPU inventory ({FAKE_GPUS_ENV}); the job leases {spec.gpus} of them and its "
            f"ranks run on CPU with gloo"
        )
    return DevicePlan(
        spec.gpus,
        "gloo" if gpus[0].fake else "nccl",
        (),
        note,
        candidates=tuple(gpus),
        explicit=spec.gpu_ids is not None,
    )


def check_port_free(port: int) -> None:
    """Raise :class:`ResourceError` when ``port`` cannot be bound on this machine (it is in use)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore: TIME_WAIT is not "in use"
        try:
            s.bind(("", port))
        except OSError as exc:
            raise ResourceError(
                f"port {port} is in use ({exc.strerror}); leave port out to pick a free one, or choose another port"
            ) from None


def free_port() -> int:
    """A TCP port that is free right now (bound to port 0, as torch elastic does)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
