"""What MLflow tracking adds to a job: a trivial 2-rank job with and without tracking.

Usage: ``.venv/bin/python benchmarks/tracking_overhead.py [--repeats 5]``. Runs in a temporary
sgpu_magic home with a fresh local sqlite store; mlflow is imported and the store created before
timing (as the extension's background import and the first job do). Prints the median wall time
of ``fn.distributed()`` per mode and the difference. Not a test: numbers for notes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    os.environ["SGPU_MAGIC_HOME"] = tmp
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"

    import io

    from sgpu_magic import distributed
    from sgpu_magic.ui.text import TextView

    def trivial():
        return 1

    def timed(fn) -> float:
        from sgpu_magic.testing import start_job

        t0 = time.perf_counter()
        job = start_job(fn, (), view=TextView(out=io.StringIO(), err=io.StringIO()))
        job.result()
        return time.perf_counter() - t0

    tracked = distributed(gpus=2, mlflow=True, widgets=False)(trivial)
    plain = distributed(gpus=2, mlflow=False, widgets=False)(trivial)
    t0 = time.perf_counter()
    import mlflow  # noqa: F401 - the extension imports it in the background at load

    print(f"import mlflow: {time.perf_counter() - t0:.2f} s")
    print(f"first tracked job (creates the sqlite store): {timed(tracked):.2f} s")
    timed(plain)
    times = {"tracked": [], "untracked": []}
    for _ in range(args.repeats):
        times["untracked"].append(timed(plain))
        times["tracked"].append(timed(tracked))
    for mode, values in times.items():
        print(f"{mode}: median {statistics.median(values):.3f} s  ({', '.join(f'{v:.2f}' for v in values)})")
    print(f"tracking adds: {statistics.median(times['tracked']) - statistics.median(times['untracked']):.3f} s per job")


if __name__ == "__main__":
    main()
