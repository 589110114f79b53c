"""Live sessions on a Ray cluster (``Session(cluster=...)``): a real two-node Ray cluster on this machine.

``ray.cluster_utils.Cluster`` starts a head node and a worker node with one CPU each, so a 2-rank session puts one
rank on each node (its placement group cannot pack both on one). One session serves the module's tests in order;
the last ones break it, restart it and stop it. Skipped without Ray (``pip install "sgpu_magic[ray]"``).
"""

from __future__ import annotations

import json
import os
import re
import signal

import psutil
import pytest
from IPython.core.error import UsageError

ray = pytest.importorskip("ray")

from sgpu_magic import Session, distributed  # noqa: E402
from sgpu_magic.errors import CellInterruptedError, RankFailedError, ResourceError, SessionError  # noqa: E402

from helpers import interrupt_session_cell, wait_for, wait_gone  # noqa: E402
from kernel_utils import execute, start_kernel, stop_kernel  # noqa: E402

pytestmark = pytest.mark.slow


def _agents() -> list[int]:
    """The rank actors' processes on this machine (Ray names an actor's worker ``ray::RankAgent...``)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if "RankAgent" in " ".join(proc.info["cmdline"] or []):
            found.append(proc.pid)
    return found


def test_a_cluster_address_where_nothing_answers_is_refused_naming_it(ip):
    with pytest.raises(ResourceError, match=r"cannot connect to the Ray cluster '127.0.0.1:9': nothing answers at"):
        Session(gpus=2, cluster="127.0.0.1:9", widgets=False, mlflow=False, name="nowhere")
    with pytest.raises(ResourceError, match=r"cannot connect to the Ray cluster '127.0.0.1:9'"):
        ip.run_line_magic("distributed_session", "start nowhere2 --gpus 2 --cluster 127.0.0.1:9")
    with pytest.raises(UsageError, match=r"argument --cluster: expected one argument"):
        ip.run_line_magic("distributed_session", "start --gpus 2 --cluster")


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    for attempt in (1, 2, 3):  # a raylet gets 30 s (hard-coded in Ray) to register: a busy 2-core machine may miss it
        c = Cluster(initialize_head=False, connect=False)
        try:
            c.add_node(num_cpus=1, include_dashboard=False)
            c.add_node(num_cpus=1)
            c.wait_for_nodes()
            break
        except Exception:
            c.shutdown()
            if attempt == 3:
                raise
    yield c
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


SETUP = (
    "import os, torch, torch.distributed as dist\n"
    "dist.init_process_group('gloo')\n"
    "rank = dist.get_rank()\n"
    "w = torch.ones(3) * (rank + 1)\n"
    "group_id = id(dist.group.WORLD)"
)


@pytest.fixture(scope="module")
def sess(cluster, ip):
    """One 2-rank session on the cluster for the module (one rank per node), stopped at the end."""
    session = Session(gpus=2, cluster=cluster.address, widgets=False, mlflow=False, name="onray")
    session.run_cell(SETUP)
    yield session
    session.stop()


def test_cells_keep_state_and_the_process_group_on_two_nodes(sess):
    job = sess.submit_cell(
        "t = w.clone()\ndist.all_reduce(t)\nprint('reduced on node', os.environ['GROUP_RANK'], flush=True)\n"
        "(rank, os.environ['GROUP_RANK'], t.tolist(), group_id == id(dist.group.WORLD))",
        {},
    )
    assert job.result() == [(0, "0", [3.0, 3.0, 3.0], True), (1, "1", [3.0, 3.0, 3.0], True)]
    assert "reduced on node 1" in job.logs(1)  # the rank's output, copied from its node into the cell's log


def test_push_pull_subsets_and_functions(sess):
    sess.push(lr=0.25)
    assert sess.run_cell("lr * (rank + 1)") == [0.25, 0.5]
    assert sess.run_cell("rank", ranks=[1]) == [1]
    assert sess.pull("w", rank=1).tolist() == [2.0, 2.0, 2.0]
    assert [v.tolist() for v in sess.pull("w")] == [[1.0] * 3, [2.0] * 3]

    def weighted(k):
        return float(w.sum()) * k  # noqa: F821 - w lives in the ranks' namespace

    assert sess.run(weighted, 2) == [6.0, 12.0]
    on_cluster = distributed(gpus=2, cluster=sess.job.spec.cluster, widgets=False, mlflow=False)(weighted)
    assert sess.run(on_cluster, 3) == [9.0, 18.0]  # a decorated function runs in the session too


def test_a_cells_metrics_come_back_from_the_nodes(sess):
    job = sess.submit_cell(
        "from sgpu_magic import runtime\nfor s in range(3):\n    runtime.log_metric('m', s + rank, step=s)", {}
    )
    job.result()
    assert job.metrics() == {"m": {0: [(0, 0.0), (1, 1.0), (2, 2.0)], 1: [(0, 1.0), (1, 2.0), (2, 3.0)]}}


def test_a_profiled_cell_s_traces_come_back_from_the_nodes(sess):
    code = "from sgpu_magic import runtime\nfor _ in range(5):\n    with runtime.step():\n        dist.all_reduce(w.clone())"
    job = sess.profile(code, steps=2)
    assert sorted(job.profile_summary()) == [0, 1] and all(s["steps"] == 2 for s in job.profile_summary().values())
    assert [len(t) for t in job.step_times().values()] == [5, 5]
    assert {e["pid"] for e in json.loads(job.profile_trace().read_bytes())["traceEvents"]} == {0, 1}


def test_a_cell_error_fails_the_cell_and_keeps_the_ranks(sess):
    pids = sess.pids
    with pytest.raises(RankFailedError, match=r"rank 1 failed \(root cause\): ValueError: bad batch on rank 1"):
        sess.run_cell("if rank == 1:\n    raise ValueError('bad batch on rank 1')\nrank")
    assert sess.run_cell("w.sum().item()") == [3.0, 6.0]
    assert sess.pids == pids and all(psutil.pid_exists(p) for p in pids.values())


def test_the_debugger_reaches_a_rank_on_its_node(sess, monkeypatch, capsys):
    """pdb's prompts travel through the rank's actor: post-mortem after a failed cell, and runtime.breakpoint()."""
    answers = ["p secret", "q", "p x", "c"]
    monkeypatch.setattr("builtins.input", lambda prompt="": answers.pop(0))
    with pytest.raises(RankFailedError, match=r"RuntimeError: failed on purpose"):
        sess.run_cell("secret = 41 + rank\nraise RuntimeError('failed on purpose')")
    sess.debug(1)
    assert "42" in capsys.readouterr().out
    assert sess.run_cell("from sgpu_magic import runtime\nx = rank + 1\nruntime.breakpoint(rank=1)\nx * 10") == [10, 20]
    out = capsys.readouterr().out
    assert "rank 1 stopped in pdb" in out and "\n2\n" in out and answers == []


def test_interrupt_keeps_the_state(sess, tmp_path):
    marker = tmp_path / "started"
    code = f"import time, pathlib\npathlib.Path({str(marker)!r} + str(rank)).touch()\nwhile True:\n    time.sleep(0.01)"
    error = interrupt_session_cell(sess, code, marker)
    assert isinstance(error, CellInterruptedError), error
    assert sess.run_cell("w.sum().item()") == [3.0, 6.0]


def test_a_rank_blocked_in_a_collective_on_ray_needs_a_restart_and_recover_says_why(sess, tmp_path):
    """recover() cannot reach the connections of ranks on a cluster's nodes: the broken session says to restart
    (naming where rank 0 waits), recover() says why it cannot, restart brings fresh ranks."""
    marker = tmp_path / "entered"
    code = f"import pathlib\npathlib.Path({str(marker)!r} + str(rank)).touch()\nif rank == 0:\n    dist.all_reduce(w)"
    error = interrupt_session_cell(sess, code, marker, ranks=(0,))
    assert isinstance(error, CellInterruptedError), error
    assert re.search(
        r"session onray needs a restart: rank\(s\) 0 did not return within 5 s of the interrupt \(blocked outside "
        r"Python: rank 0: dist\.all_reduce at session onray cell \d+ line 4 waiting for its peers\); run "
        r"%distributed_session restart",
        str(error),
    ), error
    with pytest.raises(SessionError, match=r"session onray runs on a Ray cluster, where recover\(\) cannot reach"):
        sess.recover()
    sess.restart()
    sess.run_cell(SETUP)  # the module's session as its fixture made it, for the tests after this one
    assert sess.run_cell("t = w.clone()\ndist.all_reduce(t)\nt.tolist()") == [[3.0] * 3] * 2


def test_a_rank_that_dies_breaks_the_session_and_restart_brings_fresh_ranks(sess):
    with pytest.raises(SessionError, match=r"session onray is broken: rank 1 died \(exit code 3\); the other ranks"):
        sess.run_cell("import os\nif rank == 1:\n    os._exit(3)\nimport time\ntime.sleep(60)")
    with pytest.raises(SessionError, match=r"session onray is broken: rank 1 died"):
        sess.run_cell("rank")
    sess.restart()
    assert sess.run_cell("import os\n('w' in globals(), int(os.environ['RANK']))") == [(False, 0), (False, 1)]


def test_stop_leaves_no_rank_and_no_actor(sess):
    pids = list(sess.pids.values())
    assert _agents()
    sess.stop()
    assert not wait_gone(pids, 30)
    wait_for(lambda: not _agents(), 60, "Ray to remove the session's rank actors")


def test_a_sigkilled_kernel_leaves_no_session_rank_or_actor(cluster, tmp_path):
    """The kernel is the Ray driver and owns the session's actors: when it is SIGKILLed, Ray removes them, and
    the ranks die with them."""
    km, kc = start_kernel(cwd=tmp_path, env={"SGPU_MAGIC_WIDGETS": "0"})
    try:
        out = execute(
            kc,
            f"%distributed_session start --gpus 2 --cluster {cluster.address} --no-mlflow -o s\n"
            "print('pids', *s.pids.values())",
            timeout_s=300,
        )
        assert out.error is None, out.error
        pids = [int(p) for p in out.stdout.split("pids ", 1)[1].split()]
        assert all(psutil.pid_exists(p) for p in pids) and _agents()
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        assert not wait_gone(pids, 60), "the session's ranks outlived the kernel"
        wait_for(lambda: not _agents(), 60, "Ray to remove the dead kernel's rank actors")
    finally:
        stop_kernel(km, kc)
