"""The per-rank metrics file (``metrics/rank_<r>.jsonl`` of a run directory): the rank's buffered writer and the
kernel's parser.

One JSON array per line, ``[name, value, step, time_ms]`` (``value`` a float, ``NaN`` and ``Infinity`` as Python's
``json`` writes them; ``time_ms`` epoch milliseconds, as MLflow stamps a metric). A rank appends whole lines only,
so a reader that stops at the last newline never sees half a point.

:class:`MetricsWriter` buffers points in memory and writes them in batches: when :data:`BATCH_POINTS` are
waiting, else from a daemon thread every :data:`FLUSH_INTERVAL_S`, and always when the rank's code has ended
(:meth:`MetricsWriter.flush`, called by the worker before the rank reports). A call costs a list append and
the line's encoding (a few microseconds, see ``docs/guide/mlflow.md``), never a write to the disk. Points
can also be handed to a ``forward`` callback (MLflow, in a tracked rank) from the same thread, in batches.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

BATCH_POINTS = 256
"""A rank writes its buffered points as soon as this many wait (one ``write``)."""

FLUSH_INTERVAL_S = 0.2
"""Otherwise the writer's thread writes what waits this often (so a slow loop's points still show live)."""

Point = tuple[str, float, int, int]
"""``(name, value, step, time_ms)``."""

Forward = Callable[[list[tuple[str | None, Point]]], None]
"""Receives ``[(run id or None, point)]`` in batches, from the writer's thread (or the flushing one)."""


_quoted: dict[str, str] = {}
"""Each name as a JSON string (bounded by the names a rank logs)."""

_NOT_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def encode(point: Point) -> bytes:
    """One line of the metrics file for ``point`` (what ``json.dumps`` writes, built about 7 times faster)."""
    name, value, step, time_ms = point
    quoted = _quoted.get(name)
    if quoted is None:
        quoted = _quoted[name] = json.dumps(name)
    number = repr(value) if math.isfinite(value) else _NOT_FINITE.get(value, "NaN")
    return f"[{quoted},{number},{step},{time_ms}]\n".encode()


def decode_lines(data: bytes) -> tuple[list[Point], int]:
    """The points in the complete lines of ``data`` and how many bytes those lines take (the rest is an unfinished
    line). A line that is not a point (a file written by something else) is skipped."""
    end = data.rfind(b"\n") + 1
    if not end:
        return [], 0
    try:  # the whole chunk as one JSON array: one parse instead of one a line
        rows = json.loads(b"[" + data[: end - 1].replace(b"\n", b",") + b"]")
        return [(str(n), float(v), int(s), int(t)) for n, v, s, t in rows], end
    except (ValueError, TypeError):
        pass  # a line that is not a point: parse line by line and skip it
    points: list[Point] = []
    for line in data[:end].splitlines():
        try:
            name, value, step, time_ms = json.loads(line)
            points.append((str(name), float(value), int(step), int(time_ms)))
        except (ValueError, TypeError):
            continue
    return points, end


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
        self._thread: threading.Thread | None = None
        self._forward_lock = threading.Lock()
        self.forward: Forward | None = None
        self.dropped = 0
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        """A forked child (a DataLoader worker) starts with nothing buffered and no thread; it appends to the file."""
        self._lock = threading.Lock()
        self._forward_lock = threading.Lock()
        self._lines, self._forwarded, self._thread, self._fd = [], [], None, None

    def use(self, path: Path | None) -> None:
        """Write what waits to the current file, then send later points to ``path`` (``None``: keep none)."""
        self.flush()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
            self._path, self._fd = path, None

    def record(self, name: str, value: float, step: int, time_ms: int, run_id: str | None, forward: bool) -> None:
        """Buffer one point (and, with ``forward``, hand it to :attr:`forward` for run ``run_id``)."""
        line = encode((name, value, step, time_ms))
        with self._lock:
            if self._path is None:
                self.dropped += 1
                return
            self._lines.append(line)
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

    def _write_locked(self) -> None:
        """Append the buffered lines (one ``write``); the caller holds the lock."""
        lines, self._lines = self._lines, []
        if not lines or self._path is None:
            return
        if self._fd is None:
            self._path.parent.mkdir(mode=0o700, exist_ok=True)
            self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        os.write(self._fd, b"".join(lines))

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


def _complain(text: str) -> None:
    try:
        print(f"sgpu_magic: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


WRITER = MetricsWriter()
"""This process's writer: :func:`sgpu_magic.runtime.log_metric` and the MLflow guard record into it, the worker
points it at the job's file and flushes it."""
