"""The per-rank metrics file (``metrics/rank_<r>.bin`` of a run directory, with its name table
``rank_<r>.names``): the rank's buffered writer and the kernel's decoder.

A point is one fixed-size little-endian record of :data:`RECORD_SIZE` (32) bytes, numpy dtype :func:`dtype`:
``(name_id int64, value float64, step int64, time_ms int64)`` (``time_ms`` epoch milliseconds, as MLflow stamps
a metric; ``NaN`` and infinities as IEEE doubles). ``name_id`` is :func:`name_id` of the metric's name, a hash,
so a forked DataLoader worker appending to its parent's file agrees with it on every id. The name table holds one
JSON line ``[name_id, name]`` per name; a process appends a name's line before it writes the first record that
uses it, so a reader that reads the records first and then the table knows every id it read.

A process appends whole records only (each ``write`` a multiple of 32 bytes, ``O_APPEND``), so a reader that
stops at the last multiple of 32 bytes never sees half a point, and decodes a chunk with one
``numpy.frombuffer`` (with the kernel's downsampling about 10 times less CPU per point than the JSON lines this
file used to hold, so the kernel follows 8 ranks x 1,000 points/s with the panel's chart at a few % of a core).

:class:`MetricsWriter` buffers points in memory and writes them in batches: when :data:`BATCH_POINTS` are
waiting, else from a daemon thread every :data:`FLUSH_INTERVAL_S`, and always when the rank's code has ended
(:meth:`MetricsWriter.flush`, called by the worker before the rank reports). A call costs a list append and
the record's packing (about a microsecond, see ``docs/guide/mlflow.md``), never a write to the disk. Points
can also be handed to a ``forward`` callback (MLflow, in a tracked rank) from the same thread, in batches.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

BATCH_POINTS = 256
"""A rank writes its buffered points as soon as this many wait (one ``write``)."""

FLUSH_INTERVAL_S = 0.2
"""Otherwise the writer's thread writes what waits this often (so a slow loop's points still show live)."""

RECORD = struct.Struct("<qdqq")
"""One point's record: name id, value, step, time_ms (little-endian)."""

RECORD_SIZE = RECORD.size
"""Bytes per point (32)."""

STEP_TIME = "step_time_s"
"""The metric of each step's wall time, in seconds (:mod:`sgpu_magic.rank.steps`; MLflow gets it as
``step_time_s/rank_<r>``)."""

STEP_COLLECTIVE = "step_collective_s"
"""The metric of the time each step spent inside collectives, in seconds (at most its wall time)."""

Point = tuple[str, float, int, int]
"""``(name, value, step, time_ms)``."""

Forward = Callable[[list[tuple[str | None, Point]]], None]
"""Receives ``[(run id or None, point)]`` in batches, from the writer's thread (or the flushing one)."""


_ids: dict[str, int] = {}
"""Each name's id (bounded by the names a process logs)."""


def name_id(name: str) -> int:
    """The record id of metric ``name``: the first 8 bytes of its BLAKE2b hash as a signed little-endian int64."""
    ident = _ids.get(name)
    if ident is None:
        digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        ident = _ids[name] = int.from_bytes(digest, "little", signed=True)
    return ident


def names_file(path: Path) -> Path:
    """The name table beside the metrics file ``path`` (``rank_<r>.bin`` -> ``rank_<r>.names``)."""
    return path.with_suffix(".names")


def encode(point: Point) -> bytes:
    """The record of ``point`` (its name goes to the name table: :func:`name_line`)."""
    name, value, step, time_ms = point
    return RECORD.pack(name_id(name), value, step, time_ms)


def name_line(name: str) -> bytes:
    """The name table's line for ``name``."""
    return (json.dumps([name_id(name), name]) + "\n").encode()


_dtype: list[np.dtype] = []


def dtype() -> np.dtype:
    """The records' numpy dtype (fields ``name``, ``value``, ``step``, ``time_ms``)."""
    if not _dtype:
        import numpy as np

        _dtype.append(np.dtype([("name", "<i8"), ("value", "<f8"), ("step", "<i8"), ("time_ms", "<i8")]))
    return _dtype[0]


def decode_records(data: bytes) -> tuple[np.ndarray, int]:
    """The records in the whole records of ``data`` (a structured array of :func:`dtype`, a view of ``data``) and
    how many bytes they take (the rest is a record not yet whole)."""
    import numpy as np

    used = len(data) - len(data) % RECORD_SIZE
    return np.frombuffer(data, dtype=dtype(), count=used // RECORD_SIZE), used


def decode_names(data: bytes) -> tuple[dict[int, str], int]:
    """The ``{name_id: name}`` in the complete lines of a name table's ``data`` and how many bytes those lines take.
    A line that is not ``[int, str]`` is skipped."""
    end = data.rfind(b"\n") + 1
    names: dict[int, str] = {}
    for line in data[:end].splitlines():
        try:
            ident, name = json.loads(line)
        except (ValueError, TypeError):  # not JSON, or not a pair
            continue
        if isinstance(ident, int) and isinstance(name, str):
            names[ident] = name
    return names, end


def read_new(path: Path, offset: int, limit: int = 8 << 20) -> bytes:
    """What the metrics file or name table ``path`` holds from byte ``offset`` (at most ``limit`` bytes), cut to whole
    records (a ``.bin`` file) or whole lines (a name table); ``b""`` when there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit)
    except FileNotFoundError:
        return b""
    if path.suffix == ".names":
        return data[: data.rfind(b"\n") + 1]
    return data[: len(data) - len(data) % RECORD_SIZE]


def append(path: Path, data: bytes) -> None:
    """Append ``data`` (whole records or whole lines) to the metrics file or name table ``path`` (0600, made in a 0700
    folder if missing): how a copy of another node's file is kept up to date."""
    fd = _open_append(path)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_points(path: Path) -> list[Point]:
    """Every point of the metrics file ``path`` in the order written (records whose name is not in the table
    are left out): for tests, benchmarks and tools; the kernel reads the files incrementally
    (:class:`sgpu_magic.job.metrics.MetricsPump`)."""
    names, _ = decode_names(names_file(path).read_bytes()) if names_file(path).exists() else ({}, 0)
    records, _ = decode_records(path.read_bytes())
    return [(names[ident], value, step, time_ms) for ident, value, step, time_ms in records.tolist() if ident in names]


class MetricsWriter:
    """Buffers one process's points and appends them to its metrics file (see the module docstring).

    ``use(path)`` points it at a file (the worker does, per job or per session cell); until then, and after
    ``use(None)``, points are counted in :attr:`dropped` and not kept. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: list[bytes] = []
        self._forwarded: list[tuple[str | None, Point]] = []
        self._path: Path | None = None
        self._fd: int | None = None
        self._names_fd: int | None = None
        self._named: set[int] = set()
        self._thread: threading.Thread | None = None
        self._forward_lock = threading.Lock()
        self.forward: Forward | None = None
        self.dropped = 0
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        """A forked child (a DataLoader worker) starts with nothing buffered and no thread; it appends to the file."""
        self._lock = threading.Lock()
        self._forward_lock = threading.Lock()
        self._lines, self._forwarded, self._thread, self._fd, self._names_fd = [], [], None, None, None
        # _named stays: the parent wrote those names' lines to the table this child appends to

    def use(self, path: Path | None) -> None:
        """Write what waits to the current file, then send later points to ``path`` (``None``: keep none)."""
        self.flush()
        with self._lock:
            for fd in (self._fd, self._names_fd):
                if fd is not None:
                    os.close(fd)
            self._path, self._fd, self._names_fd, self._named = path, None, None, set()

    def record(self, name: str, value: float, step: int, time_ms: int, run_id: str | None, forward: bool) -> None:
        """Buffer one point (and, with ``forward``, hand it to :attr:`forward` for run ``run_id``)."""
        ident = name_id(name)
        record = RECORD.pack(ident, value, step, time_ms)
        with self._lock:
            if self._path is None:
                self.dropped += 1
                return
            if ident not in self._named:
                self._write_name_locked(ident, name)
            self._lines.append(record)
            if forward and self.forward is not None:
                self._forwarded.append((run_id, (name, value, step, time_ms)))
            full = len(self._lines) >= BATCH_POINTS
            if full:
                self._write_locked()
        if self._thread is None:
            self._start_thread()

    def _start_thread(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="sgpu_magic metrics", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            try:
                self.flush()
            except Exception as exc:  # noqa: BLE001 - the rank's code goes on; its log says why points are missing
                _complain(f"metrics could not be written ({type(exc).__name__}: {exc})")

    def _write_name_locked(self, ident: int, name: str) -> None:
        """Append ``name``'s line to the name table now, before any record that uses it; the caller holds the
        lock and has checked :attr:`_path`."""
        if self._names_fd is None:
            self._names_fd = _open_append(names_file(self._path))  # type: ignore[arg-type] # checked by the caller
        os.write(self._names_fd, name_line(name))
        self._named.add(ident)

    def _write_locked(self) -> None:
        """Append the buffered records (one ``write``); the caller holds the lock."""
        records, self._lines = self._lines, []
        if not records or self._path is None:
            return
        if self._fd is None:
            self._fd = _open_append(self._path)
        os.write(self._fd, b"".join(records))

    def flush(self) -> None:
        """Write every buffered point to the file, then hand the points to forward to :attr:`forward` (which
        may take a while: MLflow's first import); returns once both are done."""
        with self._lock:
            self._write_locked()
        with self._forward_lock:  # taken under it: a flush that returns has seen every earlier batch forwarded
            with self._lock:
                forwarded, self._forwarded = self._forwarded, []
            forward = self.forward
            if forwarded and forward is not None:
                forward(forwarded)


def _open_append(path: Path) -> int:
    """``path`` opened to append (0600, in a 0700 folder made if missing)."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)


def _complain(text: str) -> None:
    try:
        print(f"sgpu_magic: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


WRITER = MetricsWriter()
"""This process's writer: :func:`sgpu_magic.runtime.log_metric` and the MLflow guard record into it, the worker
points it at the job's file and flushes it."""
