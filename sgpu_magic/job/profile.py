"""The kernel's side of a profiled job (``profile=``): each rank's profile summary read, and the ranks' traces
merged into one Chrome / Perfetto trace with one process per rank (:mod:`sgpu_magic.rank.profile` writes them).

The merged trace is the `Trace Event Format <https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU>`_
that Perfetto and ``chrome://tracing`` load: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``, each event's
``pid`` the rank (``process_name`` "rank <r>"), its ``tid`` the rank's own thread. The ranks of one machine share a
clock, so their events line up as recorded; a rank whose trace gives a different ``baseTimeNanoseconds`` is
shifted onto the first rank's base.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from sgpu_magic.errors import SgpuError
from sgpu_magic.rundir import RunDir, atomic_write_bytes, read_json

NO_PROFILED_STEP = (
    "no rank recorded a profiled step (the profiler waits one step and warms up one before it records: mark steps "
    "with runtime.step(), or call optimizer.step(), at least 3 times)"
)
"""Why a profiled job has no profile, and the remedy: the cell's line and ``Job.profile_trace``'s error say it."""

MERGED_TRACE = "trace.json"
"""The merged trace's name in the run directory's ``profile/``."""

_merging = threading.Lock()

_OWN_METADATA = ("process_name", "process_sort_index", "process_labels")
"""Metadata events of a rank's trace that the merged trace replaces with its own (one process per rank)."""


def summaries(rd: RunDir, world_size: int) -> dict[int, dict[str, Any]]:
    """``{rank: summary}`` of the ranks that saved one (``profile/rank_<r>.json``), ranks sorted."""
    found = {}
    for rank in range(world_size):
        path = rd.profile_summary_file(rank)
        if path.exists():
            summary = read_json(path, private=True)
            if isinstance(summary, dict):
                found[rank] = summary
    return found


def merged_trace(rd: RunDir, world_size: int, job_id: str) -> Path:
    """The merged trace of the job's ranks (made on the first call, then kept), its path.

    Raises:
        SgpuError: no rank saved a trace (the code ended before its profiled steps: one step of wait and one of
            warm-up come first), naming the job and the remedy.
    """
    target = rd.profile_dir / MERGED_TRACE
    with _merging:
        if target.exists():
            return target
        traces = {r: rd.profile_trace_file(r) for r in range(world_size) if rd.profile_trace_file(r).exists()}
        if not traces:
            raise SgpuError(f"job {job_id} has no profile trace: {NO_PROFILED_STEP}")
        events: list[dict[str, Any]] = []
        base_ns: int | None = None
        for rank, path in sorted(traces.items()):
            data = json.loads(path.read_bytes())
            rank_base = data.get("baseTimeNanoseconds")
            shift_us = 0.0
            if isinstance(rank_base, int):
                base_ns = rank_base if base_ns is None else base_ns
                shift_us = (rank_base - base_ns) / 1000
            events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
            events.append(
                {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
            )
            for event in data.get("traceEvents", []):
                if not isinstance(event, dict) or (event.get("ph") == "M" and event.get("name") in _OWN_METADATA):
                    continue  # the rank's own process name ("python") gives way to "rank <r>"
                event["pid"] = rank
                if shift_us and isinstance(event.get("ts"), (int, float)):
                    event["ts"] += shift_us
                events.append(event)
        merged: dict[str, Any] = {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"sgpu_magic job": job_id},
        }
        if base_ns is not None:
            merged["baseTimeNanoseconds"] = base_ns
        atomic_write_bytes(target, json.dumps(merged).encode())
    return target
