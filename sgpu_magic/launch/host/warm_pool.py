"""The launch host's warm pool: a forkserver with torch preloaded, and when a launch should wait for it.

Ranks fork from the forkserver (torch, ``torch._dynamo`` and elastic's wrapper already imported,
never CUDA), so a warm launch skips interpreter start-up and ``import torch``. The first forkserver
is a fork of the host once it has imported all that (:meth:`WarmPool.start_forked`), so it is ready
when the host is. One restarted because the packages changed is a fresh interpreter that takes
seconds to preload; a launch that arrives meanwhile starts cold interpreters, unless the forkserver
is expected to be ready before they would have started (:meth:`WarmPool.wait_s`).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from sgpu_magic._compat.forkserver import fork_forkserver, forkserver_pid, stop_forkserver
from sgpu_magic._util.fs import site_packages_fingerprint, touch_private
from sgpu_magic._util.proc import die_with_parent
from sgpu_magic.rundir import atomic_write_json, read_json

HOST_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "torch.distributed.elastic.multiprocessing",
    "sgpu_magic.rank.worker",
    "sgpu_magic._compat.elastic",  # elastic starts each warm rank through its wrap_no_wait
]
"""Modules warm ranks find imported, so they skip them (the first DDP imports torch._dynamo; elastic's per-rank
wrapper is unpickled from torch.distributed.elastic.multiprocessing, ~25 ms of CPU per rank otherwise). The host
imports them itself before it forks its forkserver (:meth:`WarmPool.start_forked`)."""

WARM_PRELOAD = ["sgpu_magic.launch.host.forkserver_guard", *HOST_PRELOAD, "sgpu_magic.launch.host.warm_ready"]
"""What a forkserver the host restarts (a fresh interpreter) preloads: :data:`HOST_PRELOAD` between the module
that makes it die with the host and the one that marks it ready (what a forked one gets from the host instead)."""

PRELOAD_PER_IMPORT = 2.0
"""A restarted forkserver's preload takes about this many times the host's own ``import torch`` (torch._dynamo adds
about as much again): the estimate before the ratio has been measured on this machine."""
INTERPRETER_S = 0.3
"""A cold rank's own start-up besides ``import torch`` (interpreter, sgpu_magic's worker, the rendezvous)."""


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class WarmPool:
    """The host's forkserver, with torch preloaded (never CUDA-initialised): ranks fork from it.

    It is restarted when the environment's packages change (a ``%pip install`` after it
    started), detected from the modification times of the ``site-packages`` folders on the
    ranks' ``sys.path``. Modules outside them (the notebook's own ``.py`` files) are never
    preloaded, so each rank imports them fresh.

    Attributes:
        import_s: seconds the host's own ``import torch`` took, alongside the forkserver's preloading (set by
            the host; the cost of a cold rank under the machine's load of the moment).
        ratio: the forkserver's preload time over ``import_s``, last measured on this machine (``None``: never);
            the load of the moment scales both alike, so ``ratio * import_s`` is the expected preload time.
    """

    def __init__(self, marker: str, stats_path: Path | None = None) -> None:
        self.fingerprint: tuple | None = None
        self.marker = marker
        self.stats_path = stats_path
        self.started_s: float | None = None  # time.time() of the forkserver's (re)start
        self.import_s: float | None = None
        self.ratio: float | None = _read_ratio(stats_path)
        self._measured = False

    def ready(self, sys_path: Sequence[str]) -> bool:
        """Start (or restart) the forkserver as needed; whether it has finished preloading."""
        import multiprocessing.forkserver as forkserver

        fingerprint = site_packages_fingerprint(sys_path)
        if self.fingerprint is not None and fingerprint != self.fingerprint:
            stop_forkserver()
            if os.path.exists(self.marker):
                os.unlink(self.marker)
            self.started_s, self._measured = None, False
        self.fingerprint = fingerprint
        os.environ["SGPU_MAGIC_WARM_MARKER"] = self.marker
        os.environ["SGPU_MAGIC_HOST_PID"] = str(os.getpid())
        forkserver.set_forkserver_preload(WARM_PRELOAD)
        if self.started_s is None:
            self.started_s = time.time()
        forkserver.ensure_running()
        if not os.path.exists(self.marker):
            return False
        self._record_warm_s()
        return True

    def start_forked(self, sys_path: list[str]) -> bool:
        """Start the forkserver as a fork of the host, which has imported everything in :data:`HOST_PRELOAD`
        itself: ready at once, and torch imported once instead of twice on the machine's
        cores in the seconds before the first launch. Call it before the host starts any thread.

        Falls back to :meth:`ready` (a fresh interpreter that preloads) where this Python's forkserver is not the
        shape :func:`sgpu_magic._compat.forkserver.fork_forkserver` knows. A forkserver restarted later (the
        packages changed) is always a fresh interpreter: the host's own modules are the old ones.

        Returns:
            Whether the forkserver is ready (its marker made).
        """
        host_pid = os.getpid()
        self.fingerprint = site_packages_fingerprint(sys_path)
        os.environ["SGPU_MAGIC_WARM_MARKER"] = self.marker
        os.environ["SGPU_MAGIC_HOST_PID"] = str(host_pid)
        self.started_s = time.time()
        if fork_forkserver(lambda: die_with_parent(signal.SIGKILL, host_pid)) is None:  # as forkserver_guard does
            return self.ready(sys_path)
        touch_private(self.marker)
        self._measured = True  # ready as it started: nothing to learn about preloading
        return True

    def note_ready(self) -> None:
        """Measure the preload time as soon as the forkserver is ready (called by the host's loop every half second,
        so it is measured even when no launch comes to look)."""
        if not self._measured and self.started_s is not None and os.path.exists(self.marker):
            self._record_warm_s()

    def _record_warm_s(self) -> None:
        """Remember how long this forkserver took to preload (the marker's mtime) against the host's own
        ``import torch``, for the next host's estimate (:attr:`ratio`)."""
        if self._measured or self.started_s is None or not self.import_s:
            return
        self._measured = True
        try:
            warm_s = max(0.0, os.stat(self.marker).st_mtime - self.started_s)
            self.ratio = warm_s / self.import_s
            if self.stats_path is not None:
                atomic_write_json(
                    self.stats_path,
                    {"warm_s": round(warm_s, 3), "import_s": round(self.import_s, 3), "ratio": round(self.ratio, 3)},
                )
        except OSError:
            pass

    def cold_start_s(self, world_size: int) -> float:
        """Estimated seconds until ``world_size`` cold interpreters have imported torch on this machine's cores."""
        return (self.import_s or 2.0) * math.ceil(world_size / _cores()) + INTERPRETER_S

    def wait_s(self, world_size: int, sys_path: Sequence[str]) -> float | None:
        """How long a launch of ``world_size`` ranks should wait for the warming forkserver (:func:`warm_wait_s`):
        ``0.0`` when it is ready, ``None`` to start cold ranks now."""
        if self.ready(sys_path):
            return 0.0
        expected = (self.ratio or PRELOAD_PER_IMPORT) * (self.import_s or 2.0)
        remaining = expected - (time.time() - (self.started_s or time.time()))
        return warm_wait_s(False, remaining, self.cold_start_s(world_size))

    @staticmethod
    def stop() -> None:
        """Kill the forkserver at once (it may still be importing torch)."""
        pid = forkserver_pid()
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def warm_wait_s(ready: bool, remaining_s: float | None, cold_s: float) -> float | None:
    """Whether and how long a launch waits for the forkserver: ``0.0`` when it is ready; ``None`` (start cold
    ranks now) when they would have started before the forkserver is expected to be ready (``remaining_s``,
    ``None``: unknown); else ``cold_s``, the longest a launch waits, so it is never much slower than a cold one."""
    if ready:
        return 0.0
    if remaining_s is None or remaining_s > cold_s:
        return None
    return cold_s


def _read_ratio(stats_path: Path | None) -> float | None:
    if stats_path is None:
        return None
    try:
        value = (read_json(stats_path, private=True) or {}).get("ratio")
    except (OSError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None
