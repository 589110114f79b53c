"""Time from ``fn.distributed()`` to the first line of the first rank, and to the result.

Usage: ``.venv/bin/python benchmarks/first_line.py [--ranks 2] [--repeats 5]``. Prints the
median and range of each, for a trivial job (print, init gloo, one all_reduce).
Not a test: numbers for notes and BENCHMARKS.md, measured on the machine at hand.
"""

from __future__ import annotations

import argparse
import statistics
import time

from sgpu_magic import distributed
from sgpu_magic.launch.client import get_host
from sgpu_magic.testing import start_job
from sgpu_magic.ui.text import TextView


class _Stamp(TextView):
    def __init__(self) -> None:
        super().__init__()
        self.first_line_s: float | None = None

    def lines(self, rank, lines):
        if self.first_line_s is None:
            self.first_line_s = time.perf_counter()


@distributed(gpus=2)
def trivial():
    print("first line", flush=True)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    fn = distributed(gpus=args.ranks)(trivial.__sgpu_function__)
    get_host()
    first, total = [], []
    for _ in range(args.repeats):
        view = _Stamp()
        t0 = time.perf_counter()
        job = start_job(fn, (), view=view)
        assert job.result() == [float(args.ranks)] * args.ranks
        total.append(time.perf_counter() - t0)
        first.append(view.first_line_s - t0)
    for name, xs in (("distributed() -> first rank's first line", first), ("distributed() -> result", total)):
        print(f"{name}: median {statistics.median(xs):.3f} s (min {min(xs):.3f}, max {max(xs):.3f}, n={len(xs)})")


if __name__ == "__main__":
    main()
