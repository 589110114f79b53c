"""Metric 4: capture and results.

In one kernel holding 100 small globals and one 1 GiB numpy array:

- ``capture_names`` of the 100 small globals; of those plus the 1 GiB array (the warning
  path: it is over ``max_capture_bytes``), and the time from its start to the warning
  callback (what the front doors show at once); ``capture_cell`` of a cell that reads all 101.
- end to end: a ``%%distributed --gpus 1`` cell reading them, and the driver's time from
  sending it to receiving the ``sgpu_magic warning`` on stderr (what the user sees).

Then, in a fresh kernel, gathering 8 x 100 MB tensor results: ``fn.distributed(...)`` of a
function that builds a 100 MB tensor per rank and returns it, against the same function
returning one float; the difference is the cost of bringing the tensors back.
"""

from __future__ import annotations

from .common import Context, Section, Table, Target, fmt, fmt_range, measure, median

CAPTURE_SETUP = """\
import gc
import numpy as np
from sgpu_magic import capture as _capture

for _i in range(100):
    globals()[f"g{_i}"] = (_i, f"value {_i}", [_i] * 4, {"key": _i, "x": 1.5})[_i % 4]
big = np.ones(2**27)  # 1 GiB of float64
_small = {f"g{i}" for i in range(100)}
_cell = "x = [" + ", ".join(f"g{i}" for i in range(100)) + "]\\nbig.shape\\n"
"""

CAPTURE_CELL = """\
_ns = globals()
_res = {"small_s": [], "big_s": [], "warn_s": [], "cell_s": [], "warnings": None, "payload_bytes": None}
for _ in range(__REPS__):
    gc.collect()
    _t0 = time.perf_counter(); _capture.capture_names(_small, _ns); _res["small_s"].append(time.perf_counter() - _t0)
    _warned = []
    _t0 = time.perf_counter(); _c = _capture.capture_names(_small | {"big"}, _ns, warn=lambda _w: _warned.append(time.perf_counter())); _res["big_s"].append(time.perf_counter() - _t0)
    _res["warn_s"].append(_warned[0] - _t0 if _warned else float("nan"))
    _res["warnings"] = _c.warnings
    del _c
    _t0 = time.perf_counter(); _p = _capture.capture_cell(_cell, _ns); _res["cell_s"].append(time.perf_counter() - _t0)
    _res["payload_bytes"] = sum(len(e[1]) for e in _p.globals.values() if e[0] == "value")
    del _p
_emit(**_res)
"""

E2E_CELL = """\
%%distributed --gpus 1 {flags}
x = [{names}]
big.shape
"""

GATHER_DEF = """\
import gc

def make_result(nbytes, send):
    import os
    import torch

    t = torch.full((nbytes // 4,), float(os.environ["RANK"]))
    return t if send else float(t[0])

gather_job = distributed(gpus={ranks}, **_KW)(make_result)
"""

GATHER_CELL = """\
gc.collect()
_t0 = time.perf_counter()
_r = gather_job.distributed({nbytes}, {send})
_dt = time.perf_counter() - _t0
if {send}:
    assert [float(t[0]) for t in _r] == [float(i) for i in range({ranks})] and all(t.numel() * 4 == {nbytes} for t in _r)
else:
    assert _r == [float(i) for i in range({ranks})], _r
_elapsed = gather_job.last_job.elapsed_s
del _r
_emit(kernel_s=_dt, job_elapsed_s=_elapsed, start_method=_start_method(gather_job.last_job))
"""


def run(ctx: Context) -> Section:
    cfg = ctx.cfg
    timeout = cfg.cell_timeout_s
    sec = Section()
    t = Table("4. Capture and results", ["what", "median", "min-max", "n", "note"])

    kernel, cell, problem = measure(
        lambda: _capture_kernel(ctx), None, CAPTURE_CELL.replace("__REPS__", str(cfg.capture_reps)), timeout
    )
    cap = cell.data if cell else None
    e2e = None
    if kernel is not None:
        flags = ctx.facts.get("tracking", {}).get("magic_flags", "")
        names = ", ".join(f"g{i}" for i in range(100))
        kernel, cell, problem_e2e = measure(
            lambda: None, kernel, E2E_CELL.format(flags=flags, names=names), timeout, stderr_match="sgpu_magic warning"
        )
        if cell is not None:
            e2e = {"warning_s": cell.first_stderr_match_s, "wall_s": cell.wall_s}
        else:
            e2e = {"error": problem_e2e}
        if kernel is not None:
            kernel.shutdown()
    if cap:
        warned = bool(cap["warnings"]) and any("big" in w for w in cap["warnings"])
        t.rows.append(
            [
                "capture_names: 100 small globals",
                fmt(median(cap["small_s"]) * 1e3, 1, " ms"),
                fmt_range([x * 1e3 for x in cap["small_s"]], 1) + " ms",
                len(cap["small_s"]),
                "",
            ]
        )
        t.rows.append(
            [
                "capture_names: 100 small + 1 GiB array (warning path)",
                fmt(median(cap["big_s"]) * 1e3, 1, " ms"),
                fmt_range([x * 1e3 for x in cap["big_s"]], 1) + " ms",
                len(cap["big_s"]),
                "warned" if warned else "NO WARNING",
            ]
        )
        t.rows.append(
            [
                "capture_names: 100 small + 1 GiB array -> its warning shown",
                fmt(median(cap["warn_s"]) * 1e3, 2, " ms"),
                fmt_range([x * 1e3 for x in cap["warn_s"]], 2) + " ms",
                len(cap["warn_s"]),
                "warned from the size estimate, before pickling",
            ]
        )
        t.rows.append(
            [
                "capture_cell: a cell reading all 101 globals",
                fmt(median(cap["cell_s"]) * 1e3, 1, " ms"),
                fmt_range([x * 1e3 for x in cap["cell_s"]], 1) + " ms",
                len(cap["cell_s"]),
                f"payload globals {cap['payload_bytes'] / 2**20:.0f} MiB",
            ]
        )
        if cap["warnings"]:
            t.notes.append("warning text: " + cap["warnings"][0][:300])
    else:
        t.notes.append(f"capture failed: {problem}")
    if e2e and "error" not in e2e:
        t.rows.append(
            [
                "%%distributed cell with those globals: execute -> warning on the frontend",
                fmt(e2e["warning_s"] * 1e3 if e2e["warning_s"] is not None else None, 0, " ms"),
                "-",
                1,
                f"whole cell (1 rank loads the 1 GiB payload) {e2e['wall_s']:.1f} s",
            ]
        )
    elif e2e:
        t.notes.append(f"end-to-end %%distributed cell failed: {e2e['error'][:300]}")

    gather = _gather(ctx)
    mb = cfg.gather_bytes / 1e6
    g_send, g_float = gather["send"]["kernel"], gather["float"]["kernel"]
    diff = median(g_send) - median(g_float) if g_send and g_float else None
    t.rows.append(
        [
            f"fn.distributed(): {cfg.gather_ranks} ranks each return a {mb:.0f} MB tensor",
            fmt(median(g_send), 2, " s"),
            fmt_range(g_send) + " s",
            len(g_send),
            "",
        ]
    )
    t.rows.append(
        [
            "same job, each rank returns one float (baseline)",
            fmt(median(g_float), 2, " s"),
            fmt_range(g_float) + " s",
            len(g_float),
            "",
        ]
    )
    t.rows.append(
        [
            f"gathering {cfg.gather_ranks} x {mb:.0f} MB = difference",
            fmt(diff, 2, " s"),
            "-",
            "-",
            f"{cfg.gather_ranks * mb / diff:.0f} MB/s" if diff and diff > 0 else "",
        ]
    )
    for kind in ("send", "float"):
        for e in gather[kind]["errors"]:
            t.notes.append(f"gather ({kind}) failed once: {e.splitlines()[0][:300]}")
    methods = sorted({str(m) for k in ("send", "float") for m in gather[k]["start_methods"]})
    t.notes.append(f"gather jobs' ranks started by: {', '.join(methods) or '-'} (after untimed warm-up launches).")
    t.notes.append(
        "capture timings are taken in the kernel around sgpu_magic.capture.capture_names / capture_cell; "
        "the front doors show each warning as capture finds it (arrays and tensors from their size, "
        "before anything is pickled), then the 1 GiB array is pickled too."
    )
    sec.tables.append(t)
    sec.raw = {"capture": cap, "e2e": e2e, "gather": gather}

    if cap:
        ms = median(cap["warn_s"]) * 1e3
        sec.targets.append(
            Target(
                "capture of the 1 GiB global warns (capture start -> warning shown)",
                "< 50 ms",
                f"{ms:.0f} ms" + ("" if warned else " (no warning!)"),
                ms < 50 and warned,
            )
        )
    else:
        sec.targets.append(Target("capture of the 1 GiB global warns", "< 50 ms", "failed", False))
    return sec


def _capture_kernel(ctx: Context):
    k = ctx.sgpu_kernel("capture")
    k.run(CAPTURE_SETUP, timeout_s=ctx.cfg.cell_timeout_s)
    return k


def _gather(ctx: Context) -> dict:
    cfg = ctx.cfg
    out = {k: {"kernel": [], "elapsed": [], "errors": [], "start_methods": []} for k in ("send", "float")}

    def factory():
        k = ctx.sgpu_kernel("gather", warm=True)
        k.run(GATHER_DEF.format(ranks=cfg.gather_ranks), timeout_s=cfg.cell_timeout_s)
        return k

    kernel = None
    for rep in range(cfg.gather_reps):
        for send in (True, False) if rep % 2 == 0 else (False, True):
            kind = "send" if send else "float"
            code = GATHER_CELL.format(ranks=cfg.gather_ranks, nbytes=cfg.gather_bytes, send=send)
            kernel, cell, problem = measure(factory, kernel, code, cfg.cell_timeout_s)
            if problem:
                out[kind]["errors"].append(problem)
                print(f"  gather {kind}: {problem[:300]}", flush=True)
                continue
            out[kind]["kernel"].append(cell.data["kernel_s"])
            out[kind]["elapsed"].append(cell.data["job_elapsed_s"])
            out[kind]["start_methods"].append(cell.data.get("start_method"))
            print(f"  gather {kind}: {cell.data['kernel_s']:.2f} s", flush=True)
    if kernel is not None and not kernel.closed:
        kernel.shutdown()
    return out
