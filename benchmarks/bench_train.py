"""Metric 2 (and 5, ``--gpu``): steady-state training of the quickstart MLP, sgpu_magic vs torchrun.

The same code (:mod:`benchmarks.mlp_train`) runs under both: as a notebook cell plus
``distributed(gpus=N)(mlp_train).distributed(...)`` in one kernel, and as
``torchrun --standalone --nproc-per-node N mlp_train.py`` from a cell of another kernel.
Steps/s is measured inside the ranks around the training loop only (after one untimed
warm-up epoch); the whole call's time in the kernel is shown too.
"""

from __future__ import annotations

from pathlib import Path

from .common import Context, Section, Table, Target, fmt, fmt_range, fmt_ratio, measure, median, ratio, settle

MLP_FILE = Path(__file__).resolve().parent / "mlp_train.py"
ENTRY_MARK = "# ---- ENTRY POINT (torchrun) ----"


def mlp_cell_source() -> str:
    """The part of mlp_train.py a notebook user would have in a cell (without the torchrun entry point)."""
    text = MLP_FILE.read_text()
    body = text.split(ENTRY_MARK)[0]
    return body.split('"""', 2)[2].lstrip()  # drop the module docstring


SGPU_DEF = """\
train_jobs = {{g: distributed(gpus=g, **_KW)(mlp_train) for g in {worlds!r}}}
"""

SGPU_CELL = """\
_h0, _c0, _t0 = _host_cpu(), time.process_time(), time.perf_counter()
_res = train_jobs[{g}].distributed({epochs}, 1)
_dt, _cpu, _h1 = time.perf_counter() - _t0, time.process_time() - _c0, _host_cpu()
_emit(kernel_s=_dt, ranks=_res, start_method=_start_method(train_jobs[{g}].last_job), kernel_cpu_s=_cpu,
      host_cpu_s=None if _h0 is None or _h1 is None else _h1 - _h0)
"""

TORCHRUN_CELL = """\
_out = tempfile.mkdtemp(prefix="torchrun-mlp-")
_t0 = time.perf_counter()
_p = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "{g}", {script!r}, "--epochs", "{epochs}",
                     "--warmup-epochs", "1", "--out", _out], capture_output=True, text=True)
_dt = time.perf_counter() - _t0
if _p.returncode:
    raise RuntimeError(f"torchrun failed ({{_p.returncode}}): {{_p.stderr[-3000:]}}")
_res = [json.load(open(os.path.join(_out, f"rank_{{r}}.json"))) for r in range({g})]
shutil.rmtree(_out, ignore_errors=True)
_emit(kernel_s=_dt, ranks=_res)
"""


def _steps_per_s(ranks: list[dict]) -> float:
    """The job's rate: the slowest rank's steps/s (DDP keeps them in step anyway)."""
    return min(r["steps_per_s"] for r in ranks)


def measure_training(
    ctx: Context, worlds: tuple[int, ...], reps: int, epochs: int, tag: str, gpu: bool = False
) -> dict:
    timeout = ctx.cfg.cell_timeout_s

    def sgpu_kernel():
        k = ctx.sgpu_kernel(f"{tag}-sgpu", warm=True, gpu=gpu)
        k.run(mlp_cell_source(), timeout_s=timeout)
        k.run(SGPU_DEF.format(worlds=worlds), timeout_s=timeout)
        return k

    kernels = {"sgpu_magic": None, "torchrun": None}
    factories = {"sgpu_magic": sgpu_kernel, "torchrun": lambda: ctx.peers_kernel(f"{tag}-torchrun", gpu=gpu)}
    samples = {
        (m, g): {
            "steps_per_s": [],
            "kernel": [],
            "loop": [],
            "threads": set(),
            "errors": [],
            "hangs": 0,
            "backend": None,
            "start_methods": [],
            "side_cpu_pct": [],
        }
        for m in kernels
        for g in worlds
    }
    for rep in range(reps):
        order = ["sgpu_magic", "torchrun"] if rep % 2 == 0 else ["torchrun", "sgpu_magic"]
        for g in worlds:
            for m in order:
                code = (
                    SGPU_CELL.format(g=g, epochs=epochs)
                    if m == "sgpu_magic"
                    else TORCHRUN_CELL.format(g=g, epochs=epochs, script=str(MLP_FILE))
                )
                kernels[m], cell, problem = measure(factories[m], kernels[m], code, timeout)
                s = samples[(m, g)]
                if problem is None:
                    ranks = cell.data["ranks"]
                    s["steps_per_s"].append(_steps_per_s(ranks))
                    s["kernel"].append(cell.data["kernel_s"])
                    s["loop"].append(max(r["loop_s"] for r in ranks))
                    s["threads"].update(r["threads"] for r in ranks)
                    s["backend"] = ranks[0]["backend"]
                    if cell.data.get("kernel_cpu_s") is not None and cell.data.get("host_cpu_s") is not None:
                        s["side_cpu_pct"].append(
                            100 * (cell.data["kernel_cpu_s"] + cell.data["host_cpu_s"]) / cell.data["kernel_s"]
                        )
                    if cell.data.get("start_method"):
                        s["start_methods"].append(cell.data["start_method"])
                    print(
                        f"  {tag} {m:<10} world={g}: {_steps_per_s(ranks):.1f} steps/s, "
                        f"call {cell.data['kernel_s']:.2f} s",
                        flush=True,
                    )
                elif problem.startswith("hang"):
                    s["hangs"] += 1
                    print(f"  {tag} {m:<10} world={g}: hang", flush=True)
                else:
                    s["errors"].append(problem)
                    print(f"  {tag} {m:<10} world={g}: {problem[:500]}", flush=True)
                settle()
    for k in kernels.values():
        if k is not None and not k.closed:
            k.shutdown()
    for s in samples.values():
        s["threads"] = sorted(s["threads"])
    return samples


def _table(title: str, worlds, samples, epochs: int) -> Table:
    t = Table(
        title,
        [
            "ranks",
            "launcher",
            "backend",
            "steps/s (median)",
            "steps/s min-max",
            "timed loop s",
            "whole call in kernel s",
            "kernel+host CPU % of call",
            "torch threads/rank",
            "n",
            "steps/s vs torchrun",
        ],
    )
    for g in worlds:
        base = median(samples[("torchrun", g)]["steps_per_s"])
        for m in ("sgpu_magic", "torchrun"):
            s = samples[(m, g)]
            sps = median(s["steps_per_s"])
            t.rows.append(
                [
                    g,
                    m,
                    s["backend"] or "-",
                    fmt(sps, 1),
                    fmt_range(s["steps_per_s"], 1),
                    fmt(median(s["loop"])),
                    fmt(median(s["kernel"])),
                    fmt(median(s["side_cpu_pct"]), 1, "%") if s["side_cpu_pct"] else "-",
                    ",".join(map(str, s["threads"])) or "-",
                    len(s["steps_per_s"]),
                    fmt_ratio(ratio(sps, base)),
                ]
            )
            for e in s["errors"]:
                t.notes.append(f"{m}, {g} ranks, failed once: {e.splitlines()[0][:300]}")
            if s["hangs"]:
                t.notes.append(f"{m}, {g} ranks: {s['hangs']} hang(s)")
    methods = sorted({x for g in worlds for x in samples[("sgpu_magic", g)]["start_methods"]})
    if methods:
        t.notes.append(
            f"sgpu_magic ranks started by: {', '.join(methods)} (the kernel ran untimed warm-up launches first)."
        )
    t.notes.append(
        "kernel+host CPU: CPU seconds of the kernel process and of sgpu_magic's launch host process "
        "during the call, as % of one core over the call's wall time (what sgpu_magic spends beside the "
        "ranks while following the job; with as many ranks as cores it comes out of the ranks' share)."
    )
    t.notes.append(
        f"batch 32, 5000 samples sharded over the ranks; 1 untimed warm-up epoch, then {epochs} timed "
        "epochs; steps/s of the slowest rank. 'whole call' = launch + setup + all epochs + result, "
        "timed in the kernel (torchrun: the subprocess call)."
    )
    return t


def run(ctx: Context) -> Section:
    cfg = ctx.cfg
    samples = measure_training(ctx, (2,), cfg.train_reps, cfg.train_epochs, "train")
    sec = Section(raw={"samples": {f"{m}/{g}": v for (m, g), v in samples.items()}})
    sec.tables.append(
        _table("2. Steady-state training: quickstart MLP, DDP, 2 CPU ranks (gloo)", (2,), samples, cfg.train_epochs)
    )
    r = ratio(median(samples[("sgpu_magic", 2)]["steps_per_s"]), median(samples[("torchrun", 2)]["steps_per_s"]))
    sec.targets.append(
        Target("training steps/s vs torchrun (2 CPU ranks)", ">= 0.98x", fmt_ratio(r), None if r is None else r >= 0.98)
    )
    return sec


def run_gpu(ctx: Context) -> Section:
    sec = Section()
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        n = 0
    if n == 0:
        t = Table("5. GPU: quickstart MLP with nccl, sgpu_magic vs torchrun", ["status"], [["skipped"]])
        t.notes.append(
            "skipped: no CUDA device here (torch.cuda.is_available() is False); run with --gpu on a "
            "machine with NVIDIA GPUs."
        )
        sec.tables.append(t)
        sec.raw = {"skipped": "no CUDA"}
        return sec
    worlds = (1,) if n == 1 else (1, n)
    samples = measure_training(ctx, worlds, ctx.cfg.gpu_reps, ctx.cfg.train_epochs, "gpu", gpu=True)
    sec.raw = {"gpus": n, "samples": {f"{m}/{g}": v for (m, g), v in samples.items()}}
    sec.tables.append(
        _table(
            f"5. GPU: quickstart MLP with nccl, {n} GPU(s), sgpu_magic vs torchrun",
            worlds,
            samples,
            ctx.cfg.train_epochs,
        )
    )
    return sec
