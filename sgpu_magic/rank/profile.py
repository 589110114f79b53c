"""Profiling in a rank (``profile=STEPS`` on the decorator, ``%%distributed --profile [STEPS]``, ``Session.profile``):
``torch.profiler`` over the code's steps, its Chrome trace and a breakdown of the profiled time.

The steps are those :mod:`sgpu_magic.rank.steps` marks (``runtime.step()``, else the first optimizer's
``step()``). The profiler follows torch's schedule ``schedule(wait=1, warmup=1, active=STEPS, repeat=1)``: from the
code's start to the first mark is the wait (setup: imports, the model made), the first step is the warm-up
(recorded, then dropped, so the profiler's own start-up cost is not in the figures), the next STEPS are recorded.
A code that ends sooner keeps the steps it completed (the one it ended in is left out of the figures: it ran on
into the code's end); one that ends before completing a recorded step keeps nothing (the kernel says so). Profiles the CPU, and CUDA where a device is there.

When the recorded steps end (or the code does), the rank writes into the run directory's ``profile/`` (0700):

- ``rank_<r>.trace.json``: the profiler's Chrome trace (``export_chrome_trace``), 0600;
- ``rank_<r>.json``: the breakdown: of the recorded steps' wall time (the sum of torch's ``ProfilerStep#N`` spans on
  the code's thread), the time in collectives (the rank's timed ``torch.distributed`` calls and DDP's wait at the end
  of ``backward()``, each an ``sgpu_magic::collective`` span, and any ``c10d::`` / ``gloo:`` / ``nccl:`` op), in data
  loading (torch's ``enumerate(DataLoader)...`` spans), in compute (any other op) and idle (the rest: Python between
  ops, sleeps, waits outside ``torch.distributed``); each instant is counted once, in that order of precedence, so
  the four sum to the wall time. With CUDA, also the time the device ran kernels. Then the top ops by self time.
"""

from __future__ import annotations

import os
import time
from typing import Any

from sgpu_magic.rundir import RunDir, atomic_write_json

WAIT_STEPS = 1
"""Steps the profiler waits before its warm-up (the first: from the code's start to the first step mark)."""

WARMUP_STEPS = 1
"""Steps recorded then dropped before the profiled ones."""

COLLECTIVE_SPAN = "sgpu_magic::collective"
"""The span (``torch.profiler.record_function``) around a timed collective while profiling."""

TOP_OPS = 10
"""Ops listed in a rank's summary."""

_COLLECTIVE_PREFIXES = (COLLECTIVE_SPAN, "c10d::", "gloo:", "nccl:", "record_param_comms")
_DATA_PREFIX = "enumerate(DataLoader)"
_STEP_PREFIX = "ProfilerStep"


class RankProfiler:
    """``torch.profiler`` over this rank's next steps (module docstring); :meth:`step` at each step mark,
    :meth:`stop` when the code ends."""

    def __init__(self, steps: int, run_dir: RunDir, rank: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        self.rank, self.run_dir, self.steps = rank, run_dir, steps
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.device = "cuda" if len(activities) > 1 else "cpu"
        self._profiler = profile(
            activities=activities,
            schedule=schedule(wait=WAIT_STEPS, warmup=WARMUP_STEPS, active=steps, repeat=1),
            on_trace_ready=self._save,
        )
        self._profiler.start()
        self._stopped = False
        self._marks = 0

    def step(self) -> None:
        """A step mark: the profiler's schedule moves on."""
        if not self._stopped:
            self._marks += 1
            self._profiler.step()

    def stop(self) -> None:
        """The code has ended: what was recorded is saved (nothing if it ended within the wait or warm-up)."""
        if not self._stopped:
            self._stopped = True
            self._profiler.stop()

    def _save(self, profiler: Any) -> None:
        complete = min(self.steps, self._marks - WAIT_STEPS - WARMUP_STEPS)  # steps ended by a mark
        if complete <= 0:  # the code ended within the first recorded step: nothing whole to show
            return
        started = time.perf_counter()
        folder = self.run_dir.profile_dir
        folder.mkdir(mode=0o700, exist_ok=True)
        trace = self.run_dir.profile_trace_file(self.rank)
        profiler.export_chrome_trace(str(trace))
        os.chmod(trace, 0o600)
        summary = summarize(profiler.events(), self.device, complete)
        summary.update(rank=self.rank, asked_steps=self.steps, save_s=time.perf_counter() - started)
        atomic_write_json(self.run_dir.profile_summary_file(self.rank), summary)


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``spans`` as sorted, disjoint ``(start, end)`` spans."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _clip(spans: list[tuple[float, float]], windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``spans`` inside ``windows`` (both disjoint and sorted after :func:`_merged`)."""
    out = []
    for start, end in spans:
        for low, high in windows:
            if start < high and end > low:
                out.append((max(start, low), min(end, high)))
    return _merged(out)


def summarize(events: Any, device: str, complete: int) -> dict[str, Any]:
    """The breakdown and top ops (module docstring) of a profiler's ``events()`` over its first ``complete`` steps (a code that ended within a recorded step leaves that step out: it ran on into the
    code's end); times in seconds."""
    steps = sorted((e for e in events if e.name.startswith(_STEP_PREFIX)), key=lambda e: e.time_range.start)
    steps = steps[:complete]
    thread = steps[0].thread if steps else None
    windows = _merged([(e.time_range.start, e.time_range.end) for e in steps])
    kinds: dict[str, list[tuple[float, float]]] = {"collective": [], "data": [], "compute": [], "device": []}
    for e in events:
        span = (e.time_range.start, e.time_range.end)
        if e.name.startswith(_STEP_PREFIX):
            continue
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            kinds["device"].append(span)
        elif e.thread != thread:
            continue
        elif e.name.startswith(_COLLECTIVE_PREFIXES):
            kinds["collective"].append(span)
        elif e.name.startswith(_DATA_PREFIX):
            kinds["data"].append(span)
        elif not getattr(e, "is_user_annotation", False):
            kinds["compute"].append(span)
    wall = _length(windows)
    collective = _clip(_merged(kinds["collective"]), windows)
    data = _clip(_merged(kinds["data"] + collective), windows)
    compute = _clip(_merged(kinds["compute"] + data), windows)
    result: dict[str, Any] = {
        "device": device,
        "steps": len(steps),
        "wall_s": wall / 1e6,
        "collective_s": _length(collective) / 1e6,
        "data_s": (_length(data) - _length(collective)) / 1e6,
        "compute_s": (_length(compute) - _length(data)) / 1e6,
        "idle_s": (wall - _length(compute)) / 1e6,
    }
    if device == "cuda":
        result["device_busy_s"] = _length(_clip(_merged(kinds["device"]), windows)) / 1e6
    result["top_ops"] = _top_ops(events, windows, device)
    return result


def _top_ops(events: Any, windows: list[tuple[float, float]], device: str) -> list[dict[str, Any]]:
    """The :data:`TOP_OPS` ops (by name, on any of the rank's threads) with the most self time in the recorded steps
    (``windows``: an op of the step the code ended in is left out, as in the breakdown), device time with CUDA, else
    CPU, as ``{"name", "calls", "self_cpu_s", "cpu_s"[, "self_device_s"]}``."""
    rows: dict[str, dict[str, Any]] = {}
    for e in events:
        name = e.name
        if name.startswith((_STEP_PREFIX, COLLECTIVE_SPAN, _DATA_PREFIX)) or getattr(e, "is_user_annotation", False):
            continue
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            continue  # a kernel: its time is in the self device time of the op that launched it
        start = e.time_range.start
        if not any(low <= start < high for low, high in windows):
            continue
        row = rows.setdefault(name, {"name": name, "calls": 0, "self_cpu_s": 0.0, "cpu_s": 0.0})
        row["calls"] += 1
        row["self_cpu_s"] += e.self_cpu_time_total / 1e6
        row["cpu_s"] += e.cpu_time_total / 1e6
        if device == "cuda":
            row["self_device_s"] = row.get("self_device_s", 0.0) + getattr(e, "self_device_time_total", 0.0) / 1e6
    key = "self_device_s" if device == "cuda" else "self_cpu_s"
    return sorted(rows.values(), key=lambda row: row.get(key, 0.0), reverse=True)[:TOP_OPS]
