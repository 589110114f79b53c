"""The launch host's entry point: detach from the kernel, import torch once, fork the warm forkserver, then serve.

Started by :mod:`sgpu_magic.launch.client` as ``python -c "from sgpu_magic.launch.host.boot import main; ..."
<log> <kernel_pid>``. It detaches (its own session, not a child of the kernel, so Jupyter's interrupt does not
reach it) and answers ``ready <pid>`` on stdout. Then it imports torch, ``torch._dynamo`` and the rest of what warm
ranks need, and forks its forkserver from itself (:meth:`~sgpu_magic.launch.host.warm_pool.WarmPool.start_forked`)
before it starts any thread: torch is imported once, not by the host and again by a forkserver of its own, which on
2 cores halved the time a fresh kernel's first launch waits (0.74 s against 1.58 s for one rank in the same
benchmark) and the two processes' private memory (89 against 374 MB).
"""

from __future__ import annotations

import gc
import importlib
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sgpu_magic._util.proc import adopt_orphans
from sgpu_magic.launch.host.warm_pool import HOST_PRELOAD, WarmPool
from sgpu_magic.rundir import HOST_WARM_STATS, host_warm_marker

if TYPE_CHECKING:
    from sgpu_magic.launch.host.keeper import RayJobs


def _detach(log_path: str, before_ready: Callable[[], object] | None = None) -> None:
    """Leave the kernel's process tree (fork; the parent exits), run ``before_ready`` (the run keeper binds its
    socket), say ready, log to ``log_path``."""
    if os.fork() > 0:
        os._exit(0)
    adopt_orphans()
    if before_ready is not None:
        before_ready()
    sys.stdout.write(f"ready {os.getpid()}\n")
    sys.stdout.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _import(warm: bool) -> float:
    """Import torch elastic's process API (and torch), and with ``warm`` the rest of what warm ranks need
    (:data:`~sgpu_magic.launch.host.warm_pool.HOST_PRELOAD`), before the host serves; seconds ``import torch``
    took (what a cold rank pays on this machine now). The cyclic collector is off from here until :func:`_freeze`
    (torch's ~300k objects live as long as the host: collecting them while importing is wasted CPU)."""
    gc.disable()
    started = time.perf_counter()
    import torch.distributed.elastic.multiprocessing.api  # noqa: F401

    import_s = time.perf_counter() - started
    if warm:
        for name in HOST_PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError as exc:  # as a forkserver's own preload: the ranks import it (or fail) themselves
                print(f"sgpu_magic host: could not preload {name} ({exc})", file=sys.stderr, flush=True)
    return import_s


def _freeze() -> None:
    """Move everything imported so far into gc's permanent generation and turn the collector on again: called
    right before the forkserver is forked, so its ranks inherit exactly the preload frozen (a rank's gc.collect()
    does not walk it) and the host's serving modules, imported after the fork, never reach them."""
    gc.freeze()
    gc.enable()


def main(argv: list[str], ray_jobs: Callable[[str, str | None], RayJobs] | None = None) -> None:
    """``argv``: ``[_, log_path, kernel_pid]``, a kernel's host, which runs until the kernel closes its stdin or
    dies; or ``[_, log_path, "keeper", socket_path, lock_path]``, the user's run keeper
    (:mod:`sgpu_magic.launch.host.keeper`), which binds its socket before it says ready and runs until it holds no
    run. ``ray_jobs``: the keeper's factory of the Ray backend's supervisor (:mod:`sgpu_magic.launch.keeper_main`
    passes it; the launch host imports no backend)."""
    log_path = argv[1]
    keeper = argv[2] == "keeper"
    kernel_pid = None if keeper else int(argv[2])
    listener: list[socket.socket] = []
    if keeper:
        from sgpu_magic._util.unix_socket import bind_private

        def bind() -> None:
            try:
                listener.append(bind_private(Path(argv[3])))
            except OSError as exc:  # the kernel's handshake shows it
                sys.stdout.write(f"error {exc}\n")
                sys.stdout.flush()
                os._exit(1)

        _detach(log_path, bind)
    else:
        _detach(log_path)
    warm = os.environ.get("SGPU_MAGIC_START_METHOD", "forkserver") != "subprocess"
    import_s = _import(warm)
    pool = None
    if warm:
        pool = WarmPool(str(host_warm_marker(log_path)), Path(log_path).parent / HOST_WARM_STATS)
        pool.import_s = import_s
        _freeze()
        pool.start_forked(sys.path)  # before the host starts a thread, and before it imports what it serves with
    else:
        _freeze()
    from sgpu_magic.launch.host.process import serve  # the host's own modules: after the fork, never in a rank

    host = None
    if keeper:
        from sgpu_magic.launch.host.keeper import Keeper

        assert ray_jobs is not None  # the keeper's program passes it (launch.keeper_main)
        host = Keeper(listener[0], Path(argv[3]), Path(argv[4]), pool, log_path, ray_jobs)
    serve(kernel_pid, pool, log_path, import_s, host=host)
