"""Heavy logging through a view: 2 ranks print N lines each as fast as they can.

Usage: ``.venv/bin/python benchmarks/logging_load.py [--lines 100000] [--view panel|text]``.
Prints the kernel-side CPU seconds spent following the job (this process), the wall time,
the frontend updates per second (panel flushes), and the lines found in the log files.
Not a test: numbers for notes and BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import io
import time

from sgpu_magic import distributed
from sgpu_magic.launch.client import get_host
from sgpu_magic.testing import start_job
from sgpu_magic.ui.panel import Panel
from sgpu_magic.ui.text import TextView


@distributed(gpus=2)
def flood(n):
    import os
    import sys

    rank = os.environ["RANK"]
    write = sys.stdout.write
    for i in range(n):
        write(f"r{rank} line {i:07d} " + "x" * 80 + "\n")
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--view", choices=["panel", "text"], default="panel")
    args = parser.parse_args()
    get_host()
    view = Panel() if args.view == "panel" else TextView(out=io.StringIO())
    cpu0, t0 = time.process_time(), time.perf_counter()
    job = start_job(flood, (args.lines,), view=view)
    job.result()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    counts = [job.logs(r).count("\n") for r in range(2)]
    print(
        f"view={args.view} lines/rank={args.lines} wall={wall:.2f} s kernel_cpu={cpu:.2f} s "
        f"({100 * cpu / wall:.0f}% of wall) log_lines={counts}"
    )
    if isinstance(view, Panel):
        print(f"frontend updates: {view.flushes} in {wall:.2f} s = {view.flushes / wall:.1f}/s")


if __name__ == "__main__":
    main()
