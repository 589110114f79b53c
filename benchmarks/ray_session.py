"""A live session on a local two-node Ray cluster: its start against a fresh Ray job's, and a trivial cell's time.

    .venv/bin/python -m benchmarks.ray_session [--reps 5] [--cells 30]

The cluster is a head and a worker node on this machine (``ray.cluster_utils.Cluster``, one CPU each), so the
2 ranks of a job or session take one node each, as over two machines. Measured in this process (the kernel's
place), medians and min-max over ``--reps``, after one call of each to warm Ray's worker pool:

- a fresh Ray job: ``fn.distributed()`` of a 2-rank function that inits gloo, all-reduces one element, returns
  the rank (what each job on the cluster pays);
- a session's start: ``Session(gpus=2, cluster=...)`` until its ranks are ready, then its first cell (init
  gloo), then ``stop``;
- cells on a live Ray session (``--cells`` each): ``x = 1``, and one ``all_reduce`` on the process group made
  once; the same two on a local session for reference.

Needs ``pip install "sgpu_magic[ray]"``. Not a test: nothing asserts on time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

INIT = "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\nt = torch.ones(1)"


def trivial():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank()


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _session_start(cluster: str | None) -> tuple[float, float]:
    """(start until ready, start + first cell) of one session, stopped afterwards."""
    from sgpu_magic import Session

    t = time.perf_counter()
    sess = Session(gpus=2, cluster=cluster, mlflow=False, widgets=False)
    ready = time.perf_counter() - t
    sess.run_cell(INIT)
    first = time.perf_counter() - t
    sess.stop()
    return ready, first


def _cells(cluster: str | None, n: int) -> dict[str, list[float]]:
    from sgpu_magic import Session

    sess = Session(gpus=2, cluster=cluster, mlflow=False, widgets=False)
    sess.run_cell(INIT)
    out: dict[str, list[float]] = {"x = 1": [], "all_reduce": []}
    for _ in range(n):
        out["x = 1"].append(_timed(lambda: sess.run_cell("x = 1")))
        out["all_reduce"].append(_timed(lambda: sess.run_cell("dist.all_reduce(t)")))
    sess.stop()
    return out


def _row(name: str, got: list[float], ref: float | None = None) -> str:
    med = statistics.median(got)
    vs = f" {med / ref:.2f}x |" if ref else " |"
    return f"| {name} | {med:.3f} | {min(got):.3f}-{max(got):.3f} |{vs}"


def _start_cluster():
    from ray.cluster_utils import Cluster

    for attempt in (1, 2, 3):  # a raylet gets 30 s (hard-coded in Ray) to register: a busy machine may miss it
        cluster = Cluster(initialize_head=False, connect=False)
        try:
            cluster.add_node(num_cpus=1, include_dashboard=False)
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            return cluster
        except Exception:
            cluster.shutdown()
            if attempt == 3:
                raise
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cells", type=int, default=30)
    args = parser.parse_args(argv)
    os.environ.setdefault("SGPU_MAGIC_HOME", tempfile.mkdtemp(prefix="sgpu-bench-ray-session-"))
    os.environ["SGPU_MAGIC_WIDGETS"] = "0"
    import ray

    from sgpu_magic import distributed

    cluster = _start_cluster()
    try:
        job = distributed(gpus=2, cluster=cluster.address, mlflow=False, widgets=False)(trivial)
        job.distributed()  # warm Ray's worker pool
        _session_start(cluster.address)
        jobs = [_timed(job.distributed) for _ in range(args.reps)]
        starts = [_session_start(cluster.address) for _ in range(args.reps)]
        on_ray = _cells(cluster.address, args.cells)
        local = _cells(None, args.cells)
    finally:
        ray.shutdown()  # the driver first: Ray refuses to remove a node its driver is connected to
        cluster.shutdown()
    job_s = statistics.median(jobs)
    print(f"2 ranks, one per node; medians of {args.reps} (start) and {args.cells} (cells)")
    print("| what | median s | min-max s | vs a fresh Ray job |")
    print("|---|---:|---:|---:|")
    print(_row("fresh Ray job (init gloo, all_reduce)", jobs, job_s))
    print(_row("Ray session start, until ready", [s[0] for s in starts], job_s))
    print(_row("Ray session start + first cell (init gloo)", [s[1] for s in starts], job_s))
    for name, got in on_ray.items():
        print(_row(f"Ray session cell `{name}`", got, job_s))
    for name, got in local.items():
        print(_row(f"local session cell `{name}`", got, job_s))


if __name__ == "__main__":
    main()
