"""What a GPU lease costs: launch overhead, and how fast a queued job starts once GPUs free up.

Usage: ``.venv/bin/python -m benchmarks.leases [--repeats 7]``. Uses the fake inventory
(``SGPU_MAGIC_FAKE_GPUS="8 x H100"``, ranks on CPU) and a private lease directory.
Prints medians and ranges:

- warm launch-to-result of a trivial 2-rank job with a lease (fake GPUs) vs without (CPU);
- queue latency: a job waits for 8 GPUs held by another holder; the time from that
  holder's release to the job's ranks starting (status ``started_s``).

Not a test: numbers for notes and BENCHMARKS.md, measured on the machine at hand.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def _stats(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1000:.0f} ms (min {min(xs) * 1000:.0f}, max {max(xs) * 1000:.0f}, n={len(xs)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="sgpu_bench_leases_")
    os.environ.setdefault("SGPU_MAGIC_HOME", home)
    os.environ["SGPU_MAGIC_LEASE_DIR"] = os.path.join(home, "leases")

    from sgpu_magic import distributed
    from sgpu_magic.launch.client import get_host
    from sgpu_magic.launch.leases import LeaseRegistry
    from sgpu_magic.launch.resources import fake_gpus
    from sgpu_magic.rundir import RunDir, read_json

    @distributed(gpus=2, widgets=False, mlflow=False)
    def trivial():
        return 1

    get_host()
    trivial.distributed()  # warm the forkserver
    with_lease, without = [], []
    for _ in range(args.repeats):
        for fake, into in (("8 x H100", with_lease), ("", without)):
            os.environ["SGPU_MAGIC_FAKE_GPUS"] = fake
            t0 = time.perf_counter()
            trivial.distributed()
            into.append(time.perf_counter() - t0)
    os.environ["SGPU_MAGIC_FAKE_GPUS"] = "8 x H100"
    registry = LeaseRegistry()
    queue = []
    for _ in range(args.repeats):
        holder = registry.acquire("holder", 8, fake_gpus("8 x H100"))
        job = trivial.submit()
        while not job.pending_reason:
            time.sleep(0.001)
        released = time.time()
        holder.release()
        job.result(timeout_s=60)
        queue.append(read_json(RunDir(job.run_dir).status_file)["started_s"] - released)
    print("launch-to-result, trivial 2-rank warm job, with a lease (fake GPUs):", _stats(with_lease))
    print("launch-to-result, trivial 2-rank warm job, without (CPU):           ", _stats(without))
    print(
        f"lease overhead (median difference): {(statistics.median(with_lease) - statistics.median(without)) * 1000:.0f} ms"
    )
    print("queued job: GPUs released -> ranks started:", _stats(queue))


if __name__ == "__main__":
    main()
