"""sgpu_magic benchmark suite: one command, one table per metric, ratios against the peers.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.run            # full: 1/2/4/8 ranks, 5 repetitions (15-35 min on 2 cores)
    .venv/bin/python -m benchmarks.run --quick    # 1 and 8 ranks, 1-3 repetitions, fewer lines (3-6 min)
    .venv/bin/python -m benchmarks.run --gpu      # adds the GPU section (skipped with a note without CUDA)
    .venv/bin/python -m benchmarks.run --only launch,train --reps 3 --json out.json
    .venv/bin/python -m benchmarks.run --only soak --soak 200   # 200 warm 8-rank launches, hangs counted
    .venv/bin/python -m benchmarks.run --only tracking        # per-step mlflow.log_metric vs none (batch 1)
    .venv/bin/python -m benchmarks.run --only teardown          # 500 warm launches of the DDP tutorial's main()
    .venv/bin/python -m benchmarks.run --only session           # live sessions vs ipyparallel (pip install ipyparallel)
    .venv/bin/python -m benchmarks.run --only responsive        # seconds to a refusal, a failure, a timeout, an interrupt
    .venv/bin/python -m benchmarks.run --only panel_memory      # kernel RSS per ended job with the panel (500 jobs)
    .venv/bin/python -m benchmarks.run --only session_soak      # 5,000 + 500 cells in one session: RSS, latency
    .venv/bin/python -m benchmarks.run --only metrics_chart     # kernel CPU while the chart follows 8 ranks x 1,000 metrics/s

Every measurement runs in real Jupyter kernels driven through jupyter_client, as a notebook
user would; all rows of a table come from the same run; values are medians of the
repetitions. Each metric's table is printed when it is done, then the machine and the
targets with met / NOT met. accelerate (for notebook_launcher) is optional: without it
that peer is skipped with a note. Not a test: nothing here asserts on time.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # `python benchmarks/run.py` as well as `python -m benchmarks.run`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.run import main as _main

    sys.exit(_main())

import argparse
import json
import os
import shutil
import tempfile
import time

SECTIONS = [
    "launch",
    "soak",
    "teardown",
    "train",
    "tracking",
    "logging",
    "metrics_chart",
    "capture",
    "session",
    "responsive",
    "panel_memory",
    "session_soak",
    "gpu",
]
OPT_IN = {"gpu", "soak", "teardown", "panel_memory", "metrics_chart", "session_soak"}
"""Sections run only when asked for (--gpu, --soak N, --only teardown, panel_memory, session_soak); ``metrics_chart`` is
also the second half of ``logging`` (``--only metrics_chart`` runs it alone)."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="1 and 8 ranks, 1-3 repetitions, 10,000 lines per rank (3-4 min idle, ~6 under load)",
    )
    p.add_argument(
        "--gpu", action="store_true", help="also run the GPU section (nccl); skipped with a note without CUDA"
    )
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--reps", type=int, default=None, help="repetitions for every metric (overrides the mode's)")
    p.add_argument(
        "--soak",
        type=int,
        default=0,
        metavar="N",
        help="also run N consecutive warm launches of 8 ranks and count hangs (the target asks for 200); "
        "--only soak --soak 200 runs just that",
    )
    p.add_argument(
        "--teardown",
        type=int,
        default=None,
        metavar="N",
        help="warm launches of the teardown soak (--only teardown; default 500, 100 with --quick)",
    )
    p.add_argument(
        "--panel-jobs",
        type=int,
        default=None,
        metavar="N",
        help="jobs of the panel memory section (--only panel_memory; default 500, 200 with --quick)",
    )
    p.add_argument(
        "--soak-cells",
        type=int,
        default=None,
        metavar="N",
        help="trivial cells of the session soak (--only session_soak; default 5000, 1000 with --quick), then N/10 "
        "training cells",
    )
    p.add_argument("--json", type=Path, default=None, help="write every raw sample here")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (kernel logs, run dirs)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    only = set(SECTIONS) - OPT_IN if args.only is None else {s.strip() for s in args.only.split(",") if s.strip()}
    if args.gpu:
        only.add("gpu")
    if args.soak:
        only.add("soak")
    elif "soak" in only:
        print("--only soak needs --soak N (e.g. --soak 200)", file=sys.stderr)
        return 2
    unknown = only - set(SECTIONS)
    if unknown:
        print(f"unknown section(s): {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2

    from . import (
        bench_capture,
        bench_launch,
        bench_logging,
        bench_metrics_chart,
        bench_panel_memory,
        bench_responsive,
        bench_session,
        bench_session_soak,
        bench_teardown,
        bench_tracking,
        bench_train,
    )
    from .common import Config, Context, Table, machine_description

    cfg = Config.make(args.quick, args.gpu, only, args.soak, args.reps)
    if args.teardown is not None:
        cfg.teardown_launches = args.teardown
    if args.panel_jobs is not None:
        cfg.panel_jobs = args.panel_jobs
    if args.soak_cells is not None:
        cfg.session_soak_cells = args.soak_cells
    workdir = Path(tempfile.mkdtemp(prefix="sgpu-bench-"))
    ctx = Context(cfg, workdir)
    machine = machine_description()
    mode = "quick" if cfg.quick else "full"
    print(
        f"sgpu_magic benchmarks ({mode}): sections {', '.join(s for s in SECTIONS if s in only)}; scratch {workdir}",
        flush=True,
    )
    t_start = time.perf_counter()
    runners = {
        "launch": bench_launch.run,
        "soak": bench_launch.run_soak,
        "teardown": bench_teardown.run,
        "train": bench_train.run,
        "tracking": bench_tracking.run,
        "logging": bench_logging.run,
        "metrics_chart": bench_metrics_chart.run,
        "capture": bench_capture.run,
        "session": bench_session.run,
        "responsive": bench_responsive.run,
        "panel_memory": bench_panel_memory.run,
        "session_soak": bench_session_soak.run,
        "gpu": bench_train.run_gpu,
    }
    sections, raw = [], {}
    try:
        for name in SECTIONS:
            if name not in only:
                continue
            print(f"\n== {name} ==", flush=True)
            t0 = time.perf_counter()
            try:
                sec = runners[name](ctx)
            except Exception as exc:  # noqa: BLE001 - one broken section must not lose the others
                import traceback

                traceback.print_exc()
                from .common import Section

                sec = Section(tables=[Table(f"{name}: FAILED", ["error"], [[f"{type(exc).__name__}: {exc}"[:500]]])])
            sections.append(sec)
            raw[name] = sec.raw
            print(f"({name}: {time.perf_counter() - t0:.0f} s)\n", flush=True)
            for t in sec.tables:
                print(t.render() + "\n", flush=True)
    finally:
        ctx.close()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    machine["duration_s"] = round(time.perf_counter() - t_start)
    tracking = ctx.facts.get("tracking", {})
    print("\n" + "=" * 100)
    print(f"## Results ({mode} mode, {machine['date']}, {machine['duration_s']} s)\n")
    print(
        f"Machine: {machine['cores']} cores ({machine['cpu']}), {machine['ram_gib']} GiB RAM, {machine['os']}; "
        f"Python {machine['python']}, torch {machine['torch']} (CUDA: {machine['cuda']}), accelerate "
        f"{machine['accelerate']}, ipykernel {machine['ipykernel']}, jupyter_client {machine['jupyter_client']}; "
        f"sgpu_magic at {machine['sgpu_magic_commit']}{' + uncommitted changes' if machine['sgpu_magic_dirty'] else ''}. "
        f"Load average (1/5/15 min) at start {machine['loadavg_start']}, at end {machine['loadavg_end']}."
    )
    if tracking:
        print(
            f"MLflow tracking: {'on (the default) in the rows marked MLflow on and in the tracking table, off (mlflow=False / --no-mlflow) elsewhere' if tracking.get('mlflow_kw') else 'no option to turn it off at this commit: measured with the default'}"
            f"{'' if tracking.get('mlflow_kw') or not tracking.get('tracking_sink_does_something') else ' (tracking is ON)'}. "
            f"Kernels run with SGPU_MAGIC_WIDGETS=0 except the panel row of the logging table."
        )
    warmups = ctx.facts.get("warmups", [])
    if warmups:
        print(
            "Warm-up of the kernels kept for several launches (untimed 2-rank launches until the host left its cold "
            "path): "
            + "; ".join(
                f"{w['kernel']}: {w['launches']} launch(es) in {w['s']} s, last by {w['last']}" for w in warmups
            )
            + "."
        )
    for sec in sections:
        for t in sec.tables:
            print("\n" + t.render())
    targets = [t for sec in sections for t in sec.targets]
    if targets:
        tt = Table(
            "Targets (from the issues that set them)",
            ["target", "wanted", "measured", "verdict"],
            [[t.name, t.target, t.measured, t.verdict] for t in targets],
        )
        print("\n" + tt.render())
        met = sum(t.met is True for t in targets)
        print(
            f"\n{met} of {len(targets)} targets met"
            f"{'; ' + str(sum(t.met is None for t in targets)) + ' not measured' if any(t.met is None for t in targets) else ''}."
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine,
                    "mode": mode,
                    "tracking": tracking,
                    "warmups": warmups,
                    "sections": raw,
                    "targets": [t.__dict__ for t in targets],
                },
                indent=1,
                default=str,
            )
        )
        print(f"raw samples: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
