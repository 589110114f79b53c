"""Each rank's CPU and memory, sampled about once a second into the job's status
(:class:`~sgpu_magic.status.RankUsage`, ``status.json``'s ``usage``): by the launch host for the ranks it starts,
and on a Ray cluster by each rank's agent on the rank's node (:meth:`~sgpu_magic.launch.ray.agent.RankAgent.usage`),
which the Ray supervisor asks as often.

CPU % is ``psutil.Process.cpu_percent`` over the time since the last sample (100 = one core busy); RSS is the
rank process's resident set; the peak is the kernel's high-water mark of it (``VmHWM`` in ``/proc/<pid>/status``,
so a peak between two samples counts too), else the largest RSS sampled. The rank process only: processes it
started (DataLoader workers) are not added. A rank that has ended keeps its last figures. With NVML, each rank's
GPU figures come with them (:class:`~sgpu_magic.launch.gpu.GpuSampler`).
"""

from __future__ import annotations

import time

import psutil

from sgpu_magic.launch.gpu import GpuSampler
from sgpu_magic.status import RankUsage

SAMPLE_INTERVAL_S = 1.0
"""How often the host samples a running job's ranks."""


def _high_water_bytes(pid: int) -> int:
    """``VmHWM`` of ``pid`` in bytes (Linux), 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return 0


class UsageSampler:
    """Samples the ranks ``{rank: pid}`` of one attempt; :meth:`sample` when due, :attr:`usage` the figures."""

    def __init__(self, gpu_indices: list[int] | None = None) -> None:
        self.gpu = GpuSampler(gpu_indices or [])
        self._procs: dict[int, psutil.Process] = {}
        self.usage: dict[int, RankUsage] = {}
        self._next_s = 0.0

    @property
    def watched(self) -> dict[int, int]:
        """``{rank: pid}`` of the ranks it samples now."""
        return {rank: process.pid for rank, process in self._procs.items()}

    def watch(self, pids: dict[int, int]) -> None:
        """Sample these ranks from now on (a new attempt's); the figures of the last attempt's peaks stay."""
        self._procs = {}
        for rank, pid in pids.items():
            try:
                process = self._procs[rank] = psutil.Process(pid)
                process.cpu_percent(None)  # the first call only starts the interval
            except psutil.Error:
                continue
        self._next_s = time.monotonic() + SAMPLE_INTERVAL_S

    def sample(self, force: bool = False) -> bool:
        """Sample every rank if a second has passed since the last sample (or ``force``); whether it sampled."""
        now = time.monotonic()
        if not force and now < self._next_s:
            return False
        self._next_s = now + SAMPLE_INTERVAL_S
        gpu = self.gpu.sample({rank: process.pid for rank, process in self._procs.items()})
        for rank, process in self._procs.items():
            try:
                with process.oneshot():
                    cpu, rss = process.cpu_percent(None), process.memory_info().rss
            except psutil.Error:  # ended: keep its last figures
                continue
            before = self.usage.get(rank)
            peak = max(rss, _high_water_bytes(process.pid), before.peak_rss_bytes if before else 0)
            self.usage[rank] = RankUsage(
                cpu_percent=round(cpu, 1),
                rss_bytes=rss,
                peak_rss_bytes=peak,
                time_s=time.time(),
                **gpu.get(rank, {}),  # type: ignore[arg-type] # GpuSampler's keys and types
            )
        return True
