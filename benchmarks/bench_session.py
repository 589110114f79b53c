"""Live sessions against ipyparallel (issue 20): the cost of a cell on ranks that stay.

In one kernel per system and world size (2 and 8; 2 with --quick), in-kernel medians of ``session_reps`` (30):

- a trivial cell: ``%%distributed --session`` vs ipyparallel's ``%%px`` (both through ``run_cell_magic``), with
  MLflow on (the default: one run for the session, no MLflow write per cell) and off, interleaved; and
  ``sess.run_cell`` of the same, on and off;
- that cell plus pulling one value from every rank: ``sess.pull`` vs ``rc[:].pull``;
- a cell with one gloo ``all_reduce`` of a 1-element tensor on a process group made once;
- sgpu_magic only: interrupt to idle (``sess.interrupt()`` until the cell has raised, state kept), a pull of a
  100 MB tensor against a raw pickle-over-pipe copy of the same tensor in the kernel, and the session's start
  against a warm job's launch (``fn.distributed()`` of a trivial function).

ipyparallel (``pip install ipyparallel``) is optional: without it its rows say so. Not a test: nothing here
asserts on time.
"""

from __future__ import annotations

from .common import Context, Section, Table, Target, fmt, fmt_ratio, measure, median, ratio

SGPU_CELL = """\
import threading, pickle, tempfile, pathlib
from sgpu_magic.testing import wait_for_tracking
wait_for_tracking(300)  # the extension imports mlflow in the background after its cell: not timed
from sgpu_magic import Session, CellInterruptedError
_ip = get_ipython()
_res = {"trivial": [], "pull": [], "allreduce": [], "interrupt": [], "pull100": [], "raw100": [], "start": [], "warm_job": [],
        "trivial_tracked": [], "run_cell": [], "run_cell_tracked": []}

@distributed(gpus=__N__, mlflow=False, widgets=False)
def _trivial():
    return 1

_trivial.distributed()
for _ in range(3):
    _t0 = time.perf_counter(); _trivial.distributed(); _res["warm_job"].append(time.perf_counter() - _t0)
_t0 = time.perf_counter()
sess_t = Session(gpus=__N__, widgets=False, name="tracked")  # the default: MLflow on (one run for the session)
sess = Session(gpus=__N__, mlflow=False, widgets=False, name="untracked")
_res["start"].append(time.perf_counter() - _t0)
sess_t.run_cell("x = 0"); wait_for_tracking(300)
sess.run_cell("import torch, torch.distributed as dist\\nfrom sgpu_magic import runtime\\ndist.init_process_group('gloo')\\nt = torch.ones(1)")
for _ in range(__REPS__):  # tracked and untracked interleaved, through the magic and through run_cell
    _t0 = time.perf_counter(); _ip.run_cell_magic("distributed", "--session tracked", "x = 1"); _res["trivial_tracked"].append(time.perf_counter() - _t0)
    _t0 = time.perf_counter(); _ip.run_cell_magic("distributed", "--session untracked", "x = 1"); _res["trivial"].append(time.perf_counter() - _t0)
    _t0 = time.perf_counter(); sess_t.run_cell("x"); _res["run_cell_tracked"].append(time.perf_counter() - _t0)
    _t0 = time.perf_counter(); sess.run_cell("x"); _res["run_cell"].append(time.perf_counter() - _t0)
sess_t.stop()
for _ in range(__REPS__):
    _t0 = time.perf_counter(); _ip.run_cell_magic("distributed", "--session untracked", "x = 2"); sess.pull("x"); _res["pull"].append(time.perf_counter() - _t0)
    _t0 = time.perf_counter(); _ip.run_cell_magic("distributed", "--session untracked", "dist.all_reduce(t)"); _res["allreduce"].append(time.perf_counter() - _t0)
_dir = pathlib.Path(tempfile.mkdtemp())
for _i in range(min(__REPS__, 10)):
    _m = _dir / f"in{_i}"
    def _run(m=_m):
        try:
            sess.run_cell(f"import pathlib, time\\npathlib.Path({str(m)!r} + str(dist.get_rank())).touch()\\nwhile True:\\n    time.sleep(0.001)")
        except CellInterruptedError:
            pass
    _th = threading.Thread(target=_run); _th.start()
    while not all(pathlib.Path(f"{_m}{r}").exists() for r in range(__N__)):
        time.sleep(0.001)
    _t0 = time.perf_counter(); sess.interrupt(); _th.join(); _res["interrupt"].append(time.perf_counter() - _t0)
assert sess.run_cell("'t' in globals()") == [True] * __N__, "the state was not kept"
sess.run_cell("big = torch.ones(25_000_000)")
_big = torch.ones(25_000_000)
for _ in range(min(__REPS__, 5)):
    _t0 = time.perf_counter(); _v = sess.pull("big", rank=0); _res["pull100"].append(time.perf_counter() - _t0)
    del _v
    _r, _w = os.pipe()
    def _send(w=_w):
        _data = pickle.dumps(_big, protocol=pickle.HIGHEST_PROTOCOL)
        with os.fdopen(w, "wb") as f:
            f.write(_data)
    _t0 = time.perf_counter()
    _th = threading.Thread(target=_send); _th.start()
    with os.fdopen(_r, "rb") as f:
        _v = pickle.loads(f.read())
    _th.join(); _res["raw100"].append(time.perf_counter() - _t0)
    del _v
sess.stop()
_emit(**_res)
"""

IPP_CELL = """\
import time, json, sys, socket
try:
    import ipyparallel as ipp
except ImportError:
    _emit(missing="ipyparallel is not installed (pip install ipyparallel)")
else:
    _ip = get_ipython()
    _res = {"trivial": [], "pull": [], "allreduce": [], "version": ipp.__version__}
    _cluster = ipp.Cluster(n=__N__, log_level=40)
    _rc = _cluster.start_and_connect_sync()
    _rc.wait_for_engines(__N__, timeout=300)
    _rc[:].activate()
    with socket.socket() as _s:
        _s.bind(("127.0.0.1", 0)); _port = _s.getsockname()[1]
    _rc[:].scatter("rank", list(range(__N__)), flatten=True, block=True)
    _rc[:].execute(f"import torch, torch.distributed as dist\\ndist.init_process_group('gloo', init_method='tcp://127.0.0.1:{_port}', rank=rank, world_size=__N__)\\nt = torch.ones(1)", block=True)
    for _ in range(__REPS__):
        _t0 = time.perf_counter(); _ip.run_cell_magic("px", "--block", "x = 1"); _res["trivial"].append(time.perf_counter() - _t0)
        _t0 = time.perf_counter(); _ip.run_cell_magic("px", "--block", "x = 2"); _rc[:].pull("x", block=True); _res["pull"].append(time.perf_counter() - _t0)
        _t0 = time.perf_counter(); _ip.run_cell_magic("px", "--block", "dist.all_reduce(t)"); _res["allreduce"].append(time.perf_counter() - _t0)
    _cluster.stop_cluster_sync()
    _emit(**_res)
"""

ROWS = [
    ("trivial_tracked", "trivial cell, MLflow on (default; %%distributed --session vs %%px)"),
    ("trivial", "trivial cell, --no-mlflow (%%distributed --session vs %%px)"),
    ("pull", "cell + pull one value per rank"),
    ("allreduce", "cell with one gloo all_reduce"),
]


def _ms(xs: list[float] | None) -> float | None:
    return None if not xs else median(xs) * 1e3


def run(ctx: Context) -> Section:
    cfg = ctx.cfg
    sec = Section()
    reps = cfg.session_reps
    for n in cfg.session_ranks:
        _, cell, problem = measure(
            lambda n=n: ctx.sgpu_kernel(f"session-{n}"),
            None,
            SGPU_CELL.replace("__N__", str(n)).replace("__REPS__", str(reps)),
            cfg.cell_timeout_s * 3,
        )
        ours = cell.data if cell else {"error": problem}
        _, cell, problem = measure(
            lambda n=n: ctx.peers_kernel(f"ipyparallel-{n}"),
            None,
            IPP_CELL.replace("__N__", str(n)).replace("__REPS__", str(reps)),
            cfg.cell_timeout_s * 3,
        )
        peer = cell.data if cell else {"error": problem}
        sec.raw[f"ranks_{n}"] = {"sgpu_magic": ours, "ipyparallel": peer}
        _tables(sec, n, ours, peer, reps)
    return sec


def _tables(sec: Section, n: int, ours: dict, peer: dict, reps: int) -> None:
    t = Table(
        f"Sessions: {n} ranks, in-kernel medians of {reps}",
        ["what", "sgpu_magic", f"ipyparallel {peer.get('version', '')}".strip(), "ratio"],
    )
    for key, label in ROWS:
        a, b = _ms(ours.get(key)), _ms(peer.get("trivial" if key == "trivial_tracked" else key))
        t.rows.append([label, fmt(a, 1, " ms"), fmt(b, 1, " ms"), fmt_ratio(ratio(a, b))])
        r = ratio(a, b)
        sec.targets.append(
            Target(
                f"sessions: {label}, {n} ranks", "<= 0.5x ipyparallel", fmt_ratio(r), None if r is None else r <= 0.5
            )
        )
    tracked, plain = _ms(ours.get("run_cell_tracked")), _ms(ours.get("run_cell"))
    t.rows.append(
        [
            "sess.run_cell('x'), MLflow on vs off",
            fmt(tracked, 1, " ms"),
            f"off: {fmt(plain, 1, ' ms')}",
            fmt_ratio(ratio(tracked, plain)),
        ]
    )
    for what, a, b in (
        ("%%distributed --session", _ms(ours.get("trivial_tracked")), _ms(ours.get("trivial"))),
        ("sess.run_cell", tracked, plain),
    ):
        r = ratio(a, b)
        sec.targets.append(
            Target(
                f"sessions: {what} cell, MLflow on vs off, {n} ranks (issue 31)",
                "<= 1.2x",
                fmt_ratio(r),
                None if r is None else r <= 1.2,
            )
        )
    interrupt = _ms(ours.get("interrupt"))
    t.rows.append(["interrupt to idle (state kept)", fmt(interrupt, 1, " ms"), "-", ""])
    sec.targets.append(
        Target(
            f"sessions: interrupt to idle, {n} ranks",
            "<= 100 ms",
            fmt(interrupt, 1, " ms"),
            None if interrupt is None else interrupt <= 100,
        )
    )
    pull, raw = _ms(ours.get("pull100")), _ms(ours.get("raw100"))
    t.rows.append(
        [
            "pull of a 100 MB tensor (rank 0)",
            fmt(pull, 1, " ms"),
            f"raw pickle over a pipe: {fmt(raw, 1, ' ms')}",
            fmt_ratio(ratio(pull, raw)),
        ]
    )
    r = ratio(pull, raw)
    sec.targets.append(
        Target(
            f"sessions: 100 MB pull vs raw pipe, {n} ranks", "<= 1.5x", fmt_ratio(r), None if r is None else r <= 1.5
        )
    )
    start, warm = _ms(ours.get("start")), _ms(ours.get("warm_job"))
    t.rows.append(
        [
            "session start vs a warm job's launch",
            fmt(start, 1, " ms"),
            f"warm job: {fmt(warm, 1, ' ms')}",
            fmt_ratio(ratio(start, warm)),
        ]
    )
    sec.targets.append(
        Target(
            f"sessions: start vs warm job, {n} ranks",
            "<= 1.0x",
            fmt_ratio(ratio(start, warm)),
            None if start is None or warm is None else start <= warm,
        )
    )
    for who, data in (("sgpu_magic", ours), ("ipyparallel", peer)):
        if "error" in data or "missing" in data:
            t.notes.append(f"{who}: {data.get('error') or data.get('missing')}")
    sec.tables.append(t)
