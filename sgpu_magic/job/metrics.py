"""The kernel's side of rank metrics: each rank's metrics file read by byte offset (as :class:`~sgpu_magic.job.follow.LogPump`
reads the logs) into bounded series, behind :meth:`sgpu_magic.job.handle.Job.metrics`.

Memory is bounded per series (one metric of one rank): past :data:`MAX_POINTS` points a series keeps every
second point it holds and from then on every ``stride``-th point logged (1, 2, 4, ... as it grows), so it always
holds an evenly spaced sample of at most ``MAX_POINTS`` points, the first point logged, and the last one.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import IO

from sgpu_magic._util.metrics import Point, decode_lines

MAX_POINTS = 2000
"""Points a series holds at most (plus its last point); beyond that it is downsampled (module docstring)."""

READ_INTERVAL_S = 0.2
"""How often a running job's metrics files are read (the panel shows them at most 5 times a second)."""


class Series:
    """One metric of one rank: an evenly downsampled ``[(step, value)]`` with its first and last point."""

    __slots__ = ("points", "stride", "seen", "last")

    def __init__(self) -> None:
        self.points: list[tuple[int, float]] = []
        self.stride = 1
        self.seen = 0
        self.last: tuple[int, float] | None = None

    def add(self, step: int, value: float) -> None:
        point = (step, value)
        if self.seen % self.stride == 0:
            self.points.append(point)
            if len(self.points) > MAX_POINTS:
                self.points = self.points[::2]  # the points logged at multiples of the doubled stride
                self.stride *= 2
        self.seen += 1
        self.last = point

    def values(self) -> list[tuple[int, float]]:
        """The held points in the order logged, ending with the last point logged."""
        points = list(self.points)
        if self.last is not None and (not points or points[-1] is not self.last):
            points.append(self.last)
        return points


class MetricsPump:
    """Reads the ranks' metrics files (``metrics/rank_<r>.jsonl``) into :class:`Series`; thread-safe."""

    def __init__(self, paths: list[Path]) -> None:
        self._paths = paths
        self._files: list[IO[bytes] | None] = [None] * len(paths)
        self._offsets = [0] * len(paths)
        self._series: dict[str, dict[int, Series]] = {}
        self._lock = threading.Lock()
        self._read_at = 0.0

    def pump(self, final: bool = False) -> bool:
        """Read what the ranks appended (at most every ``READ_INTERVAL_S`` unless ``final``; ``final`` also closes
        the files); whether any point was new."""
        now = time.monotonic()
        if not final and now - self._read_at < READ_INTERVAL_S:
            return False
        self._read_at = now
        new = False
        for rank in range(len(self._paths)):
            new = self._read(rank) or new
            if final and self._files[rank] is not None:
                self._files[rank].close()  # type: ignore[union-attr] # checked just before
                self._files[rank] = None
        return new

    def _read(self, rank: int) -> bool:
        f = self._files[rank]
        if f is None:
            try:
                f = self._files[rank] = open(self._paths[rank], "rb")  # noqa: SIM115 - kept open until final
            except FileNotFoundError:  # the rank has logged nothing yet
                return False
        if os.fstat(f.fileno()).st_size <= self._offsets[rank]:
            return False
        f.seek(self._offsets[rank])
        points, used = decode_lines(f.read())
        self._offsets[rank] += used
        self._add(rank, points)
        return bool(points)

    def _add(self, rank: int, points: list[Point]) -> None:
        with self._lock:
            for name, value, step, _time_ms in points:
                by_rank = self._series.get(name)
                if by_rank is None:
                    by_rank = self._series[name] = {}
                series = by_rank.get(rank)
                if series is None:
                    series = by_rank[rank] = Series()
                series.add(step, value)

    def snapshot(self, name: str | None = None) -> dict[str, dict[int, list[tuple[int, float]]]]:
        """``{name: {rank: [(step, value)]}}`` of every metric (or only ``name``), names and ranks sorted."""
        with self._lock:
            names = sorted(self._series) if name is None else [name] if name in self._series else []
            return {n: {r: s.values() for r, s in sorted(self._series[n].items())} for n in names}

    def last_values(self) -> dict[str, dict[int, float]]:
        """``{name: {rank: last value}}``, names and ranks sorted."""
        with self._lock:
            return {
                n: {r: s.last[1] for r, s in sorted(by_rank.items()) if s.last is not None}
                for n, by_rank in sorted(self._series.items())
            }
