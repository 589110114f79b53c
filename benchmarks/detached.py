"""What detaching costs: launch-to-result latency of a trivial 2-rank job under the run keeper against the kernel's
launch host, and how long attaching to a run takes.

    .venv/bin/python -m benchmarks.detached [--reps 5] [--ray]

Both kinds are called through the decorator in this process, interleaved, with the defaults (MLflow on: one run
per job, in a SQLite store in a scratch folder), after one call each to warm up (the host's forkserver; the keeper,
which the first detached job starts). The first detached call's time includes starting the keeper. Attaching: a
detached job prints 200 lines per rank and ends; then ``sgpu_magic.attach(job_id)`` (a handle rebuilt from the run
directory) until ``result()`` returns, every line pumped to the text view. ``--ray`` adds the same job on a one-node
Ray cluster started here (4 CPUs: the warm agents of one and those of the other fit at once): supervised by this
process (the Ray driver) against ``detach=True`` (supervised by the run keeper); each keeps its last job's rank agents
warm for the next.
"""

from __future__ import annotations

import argparse
import contextlib
import io
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


def chatty():
    for i in range(200):
        print("line", i)
    return 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ray", action="store_true", help="also on a Ray cluster started here")
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="sgpu-bench-detached-")
    os.environ.setdefault("SGPU_MAGIC_HOME", scratch)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{scratch}/mlflow.db")
    os.environ["SGPU_MAGIC_WIDGETS"] = "0"
    import sgpu_magic
    from sgpu_magic import distributed

    peers = {
        "launch host (MLflow on)": distributed(gpus=2, widgets=False)(trivial),
        "run keeper, detach=True (MLflow on)": distributed(gpus=2, widgets=False, detach=True)(trivial),
    }
    cluster = None
    if args.ray:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 4})
        on = {"cluster": cluster.address, "widgets": False}
        peers["Ray, the kernel's driver (MLflow on)"] = distributed(gpus=2, **on)(trivial)
        peers["Ray, run keeper, detach=True (MLflow on)"] = distributed(gpus=2, detach=True, **on)(trivial)
    first, samples = {}, {name: [] for name in peers}
    for name, fn in peers.items():
        t = time.perf_counter()
        assert fn.distributed() == [0, 1]
        first[name] = time.perf_counter() - t
    for _ in range(args.reps):
        for name, fn in peers.items():
            t = time.perf_counter()
            assert fn.distributed() == [0, 1]
            samples[name].append(time.perf_counter() - t)
    attach_s = []
    job_fn = distributed(gpus=2, widgets=False, detach=True)(chatty)
    for _ in range(args.reps):
        with contextlib.redirect_stdout(io.StringIO()):
            job_id = job_fn.submit().job_id
            job_fn.last_job.wait()
            t = time.perf_counter()
            assert sgpu_magic.attach(job_id).result() == [1, 1]
        attach_s.append(time.perf_counter() - t)
    print("| 2-rank trivial job | first call s | median s | min-max s | vs launch host |")
    print("|---|---:|---:|---:|---:|")
    host = statistics.median(samples["launch host (MLflow on)"])
    for name, got in samples.items():
        med = statistics.median(got)
        print(f"| {name} | {first[name]:.2f} | {med:.2f} | {min(got):.2f}-{max(got):.2f} | {med / host:.1f}x |")
    print(
        f"attach to an ended 2-rank run of 200 lines per rank, to its result: median {statistics.median(attach_s):.3f} s "
        f"({min(attach_s):.3f}-{max(attach_s):.3f})"
    )
    if cluster is not None:
        import ray

        sgpu_magic.release()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
