"""What a metric point costs the rank that logs it: ``runtime.log_metric`` untracked and tracked, and
``mlflow.log_metric`` as MLflow has it and as a tracked rank has it (intercepted into the metrics file); what a
step mark costs (``runtime.step()``, bare and as a ``with`` block: two points each), and what the rank's timing
wrapper adds to a collective (a 1-rank gloo ``all_reduce``, wrapped and torch's own).

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.metrics_cost [N]     # N points per measurement (default 100,000)

One CPU rank per job, a scratch sgpu_magic home and MLflow sqlite store; each measurement is its own job, so
MLflow's writing of one does not slow the next. Prints microseconds per call in the rank, and for the tracked
``runtime.log_metric`` the seconds the rank's end waited for MLflow to take the points (its store's
throughput). Not a test: nothing here asserts on time.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def _runtime(n: int) -> dict[str, float]:
    import time

    from sgpu_magic import runtime
    from sgpu_magic._util.metrics import WRITER

    runtime.log_metric("warm", 0.0)
    start = time.perf_counter()
    for step in range(n):
        runtime.log_metric("loss", 0.5, step=step)
    call_us = (time.perf_counter() - start) / n * 1e6
    start = time.perf_counter()
    WRITER.flush()
    return {"runtime.log_metric us/call": call_us, "end of rank waited s": time.perf_counter() - start}


def _steps(n: int) -> dict[str, float]:
    import time

    import torch
    import torch.distributed as dist

    from sgpu_magic import runtime
    from sgpu_magic._util.metrics import WRITER

    out = {}
    for _ in range(2):  # twice: the second round's figures are kept
        start = time.perf_counter()
        for _ in range(n):
            runtime.step()
        out["runtime.step() us/call"] = (time.perf_counter() - start) / n * 1e6
        start = time.perf_counter()
        for _ in range(n):
            with runtime.step():
                pass
        out["with runtime.step() us/step"] = (time.perf_counter() - start) / n * 1e6
        WRITER.flush()
    dist.init_process_group("gloo")
    t, calls = torch.ones(1), n // 10
    for label, fn in (("wrapped", dist.all_reduce), ("torch's own", dist.all_reduce.__wrapped__)) * 2:
        start = time.perf_counter()
        for _ in range(calls):
            fn(t)
        out[f"all_reduce {label} us/call"] = (time.perf_counter() - start) / calls * 1e6
    dist.destroy_process_group()
    return out


def _mlflow(n: int) -> dict[str, float]:
    import time

    import mlflow
    from mlflow.tracking import fluent

    out = {}
    both = (
        ("mlflow.log_metric, MLflow's own", "own", fluent.log_metric),
        ("intercepted", "intercepted", mlflow.log_metric),
    )
    for label, name, log in both + both:  # twice each, alternating: the second round's figures are kept
        log("warm", 0.0)
        mlflow.flush_async_logging()
        start = time.perf_counter()
        for step in range(n):
            log(name, 0.5, step=step)
        out[f"{label} us/call"] = (time.perf_counter() - start) / n * 1e6
        mlflow.flush_async_logging()
    return out


def main(argv: list[str]) -> int:
    n = int(argv[1]) if len(argv) > 1 else 100_000
    scratch = tempfile.mkdtemp(prefix="sgpu-metrics-bench-")
    os.environ["SGPU_MAGIC_HOME"] = os.path.join(scratch, "home")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{scratch}/mlflow.db"
    from sgpu_magic import distributed

    runs = [
        ("untracked", _runtime, False, n),
        ("tracked", _runtime, True, n),
        ("tracked", _mlflow, True, n // 20),
        ("steps, tracked", _steps, True, n),
        ("steps, untracked", _steps, False, n),
    ]
    for label, body, tracked, points in runs:
        fn = distributed(gpus=1, mlflow=tracked, widgets=False)(body)
        start = time.perf_counter()
        result = fn.distributed(points)[0]
        result["job s"] = time.perf_counter() - start
        print(f"{label} ({points} points):", json.dumps({k: round(v, 2) for k, v in result.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
