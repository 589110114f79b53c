"""sgpu_magic in real Jupyter kernels, driven the way a notebook frontend drives them.

Every test starts a real ``python3`` kernel through jupyter_client (it inherits this process's
environment, where conftest points SGPU_MAGIC_HOME at a private directory), and every job runs
real rank processes. Nothing is mocked. Tests wait for conditions by polling with a deadline,
never with a fixed sleep.

- the quickstart notebook runs headless with nbclient;
- a cell magic's last expression is the cell's execute_result, and rank lines stream as ``[rank N]``;
- C11: an interrupt stops both ranks and their DataLoader workers, and the cell can run again;
- C12: a graceful restart or a SIGKILL of the kernel leaves no rank and no launch host behind.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from nbclient import NotebookClient

from helpers import wait_for
from kernel_utils import collect, execute, start_kernel, stop_kernel

pytestmark = pytest.mark.slow

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "01_quickstart.ipynb"
START_DEADLINE_S = 120.0  # rank start-up on a busy 2-core box: two fresh `import torch`


# ----------------------------------------------------------------------------- helpers


def kernel_eval(kc, expr: str):
    """Evaluate ``expr`` in the kernel and return its value (it must have a literal repr)."""
    out = execute(kc, f"print(repr({expr}))")
    assert out.error is None, out.error
    return ast.literal_eval(out.stdout.strip())


def make_piddir(kc) -> Path:
    """Cell 1 of cases C11/C12: a temporary directory in which the ranks record their pids."""
    out = execute(kc, "import os, tempfile\npiddir = tempfile.mkdtemp()\nprint(piddir)")
    assert out.error is None, out.error
    return Path(out.stdout.strip())


def recorded(piddir: Path, prefix: str = "") -> set[int]:
    """The pids recorded in ``piddir``: ranks write ``<pid>``, DataLoader workers ``worker-<pid>``."""
    names = os.listdir(piddir)
    if prefix:
        return {int(n[len(prefix) :]) for n in names if n.startswith(prefix)}
    return {int(n) for n in names if n.isdigit()}


def new_pids(piddir: Path, n: int, known: set[int] = frozenset(), prefix: str = ""):
    """A condition for :func:`wait_for`: the ``n`` pids recorded with ``prefix`` that are not in ``known``."""

    def condition():
        pids = recorded(piddir, prefix) - known
        return pids if len(pids) >= n else None

    return condition


def existing(pids) -> list[int]:
    """Which of ``pids`` are still in the process table (a zombie counts: nobody reaped it)."""
    return sorted(p for p in pids if psutil.pid_exists(p))


def assert_interrupted(kc, error: dict) -> None:
    """The cell whose ``error`` reply this is ended with KeyboardInterrupt (or a product error subclassing it)."""
    name, is_interrupt = kernel_eval(
        kc, "(type(__import__('sys').last_value).__name__, isinstance(__import__('sys').last_value, KeyboardInterrupt))"
    )
    assert name == error["ename"] and is_interrupt, f"the cell ended with {error['ename']}: {error['evalue']}"


def gpu_pids() -> set[int]:
    """Pids that hold a CUDA context, from nvidia-smi; empty when there is no NVIDIA GPU."""
    if shutil.which("nvidia-smi") is None:
        return set()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return set()
    return {int(line) for line in out.split() if line.strip().isdigit()}


@pytest.fixture(scope="module")
def kernel():
    """One kernel shared by the tests that leave it alive: (km, kc)."""
    km, kc = start_kernel()
    yield km, kc
    stop_kernel(km, kc)


# ----------------------------------------------------------------------------- quickstart notebook


def _outputs(cell) -> tuple[str, list[str]]:
    stream = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
    results = [o.data.get("text/plain", "") for o in cell.outputs if o.output_type == "execute_result"]
    return stream, results


def _cell(nb, needle: str):
    matches = [c for c in nb.cells if c.cell_type == "code" and needle in c.source]
    assert len(matches) == 1, f"expected one code cell containing {needle!r}, found {len(matches)}"
    return matches[0]


def test_quickstart_notebook_runs_headless():
    stored = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(stored)
    code_cells = [c for c in stored.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code_cells), "the notebook is stored with outputs"

    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()  # raises on any cell error

    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    for needle in ("run_train.distributed(", "%%distributed --gpus $RANKS -o job"):
        stream, results = _outputs(_cell(nb, needle))
        for rank in (0, 1):
            epochs = re.findall(rf"^\[rank {rank}\] rank {rank}: epoch (\d)/3 mean loss (\d+\.\d+)$", stream, re.M)
            assert [e for e, _ in epochs] == ["1", "2", "3"], f"{needle}: rank {rank} epoch lines missing:\n{stream}"
            losses = [float(loss) for _, loss in epochs]
            assert losses[2] < losses[0] / 3 and losses[2] > 0, losses  # a first notebook shows learning
        assert len(results) == 1, f"{needle}: expected one execute_result, got {results}"

    _, (decorated,) = _outputs(_cell(nb, "run_train.distributed("))
    per_rank = ast.literal_eval(decorated)
    assert isinstance(per_rank, list) and len(per_rank) == 2
    assert [r["rank"] for r in per_rank] == [0, 1]
    assert all(r["world_size"] == 2 and r["backend"] in ("gloo", "nccl") and r["final_loss"] > 0 for r in per_rank)

    stream, _ = _outputs(_cell(nb, "job0 = run_train.last_job"))
    assert "None" not in stream.splitlines() and "no MLflow run page yet: run %mlflow_ui" in stream, stream

    _, (rank0,) = _outputs(_cell(nb, "%%distributed --gpus $RANKS -o job"))
    assert ast.literal_eval(rank0)["rank"] == 0

    stream, (job_results,) = _outputs(_cell(nb, "job.results"))
    per_rank = ast.literal_eval(job_results)
    assert [r["rank"] for r in per_rank] == [0, 1] and all(r["world_size"] == 2 for r in per_rank)
    assert len(re.findall(r"^rank [01] log: .*rank_[01]\.log$", stream, re.M)) == 2
    assert re.search(r"^the MLflow runs of this notebook's jobs: \S+$", stream, re.M), stream  # where the runs went


# ----------------------------------------------------------------------------- execute_result and rank lines

RESULT_CELL = """%%distributed --gpus 2
import torch
import torch.distributed as dist
from sgpu_magic import runtime
if not dist.is_initialized():
    dist.init_process_group(runtime.backend())
rank = runtime.get_global_rank()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(f"hello from rank {rank} of {runtime.get_world_size()}, sum {total.item():g}")
dist.destroy_process_group()
{"rank": rank, "sum": total.item()}
"""


def test_cell_magic_value_is_execute_result_and_rank_lines_stream(kernel):
    km, kc = kernel
    out = execute(kc, RESULT_CELL)
    assert out.error is None, out.error
    assert out.results == ["{'rank': 0, 'sum': 3.0}"]
    assert kernel_eval(kc, "_") == {"rank": 0, "sum": 3.0}  # `_` is set by the displayhook: an execute_result
    assert re.search(r"^\[rank 0\] hello from rank 0 of 2, sum 3$", out.stdout, re.M), out.stdout
    assert re.search(r"^\[rank 1\] hello from rank 1 of 2, sum 3$", out.stdout, re.M), out.stdout


# ----------------------------------------------------------------------------- C11: interrupt

C11_CELL = """%%distributed --gpus 2
import os, time
import torch.distributed as dist
from torch.utils.data import DataLoader
open(os.path.join(piddir, str(os.getpid())), "w").close()
if not dist.is_initialized():
    dist.init_process_group("gloo")

def mark_worker(worker_id):
    open(os.path.join(piddir, f"worker-{os.getpid()}"), "w").close()

dl = DataLoader(list(range(10_000)), batch_size=1, num_workers=2, persistent_workers=True,
                worker_init_fn=mark_worker)
for epoch in range(1000):
    for b in dl:
        time.sleep(0.01)
"""

LEFTOVERS = """
import psutil, time
names = os.listdir(piddir)
pids = [int(n) for n in names if n.isdigit()] + [int(n[7:]) for n in names if n.startswith("worker-")]
deadline = time.monotonic() + {timeout_s}
while True:
    left = [p for p in pids if psutil.pid_exists(p)]
    kids = [c.pid for c in psutil.Process().children(recursive=True)]
    if (not left and not kids) or time.monotonic() > deadline:
        break
    time.sleep(0.1)
print(repr((len(pids), left, kids)))
"""


def leftovers(kc, timeout_s: float = 10.0) -> tuple[int, list[int], list[int]]:
    """Case C11's cell 3, polling up to ``timeout_s``: (pids recorded, those still existing, kernel children)."""
    out = execute(kc, LEFTOVERS.format(timeout_s=timeout_s))
    assert out.error is None, out.error
    return ast.literal_eval(out.stdout.strip())


def _start_c11_and_interrupt(km, kc, piddir: Path, known: set[int]) -> tuple[set[int], set[int]]:
    """Run the C11 cell, wait until 2 new ranks and 4 new workers recorded themselves, interrupt once.

    Returns the new rank pids and the new worker pids. (How soon the cell ends after the interrupt is a figure
    of ``python -m benchmarks.run --only responsive``: interrupt_to_idle_s.)
    """
    msg_id = kc.execute(C11_CELL)
    ranks = wait_for(new_pids(piddir, 2, known), START_DEADLINE_S, "both ranks to record their pid")
    workers = wait_for(
        new_pids(piddir, 4, known, "worker-"), START_DEADLINE_S, "the 4 DataLoader workers (2 per rank) to start"
    )
    km.interrupt_kernel()
    out = collect(kc, msg_id, timeout_s=60)
    assert out.error is not None, f"the cell did not fail after the interrupt:\n{out.stdout}\n{out.stderr}"
    assert_interrupted(kc, out.error)
    return ranks, workers


def test_c11_interrupt_stops_ranks_and_their_dataloader_workers(kernel):
    km, kc = kernel
    piddir = make_piddir(kc)

    ranks, workers = _start_c11_and_interrupt(km, kc, piddir, set())
    n, left, kids = leftovers(kc)
    assert (n, left, kids) == (6, [], []), (
        f"left over: pids {left}, kernel children {kids} (ranks {ranks}, workers {workers})"
    )
    assert existing(ranks | workers) == []

    # The same cell again, straight away: it starts (both ranks join a new process group).
    ranks2, workers2 = _start_c11_and_interrupt(km, kc, piddir, ranks | workers)
    assert not (ranks2 & ranks)
    n, left, kids = leftovers(kc)
    assert (n, left, kids) == (12, [], [])
    assert kernel_eval(kc, "1 + 1") == 2  # the kernel is alive and not blocked


# ----------------------------------------------------------------------------- C12: restart / kill

C12_CELL = """%%distributed --gpus 2
import os, time, torch
open(os.path.join(piddir, str(os.getpid())), "w").close()
if torch.cuda.is_available():
    hold = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")   # 256 MiB per rank
time.sleep(3600)
"""


@pytest.mark.parametrize("how", ["restart", "kill"])
def test_c12_restart_or_kill_leaves_no_ranks_or_host(how):
    """Round A: graceful restart; round B: SIGKILL of the kernel. Within 15 s no rank and no host exists.

    The host is detached from the kernel (double fork), so once it exits it is reaped by init;
    a rank is reaped by the host. A zombie counts as still existing.
    """
    km, kc = start_kernel()
    try:
        piddir = make_piddir(kc)
        host_pid = kernel_eval(kc, "__import__('sgpu_magic.launch.client').launch.client.get_host().pid")
        kc.execute(C12_CELL)
        ranks = wait_for(new_pids(piddir, 2), START_DEADLINE_S, "both ranks to record their pid")
        assert existing(ranks | {host_pid}) == sorted(ranks | {host_pid})
        # the host's own children (its forkserver, with torch preloaded) must go too
        ranks |= {p.pid for p in psutil.Process(host_pid).children()}

        t0 = time.monotonic()
        if how == "restart":
            km.restart_kernel(now=False)  # round A: graceful restart
        else:
            km.shutdown_kernel(now=True)  # round B: SIGKILL, no cleanup code runs in the kernel

        def all_gone():
            return not existing(ranks | {host_pid}) and not (ranks & gpu_pids())

        try:
            wait_for(all_gone, 15.0 - (time.monotonic() - t0), "the ranks and the launch host to exit")
        except AssertionError:
            raise AssertionError(
                f"after {how}: still there after 15 s: {existing(ranks | {host_pid})} "
                f"(ranks {sorted(ranks)}, host {host_pid})"
            ) from None
    finally:
        stop_kernel(km, kc)


def test_widget_panel_in_a_kernel_replaces_the_text_stream(kernel):
    """With widgets on, the cell shows one panel (a widget view), updated by comm messages, and a summary line."""
    km, kc = kernel
    assert execute(kc, "import os; os.environ['SGPU_MAGIC_WIDGETS'] = '1'").error is None
    try:
        msg_id = kc.execute(
            "%%distributed --gpus 2\nimport os\nfor i in range(50):\n    print('line', i)\nint(os.environ['RANK'])"
        )
        views, updates, stdout, results = 0, 0, "", []
        while True:
            msg = kc.get_iopub_msg(timeout=180)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "display_data" and "application/vnd.jupyter.widget-view+json" in content["data"]:
                views += 1
            elif kind == "comm_msg" and content["data"].get("method") == "update":
                updates += 1
            elif kind == "stream":
                stdout += content["text"]
            elif kind == "execute_result":
                results.append(content["data"]["text/plain"])
            elif kind == "error":
                raise AssertionError(content)
            elif kind == "status" and content["execution_state"] == "idle":
                break
    finally:
        execute(kc, "os.environ['SGPU_MAGIC_WIDGETS'] = '0'")
    assert views == 1 and updates > 0
    assert "[rank" not in stdout
    assert re.search(r"sgpu_magic: job \S+ succeeded in [\d.]+ s on 2 x cpu \(gloo\)", stdout)
    assert results == ["0"]


WHERE_CELL = """
from sgpu_magic import distributed
@distributed(gpus=2, mlflow=False)
def where():
    import os
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
a = where.distributed()
print(repr((a[0] == a[1], a[0][1])))
"""


def test_c15_two_kernels_launching_at_the_same_moment_get_distinct_ports():
    """C15: two kernels run the same job at once; both succeed, each job's ranks agree on its own port."""
    kernels = [start_kernel(), start_kernel()]
    try:
        msg_ids = [kc.execute(WHERE_CELL) for _, kc in kernels]  # both sent before either finishes
        outs = [collect(kc, msg_id, timeout_s=300) for (_, kc), msg_id in zip(kernels, msg_ids)]
        for out in outs:
            assert out.error is None, out.error
        results = [ast.literal_eval(out.stdout.strip().splitlines()[-1]) for out in outs]
        assert [agree for agree, _ in results] == [True, True]
        assert results[0][1] != results[1][1]
    finally:
        for km, kc in kernels:
            stop_kernel(km, kc)


STOP_CELL = """
from sgpu_magic import distributed
@distributed(gpus=2, mlflow=False, widgets=True)
def sleeper():
    import time
    print("sleeping", flush=True)
    time.sleep(600)
sleeper.distributed()
"""


def test_stop_button_clicked_on_a_kernel_subshell_cancels_a_blocking_job():
    """What JupyterLab 4.4+ does: the Stop click comes on a kernel subshell while the blocking cell runs
    (the browser test clicks it for real); the job is cancelled and the cell ends with JobCancelledError."""
    km, kc = start_kernel()
    try:
        subshell = kc.session.msg("create_subshell_request", {})
        kc.control_channel.send(subshell)
        subshell_id = kc.control_channel.get_msg(timeout=30)["content"]["subshell_id"]
        msg_id = kc.execute(STOP_CELL)
        stop_comm, running, clicked_at = None, False, None
        while True:
            msg = kc.get_iopub_msg(timeout=180)
            kind, content = msg["msg_type"], msg["content"]
            if clicked_at is not None and time.monotonic() - clicked_at > 60:
                raise AssertionError("the cell still runs 60 s after Stop was clicked on a subshell")
            if kind == "comm_open" and content["data"]["state"].get("description") == "Stop":
                stop_comm = content["comm_id"]
            if kind == "stream" and "sleeping" in content.get("text", ""):
                running = True
            if kind == "comm_msg" and content["data"].get("state", {}).get("outputs"):
                running = running or "sleeping" in json.dumps(content["data"]["state"]["outputs"])
            if running and clicked_at is None and stop_comm is not None:
                click = kc.session.msg(
                    "comm_msg", {"comm_id": stop_comm, "data": {"method": "custom", "content": {"event": "click"}}}
                )
                click["header"]["subshell_id"] = subshell_id
                kc.shell_channel.send(click)
                clicked_at = time.monotonic()
            if msg["parent_header"].get("msg_id") == msg_id and kind == "error":
                error = content
            if (
                msg["parent_header"].get("msg_id") == msg_id
                and kind == "status"
                and content["execution_state"] == "idle"
            ):
                break
        assert clicked_at is not None, "the job never showed its first line"
        assert error["ename"] == "JobCancelledError", error
    finally:
        stop_kernel(km, kc)


def test_the_default_mlflow_store_stays_in_the_notebooks_folder_after_a_cd(tmp_path):
    """With no tracking URI set, MLflow names a store in the current directory: after ``%cd sub`` every run went to
    a new ``sub/mlflow.db``. The store is the one of the folder the extension was loaded in."""
    from jupyter_client.manager import start_new_kernel

    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    (tmp_path / "sub").mkdir()
    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=90, cwd=str(tmp_path), env=env)
    try:
        assert execute(kc, "%load_ext sgpu_magic").error is None
        assert execute(kc, "%cd sub").error is None
        out = execute(kc, "%%distributed --gpus 1 -o job\n'tracked'")
        assert out.error is None, out.error
        assert kernel_eval(kc, "__import__('os').getcwd()") == str(tmp_path / "sub")
        run_id = kernel_eval(kc, "job.mlflow_run_id")
    finally:
        stop_kernel(km, kc)
    from mlflow import MlflowClient

    run = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.artifact_uri.startswith((tmp_path / "mlruns").as_uri())
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == []  # no mlflow.db, no mlruns/ there


@pytest.mark.parametrize("statement", ["from mlflow.entities import Metric", "import mlflow.tracking"])
def test_the_notebooks_own_mlflow_import_right_after_load_ext_gets_all_of_mlflow(tmp_path, statement):
    """``%load_ext`` has the kernel's tracking worker import mlflow in the background once its cell ends; a next
    cell importing an mlflow submodule meanwhile got ``ImportError: cannot import name ... from partially initialized
    module 'mlflow.entities'`` (or a protobuf ``databricks.proto`` error), every time: it now waits for that import."""
    km, kc = start_kernel(cwd=tmp_path, env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"})
    try:
        out = execute(kc, f"{statement}\nimport mlflow.entities\nprint(mlflow.entities.Run.__name__)")
        assert out.error is None, out.error
        assert out.stdout.strip() == "Run"
    finally:
        stop_kernel(km, kc)
