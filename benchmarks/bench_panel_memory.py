"""Panel memory: what each ended job with the widget panel leaves in the kernel.

One warm kernel runs ``--panel-jobs`` (default 500) consecutive blocking jobs of 2 CPU ranks, each printing 2,000
lines per rank, with the panel on (``widgets=True``), in cells of 25 jobs. After each cell the kernel runs
``gc.collect()`` and reports its RSS (psutil), the widgets still open (ipywidgets' registry) and the length of its
job list (``jobs()``). Reported: MiB of RSS per ended job over all jobs after a warm-up of 25 (this includes the
100 ended handles the job list keeps), and over the jobs after the list is full (the steady state: what a kernel
that runs jobs all day grows by per job). Issue 21's target: <= 0.1 MiB per ended job over 500 jobs (before it:
~0.8 MiB, 100 jobs of 2 ranks x 2,000 lines: 212 -> 274 MiB).
"""

from __future__ import annotations

from .common import Context, Section, Table, Target, fmt, slope

CHATTER_DEF = """\
import gc, psutil
import ipywidgets as _w
from sgpu_magic.job.handle import jobs as _jobs

@distributed(gpus=2, widgets=True, **_KW)
def chatter(n):
    import os
    rank = os.environ["RANK"]
    for i in range(n):
        print(f"rank {rank} line {i:05d} " + "x" * 40)
    return int(rank)

def _open_widgets():
    return len(getattr(_w.Widget, "_active_widgets", None) or _w.widgets.widget._instances)
"""

BATCH = """\
for _ in range({n}):
    assert chatter.distributed({lines}) == [0, 1]
gc.collect()
_emit(rss_mib=psutil.Process().memory_info().rss / 2**20, widgets=_open_widgets(), listed=len(_jobs()))
"""

LINES = 2000
BATCH_JOBS = 25
WARMUP_JOBS = 25
LIST_FULL_AT = 100
TARGET_MIB_PER_JOB = 0.1


def run(ctx: Context) -> Section:
    n = ctx.cfg.panel_jobs
    kernel = ctx.sgpu_kernel("panel_memory", warm=True)
    kernel.run(CHATTER_DEF, timeout_s=ctx.cfg.cell_timeout_s)
    first = kernel.run(BATCH.format(n=WARMUP_JOBS, lines=LINES), timeout_s=3600).data
    samples = [{"jobs": WARMUP_JOBS, **first}]
    done = WARMUP_JOBS
    while done < n:
        batch = min(BATCH_JOBS, n - done)
        cell = kernel.run(BATCH.format(n=batch, lines=LINES), timeout_s=3600)
        done += batch
        samples.append({"jobs": done, **cell.data})
        print(
            f"  panel_memory: {done}/{n} jobs, RSS {cell.data['rss_mib']:.1f} MiB, "
            f"{cell.data['widgets']} widgets open, {cell.data['listed']} jobs listed",
            flush=True,
        )
    kernel.shutdown()
    return _report(samples)


def _report(samples: list[dict]) -> Section:
    overall = slope(samples, "jobs", "rss_mib", WARMUP_JOBS)
    steady = slope(samples, "jobs", "rss_mib", LIST_FULL_AT + WARMUP_JOBS)
    last = samples[-1]
    sec = Section(raw={"samples": samples})
    t = Table(
        f"Panel memory: {last['jobs']} blocking jobs with the panel (2 CPU ranks x {LINES} lines each) in one kernel",
        [
            "jobs",
            f"RSS after {WARMUP_JOBS} (MiB)",
            "RSS at end (MiB)",
            f"MiB per ended job (after {WARMUP_JOBS})",
            f"MiB per ended job (after {LIST_FULL_AT + WARMUP_JOBS})",
            "widgets open at end",
            "jobs listed at end",
        ],
        [
            [
                last["jobs"],
                fmt(samples[0]["rss_mib"], 1),
                fmt(last["rss_mib"], 1),
                fmt(overall, 3),
                fmt(steady, 3),
                last["widgets"],
                last["listed"],
            ]
        ],
    )
    t.notes += [
        "RSS of the kernel process after gc.collect(), read in the kernel (psutil) after each cell of "
        f"{BATCH_JOBS} jobs; the first column is after a warm-up cell of {WARMUP_JOBS} jobs.",
        f"the job list keeps the last {LIST_FULL_AT} ended jobs' handles: the second figure is the growth once it "
        "is full (a kernel that runs jobs all day); the first includes those handles.",
        "RSS per sample: " + ", ".join(f"{s['jobs']}: {s['rss_mib']:.0f}" for s in samples),
    ]
    sec.tables.append(t)
    sec.targets.append(
        Target(
            f"panel memory: <= {TARGET_MIB_PER_JOB} MiB per ended job over {last['jobs']} jobs",
            f"<= {TARGET_MIB_PER_JOB} MiB",
            f"{fmt(overall, 3)} MiB (steady state {fmt(steady, 3)} MiB)",
            None if overall is None else overall <= TARGET_MIB_PER_JOB,
        )
    )
    return sec
