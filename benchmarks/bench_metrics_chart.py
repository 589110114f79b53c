"""Metric 3b (issue 21): the panel's Metrics tab following 8 ranks that each log 1,000 metric points a second.

One warm kernel runs ``fn.distributed(...)`` of a function whose ranks call ``sgpu_magic.runtime.log_metric``
at 1,000 points a second each for ``seconds`` seconds (paced: point ``i`` waits until ``i / 1000`` s after the
start), with the panel (``widgets=True``: the chart follows the job) off screen (the panel opens on rank 0's tab:
the chart is redrawn every 5 s) and on screen (the cell selects the Metrics tab as soon as it appears, as a user
watching it would: the chart is redrawn at the panel's rate, up to 5 times a second), and, for reference, with the
text view.

Measured: kernel CPU time (``time.process_time()`` of the kernel, all threads, around the call) as a share of
the call's wall time; points lost (each rank's metrics file must hold every step once, and ``job.metrics()``
each rank's last step). (That the chart is fed is a test's: ``tests/kernel/test_kernel_panel.py``.)
Run by ``python -m benchmarks.run --only logging`` after the print flood.
"""

from __future__ import annotations

from .common import Context, Section, Table, Target, fmt, measure, median, panel_cpu_targets, settle

RATE_PER_S = 1000

METRICS_DEF = '''\
import mlflow  # waits for the kernel's background import of MLflow (a one-time cost, not the chart's)
import bqplot  # imported by a kernel's first chart: a one-time cost too (about 0.3 s of CPU), not following's

def paced_metrics(seconds, rate):
    import os
    import time
    from sgpu_magic import runtime

    rank = int(os.environ["RANK"])
    t0 = time.perf_counter()
    for i in range(int(seconds * rate)):
        ahead = i / rate - (time.perf_counter() - t0)
        if ahead > 0:
            time.sleep(ahead)
        runtime.log_metric("loss", 1.0 / (i + 1) + rank, step=i)
    return time.perf_counter() - t0

metric_jobs = {{"panel": distributed(gpus={ranks}, widgets=True, **_KW)(paced_metrics),
               "text": distributed(gpus={ranks}, widgets=False, **_KW)(paced_metrics)}}
metric_jobs["panel_small"] = metric_jobs["panel_on_screen"] = metric_jobs["panel"]

def _call(fn, cond, ranks, *args):
    """fn.distributed(*args); for "panel_on_screen", the Metrics tab selected as soon as the panel has it."""
    if cond != "panel_on_screen":
        return fn.distributed(*args)
    job = fn.submit(*args)
    while len(job.view.tabs.children) <= ranks and not job.done():
        time.sleep(0.02)
    if len(job.view.tabs.children) > ranks:
        job.view.tabs.selected_index = ranks
    return job.result()

def _points_on_disk(job, n):
    """(points lost, points duplicated) over every rank's metrics file: each step 0..n-1 once."""
    from sgpu_magic._util.metrics import read_points
    lost = dup = 0
    for rank in range(job.world_size):
        seen = bytearray(n)
        for _name, _value, step, _time_ms in read_points(job.run_dir / "metrics" / f"rank_{{rank}}.bin"):
            dup += seen[step]
            seen[step] = 1
        lost += n - sum(seen)
    return lost, dup
'''

METRICS_CELL = """\
_fn = metric_jobs[{cond!r}]
_c0, _t0 = time.process_time(), time.perf_counter()
_loops = _call(_fn, {cond!r}, {ranks}, {seconds}, {rate})
_wall, _cpu = time.perf_counter() - _t0, time.process_time() - _c0
_job = _fn.last_job
_lost, _dup = _points_on_disk(_job, {n})
_last = {{r: pts[-1][0] for r, pts in _job.metrics("loss")["loss"].items()}}
_emit(wall_s=_wall, cpu_s=_cpu, job_elapsed_s=_job.elapsed_s, loop_s=_loops, lost=_lost, dup=_dup,
      last_ok=all(v == {n} - 1 for v in _last.values()) and len(_last) == {ranks}, view=type(_job.view).__name__)
"""

CONDITIONS = ["panel", "panel_on_screen", "panel_small", "text"]
SMALL_SECONDS = 0.01
"""panel_small: the same panel job logging 10 points a rank: the panel's fixed cost per job (widgets, snapshot)."""


def run(ctx: Context, seconds: float = 10.0) -> Section:
    cfg = ctx.cfg
    ranks, timeout = cfg.log_ranks, cfg.cell_timeout_s
    n = int(seconds * RATE_PER_S)

    def factory():
        k = ctx.sgpu_kernel("metrics_chart", warm=True)
        k.run(METRICS_DEF.format(ranks=ranks), timeout_s=timeout)
        return k

    kernel = None
    samples: dict[str, dict[str, list]] = {
        c: {"cpu_pct": [], "cpu": [], "wall": [], "lost": [], "rows": []} for c in CONDITIONS
    }
    for rep in range(cfg.log_reps):
        for cond in CONDITIONS[rep % len(CONDITIONS) :] + CONDITIONS[: rep % len(CONDITIONS)]:
            secs = SMALL_SECONDS if cond == "panel_small" else seconds
            code = METRICS_CELL.format(cond=cond, seconds=secs, rate=RATE_PER_S, n=int(secs * RATE_PER_S), ranks=ranks)
            kernel, cell, problem = measure(factory, kernel, code, timeout, keep_stdout=False)
            if problem is not None:
                print(f"  metrics {cond:<5}: {problem[:500]}", flush=True)
                continue
            d = cell.data
            s = samples[cond]
            s["cpu_pct"].append(100 * d["cpu_s"] / d["wall_s"])
            s["cpu"].append(d["cpu_s"])
            s["wall"].append(d["wall_s"])
            s["lost"].append(d["lost"] + d["dup"] + (0 if d["last_ok"] else 1))
            s["rows"].append(d)
            print(
                f"  metrics {cond:<5}: wall {d['wall_s']:.2f} s, kernel CPU {d['cpu_s']:.2f} s "
                f"({100 * d['cpu_s'] / d['wall_s']:.1f}%), lost {d['lost']}, dup {d['dup']}, last ok {d['last_ok']}, "
                f"view {d['view']}",
                flush=True,
            )
            settle()
    if kernel is not None and not kernel.closed:
        kernel.shutdown()
    return _report(ranks, seconds, n, samples)


def _report(ranks: int, seconds: float, n: int, samples: dict) -> Section:
    sec = Section(raw={"ranks": ranks, "seconds": seconds, "samples": samples})
    t = Table(
        f"3b. Metrics: {ranks} ranks x {RATE_PER_S:,} points/s each for {seconds:g} s ({n:,} points a rank)",
        ["view", "call wall s", "kernel CPU % of wall", "points lost or doubled", "n"],
    )
    for cond in CONDITIONS:
        s = samples[cond]
        t.rows.append(
            [
                {
                    "panel": "panel with the Metrics chart, rank 0's tab on screen",
                    "panel_on_screen": "panel with the Metrics chart on screen",
                    "panel_small": f"same panel job, {int(SMALL_SECONDS * RATE_PER_S)} points a rank (fixed cost)",
                    "text": "text view (last-value table)",
                }[cond],
                fmt(median(s["wall"])),
                fmt(median(s["cpu_pct"]), 1, "%"),
                str(max(s["lost"])) if s["lost"] else "-",
                len(s["wall"]),
            ]
        )
    t.notes.append(
        "kernel CPU: time.process_time() of the kernel (all threads) around fn.distributed(); points lost or "
        "doubled: every rank's metrics file checked for each step once, plus job.metrics()'s last step per rank."
    )
    sec.tables.append(t)
    targets, _, _ = panel_cpu_targets(
        samples,
        f"the chart follows {ranks} ranks x {RATE_PER_S:,} metrics/s",
        "panel job of 10 points a rank",
    )
    sec.targets += targets
    targets, _, _ = panel_cpu_targets(
        samples,
        f"the chart on screen follows {ranks} ranks x {RATE_PER_S:,} metrics/s",
        "panel job of 10 points a rank",
        key="panel_on_screen",
    )
    sec.targets += targets
    lost = samples["panel"]["lost"] + samples["panel_on_screen"]["lost"] + samples["text"]["lost"]
    sec.targets.append(
        Target("metric points lost", "0", str(max(lost)) if lost else "-", None if not lost else max(lost) == 0)
    )
    return sec
