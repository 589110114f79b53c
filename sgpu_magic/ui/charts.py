"""The panel's metrics charts: the live bqplot chart of its Metrics tab, the inline SVG of an ended job's snapshot,
and the min-max bucketing that bounds both.

Every series (one metric of one rank) is drawn from at most :data:`MAX_CHART_POINTS` points: past that,
:func:`minmax_indices` keeps the first and the last point and, of each of at most ``(MAX_CHART_POINTS - 2) // 2``
equal buckets of the points in between, the lowest and the highest one (in the order logged), so spikes stay
visible where plain decimation would drop them. The series it reads (``Job.metric_arrays()``) hold at most 2000
points already; only the metric on screen is fetched and drawn.

bqplot is imported only when the first metric of a job reaches a panel (:class:`MetricsChart`): a panel without
metrics, and the text view, never import it.
"""

from __future__ import annotations

import html
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

MAX_CHART_POINTS = 1000
"""Points each series of the live chart holds at most (min-max bucketing beyond; module docstring)."""


SVG_POINTS = 300
"""Points each polyline of a snapshot's SVG chart has at most (the snapshot stays a few KB)."""


COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
"""Rank r's line colour is ``COLOURS[r % 10]`` (matplotlib's and bqplot's category10), live and in the snapshot."""


Points = Sequence[tuple[float, float]]


def minmax_indices(values: np.ndarray, max_points: int = MAX_CHART_POINTS) -> np.ndarray:
    """The indices (ascending) of at most ``max_points`` (>= 4) of ``values`` to draw: the first, the last, and of
    each of ``(max_points - 2) // 2`` equal buckets of the rest (sizes differing by one at most) the lowest and the
    highest one (the first of equal values; NaN ignored; a bucket of NaN only gives none); every index when they
    fit. Vectorised: an ``argmin`` and an ``argmax`` over the buckets as rows (tens of µs for 2000 points)."""
    import numpy as np

    n = len(values)
    if n <= max_points:
        return np.arange(n)
    inner = values[1:-1]
    buckets = (max_points - 2) // 2
    size, wider = divmod(len(inner), buckets)  # the first `wider` buckets hold size + 1 points
    nan = np.isnan(inner)
    low, high = np.where(nan, np.inf, inner), np.where(nan, -np.inf, inner)
    found = []
    for start, rows, width in ((0, wider, size + 1), (wider * (size + 1), buckets - wider, size)):
        if not rows:
            continue
        part = slice(start, start + rows * width)
        base = start + np.arange(rows) * width
        lo = base + low[part].reshape(rows, width).argmin(axis=1)
        hi = base + high[part].reshape(rows, width).argmax(axis=1)
        found.append(np.stack([np.minimum(lo, hi), np.maximum(lo, hi)], axis=1).ravel())
    pairs = np.concatenate(found)
    keep = ~nan[pairs]
    keep[1::2] &= pairs[1::2] != pairs[::2]  # a bucket's lowest and highest at one point: once
    return np.concatenate([[0], pairs[keep] + 1, [n - 1]])


def minmax_downsample(points: Points, max_points: int = MAX_CHART_POINTS) -> list[tuple[float, float]]:
    """:func:`minmax_indices` of ``points`` (``[(x, y)]``): at most ``max_points`` of them, in their order; ``points``
    as a list when they fit."""
    if len(points) <= max_points:
        return list(points)
    import numpy as np

    values = np.fromiter((p[1] for p in points), dtype=float, count=len(points))
    return [points[i] for i in minmax_indices(values, max_points).tolist()]


Fetch = Callable[[str], Mapping[int, "tuple[np.ndarray, np.ndarray]"]]
"""The points of one metric per rank as ``(steps, values)`` arrays (:meth:`sgpu_magic.job.handle.Job.metric_arrays`)."""


class MetricsChart:
    """The Metrics tab: a dropdown of the metric names, one bqplot figure of the chosen metric, a line per rank
    (``ranks`` of them, made with the figure: bqplot draws no mark added to a figure that is not on screen) with a
    legend. :meth:`update` (any thread) gives it the names and how to fetch a metric's points; only the metric on
    screen is fetched and drawn, each series min-max bucketed to at most :data:`MAX_CHART_POINTS` points."""

    def __init__(self, ranks: int) -> None:
        import bqplot as bq
        import ipywidgets as w
        import numpy as np

        self._lock = threading.Lock()
        self._fetch: Fetch | None = None
        self.x_scale, self.y_scale = bq.LinearScale(), bq.LinearScale()
        self.lines: dict[int, bq.Lines] = {
            rank: bq.Lines(
                x=np.zeros(0),
                y=np.zeros(0),
                scales={"x": self.x_scale, "y": self.y_scale},
                colors=[COLOURS[rank % len(COLOURS)]],
                labels=[f"rank {rank}"],
                display_legend=True,
            )
            for rank in range(ranks)
        }
        axes = [
            bq.Axis(scale=self.x_scale, label="step", tick_format="d"),
            bq.Axis(scale=self.y_scale, orientation="vertical", tick_format=".3g"),
        ]
        self.figure = bq.Figure(
            marks=list(self.lines.values()),
            axes=axes,
            animation_duration=0,
            legend_location="top-right",
            fig_margin={"top": 20, "bottom": 40, "left": 60, "right": 20},
            layout=w.Layout(height="320px", width="100%"),
        )
        self.picker = w.Dropdown(description="metric", options=[])
        self.widget = w.VBox([self.picker, self.figure])
        self.picker.observe(lambda _: self.draw(), names="value")

    @property
    def metric(self) -> str | None:
        """The metric on screen (the dropdown's value)."""
        return self.picker.value

    def update(self, names: Sequence[str], fetch: Fetch) -> None:
        """Take the metric ``names`` (the dropdown's choices) and ``fetch``, then redraw the metric on screen."""
        with self._lock:
            self._fetch = fetch
        names, before = list(names), self.picker.value
        if list(self.picker.options) != names:
            self.picker.options = names  # keeps the value while it is still a name; the first one at first
            if self.picker.value is None and names:
                self.picker.value = names[0]
        if self.picker.value == before:  # else the dropdown's observer has drawn it
            self.draw()

    def draw(self) -> None:
        """Show the chosen metric: one line per rank (a rank that has not logged it gets an empty line)."""
        import numpy as np

        with self._lock:
            fetch, name = self._fetch, self.picker.value
            by_rank = fetch(name) if fetch is not None and name is not None else {}
            empty = np.zeros(0)
            for rank, line in self.lines.items():
                steps, values = by_rank.get(rank, (empty, empty))
                kept = minmax_indices(values)
                with line.hold_sync():
                    line.x = steps[kept] if len(kept) < len(steps) else steps
                    line.y = values[kept] if len(kept) < len(values) else values


def _finite(points: Points) -> list[tuple[float, float]]:
    return [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]


def svg_chart(name: str, by_rank: dict[int, list[tuple[int, float]]], width: int = 360, height: int = 170) -> str:
    """One metric as an inline SVG (no script, no library): a polyline per rank (at most :data:`SVG_POINTS` points,
    min-max bucketed), the value and step ranges at the axes, the name as title, a legend; non-finite points are
    left out. Renders wherever HTML does (a saved notebook, nbviewer, nbconvert's HTML)."""
    series = {rank: _finite(minmax_downsample(points, SVG_POINTS)) for rank, points in by_rank.items()}
    every = [p for points in series.values() for p in points]
    left, right, top, bottom = 52, 10, 22, 30
    plot_w, plot_h = width - left - right, height - top - bottom
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'style="font:11px sans-serif;margin:2px 8px 2px 0;background:#fff">',
        f'<text x="{left}" y="14" font-weight="bold">{html.escape(name)}</text>',
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#bbb"/>',
    ]
    if every:
        x0, x1 = min(p[0] for p in every), max(p[0] for p in every)
        y0, y1 = min(p[1] for p in every), max(p[1] for p in every)
        sx = plot_w / (x1 - x0) if x1 > x0 else 0.0
        sy = plot_h / (y1 - y0) if y1 > y0 else 0.0
        for rank, points in series.items():
            coords = " ".join(
                f"{left + (x - x0) * sx:.1f},{top + plot_h - ((y - y0) * sy if sy else plot_h / 2):.1f}"
                for x, y in points
            )
            parts.append(
                f'<polyline points="{coords}" fill="none" stroke="{COLOURS[rank % len(COLOURS)]}" stroke-width="1.5"/>'
            )
        parts += [
            f'<text x="{left - 4}" y="{top + 9}" text-anchor="end">{y1:.4g}</text>',
            f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end">{y0:.4g}</text>',
            f'<text x="{left}" y="{height - 16}">{x0:g}</text>',
            f'<text x="{left + plot_w}" y="{height - 16}" text-anchor="end">step {x1:g}</text>',
        ]
    legend = "".join(
        f'<tspan fill="{COLOURS[rank % len(COLOURS)]}">&#9644; rank {rank} </tspan>' for rank in sorted(series)
    )
    parts.append(f'<text x="{left}" y="{height - 3}">{legend}</text></svg>')
    return "".join(parts)
