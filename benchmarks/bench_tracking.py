"""Per-step MLflow logging from the ranks (issue 17): the seed MLP at batch size 1, with and without
``mlflow.log_metric`` at every step, in tracked jobs of one warm kernel.

The same code (:func:`benchmarks.mlp_train.mlp_train`, 2 CPU ranks, DDP) runs as
``distributed(gpus=2)(mlp_train).distributed(epochs, 1, 1, log_metrics)`` with tracking on (each call is
an MLflow run in a sqlite store in the scratch directory): without logging, and with
``mlflow.log_metric(f"loss_rank{rank}", loss, step=step)`` at every step, which sgpu_magic makes MLflow's
async logging by default. Each rank times its loop (one untimed warm-up epoch first); after each logged
job the kernel counts the points in the run (every step of every rank, warm-up included, must be there).
One shorter run with ``MLFLOW_ENABLE_ASYNC_LOGGING=false`` in the kernel (the synchronous logging of
before) is shown for reference. Target: logged epoch time within 1.3x of the unlogged one.
"""

from __future__ import annotations

from .bench_train import mlp_cell_source
from .common import Context, Section, Table, Target, fmt, fmt_range, fmt_ratio, measure, median, ratio, settle

DEF = """\
tracked_mlp = distributed(gpus=2)(mlp_train)
from mlflow import MlflowClient as _Client

def _points(job, world):
    c = _Client()
    return [len(c.get_metric_history(job.mlflow_run_id, f"loss_rank{r}")) for r in range(world)]
"""

CELL = """\
_env_before = os.environ.get("MLFLOW_ENABLE_ASYNC_LOGGING")
if {sync!r}:
    os.environ["MLFLOW_ENABLE_ASYNC_LOGGING"] = "false"  # as the user would: %env MLFLOW_ENABLE_ASYNC_LOGGING=false
try:
    _t0 = time.perf_counter()
    _res = tracked_mlp.distributed({epochs}, 1, 1, {log}, {max_steps})
    _dt = time.perf_counter() - _t0
finally:
    if _env_before is None:
        os.environ.pop("MLFLOW_ENABLE_ASYNC_LOGGING", None)
    else:
        os.environ["MLFLOW_ENABLE_ASYNC_LOGGING"] = _env_before
_emit(kernel_s=_dt, ranks=_res, points=_points(tracked_mlp.last_job, 2) if {log} else None)
"""

MODES = {
    "no logging": {"log": False, "sync": False},
    "per-step log_metric (async, default)": {"log": True, "sync": False},
}
SYNC_MODE = "per-step log_metric, synchronous (MLFLOW_ENABLE_ASYNC_LOGGING=false)"
SYNC_STEPS = 300
STEPS_PER_EPOCH = 2500  # per rank: 5000 samples over 2 ranks at batch size 1


def _one(ctx: Context, kernel, factory, mode: str, epochs: int, max_steps, samples: dict):
    opts = MODES.get(mode) or {"log": True, "sync": True}
    code = CELL.format(epochs=epochs, max_steps=max_steps, **opts)
    kernel, cell, problem = measure(factory, kernel, code, ctx.cfg.cell_timeout_s * 3)
    s = samples[mode]
    if problem is not None:
        s["errors"].append(problem)
        print(f"  tracking {mode}: {problem[:300]}", flush=True)
        return kernel
    ranks = cell.data["ranks"]
    loop_s = max(r["loop_s"] for r in ranks)
    s["steps_per_s"].append(min(r["steps_per_s"] for r in ranks))
    scale = STEPS_PER_EPOCH / max_steps if max_steps else 1  # a short run: projected to a full epoch
    s["epoch_s"].append(loop_s / epochs * scale)
    s["kernel_s"].append(cell.data["kernel_s"])
    s["cpu_epoch_s"].append(max(r["loop_cpu_s"] for r in ranks) / epochs * scale)
    if cell.data["points"] is not None:
        s["logged"].append(sum(r["logged"] for r in ranks))
        s["in_run"].append(sum(cell.data["points"]))
    print(
        f"  tracking {mode}: {s['steps_per_s'][-1]:.1f} steps/s, epoch {s['epoch_s'][-1]:.2f} s"
        + (f", points {s['in_run'][-1]}/{s['logged'][-1]}" if cell.data["points"] is not None else ""),
        flush=True,
    )
    return kernel


def run(ctx: Context) -> Section:
    cfg = ctx.cfg
    reps, epochs = (max(2, cfg.train_reps), 1) if cfg.quick else (cfg.train_reps, 2)  # --reps N sets train_reps
    store = f"sqlite:///{ctx.workdir}/tracking-mlflow.db"

    def factory():
        k = ctx.sgpu_kernel("tracking", warm=True, MLFLOW_TRACKING_URI=store)
        k.run(mlp_cell_source(), timeout_s=cfg.cell_timeout_s)
        k.run(DEF, timeout_s=cfg.cell_timeout_s)
        return k

    samples = {
        m: {
            "steps_per_s": [],
            "epoch_s": [],
            "kernel_s": [],
            "cpu_epoch_s": [],
            "logged": [],
            "in_run": [],
            "errors": [],
        }
        for m in [*MODES, SYNC_MODE]
    }
    kernel = None
    for rep in range(reps):
        for mode in list(MODES) if rep % 2 == 0 else list(MODES)[::-1]:
            kernel = _one(ctx, kernel, factory, mode, epochs, None, samples)
            settle()
    kernel = _one(ctx, kernel, factory, SYNC_MODE, 1, SYNC_STEPS, samples)
    if kernel is not None and not kernel.closed:
        kernel.shutdown()
    return _section(samples, epochs, reps)


def _section(samples: dict, epochs: int, reps: int) -> Section:
    base = median(samples["no logging"]["epoch_s"])
    t = Table(
        "Tracking: per-step mlflow.log_metric from 2 CPU ranks, seed MLP at batch size 1 (tracked jobs)",
        [
            "mode",
            "steps/s (median)",
            "steps/s min-max",
            "epoch s (median)",
            "epoch s min-max",
            "CPU s per epoch and rank",
            "points in the run / logged",
            "n",
            "epoch time vs no logging",
            "CPU vs no logging",
        ],
    )
    base_rate = median(samples["no logging"]["steps_per_s"])
    for mode, s in samples.items():
        points = (
            "-"
            if not s["logged"]
            else (
                f"{min(s['in_run'])}/{s['logged'][0]}"
                if len(set(s["logged"])) == 1
                else f"{sum(s['in_run'])}/{sum(s['logged'])}"
            )
        )
        # time per step against no logging: from epoch times, or (the short synchronous run) from steps/s
        slower = ratio(median(s["epoch_s"]), base) if mode != SYNC_MODE else ratio(base_rate, median(s["steps_per_s"]))
        t.rows.append(
            [
                mode,
                fmt(median(s["steps_per_s"]), 1),
                fmt_range(s["steps_per_s"], 1),
                fmt(median(s["epoch_s"])),
                fmt_range(s["epoch_s"]),
                fmt(median(s["cpu_epoch_s"])),
                points,
                len(s["epoch_s"]),
                fmt_ratio(slower),
                fmt_ratio(ratio(median(s["cpu_epoch_s"]), median(samples["no logging"]["cpu_epoch_s"]))),
            ]
        )
        for e in s["errors"]:
            t.notes.append(f"{mode} failed once: {e.splitlines()[0][:300]}")
    t.notes.append(
        f"{reps} repetition(s), order alternated; 1 untimed warm-up epoch, then {epochs} timed epoch(s) of "
        f"2500 steps per rank (5000 samples, batch size 1, 2 ranks); steps/s of the slower rank. The "
        f"synchronous row runs {SYNC_STEPS} steps per epoch once (at its rate a full epoch takes "
        f"minutes): its epoch time is projected from its steps/s, and its ratio is the steps/s of no "
        f"logging over its own. "
        f"'points in the run' counts both ranks' metric history after the job (warm-up steps included). "
        f"Tracking is on for every job of this table (the other sections turn it off). CPU s: the slower "
        f"rank's process CPU time over the timed loop (all its threads, MLflow's writer among them) per "
        f"epoch, which a busy machine changes less than wall time."
    )
    sec = Section(tables=[t], raw={"samples": samples})
    logged = samples["per-step log_metric (async, default)"]
    r = ratio(median(logged["epoch_s"]), base)
    lost = any(i != n for i, n in zip(logged["in_run"], logged["logged"]))
    sec.targets.append(
        Target(
            "per-step log_metric epoch time vs without (batch 1, 2 CPU ranks)",
            "<= 1.3x",
            fmt_ratio(r),
            None if r is None else r <= 1.3,
        )
    )
    sec.targets.append(
        Target(
            "every logged point in the MLflow run",
            "all",
            "-" if not logged["logged"] else ("points missing" if lost else "all"),
            None if not logged["logged"] else not lost,
        )
    )
    return sec
