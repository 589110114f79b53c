"""The static snapshot an ended job's panel leaves in its cell: plain HTML (and a text form) that renders without a
kernel (a reopened notebook, nbviewer, GitHub, nbconvert's HTML), in place of the widgets, which are closed so the
kernel frees them."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

from sgpu_magic.ui.charts import svg_chart

SNAPSHOT_LINES = 20
"""Last lines of each rank that a snapshot keeps (every line stays in the rank's log file)."""


SNAPSHOT_CHARTS = 12
"""Metrics a snapshot draws at most (the header's table and ``job.metrics()`` have every one)."""


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def plain(markup: str) -> str:
    """The text of an HTML fragment: ``<br>`` and table rows become line ends, tags go, entities are decoded."""
    text = re.sub(r"<br>|</tr>", "\n", markup)
    text = re.sub(r"</t[dh]>", " ", text)
    return html.unescape(re.sub(r"<[^>]+>", "", text))


@dataclass(frozen=True)
class RankTail:
    """One rank in a snapshot: its footer (state, earlier lines, log path; HTML) and its last lines."""

    rank: int
    footer_html: str
    text: str
    open: bool = False


def snapshot_bundle(
    header_html: str, ranks: list[RankTail], metrics: dict[str, dict[int, list[tuple[int, float]]]], summary: str
) -> dict[str, str]:
    """The snapshot as a display bundle: ``{"text/html": ..., "text/plain": ...}``.

    ``header_html``: the panel's final header; ``ranks``: each rank's tail (a rank ``open`` shows its lines, the
    others in a closed ``<details>``); ``metrics``: ``Job.metrics()`` (an SVG chart per metric, at most
    ``SNAPSHOT_CHARTS``); ``summary``: the job's summary line (log folder, MLflow run), ``""`` when the cell has it
    already. The header is in a ``<div class="sgpu-magic-header">``, the whole in ``<div class="sgpu-magic-snapshot">``.
    """
    charts = "".join(svg_chart(name, by_rank) for name, by_rank in list(metrics.items())[:SNAPSHOT_CHARTS])
    more = len(metrics) - SNAPSHOT_CHARTS
    if more > 0:
        charts += f"<br><small>... and {more} more metrics: <code>job.metrics()</code></small>"
    tails = "".join(
        f"<details{' open' if tail.open else ''}><summary><b>rank {tail.rank}</b> {tail.footer_html}</summary>"
        f'<pre style="margin:2px 0 4px 0;max-height:24em;overflow:auto;font-size:12px">'
        f"{html.escape(_ANSI.sub('', tail.text))}</pre></details>"
        for tail in ranks
    )
    body = (
        f'<div class="sgpu-magic-snapshot" style="border:1px solid #d0d7de;border-radius:6px;padding:6px 10px">'
        f'<div class="sgpu-magic-header">{header_html}</div>{f"<div>{charts}</div>" if charts else ""}{tails}'
        f"{f'<small>{html.escape(summary)}</small>' if summary else ''}</div>"
    )
    text = [plain(header_html)]
    text += [f"--- rank {tail.rank}: {plain(tail.footer_html)}\n{_ANSI.sub('', tail.text).rstrip()}" for tail in ranks]
    return {"text/html": body, "text/plain": "\n".join(text + ([summary] if summary else []))}


def close_tree(widget) -> int:
    """Close ``widget`` and every widget it holds (children, layouts, styles, a figure's marks, axes and scales),
    so the kernel drops their comms and state; returns how many were closed."""
    from ipywidgets import Widget

    seen: set[int] = set()
    stack = [widget]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for name in current.keys:
            value = getattr(current, name, None)
            items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else [value]
            stack.extend(item for item in items if isinstance(item, Widget))
        current.close()
    return len(seen)
