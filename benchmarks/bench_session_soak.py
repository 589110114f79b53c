"""Session soak (issue 33): one live session runs thousands of cells; the kernel's and the ranks' memory and the
cell latency must stay flat.

Per tracking setting (MLflow on, the default: one run for the session; and off), one fresh kernel starts one
2-rank session and runs ``--soak-cells`` (default 5,000; 1,000 with --quick) trivial cells (``sess.run_cell("r")``,
each returns the rank) then a tenth as many training cells (one forward, backward and SGD step of a small DDP MLP on
gloo, a 64 x 32 batch). In-kernel wall time of every cell is kept. After each batch of cells the kernel runs
``gc.collect()`` and reports its RSS and each rank's (psutil), and the length of its job list (``jobs()``).

Reported per setting: KiB of kernel RSS per ended cell after the first 100 trivial cells (a session keeps its last
100 cells' handles, so this is the steady-state growth), MiB the ranks grew over the whole soak, and p50 / p99 cell
latency of the first and the last 500 trivial cells. Issue 33's targets: <= 1 KiB per ended cell after the first 100,
ranks flat, p99 of the last 500 within 1.5x of the first 500. Before it: 553 KiB per cell over the first 300 cells,
22 KiB after 150 (each ended cell was a kernel job). Not a test: nothing here asserts on time.
"""

from __future__ import annotations

from .common import Context, Section, Table, Target, fmt, fmt_ratio, ratio, slope

SESSION_DEF = """\
import gc, psutil, time as _time
from sgpu_magic import Session
from sgpu_magic.job.handle import jobs as _jobs
from sgpu_magic.testing import wait_for_tracking

_sess = Session(gpus=2, name="soak", **({{}} if {mlflow} else {{"mlflow": False}}))
_sess.run_cell('''
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
r = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 32), torch.randn(64, 1)
''')
wait_for_tracking(300)  # the kernel imports mlflow in the background (for the runs it may make): not measured
_ranks = [psutil.Process(p) for p in _sess.pids.values()]
_lat = {{"trivial": [], "train": []}}

def _sample(cells):
    gc.collect()
    _emit(cells=cells, rss_kib=psutil.Process().memory_info().rss / 1024,
          ranks_rss_mib=[p.memory_info().rss / 2**20 for p in _ranks], listed=len(_jobs()))
_sample(0)
"""

TRIVIAL = """\
for _ in range({n}):
    _t0 = _time.perf_counter(); _sess.run_cell("r"); _lat["trivial"].append(_time.perf_counter() - _t0)
_sample({done})
"""

TRAIN = """\
for _ in range({n}):
    _t0 = _time.perf_counter()
    _sess.run_cell("opt.zero_grad()\\nloss = torch.nn.functional.mse_loss(model(x), y)\\nloss.backward()\\nopt.step()")
    _lat["train"].append(_time.perf_counter() - _t0)
_sample({done})
"""

END = """\
_emit(latencies=_lat)
_sess.stop()
"""

BATCH = 250
KEPT = 100
WINDOW = 500
TARGET_KIB_PER_CELL = 1.0
TARGET_P99_RATIO = 1.5


def run(ctx: Context) -> Section:
    sec = Section(raw={})
    n = ctx.cfg.session_soak_cells
    rows = []
    for mlflow in (True, False):
        kernel = ctx.sgpu_kernel(f"session_soak_{'mlflow' if mlflow else 'untracked'}")
        samples = [kernel.run(SESSION_DEF.format(mlflow=mlflow), timeout_s=ctx.cfg.cell_timeout_s).data]
        done = 0
        while done < n:
            batch = min(KEPT if done == 0 else BATCH, n - done)  # a sample at KEPT cells: where the slope starts
            done += batch
            samples.append(kernel.run(TRIVIAL.format(n=batch, done=done), timeout_s=3600).data)
            print(
                f"  session_soak (mlflow {'on' if mlflow else 'off'}): {done}/{n} cells, "
                f"kernel RSS {samples[-1]['rss_kib'] / 1024:.1f} MiB, {samples[-1]['listed']} jobs listed",
                flush=True,
            )
        train_n, trained = n // 10, 0
        while trained < train_n:
            batch = min(BATCH, train_n - trained)
            trained += batch
            samples.append(kernel.run(TRAIN.format(n=batch, done=n + trained), timeout_s=3600).data)
        latencies = kernel.run(END, timeout_s=ctx.cfg.cell_timeout_s).data["latencies"]
        kernel.shutdown()
        sec.raw["mlflow" if mlflow else "untracked"] = {"samples": samples, "latencies": latencies}
        rows.append(_row(mlflow, samples, latencies, n, train_n))
    t = Table(
        f"Session soak: {n} trivial cells then {n // 10} DDP training cells in one 2-rank session, per tracking setting",
        [
            "MLflow",
            f"kernel KiB per ended cell (trivial, after {KEPT})",
            "kernel KiB per training cell",
            "ranks' RSS growth (MiB, whole soak)",
            f"trivial p50 / p99, first {WINDOW} (ms)",
            f"trivial p50 / p99, last {WINDOW} (ms)",
            "p99 last / first",
            "train p50 / p99 (ms)",
            "jobs listed at end",
        ],
        [r["cells"] for r in rows],
    )
    t.notes += [
        "RSS of the kernel after gc.collect(), read in the kernel (psutil) after each batch of "
        f"{BATCH} cells; per-cell growth is the slope from the sample at {KEPT} cells (the session keeps its last "
        f"{KEPT} cells' handles) to the end of the trivial cells. Widgets off (no browser in the benchmark's kernels).",
        "cell latency: in-kernel wall time of sess.run_cell (capture, hand-off, the ranks' run, the reply).",
    ]
    sec.tables.append(t)
    for r in rows:
        sec.targets.append(
            Target(
                f"session soak (MLflow {r['mlflow']}): <= {TARGET_KIB_PER_CELL:g} KiB kernel RSS per ended cell "
                f"after the first {KEPT}",
                f"<= {TARGET_KIB_PER_CELL:g} KiB",
                f"{fmt(r['kib_per_cell'], 2)} KiB",
                None if r["kib_per_cell"] is None else r["kib_per_cell"] <= TARGET_KIB_PER_CELL,
            )
        )
        sec.targets.append(
            Target(
                f"session soak (MLflow {r['mlflow']}): p99 of the last {WINDOW} cells within "
                f"{TARGET_P99_RATIO:g}x of the first {WINDOW}",
                f"<= {TARGET_P99_RATIO:g}x",
                fmt_ratio(r["p99_ratio"]),
                None if r["p99_ratio"] is None else r["p99_ratio"] <= TARGET_P99_RATIO,
            )
        )
    return sec


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def _row(mlflow: bool, samples: list[dict], lat: dict, n: int, train_n: int) -> dict:
    per_cell = slope(samples, "cells", "rss_kib", KEPT, n)
    per_train = slope(samples, "cells", "rss_kib", n, n + train_n)
    first, last = lat["trivial"][:WINDOW], lat["trivial"][-WINDOW:]
    p99_first, p99_last = _pct(first, 0.99), _pct(last, 0.99)
    p99_ratio = ratio(p99_last, p99_first)
    growth = max(e - s for s, e in zip(samples[0]["ranks_rss_mib"], samples[-1]["ranks_rss_mib"], strict=True))
    return {
        "mlflow": "on" if mlflow else "off",
        "kib_per_cell": per_cell,
        "p99_ratio": p99_ratio,
        "cells": [
            "on (default)" if mlflow else "off",
            fmt(per_cell, 2),
            fmt(per_train, 2),
            fmt(growth, 1),
            f"{fmt(_pct(first, 0.5), 1)} / {fmt(p99_first, 1)}",
            f"{fmt(_pct(last, 0.5), 1)} / {fmt(p99_last, 1)}",
            fmt_ratio(p99_ratio),
            f"{fmt(_pct(lat['train'], 0.5), 1)} / {fmt(_pct(lat['train'], 0.99), 1)}",
            samples[-1]["listed"],
        ],
    }
