"""Each rank's GPU, sampled through NVML (``pynvml``, from nvidia-ml-py) by the launch host with the CPU figures
(:mod:`sgpu_magic.launch.usage`): utilisation %, memory used and total, power. NVML reads the driver's
counters and makes no CUDA context. Without NVML (no driver, no GPU, a CPU job) :class:`GpuSampler` does nothing.

Rank ``r`` uses the job's ``r``-th GPU (``LOCAL_RANK`` on one node: :func:`sgpu_magic.runtime.device`), so its
figures are those of that device; ``memory`` is the device's memory in use (every process on it), the peak the
largest such sample. Where NVML lists the rank's own process on the device, its own memory is used instead.
"""

from __future__ import annotations

from typing import Any


class GpuSampler:
    """NVML handles of the job's GPUs in rank order; :meth:`sample` returns ``{rank: figures}``."""

    def __init__(self, gpu_indices: list[int]) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        self.peak: dict[int, int] = {}
        if not gpu_indices:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in gpu_indices]
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVML, no driver, no such GPU: no GPU figures
            self._handles = []

    @property
    def active(self) -> bool:
        return self._nvml is not None

    def _own_memory(self, handle: Any, pid: int) -> int | None:
        try:
            for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
        except Exception:  # noqa: BLE001 - not supported (e.g. in a container's PID namespace)
            return None
        return None

    def sample(self, pids: dict[int, int]) -> dict[int, dict[str, float | int]]:
        """``{rank: {"gpu_percent", "gpu_memory_bytes", "gpu_memory_total_bytes", "gpu_power_w",
        "peak_gpu_memory_bytes"}}`` for the ranks whose GPU NVML could read; ``{}`` without NVML."""
        if self._nvml is None:
            return {}
        nvml, out = self._nvml, {}
        for rank, pid in pids.items():
            handle = self._handles[rank % len(self._handles)]
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                power_w = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # milliwatts
            except Exception:  # noqa: BLE001 - a GPU that fell off the bus: no figures this time
                continue
            used = self._own_memory(handle, pid) or int(memory.used)
            self.peak[rank] = max(used, self.peak.get(rank, 0))
            out[rank] = {
                "gpu_percent": float(util),
                "gpu_memory_bytes": used,
                "gpu_memory_total_bytes": int(memory.total),
                "gpu_power_w": round(power_w, 1),
                "peak_gpu_memory_bytes": self.peak[rank],
            }
        return out

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
            self._nvml = None
