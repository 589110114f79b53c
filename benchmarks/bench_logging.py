"""Metric 3: heavy logging. 8 ranks print N lines each as fast as they can.

Four runs per round, in one kernel, each through ``fn.distributed(...)``:

- panel: the ipywidgets panel (``widgets=True``), what a Jupyter user gets by default;
- text: the plain ``[rank N]`` text view (``widgets=False``, as ``SGPU_MAGIC_WIDGETS=0``);
- file: the ranks point their stdout at a plain file of their own that nobody follows
  (a reference: what writing a file costs without sgpu_magic's following and view);
- /dev/null: the same ranks with their stdout pointed at /dev/null (the baseline).

Measured: lines lost in the log files (each line is numbered; lost = expected - distinct
well-formed lines found), lines that reached the view, kernel-side CPU seconds (process
CPU time of the kernel, all its threads, around the call), the panel's ``flushes`` counter
and the iopub messages the driver received, per second of the call, and the ranks' own
print-loop time against the /dev/null baseline.
"""

from __future__ import annotations

from .common import Context, Section, Table, Target, fmt, fmt_range, measure, median, panel_cpu_targets, ratio, settle

FLOOD_DEF = '''\
def flood(n, redirect=None):
    import os
    import sys
    import time

    rank = int(os.environ["RANK"])
    if redirect:  # /dev/null, or a plain file that nobody follows
        path = redirect if redirect == os.devnull else f"{{redirect}}.{{rank}}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.close(fd)
    write = sys.stdout.write
    pad = "x" * 80
    t0 = time.perf_counter()
    for i in range(n):
        write(f"r{{rank}} line {{i:07d}} {{pad}}\\n")
    sys.stdout.flush()
    return time.perf_counter() - t0

flood_jobs = {{"panel": distributed(gpus={ranks}, widgets=True, **_KW)(flood),
              "text": distributed(gpus={ranks}, widgets=False, **_KW)(flood)}}
flood_jobs["devnull"] = flood_jobs["file"] = flood_jobs["text"]
flood_jobs["panel_small"] = flood_jobs["panel"]

def _count_lines(path, rank, n):
    """(lines lost, other lines) in one rank's log: every line i of rank r must be there once, whole."""
    seen = bytearray(n)
    prefix = f"r{{rank}} line ".encode()
    expected_len = len(prefix) + 7 + 1 + 80 + 1
    other = 0
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(prefix) and len(line) == expected_len:
                seen[int(line[len(prefix):len(prefix) + 7])] = 1
            else:
                other += 1
    return n - sum(seen), other
'''

FLOOD_CELL = """\
_fn = flood_jobs[{cond!r}]
_h0, _c0, _t0 = _host_cpu(), time.process_time(), time.perf_counter()
_loops = _fn.distributed({lines}, {redirect!r})
_wall, _cpu, _h1 = time.perf_counter() - _t0, time.process_time() - _c0, _host_cpu()
_job = _fn.last_job
_view = getattr(_job, "view", None)
_paths = _job.log_paths if {redirect!r} is None else [f"{{{redirect!r}}}.{{r}}" for r in range({ranks})]
_counts = [_count_lines(p, r, {lines}) for r, p in enumerate(_paths)] if {redirect!r} != os.devnull else []
if {redirect!r} and {redirect!r} != os.devnull:
    for _p in _paths:
        os.unlink(_p)
_emit(wall_s=_wall, cpu_s=_cpu, host_cpu_s=None if _h0 is None or _h1 is None else _h1 - _h0,
      job_elapsed_s=_job.elapsed_s, loop_s=_loops,
      lost=sum(c[0] for c in _counts), other_lines=sum(c[1] for c in _counts),
      flushes=getattr(_view, "flushes", None), view=type(_view).__name__, start_method=_start_method(_job),
      view_lines=[getattr(b, "total_lines", None) for b in getattr(_view, "buffers", [])])
"""

CONDITIONS = ["panel", "panel_small", "text", "file", "devnull"]
SMALL_LINES = 10
"""panel_small: the same panel job printing 10 lines a rank: the panel's fixed cost per job (widgets, final view)."""


def run(ctx: Context) -> Section:
    cfg = ctx.cfg
    ranks, lines = cfg.log_ranks, cfg.log_lines
    timeout = cfg.cell_timeout_s

    def factory():
        k = ctx.sgpu_kernel("logging", warm=True)
        k.run(FLOOD_DEF.format(ranks=ranks), timeout_s=timeout)
        return k

    kernel = None
    samples = {
        c: {
            "wall": [],
            "cpu": [],
            "cpu_pct": [],
            "elapsed": [],
            "loop": [],
            "lost": [],
            "other": [],
            "view_lines": [],
            "flushes_per_s": [],
            "iopub_per_s": [],
            "comm_msgs": [],
            "errors": [],
            "hangs": 0,
            "host_cpu": [],
            "side_cpu_pct": [],
            "start_methods": [],
        }
        for c in CONDITIONS
    }
    for rep in range(cfg.log_reps):
        order = CONDITIONS[rep % len(CONDITIONS) :] + CONDITIONS[: rep % len(CONDITIONS)]
        for cond in order:
            devnull = cond == "devnull"
            redirect = {"devnull": "/dev/null", "file": str(ctx.workdir / "flood")}.get(cond)
            n_lines = SMALL_LINES if cond == "panel_small" else lines
            code = FLOOD_CELL.format(cond=cond, lines=n_lines, redirect=redirect, ranks=ranks)
            kernel, cell, problem = measure(factory, kernel, code, timeout, keep_stdout=False, count_substring="[rank ")
            s = samples[cond]
            if problem is not None:
                if problem.startswith("hang"):
                    s["hangs"] += 1
                else:
                    s["errors"].append(problem)
                print(f"  logging {cond:<8}: {problem[:500]}", flush=True)
                continue
            d = cell.data
            s["wall"].append(d["wall_s"])
            s["cpu"].append(d["cpu_s"])
            s["cpu_pct"].append(100 * d["cpu_s"] / d["wall_s"])
            if d.get("host_cpu_s") is not None:
                s["host_cpu"].append(d["host_cpu_s"])
                s["side_cpu_pct"].append(100 * (d["cpu_s"] + d["host_cpu_s"]) / d["wall_s"])
            s["elapsed"].append(d["job_elapsed_s"])
            s["loop"].append(median(d["loop_s"]))
            if not devnull:
                s["lost"].append(d["lost"])
                s["other"].append(d["other_lines"])
            if cond == "panel_small":
                pass
            elif cond == "panel":
                s["view_lines"].append(sum(x or 0 for x in d["view_lines"]))
                if d["flushes"] is not None:
                    s["flushes_per_s"].append(d["flushes"] / d["wall_s"])
            elif cond == "text":
                s["view_lines"].append(cell.msg_counts["substring"])
            iopub = sum(v for k, v in cell.msg_counts.items() if k not in ("substring", "stdout_lines"))
            s["iopub_per_s"].append(iopub / d["wall_s"])
            s["comm_msgs"].append(cell.msg_counts["comm_msg"])
            s["start_methods"].append(d.get("start_method"))
            print(
                f"  logging {cond:<8}: wall {d['wall_s']:.2f} s, kernel CPU {d['cpu_s']:.2f} s, "
                f"rank loop {median(d['loop_s']):.2f} s, lost {d['lost']}, flushes {d['flushes']}",
                flush=True,
            )
            settle()
    if kernel is not None and not kernel.closed:
        kernel.shutdown()
    section = _report(ranks, lines, samples)
    from . import bench_metrics_chart

    chart = bench_metrics_chart.run(ctx, seconds=5.0 if cfg.quick else 10.0)
    section.tables += chart.tables
    section.targets += chart.targets
    section.raw["metrics_chart"] = chart.raw
    return section


def _report(ranks: int, lines: int, samples: dict) -> Section:
    sec = Section(raw={"ranks": ranks, "lines": lines, "samples": samples})
    base_loop = median(samples["devnull"]["loop"])
    t = Table(
        f"3. Logging: {ranks} ranks x {lines:,} lines each, as fast as they can",
        [
            "rank stdout",
            "lines lost on disk",
            "other lines on disk",
            "lines that reached the view",
            "rank print loop s",
            "loop slowdown vs /dev/null",
            "call wall s",
            "kernel CPU s",
            "kernel CPU % of wall",
            "host CPU s",
            "kernel+host CPU % of wall",
            "panel flushes/s",
            "iopub msgs/s",
            "n",
        ],
    )
    names = {
        "panel": "sgpu_magic log file + panel (widgets)",
        "panel_small": f"same panel job, {SMALL_LINES} lines per rank (fixed cost)",
        "text": "sgpu_magic log file + text view",
        "file": "plain file nobody follows (reference)",
        "devnull": "/dev/null (baseline)",
    }
    expected = ranks * lines
    for cond in CONDITIONS:
        s = samples[cond]
        if cond == "panel_small":
            t.rows.append(
                [
                    names[cond],
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    fmt(median(s["wall"])),
                    fmt(median(s["cpu"])),
                    fmt(median(s["cpu_pct"]), 1, "%"),
                    fmt(median(s["host_cpu"])),
                    "-",
                    "-",
                    fmt(median(s["iopub_per_s"]), 1),
                    len(s["wall"]),
                ]
            )
            continue
        lost = "-" if cond == "devnull" else (str(max(s["lost"])) if s["lost"] else "-")
        other = "-" if cond == "devnull" else (str(max(s["other"])) if s["other"] else "-")
        view = "-" if not s["view_lines"] else f"{min(s['view_lines']):,} of {expected:,}"
        if cond == "panel" and s["view_lines"]:
            view += " (read from each log's tail; all lines counted at the end)"
        t.rows.append(
            [
                names[cond],
                lost,
                other,
                view,
                fmt(median(s["loop"])),
                "1.00x"
                if cond == "devnull"
                else (f"{ratio(median(s['loop']), base_loop):.2f}x" if s["loop"] and base_loop else "-"),
                fmt(median(s["wall"])),
                fmt(median(s["cpu"])),
                fmt(median(s["cpu_pct"]), 1, "%"),
                fmt(median(s["host_cpu"])),
                fmt(median(s["side_cpu_pct"]), 1, "%"),
                fmt(median(s["flushes_per_s"]), 1) if cond == "panel" else "-",
                fmt(median(s["iopub_per_s"]), 1),
                len(s["wall"]),
            ]
        )
        for e in s["errors"]:
            t.notes.append(f"{names[cond]} failed once: {e.splitlines()[0][:300]}")
        if s["hangs"]:
            t.notes.append(f"{names[cond]}: {s['hangs']} hang(s)")
    t.notes += [
        "lines lost on disk: worst repetition, over all ranks; other lines: anything in the logs that is not one "
        "whole numbered line (interleaving, torn writes, warnings).",
        "kernel CPU: time.process_time() of the kernel process (all threads) around fn.distributed(); host CPU: "
        "CPU time of sgpu_magic's launch host process (itself, not the ranks) over the same call; % of wall: of "
        "that call's wall time (one core = 100%).",
        "plain file nobody follows: the ranks point their stdout at their own file outside sgpu_magic's run directory "
        "(no log following, no view): the cost of writing a file at all; its lines are checked too.",
        "panel flushes/s: Panel.flushes (frontend updates) per second of the call; iopub msgs/s: every message the "
        "driver received for the cell (widget comm messages, streams, status) per second.",
        f"rank print loop: median over ranks of the time each rank spent in its print loop (min-max over repetitions: "
        f"panel {fmt_range(samples['panel']['loop'])}, /dev/null {fmt_range(samples['devnull']['loop'])}).",
    ]
    methods = sorted({str(m) for c in CONDITIONS for m in samples[c]["start_methods"]})
    t.notes.append(
        f"sgpu_magic ranks started by: {', '.join(methods) or '-'} (the kernel ran untimed warm-up launches first)."
    )
    sec.tables.append(t)
    all_lost = samples["panel"]["lost"] + samples["text"]["lost"]
    sec.targets.append(
        Target(
            f"lines lost on disk ({ranks} x {lines:,} lines)",
            "0",
            "-" if not all_lost else str(max(all_lost)),
            None if not all_lost else max(all_lost) == 0,
        )
    )
    targets, extra_s, marginal = panel_cpu_targets(
        samples, "logging heavily (panel)", f"panel job of {SMALL_LINES} lines"
    )
    sec.targets += targets
    if extra_s is not None:
        t.notes.append(
            f"kernel CPU for following the logs alone (panel job minus the {SMALL_LINES}-line panel job): "
            f"{extra_s:.3f} s = {marginal:.1f}% of the heavy job's wall time."
        )
    return sec
