"""torch's NCCL flight recorder in GPU jobs: switched on for the ranks, and its dumps read back into one line.

torch records each rank's last collectives in a ring buffer (``TORCH_NCCL_TRACE_BUFFER_SIZE`` entries) and, when
a collective times out in NCCL's watchdog (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``), writes the buffer as a pickle to
``<TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>`` (torch's format: ``{"version", "pg_config", "entries": [...]}``, each
entry with ``profiling_name`` such as ``nccl:all_reduce``, ``collective_seq_id`` and ``state``; see
``torch/distributed/flight_recorder``). sgpu_magic points that file into the run directory
(``flight_recorder/rank_<r>``, private) unless the kernel's environment sets these variables, and a failed or
timed-out job's error then says which collective each rank entered last and where their sequence numbers differ.

gloo (CPU jobs) records too (``TORCH_FR_BUFFER_SIZE``) but never dumps on a timeout, so CPU jobs get no summary.
"""

from __future__ import annotations

import pickle
from pathlib import Path

from sgpu_magic.rundir import RunDir, make_private_dir, read_private

TRACE_BUFFER_SIZE = 2000
"""Entries each rank's flight recorder keeps (``TORCH_NCCL_TRACE_BUFFER_SIZE``)."""


def flight_recorder_env(rd: RunDir, backend: str, env: dict[str, str]) -> dict[str, str]:
    """The variables that switch the NCCL flight recorder on for a job on ``backend`` (``{}`` unless ``"nccl"``),
    those the kernel's environment ``env`` already sets left out; makes the private dump folder."""
    if backend != "nccl":
        return {}
    make_private_dir(rd.flight_recorder_dir)
    prefix = str(rd.flight_recorder_dir / "rank_")
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(TRACE_BUFFER_SIZE),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
    }
    return {k: v for k, v in wanted.items() if k not in env}


def read_dumps(folder: Path) -> dict[int, dict]:
    """``{rank: dump}`` from ``folder/rank_<r>`` (private files only); a dump that cannot be read is left out."""
    dumps = {}
    for path in sorted(folder.glob("rank_*")) if folder.is_dir() else []:
        suffix = path.name[len("rank_") :]
        if not suffix.isdigit():
            continue
        try:
            dump = pickle.loads(read_private(path, folder.parent))
        except (OSError, pickle.UnpicklingError, EOFError, ValueError):
            continue
        if isinstance(dump, dict) and isinstance(dump.get("entries"), list):
            dumps[int(suffix)] = dump
    return dumps


def _last(entries: list[dict]) -> dict | None:
    """The last collective a rank entered: its newest entry that did not complete, else its newest."""
    collectives = [e for e in entries if not e.get("is_p2p")] or entries
    open_ = [e for e in collectives if e.get("state") != "completed"]
    chosen = open_ or collectives
    return chosen[-1] if chosen else None


def summary(dumps: dict[int, dict]) -> str:
    """``rank 0: nccl:all_reduce #42 (started); rank 1: nccl:all_reduce #41 (completed). Collective sequence
    numbers differ: rank 1 is at #41, rank 0 at #42`` (``""`` without dumps)."""
    parts, seqs = [], {}
    for rank, dump in sorted(dumps.items()):
        last = _last(dump["entries"])
        if last is None:
            parts.append(f"rank {rank}: no collective recorded")
            continue
        seqs[rank] = int(last.get("collective_seq_id", 0))
        parts.append(f"rank {rank}: {last.get('profiling_name', '?')} #{seqs[rank]} ({last.get('state', '?')})")
    if not parts:
        return ""
    text = "; ".join(parts)
    if len(set(seqs.values())) > 1:
        by_seq: dict[int, list[int]] = {}
        for rank, seq in seqs.items():
            by_seq.setdefault(seq, []).append(rank)
        ranked = sorted(by_seq.items())
        text += ". Collective sequence numbers differ: " + ", ".join(
            f"{'ranks' if len(r) > 1 else 'rank'} {', '.join(map(str, r))} at #{seq}" for seq, r in ranked
        )
    return text


def flight_recorder_note(rd: RunDir) -> str:
    """`` NCCL flight recorder (<dir>): rank 0: ...`` for an error message, ``""`` when no rank dumped."""
    text = summary(read_dumps(rd.flight_recorder_dir))
    return f" NCCL flight recorder ({rd.flight_recorder_dir}): {text}." if text else ""
