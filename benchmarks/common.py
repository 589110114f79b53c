"""Shared pieces of the benchmark suite: configuration, kernels, statistics, tables, targets."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .kernel import CellError, CellTimeout, Kernel, kernel_env

REPO = Path(__file__).resolve().parent.parent

SGPU_SETUP = '''\
%load_ext sgpu_magic
import inspect, json, os, sys, time
import torch
import torch.distributed as dist
from sgpu_magic import distributed
from sgpu_magic.front.magics import DistributedMagics as _DM
from sgpu_magic.tracking.run import MlflowTracking as _MT
from sgpu_magic.job.follow import JobSink as _JS

def _emit(**data):
    sys.stdout.write("__BENCH__" + json.dumps(data) + "\\n")
    sys.stdout.flush()

def _start_method(job):
    """How the launch host started this job's ranks, as it reports it in status.json (None if it does not say)."""
    try:
        with open(os.path.join(job.run_dir, "status.json")) as f:
            return json.load(f).get("start_method")
    except Exception:
        return None

def _host_cpu():
    """CPU seconds used so far by this kernel's launch host process itself (not its children)."""
    try:
        import psutil
        from sgpu_magic.launch.client import get_host

        t = psutil.Process(get_host().pid).cpu_times()
        return t.user + t.system
    except Exception:
        return None

# tracking off where the option exists (it is not measured here)
_KW = {"mlflow": False} if "mlflow" in inspect.signature(distributed).parameters else {}
_parser = getattr(_DM.distributed, "parser", None)
_MAGIC_FLAGS = "--no-mlflow" if _parser and "--no-mlflow" in _parser.format_usage() else ""
_emit(mlflow_kw=bool(_KW), magic_no_mlflow=bool(_MAGIC_FLAGS), magic_flags=_MAGIC_FLAGS,
      tracking_sink_does_something=any(m in vars(_MT) for m in vars(_JS) if not m.startswith("__")))
'''

WARMUP_MAX_S = 120.0

WARMUP_DEF = """\
def _warmup():
    return 0

# 2 ranks; 1 on a machine with one GPU (each rank takes one GPU)
_warmup_job = distributed(gpus=min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2, **_KW)(_warmup)
"""

WARMUP_CELL = """\
_warmup_job.distributed()
_emit(start_method=_start_method(_warmup_job.last_job))
"""

PEERS_SETUP = """\
import json, os, shutil, socket, subprocess, sys, tempfile, time
import torch
import torch.multiprocessing as mp
if {repo!r} not in sys.path:
    sys.path.insert(0, {repo!r})
from benchmarks import workloads
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

def _emit(**data):
    sys.stdout.write("__BENCH__" + json.dumps(data) + "\\n")
    sys.stdout.flush()

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
"""


@dataclass
class Config:
    quick: bool
    gpu: bool
    only: set[str]
    soak: int
    launch_ranks: tuple[int, ...]
    launch_reps: int
    train_reps: int
    train_epochs: int
    log_ranks: int
    log_lines: int
    log_reps: int
    capture_reps: int
    gather_ranks: int
    gather_bytes: int
    gather_reps: int
    gpu_reps: int
    cell_timeout_s: float
    launch_timeout_s: float
    teardown_launches: int = 500
    panel_jobs: int = 500
    session_soak_cells: int = 5000
    session_ranks: tuple[int, ...] = (2, 8)
    session_reps: int = 30
    responsive_reps: int = 3

    @classmethod
    def make(cls, quick: bool, gpu: bool, only: set[str], soak: int, reps: int | None) -> Config:
        if quick:
            cfg = cls(
                quick,
                gpu,
                only,
                soak,
                launch_ranks=(1, 8),
                launch_reps=1,
                train_reps=1,
                train_epochs=3,
                log_ranks=8,
                log_lines=10_000,
                log_reps=1,
                capture_reps=2,
                gather_ranks=8,
                gather_bytes=100_000_000,
                gather_reps=1,
                gpu_reps=2,
                cell_timeout_s=240,
                launch_timeout_s=120,
                teardown_launches=100,
                panel_jobs=200,
                session_soak_cells=1000,
                session_ranks=(2,),
                session_reps=10,
                responsive_reps=1,
            )
        else:
            cfg = cls(
                quick,
                gpu,
                only,
                soak,
                launch_ranks=(1, 2, 4, 8),
                launch_reps=5,
                train_reps=5,
                train_epochs=10,
                log_ranks=8,
                log_lines=100_000,
                log_reps=3,
                capture_reps=5,
                gather_ranks=8,
                gather_bytes=100_000_000,
                gather_reps=3,
                gpu_reps=3,
                cell_timeout_s=300,
                launch_timeout_s=180,
            )
        if reps:
            cfg.launch_reps = cfg.train_reps = cfg.log_reps = cfg.capture_reps = cfg.gather_reps = cfg.gpu_reps = reps
            cfg.responsive_reps = reps
        return cfg


class Context:
    """The run's configuration, scratch directory and the kernels it starts."""

    def __init__(self, cfg: Config, workdir: Path) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.home = workdir / "sgpu_home"
        self.log_dir = workdir / "kernel_logs"
        self.home.mkdir(parents=True, exist_ok=True)
        self.kernels: list[Kernel] = []
        self.facts: dict = {}

    def kernel(self, name: str, gpu: bool = False, **env: str) -> Kernel:
        """A kernel; unless ``gpu``, with ``CUDA_VISIBLE_DEVICES=""``, so that on a GPU machine every launcher
        in the CPU sections (sgpu_magic and the peers alike) runs CPU ranks with gloo, as on a machine without one."""
        if not gpu:
            env.setdefault("CUDA_VISIBLE_DEVICES", "")
        k = Kernel(name, kernel_env(self.home, **env), REPO, self.log_dir)
        self.kernels.append(k)
        return k

    def sgpu_kernel(self, name: str, warm: bool = False, gpu: bool = False, **env: str) -> Kernel:
        """A kernel with ``%load_ext sgpu_magic`` run, torch imported and ``_KW`` (tracking off) defined.

        ``warm``: also run untimed 2-rank launches, a second apart, until the host reports a start
        method other than ``subprocess`` (its cold path while its forkserver warms up), for at most
        ``WARMUP_MAX_S``: later measurements then see the steady state of a kernel in use.
        """
        k = self.kernel(name, gpu, **env)
        cell = k.run(SGPU_SETUP, timeout_s=self.cfg.cell_timeout_s)
        self.facts.setdefault("tracking", cell.data)
        if warm:
            k.run(WARMUP_DEF, timeout_s=self.cfg.cell_timeout_s)
            methods, t0 = [], time.monotonic()
            while True:
                methods.append(k.run(WARMUP_CELL, timeout_s=self.cfg.cell_timeout_s).data.get("start_method"))
                if methods[-1] != "subprocess" or time.monotonic() - t0 > WARMUP_MAX_S:
                    break
                time.sleep(1.0)
            self.facts.setdefault("warmups", []).append(
                {"kernel": k.name, "launches": len(methods), "last": methods[-1], "s": round(time.monotonic() - t0, 1)}
            )
        return k

    def peers_kernel(self, name: str, gpu: bool = False, **env: str) -> Kernel:
        k = self.kernel(name, gpu, **env)
        k.run(PEERS_SETUP.format(repo=str(REPO)), timeout_s=self.cfg.cell_timeout_s)
        return k

    def close(self) -> None:
        for k in self.kernels:
            try:
                k.shutdown()
            except Exception:  # noqa: BLE001
                k.kill()


def settle(seconds: float = 0.5) -> None:
    """Let the processes of the previous measurement exit before the next one starts."""
    time.sleep(seconds)


# ---- statistics and formatting ----


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def slope(samples: list[dict], x: str, y: str, start: int, end: float = float("inf")) -> float | None:
    """Growth of ``y`` per unit of ``x`` (e.g. RSS per ended job) from the first sample with ``x >= start`` to the
    last with ``x <= end``; ``None`` without two such samples."""
    base = next((s for s in samples if s[x] >= start), None)
    last = next((s for s in reversed(samples) if s[x] <= end), None)
    if base is None or last is None or last[x] <= base[x]:
        return None
    return (last[y] - base[y]) / (last[x] - base[x])


def fmt(x: float | None, digits: int = 2, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}{unit}"


def fmt_range(xs: list[float], digits: int = 2) -> str:
    return f"{min(xs):.{digits}f}-{max(xs):.{digits}f}" if xs else "-"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        widths = [max(len(str(c)) for c in col) for col in zip(self.headers, *self.rows)]
        line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
        out = [f"### {self.title}", "", line(self.headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        out += [line(r) for r in self.rows]
        if self.notes:
            out.append("")
            out += [f"- {n}" for n in self.notes]
        return "\n".join(out)


@dataclass
class Target:
    name: str
    target: str
    measured: str
    met: bool | None  # None: not measured in this run

    @property
    def verdict(self) -> str:
        return {True: "met", False: "NOT met", None: "not measured"}[self.met]


@dataclass
class Section:
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    raw: dict = field(default_factory=dict)


def measure(kernel_factory, kernel: Kernel | None, code: str, timeout_s: float, **run_kw):
    """Run ``code`` (in a kernel from ``kernel_factory`` when ``kernel`` is gone).

    Returns ``(kernel, cell, problem)``; ``problem`` is ``None``, ``"hang: ..."`` or ``"error: ..."``.
    After a hang or an error the kernel is gone (``None``): the next call starts a new one.
    """
    try:
        if kernel is None or kernel.closed:
            kernel = kernel_factory()
        return kernel, kernel.run(code, timeout_s=timeout_s, **run_kw), None
    except CellTimeout as exc:
        return None, None, f"hang: {exc}"
    except CellError as exc:
        if kernel is not None:
            kernel.shutdown()
        return None, None, f"error: {exc}"


# ---- the machine ----


def machine_description() -> dict:
    import torch

    try:
        import accelerate

        acc = accelerate.__version__
    except ImportError:
        acc = "not installed"
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception:  # noqa: BLE001
        commit = "?"
    try:
        dirty = bool(
            subprocess.run(
                ["git", "-C", str(REPO), "status", "--porcelain", "--", "sgpu_magic"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        )
    except Exception:  # noqa: BLE001
        dirty = False
    import ipykernel
    import jupyter_client

    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "accelerate": acc,
        "ipykernel": ipykernel.__version__,
        "jupyter_client": jupyter_client.__version__,
        "sgpu_magic_commit": commit,
        "sgpu_magic_dirty": dirty,
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "argv": " ".join([Path(sys.executable).name, *sys.argv]),
    }


def panel_cpu_targets(
    samples: dict, what: str, small: str, key: str = "panel"
) -> tuple[list[Target], float | None, float | None]:
    """The two kernel-CPU targets of a heavy panel job (``samples[key]``, ``what`` it did): <= 5% of its wall
    time, and <= 5% beyond the panel's fixed cost per job, measured by the same panel job doing little
    (``samples["panel_small"]``, described by ``small``). Also the CPU seconds beyond that fixed cost and their
    share of the wall time in percent (``None`` when either job was not measured)."""
    pct = median(samples[key]["cpu_pct"])
    targets = [
        Target(
            f"kernel CPU while {what}, % of the job's wall time",
            "<= 5%",
            fmt(pct, 1, "%"),
            None if pct is None else pct <= 5.0,
        )
    ]
    cpu, fixed, wall = (
        median(samples[key]["cpu"]),
        median(samples["panel_small"]["cpu"]),
        median(samples[key]["wall"]),
    )
    if cpu is None or fixed is None or wall is None:
        return targets, None, None
    marginal = 100 * max(0.0, cpu - fixed) / wall
    targets.append(
        Target(
            f"the same, beyond the panel's fixed cost per job ({small}: {fixed:.3f} s)",
            "<= 5%",
            f"{marginal:.1f}%",
            marginal <= 5.0,
        )
    )
    return targets, cpu - fixed, marginal
