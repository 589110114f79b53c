"""The launch host's entry point: detach from the kernel, start the warm forkserver, then serve.

Started by :mod:`sgpu_magic.launch.client` as ``python -c "from sgpu_magic.launch.host.boot import main; ..."
<log> <kernel_pid>``. It detaches (its own session, not a child of the kernel, so Jupyter's interrupt does not
reach it), answers ``ready <pid>`` on stdout, and starts its forkserver preloading torch before it imports the
rest of the host (:mod:`sgpu_magic.launch.host.process`): the first launch waits for that forkserver, so every
tenth of a second it starts earlier is one the first launch does not wait.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sgpu_magic._util.proc import adopt_orphans
from sgpu_magic.launch.host.warm_pool import WarmPool
from sgpu_magic.rundir import HOST_WARM_STATS, host_warm_marker


def _detach(log_path: str) -> None:
    """Leave the kernel's process tree (fork; the parent exits), say ready, log to ``log_path``."""
    if os.fork() > 0:
        os._exit(0)
    adopt_orphans()
    sys.stdout.write(f"ready {os.getpid()}\n")
    sys.stdout.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str]) -> None:
    """``argv``: ``[_, log_path, kernel_pid]``; runs until the kernel closes the host's stdin or dies."""
    log_path, kernel_pid = argv[1], int(argv[2])
    _detach(log_path)
    pool = None
    if os.environ.get("SGPU_MAGIC_START_METHOD", "forkserver") != "subprocess":
        pool = WarmPool(str(host_warm_marker(log_path)), Path(log_path).parent / HOST_WARM_STATS)
        pool.ready(sys.path)  # the forkserver preloads while the host imports the rest and torch

    from sgpu_magic.launch.host.process import serve

    serve(kernel_pid, pool, log_path)
