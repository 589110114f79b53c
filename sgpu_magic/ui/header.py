"""The panel's header as HTML: the job, its state badge, devices, elapsed time and MLflow link, what its state
does not say, and the per-rank table (CPU, RSS, last metric values). Shared by the live panel and its snapshot."""

from __future__ import annotations

import html

from sgpu_magic.job.handle import Job
from sgpu_magic.job.state import JobState
from sgpu_magic.status import RankUsage
from sgpu_magic.ui.text import MAX_METRIC_LINES, restart_reason, straggler_lines, stuck_line

_BADGE_COLOURS = {
    JobState.PENDING: "#777",
    JobState.STARTING: "#1f6feb",
    JobState.RUNNING: "#1f6feb",
    JobState.SUCCEEDED: "#1a7f37",
    JobState.FAILED: "#cf222e",
    JobState.CANCELLED: "#bf8700",
    JobState.TIMED_OUT: "#bf8700",
}


_TEXT_STYLE = "line-height: 1.4"
"""For the panel's HTML text: ipywidgets gives an HTML widget its one-line height as line height, which
spreads text that wraps or has a second line."""


_NO_GPU = ' <small title="this machine has no GPU: the ranks run on CPU with gloo">(no GPU found)</small>'
"""After the device kind in the header of a job on a machine without GPUs (the cell says so once per kernel)."""


def header_html(job: Job, state: JobState, error: BaseException | None = None) -> str:
    """The panel's header (and its snapshot's): job, state badge, devices, elapsed time, MLflow link, then what the
    state does not say (the error's first line, notes, activity, the hang detector's report, restarts) and the per-rank table (:func:`metrics_html`)."""
    colour = _BADGE_COLOURS[state]
    # whole seconds while running, so the clock alone changes the header at most once a second
    digits = 1 if state.final else 0
    elapsed = f"{job.elapsed_s:.{digits}f} s" if job.elapsed_s is not None else "&ndash;"
    url = getattr(job, "run_url", None)
    link = f' &middot; <a href="{html.escape(url)}" target="_blank">MLflow run</a>' if url else ""
    badge = f'<span style="background:{colour};color:white;border-radius:4px;padding:1px 6px">{state.label}</span>'
    problem = f"<br><code>{html.escape(str(error).splitlines()[0])}</code>" if error else ""
    if state is JobState.PENDING and job.pending_reason:
        problem = f"<br><small>{html.escape(job.pending_reason)}</small>"
    if state.final:
        problem += "".join(f"<br><small>{html.escape(note)}</small>" for note in job.notes)
    elif job.activity:
        problem += f"<br><b>{html.escape(job.activity)}</b>"
    stuck = stuck_line(job) if not state.final else ""
    if stuck:  # the hang detector's badge (launch host): cleared when a rank writes again
        badge += ' <span style="background:#e67e22;color:white;border-radius:4px;padding:1px 6px">possibly stuck</span>'
        problem += f"<br><small>{html.escape(stuck)}</small>"
    for line in straggler_lines(job):  # the straggler check (job/steps.py): named while it holds
        badge += ' <span style="background:#8250df;color:white;border-radius:4px;padding:1px 6px">straggler</span>'
        problem += f"<br><small>{html.escape(line)}</small>"
    attempt = job.attempt if job.spec.max_restarts else 1
    if attempt > 1:
        badge += f" &middot; attempt {attempt} of {job.spec.max_restarts + 1}"
        if not error and not (state is JobState.PENDING and job.pending_reason):  # (an error says more)
            problem += f"<br><small>{html.escape(restart_reason(job))}; all ranks restarted</small>"
    problem += metrics_html(job.last_metrics(), dict(sorted(job.status.usage.items())), state.final)
    return (
        f'<div style="{_TEXT_STYLE}">'
        f"<b>sgpu_magic {'job' if job.title.startswith('job ') else html.escape(job.title)}</b> "
        f"<code>{job.job_id}</code> {badge} &middot; "
        f"{html.escape(job.plan.device_kind)}{_NO_GPU if job.plan.no_gpu else ''} &middot; "
        f"{elapsed}{link}{problem}</div>"
    )


def _usage_rows(usage: dict[int, RankUsage], final: bool) -> dict[str, dict[int, str]]:
    """The header table's first rows: each rank's CPU % and RSS as the launch host last sampled them; once the job
    has ended, each rank's peak RSS."""
    if not usage:
        return {}
    if final:
        return {"<i>peak RSS MiB</i>": {r: f"{u.peak_rss_bytes / 2**20:.0f}" for r, u in usage.items()}}
    return {
        "<i>cpu %</i>": {r: f"{u.cpu_percent:.0f}" for r, u in usage.items()},
        "<i>RSS MiB</i>": {r: f"{u.rss_bytes / 2**20:.0f}" for r, u in usage.items()},
    }


def metrics_html(
    last: dict[str, dict[int, float]], usage: dict[int, RankUsage] | None = None, final: bool = False
) -> str:
    """The header's table, one column per rank: each rank's CPU % and RSS (``usage``, sampled about once a second;
    once the job has ended (``final``), its peak RSS), then one row per metric with its last value (at most
    ``MAX_METRIC_LINES``); ``""`` when there is neither. Plain HTML in the header widget: no widget (comm) of its
    own."""
    table = _usage_rows(usage or {}, final)
    for name, by_rank in list(last.items())[:MAX_METRIC_LINES]:
        table[f"<code>{html.escape(name)}</code>"] = {r: f"{v:.4g}" for r, v in by_rank.items()}
    if not table:
        return ""
    ranks = sorted({rank for by_rank in table.values() for rank in by_rank})
    cell = 'style="padding:0 8px;text-align:right"'
    head = "".join(f"<th {cell}>rank {r}</th>" for r in ranks)
    rows = "".join(
        f'<tr><td style="padding:0 8px">{label}</td>'
        + "".join(f"<td {cell}>{by_rank.get(r, '')}</td>" for r in ranks)
        + "</tr>"
        for label, by_rank in table.items()
    )
    more = len(last) - MAX_METRIC_LINES
    extra = f"<br><small>... and {more} more: <code>job.metrics()</code></small>" if more > 0 else ""
    return (
        f'<br><small><table style="border-collapse:collapse"><tr><th {cell}></th>{head}</tr>'
        f"{rows}</table>{extra}</small>"
    )
