"""Launch-to-result latency of a trivial 4-rank job: on a local two-node Ray cluster vs the local launcher.

    .venv/bin/python -m benchmarks.ray_launch [--reps 5]

The job: init a gloo process group, one all_reduce, return the rank. The Ray cluster is a head
and a worker node on this machine (``ray.cluster_utils.Cluster``, 2 CPUs each), so the ranks of
the Ray job spread over two raylets as over two machines. Both are called through the decorator
in this process, interleaved, with the defaults (MLflow on: one run per job, in a SQLite store in a scratch
folder) and then with ``mlflow=False``, after one call each to warm up (the local launcher's forkserver; for Ray,
the first job's placement group and agents, kept warm for the next job of its shape, whose zygotes have preloaded
torch before the repeated calls start: an edit-and-rerun loop's pause); the table shows medians and min-max.
``--no-keep-warm`` measures Ray with ``ray_keep_warm_s = 0`` (a fresh placement group, agents and interpreters
per job, as before warm Ray jobs). Needs ``pip install "sgpu_magic[ray]"``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def trivial():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-keep-warm", action="store_true", help="ray_keep_warm_s = 0: nothing kept between jobs")
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="sgpu-bench-ray-")
    os.environ.setdefault("SGPU_MAGIC_HOME", scratch)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{scratch}/mlflow.db")
    os.environ["SGPU_MAGIC_WIDGETS"] = "0"
    if args.no_keep_warm:
        os.environ["SGPU_MAGIC_RAY_KEEP_WARM_S"] = "0"
    from ray.cluster_utils import Cluster

    from sgpu_magic import distributed

    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    started_s = time.perf_counter() - t0
    peers = {
        "local launcher (MLflow on)": distributed(gpus=4, widgets=False)(trivial),
        "Ray, 2 nodes (MLflow on)": distributed(gpus=4, cluster=cluster.address, widgets=False)(trivial),
        "local launcher, mlflow=False": distributed(gpus=4, mlflow=False, widgets=False)(trivial),
        "Ray, 2 nodes, mlflow=False": distributed(gpus=4, cluster=cluster.address, mlflow=False, widgets=False)(
            trivial
        ),
    }
    first = {}
    for name, fn in peers.items():
        t = time.perf_counter()
        assert fn.distributed() == [0, 1, 2, 3]
        first[name] = time.perf_counter() - t
        if name.startswith("Ray"):
            _wait_warm()
    samples = {name: [] for name in peers}
    for _ in range(args.reps):
        for name, fn in peers.items():
            t = time.perf_counter()
            assert fn.distributed() == [0, 1, 2, 3]
            samples[name].append(time.perf_counter() - t)
    import ray

    import sgpu_magic

    sgpu_magic.release()
    ray.shutdown()  # the driver first: Ray refuses to remove a node its driver is connected to
    cluster.shutdown()
    print(f"Ray cluster start (head + 1 worker node): {started_s:.1f} s; keep warm: {not args.no_keep_warm}")
    print("| 4-rank trivial job | first call s | median s | min-max s | vs local launcher, same MLflow setting |")
    print("|---|---:|---:|---:|---:|")
    for name, got in samples.items():
        med = statistics.median(got)
        local = statistics.median(samples[name.replace("Ray, 2 nodes", "local launcher")])
        print(f"| {name} | {first[name]:.2f} | {med:.2f} | {min(got):.2f}-{max(got):.2f} | {med / local:.1f}x |")


def _wait_warm(timeout_s: float = 300.0) -> None:
    """Until the kept agents' zygotes have preloaded torch (nothing is kept with --no-keep-warm)."""
    import ray

    from sgpu_magic.launch.ray.warm import WARM

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = WARM.held()
        if held is None or all(ray.get([a.warm.remote() for a in held.actors])):
            return
        time.sleep(0.2)


if __name__ == "__main__":
    main()
