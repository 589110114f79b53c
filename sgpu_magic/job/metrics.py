"""The kernel's side of rank metrics: each rank's metrics file read by byte offset (as
:class:`~sgpu_magic.job.follow.LogPump` reads the logs), decoded a chunk at a time with numpy, into bounded
series, behind :meth:`sgpu_magic.job.handle.Job.metrics`.

Memory is bounded per series (one metric of one rank): past :data:`MAX_POINTS` points a series keeps every
second point it holds and from then on every ``stride``-th point logged (1, 2, 4, ... as it grows), so it always
holds an evenly spaced sample of at most ``MAX_POINTS`` points, the first point logged, and the last one.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, TYPE_CHECKING

from sgpu_magic._util.metrics import (
    RECORD_SIZE,
    STEP_COLLECTIVE,
    STEP_TIME,
    decode_names,
    decode_records,
    names_file,
    read_new,
)

if TYPE_CHECKING:
    import numpy as np

MAX_POINTS = 2000
"""Points a series holds at most (plus its last point); beyond that it is downsampled (module docstring)."""

INITIAL_POINTS = 16
"""A new series' buffers hold this many points; they double as it grows (a job's many short series stay small)."""

RECENT_STEPS = 50
"""Of the step metrics (``step_time_s``, ``step_collective_s``) each rank's last this many points are kept whole, for
the straggler check (:mod:`sgpu_magic.job.steps`), however the series is downsampled."""

_STEP_METRICS = (STEP_TIME, STEP_COLLECTIVE)

READ_INTERVAL_S = 0.2
"""How often a running job's metrics files are read (the panel shows them at most 5 times a second)."""


class Series:
    """One metric of one rank: an evenly downsampled sample of its points with its first and last point.

    The points held are those logged at the multiples of :attr:`stride` (counting from 0, the first point), in two
    numpy buffers (steps, values) that grow to ``MAX_POINTS + 1`` entries at most (32 KB for both)."""

    __slots__ = ("_steps", "_values", "held", "stride", "seen", "last")

    def __init__(self) -> None:
        import numpy as np

        self._steps = np.empty(INITIAL_POINTS, dtype=np.int64)
        self._values = np.empty(INITIAL_POINTS, dtype=np.float64)
        self.held = 0
        self.stride = 1
        self.seen = 0
        self.last: tuple[int, float] | None = None

    def add(self, step: int, value: float) -> None:
        """Take one more point."""
        import numpy as np

        self.add_many(np.array([step], dtype=np.int64), np.array([value], dtype=np.float64))

    def add_many(self, steps: np.ndarray, values: np.ndarray) -> None:
        """Take the points ``zip(steps, values)`` (numpy arrays, in the order logged): one slice per stride."""
        n = len(steps)
        if not n:
            return
        i = 0
        while i < n:
            first = i + (-(self.seen + i)) % self.stride  # the first point at or after i the stride keeps
            if first >= n:
                break
            room = MAX_POINTS + 1 - self.held  # points it takes until the next halving
            end = min(n, first + room * self.stride)
            kept = slice(first, end, self.stride)
            count = len(range(first, end, self.stride))
            if self.held + count > len(self._steps):
                self._grow(self.held + count)
            self._steps[self.held : self.held + count] = steps[kept]
            self._values[self.held : self.held + count] = values[kept]
            self.held += count
            i = end
            if self.held > MAX_POINTS:  # keep the points logged at multiples of the doubled stride
                half = (self.held + 1) // 2
                self._steps[:half] = self._steps[: self.held : 2].copy()
                self._values[:half] = self._values[: self.held : 2].copy()
                self.held, self.stride = half, self.stride * 2
        self.seen += n
        self.last = (int(steps[-1]), float(values[-1]))

    def _grow(self, needed: int) -> None:
        """Make the buffers hold at least ``needed`` points (doubling, at most ``MAX_POINTS + 1``)."""
        import numpy as np

        size = min(MAX_POINTS + 1, max(needed, 2 * len(self._steps)))
        for name in ("_steps", "_values"):
            old = getattr(self, name)
            new = np.empty(size, dtype=old.dtype)
            new[: self.held] = old[: self.held]
            setattr(self, name, new)

    def _last_extra(self) -> bool:
        """Whether the last point logged is not one the stride keeps (it is then shown after the held ones)."""
        return self.last is not None and (self.seen - 1) % self.stride != 0

    @property
    def points(self) -> list[tuple[int, float]]:
        """The held points, ``[(step, value)]``."""
        return list(zip(self._steps[: self.held].tolist(), self._values[: self.held].tolist()))

    def values(self) -> list[tuple[int, float]]:
        """The held points in the order logged, ending with the last point logged."""
        points = self.points
        if self._last_extra():
            points.append(self.last)  # type: ignore[arg-type] # not None: _last_extra checked it
        return points

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`values` as two new numpy arrays: steps (float64) and values (float64)."""
        import numpy as np

        extra = self._last_extra()
        steps = np.empty(self.held + extra, dtype=np.float64)
        values = np.empty(self.held + extra, dtype=np.float64)
        steps[: self.held], values[: self.held] = self._steps[: self.held], self._values[: self.held]
        if extra:
            steps[-1], values[-1] = self.last  # type: ignore[misc] # not None: _last_extra checked it
        return steps, values


class MetricsPump:
    """Reads the ranks' metrics files (``metrics/rank_<r>.bin`` and their name tables) into :class:`Series`;
    thread-safe."""

    def __init__(self, paths: list[Path]) -> None:
        self._paths = paths
        self._files: list[IO[bytes] | None] = [None] * len(paths)
        self._offsets = [0] * len(paths)
        self._names: list[dict[int, str]] = [{} for _ in paths]
        self._names_read = [0] * len(paths)
        self._series: dict[str, dict[int, Series]] = {}
        self._recent: dict[str, dict[int, deque[tuple[int, float]]]] = {name: {} for name in _STEP_METRICS}
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()  # one reader of the files at a time (the follower, a caller of metrics())
        self._read_at = 0.0

    def pump(self, final: bool = False) -> bool:
        """Read what the ranks appended (at most every ``READ_INTERVAL_S`` unless ``final``; ``final`` also closes
        the files); whether any point was new."""
        with self._read_lock:
            now = time.monotonic()
            if not final and now - self._read_at < READ_INTERVAL_S:
                return False
            self._read_at = now
            new = False
            for rank in range(len(self._paths)):
                new = self._read(rank, final) or new
                if final and self._files[rank] is not None:
                    self._files[rank].close()  # type: ignore[union-attr] # checked just before
                    self._files[rank] = None
            return new

    def _read(self, rank: int, final: bool) -> bool:
        f = self._files[rank]
        if f is None:
            try:
                f = self._files[rank] = open(self._paths[rank], "rb")  # noqa: SIM115 - kept open until final
            except FileNotFoundError:  # the rank has logged nothing yet
                return False
        if os.fstat(f.fileno()).st_size <= self._offsets[rank]:
            return False
        f.seek(self._offsets[rank])
        records, used = decode_records(f.read())
        if not used:
            return False
        known = self._known(rank, records)
        if known < len(records) and not final:  # a name not in the table yet: read those records again next time
            records, used = records[:known], known * RECORD_SIZE
            if not known:
                return False
        self._offsets[rank] += used
        self._add(rank, records)
        return True

    def _known(self, rank: int, records: np.ndarray) -> int:
        """How many of ``records``, from the first, have names in the rank's name table (read again if needed)."""
        names = self._names[rank]
        ids = records["name"]
        unknown = [i for i in set(ids.tolist()) if i not in names]
        if unknown:
            self._read_names(rank)
            unknown = [i for i in unknown if i not in names]
        if not unknown:
            return len(records)
        import numpy as np

        return int(np.flatnonzero(np.isin(ids, unknown))[0])

    def _read_names(self, rank: int) -> None:
        names, used = decode_names(read_new(names_file(self._paths[rank]), self._names_read[rank]))
        self._names_read[rank] += used
        self._names[rank].update(names)

    def _add(self, rank: int, records: np.ndarray) -> None:
        import numpy as np

        ids = records["name"]
        if (ids == ids[0]).all():  # the usual chunk: one metric
            groups = [(int(ids[0]), records)]
        else:
            unique, which = np.unique(ids, return_inverse=True)
            groups = [(int(ident), records[which == k]) for k, ident in enumerate(unique.tolist())]
        names = self._names[rank]
        with self._lock:
            for ident, chunk in groups:
                name = names.get(ident)
                if name is None:  # not in the table: not written by sgpu_magic's writer
                    continue
                by_rank = self._series.get(name)
                if by_rank is None:
                    by_rank = self._series[name] = {}
                series = by_rank.get(rank)
                if series is None:
                    series = by_rank[rank] = Series()
                series.add_many(chunk["step"], chunk["value"])
                recent = self._recent.get(name)
                if recent is not None:
                    window = recent.setdefault(rank, deque(maxlen=RECENT_STEPS))
                    window.extend(zip(chunk["step"][-RECENT_STEPS:].tolist(), chunk["value"][-RECENT_STEPS:].tolist()))

    def snapshot(self, name: str | None = None) -> dict[str, dict[int, list[tuple[int, float]]]]:
        """``{name: {rank: [(step, value)]}}`` of every metric (or only ``name``), names and ranks sorted."""
        with self._lock:
            names = sorted(self._series) if name is None else [name] if name in self._series else []
            return {n: {r: s.values() for r, s in sorted(self._series[n].items())} for n in names}

    def arrays(self, name: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """``{rank: (steps, values)}`` of metric ``name`` as numpy arrays (:meth:`Series.arrays`), ranks sorted;
        ``{}`` for a name never logged."""
        with self._lock:
            return {r: s.arrays() for r, s in sorted(self._series.get(name, {}).items())}

    def last_values(self) -> dict[str, dict[int, float]]:
        """``{name: {rank: last value}}``, names and ranks sorted."""
        with self._lock:
            return {
                n: {r: s.last[1] for r, s in sorted(by_rank.items()) if s.last is not None}
                for n, by_rank in sorted(self._series.items())
            }

    def recent_steps(self) -> dict[int, list[tuple[int, float, float]]]:
        """Each rank's last :data:`RECENT_STEPS` steps as ``{rank: [(step, wall s, s in collectives)]}`` (the steps
        both metrics have reached the kernel for), ranks sorted; ``{}`` before any step."""
        with self._lock:
            walls, collectives = self._recent[STEP_TIME], self._recent[STEP_COLLECTIVE]
            joined = {}
            for rank in sorted(walls):
                inside = dict(collectives.get(rank, ()))
                joined[rank] = [(step, wall, inside[step]) for step, wall in walls[rank] if step in inside]
            return joined
