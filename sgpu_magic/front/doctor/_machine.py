"""The doctor's facts about this machine and its rows about Python, torch, GPUs and their holders, and leases (ports,
home and the launch host: :mod:`sgpu_magic.front.doctor._system`)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sgpu_magic.errors import ResourceError
from sgpu_magic.front.doctor._rows import Check, DoctorConfig, error, ok, warning
from sgpu_magic.launch.resources import FAKE_GPUS_ENV, Gpu, list_gpus

FREE_SPACE_WARNING_BYTES = 1 << 30
"""Less free disk than this under sgpu_magic's home gets a warning (rank logs, checkpoints staged there)."""

LEASE_DIR_REMEDY = (
    "set SGPU_MAGIC_LEASE_DIR (or %config DistributedMagics.lease_dir) to a directory you can write; "
    "for a team, one every user can write (e.g. mode 2775 with a shared group)"
)


@dataclass(frozen=True)
class Inventory:
    """The GPUs a job would see (``resources.list_gpus``), and what NVML says about the driver."""

    gpus: tuple[Gpu, ...] = ()
    bad_fake: str | None = None
    unreadable: str | None = None
    driver: str | None = None
    driver_cuda: tuple[int, int] | None = None
    attached: int = 0

    @property
    def fake(self) -> bool:
        return bool(self.gpus) and self.gpus[0].fake

    @property
    def real(self) -> int:
        return 0 if self.fake else len(self.gpus)


@dataclass(frozen=True)
class Leases:
    """The lease directory and what its registry holds (``None`` when it does not exist yet or is broken)."""

    directory: Path
    snapshot: dict | None = None
    problem: Check | None = None


@dataclass(frozen=True)
class Facts:
    """What several rows need, read once."""

    inventory: Inventory
    leases: Leases

    @classmethod
    def gather(cls, config: DoctorConfig) -> Facts:
        try:
            inventory = _inventory()
        except Exception as exc:  # noqa: BLE001 - an NVML error mid-listing: the other rows still come
            inventory = Inventory(unreadable=f"{type(exc).__name__}: {exc}")
        try:
            leases = _leases(config.lease_dir)
        except Exception as exc:  # noqa: BLE001 - e.g. a registry lock of another user's
            from sgpu_magic.launch.leases import default_lease_dir

            directory = Path(config.lease_dir) if config.lease_dir else default_lease_dir()
            leases = Leases(
                directory,
                problem=warning(
                    "leases", f"{directory} could not be read ({type(exc).__name__}: {exc})", LEASE_DIR_REMEDY
                ),
            )
        return cls(inventory, leases)


def _nvml_driver() -> tuple[str | None, tuple[int, int] | None, int]:
    """(driver version, the CUDA version it supports, GPUs attached) from NVML; ``(None, None, 0)`` without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no nvidia-ml-py, no driver, no device: all mean "no NVIDIA GPU here"
        return None, None, 0
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12040 for 12.4
        count = pynvml.nvmlDeviceGetCount()
        return (driver.decode() if isinstance(driver, bytes) else driver), (cuda // 1000, cuda % 1000 // 10), count
    finally:
        pynvml.nvmlShutdown()


def _inventory() -> Inventory:
    try:
        gpus = tuple(list_gpus())
    except ResourceError:
        return Inventory(bad_fake=os.environ.get(FAKE_GPUS_ENV, ""))
    if gpus and gpus[0].fake:
        return Inventory(gpus)
    driver, cuda, attached = _nvml_driver()
    return Inventory(gpus, driver=driver, driver_cuda=cuda, attached=attached)


def unwritable(path: Path) -> str | None:
    """Why ``path`` (a directory, made with its parents if missing) cannot be used, or ``None``."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by you"
    return None


def _leases(lease_dir: str | None) -> Leases:
    from sgpu_magic.launch.leases import LeaseRegistry, default_lease_dir

    directory = Path(lease_dir) if lease_dir else default_lease_dir()
    why = unwritable(directory)
    if why is not None:
        return Leases(
            directory,
            problem=error("leases", f"the lease directory {directory} cannot be used: {why}", LEASE_DIR_REMEDY),
        )
    if not directory.exists():
        return Leases(directory)
    registry = directory / "registry.json"
    try:
        json.loads(registry.read_text()) if registry.exists() else None
    except (OSError, ValueError) as exc:
        return Leases(
            directory,
            problem=error(
                "leases",
                f"the lease registry {registry} cannot be read ({exc})",
                "remove it while no sgpu_magic job runs (the next job writes a new one)",
            ),
        )
    return Leases(directory, LeaseRegistry(directory).snapshot())


# ----------------------------------------------------------------------------- rows


def python_rows(config: DoctorConfig, facts: Facts) -> list[Check]:
    from sgpu_magic import __version__

    package = Path(__file__).resolve().parents[2]
    return [
        ok("python", f"{platform.python_version()} ({sys.executable})"),
        ok("sgpu_magic", f"{__version__} ({package})"),
    ]


def _nccl_version(torch) -> str | None:
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return None
    version = torch.cuda.nccl.version()  # the NCCL torch was built with; no CUDA context is made
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def torch_gpu_problem(
    torch_cuda: str | None, real_gpus: int, driver_cuda: tuple[int, int] | None
) -> tuple[str, str] | None:
    """(problem, remedy) when this torch build cannot use the visible GPUs, else ``None``.

    ``torch_cuda`` is ``torch.version.cuda`` (``None`` for a CPU build); ``driver_cuda`` the newest CUDA the
    NVIDIA driver supports (NVML). CUDA's minor-version compatibility lets a driver run any build of its major.
    """
    if not real_gpus:
        return None
    if torch_cuda is None:
        return (
            f"it is a CPU build, but {real_gpus} GPU(s) are visible: jobs would give their ranks GPUs and nccl "
            f"that this torch cannot use",
            "install a CUDA build of torch (the pip command from pytorch.org's install selector), or hide the "
            "GPUs (CUDA_VISIBLE_DEVICES='') to run CPU ranks",
        )
    major = int(torch_cuda.split(".")[0])
    if driver_cuda is not None and major > driver_cuda[0]:
        return (
            f"it is built for CUDA {torch_cuda}, but the NVIDIA driver supports CUDA up to "
            f"{driver_cuda[0]}.{driver_cuda[1]}: ranks would fail to initialise CUDA",
            f"update the NVIDIA driver, or install a torch build for CUDA {driver_cuda[0]}",
        )
    return None


def torch_rows(config: DoctorConfig, facts: Facts) -> list[Check]:
    try:
        import torch
    except ImportError as exc:  # not installed, or a broken install (a missing shared library)
        return [
            error(
                "torch",
                f"cannot be imported ({exc})",
                "install it: pip install torch (on a GPU machine, the CUDA build pytorch.org's install selector gives)",
            )
        ]
    cuda = torch.version.cuda
    nccl = _nccl_version(torch)
    gloo = torch.distributed.is_available() and torch.distributed.is_gloo_available()
    details = (
        f"{torch.__version__}, "
        + (f"CUDA {cuda}" if cuda else "CPU build (no CUDA)")
        + (f", NCCL {nccl}" if nccl else "")
        + (", gloo" if gloo else ", no gloo")
    )
    problem = torch_gpu_problem(cuda, facts.inventory.real, facts.inventory.driver_cuda)
    if problem is not None:
        return [error("torch", f"{details}: {problem[0]}", problem[1])]
    return [ok("torch", details)]


def _holder_text(holder: dict) -> str:
    since = time.strftime("%H:%M:%S", time.localtime(holder["since_s"]))
    return f"job {holder['job_id']} (kernel pid {holder['pids'][0][0]}, user {holder['user']}) since {since}"


def _gpu_row(gpu: Gpu, held: dict[str, dict]) -> Check:
    name = f"gpu {gpu.index}"
    busy = ", ".join(p.describe() for p in gpu.processes)
    if gpu.uuid in held:
        return ok(name, f"{gpu.name}: leased by {_holder_text(held[gpu.uuid])}" + (f"; running {busy}" if busy else ""))
    if busy:
        return warning(
            name,
            f"{gpu.name}: busy outside sgpu_magic ({busy}); jobs skip it",
            "end that process, or pick other GPUs with gpu_ids= / --gpu-ids",
        )
    return ok(name, f"{gpu.name}: free")


def _inventory_row(inv: Inventory) -> Check:
    if inv.bad_fake is not None:
        return error(
            "gpus",
            f"{FAKE_GPUS_ENV}={inv.bad_fake!r} is not a GPU inventory",
            f"write it as '8 x H100' (count x name), or unset {FAKE_GPUS_ENV} to use the real GPUs",
        )
    if inv.unreadable is not None:
        return warning(
            "gpus",
            f"NVML's GPU list could not be read ({inv.unreadable})",
            "check the NVIDIA driver (nvidia-smi); jobs may not see the GPUs",
        )
    if inv.fake:
        return warning(
            "gpus",
            f"{len(inv.gpus)} x {inv.gpus[0].name} from {FAKE_GPUS_ENV} (a test seam): jobs "
            f"lease them as real GPUs and their ranks run on CPU with gloo",
            f"unset {FAKE_GPUS_ENV} to use this machine's real GPUs",
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not inv.gpus and inv.attached:
        return warning(
            "gpus",
            f"{inv.attached} attached, but CUDA_VISIBLE_DEVICES={visible!r} hides them all: jobs "
            f"run CPU ranks with gloo",
            "unset CUDA_VISIBLE_DEVICES in the kernel, or name GPUs in it",
        )
    if not inv.gpus:
        return ok("gpus", "none (no NVIDIA driver or GPU seen through NVML): jobs run CPU ranks with gloo")
    names = sorted({g.name for g in inv.gpus})
    cuda = f"{inv.driver_cuda[0]}.{inv.driver_cuda[1]}" if inv.driver_cuda else "?"
    shown = f"; CUDA_VISIBLE_DEVICES={visible!r} shows {len(inv.gpus)} of {inv.attached}" if visible is not None else ""
    return ok("gpus", f"{len(inv.gpus)} x {', '.join(names)}; NVIDIA driver {inv.driver} (CUDA {cuda}){shown}")


def gpu_rows(config: DoctorConfig, facts: Facts) -> list[Check]:
    snapshot = facts.leases.snapshot or {}
    held = {uuid: h for h in snapshot.get("holders", []) for uuid in h["gpus"]}
    return [_inventory_row(facts.inventory)] + [_gpu_row(g, held) for g in facts.inventory.gpus]


def lease_rows(config: DoctorConfig, facts: Facts) -> list[Check]:
    leases = facts.leases
    if leases.problem is not None:
        return [leases.problem]
    unused = "" if facts.inventory.gpus else " (not used here: CPU jobs lease nothing)"
    if leases.snapshot is None:
        return [ok("leases", f"{leases.directory}: made by the first GPU job{unused}")]
    holders, queue = leases.snapshot["holders"], leases.snapshot["queue"]
    held = "; ".join(f"GPUs {','.join(map(str, h['indices']))} held by {_holder_text(h)}" for h in holders)
    waiting = "; ".join(f"job {w['job_id']} (user {w['user']}) waits for {w['count']} GPU(s)" for w in queue)
    state = "; ".join(part for part in (held, waiting) if part) or "no GPU leased, no job waiting"
    return [ok("leases", f"{leases.directory}: {state}{unused}")]
