"""Warm Ray ranks: the placement group and rank agents of a kernel's last Ray job, kept for the next job of its shape.

A job on a Ray cluster pays a placement group, one actor per rank (a fresh Ray worker that imports Ray) and a fresh
interpreter per rank that imports torch: 10-20 s for a trivial 4-rank job on a two-node cluster on 2 cores. When a
job ends, its supervisor parks its bundles and agents here (:meth:`WarmRanks.park`) instead of removing them; each
agent then starts a zygote that preloads torch (:meth:`~sgpu_magic.launch.ray.agent.RankAgent.reset`), so the
next job of the same shape (world size, resources per rank) takes them (:meth:`WarmRanks.take`) and forks its ranks
on the nodes, as the local launch host's warm pool does.

What is held is given back to the cluster at once when a job of another shape needs the resources, when the kernel
ends (the kernel is the Ray driver: Ray removes its actors and placement groups however it ends; an ``atexit`` hook
does it first on a clean exit), on :func:`sgpu_magic.release` or ``%distributed_session stop``, and after
``keep_warm_s`` seconds with no job (``%config DistributedMagics.ray_keep_warm_s``, default
:data:`DEFAULT_KEEP_WARM_S`; ``0`` keeps nothing). While held, the bundles are the cluster's resources that no one
else can use: that is the trade-off the keep-warm time sets.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sgpu_magic.errors import SpecError

DEFAULT_KEEP_WARM_S = 180.0
"""Seconds the kernel keeps its last Ray job's placement group and rank agents with no job to run: three minutes of
an edit-and-rerun loop, and the cluster's resources back to everyone soon after."""

KEEP_WARM_ENV = "SGPU_MAGIC_RAY_KEEP_WARM_S"
"""The environment variable that sets :func:`keep_warm_s` where ``%config`` does not reach (a script)."""


def _env_keep_warm_s() -> float:
    raw = os.environ.get(KEEP_WARM_ENV, "").strip()
    if not raw:
        return DEFAULT_KEEP_WARM_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise SpecError(
            f"{KEEP_WARM_ENV}={raw!r}: give the seconds a Ray job's placement group and rank agents are kept for the "
            f"next job, a number >= 0 (0 keeps nothing warm), e.g. {KEEP_WARM_ENV}=180, or unset it"
        )
    return value


_keep_warm_s: float | None = None


def keep_warm_s() -> float:
    """Seconds an idle warm set is kept: what :func:`set_keep_warm_s` set (``DistributedMagics.ray_keep_warm_s``),
    else ``$SGPU_MAGIC_RAY_KEEP_WARM_S``, else :data:`DEFAULT_KEEP_WARM_S`; checked when a Ray job is planned, read
    when it ends.

    Raises:
        SpecError: the environment variable is not a number >= 0."""
    return _env_keep_warm_s() if _keep_warm_s is None else _keep_warm_s


def set_keep_warm_s(seconds: float | None) -> None:
    """Set the keep-warm time (``None``: back to the environment's or the default).

    Raises:
        ValueError: ``seconds`` is negative."""
    global _keep_warm_s
    if seconds is not None and seconds < 0:
        raise ValueError(f"ray_keep_warm_s must be >= 0 seconds (0 keeps nothing warm), not {seconds!r}")
    _keep_warm_s = None if seconds is None else float(seconds)


@dataclass
class WarmSet:
    """A parked placement group with one rank agent per bundle, in rank order.

    Attributes:
        shape: what a job must ask for to take it: ``(world_size, bundle)``.
        driver: the Ray job id of the driver that made it (a set from before ``ray.shutdown()`` is gone).
        since_s: ``time.time()`` when it was parked.
        name: the placement group's name.
    """

    shape: tuple
    pg: Any
    actors: list
    driver: str
    name: str
    since_s: float = field(default_factory=time.time)

    def what(self) -> str:
        world, bundle = self.shape
        unit = "GPU" if "GPU" in dict(bundle) else "CPU"
        since = time.strftime("%H:%M:%S", time.localtime(self.since_s))
        return (
            f"{world} warm rank agent(s) and placement group {self.name} ({world} x 1 {unit}) on the Ray cluster, "
            f"held since {since}"
        )

    def describe(self, keep_s: float) -> str:
        return f"Ray: {self.what()}, given back after {keep_s:g} s with no job (sgpu_magic.release() now)"


def shape_of(world_size: int, bundle: dict[str, float]) -> tuple:
    return world_size, tuple(sorted(bundle.items()))


def driver_id() -> str:
    """The Ray job id of this kernel's driver now (``""``: not connected; Ray is not imported to say so)."""
    import sys

    ray = sys.modules.get("ray")
    try:
        return str(ray.get_runtime_context().get_job_id()) if ray is not None and ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - a Ray client connection gone, or an older Ray
        return ""


class WarmRanks:
    """The kernel's one warm set (at most one: the last shape), its idle timer, and who waits for resources."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: WarmSet | None = None
        self._timer: threading.Timer | None = None
        self._waiting = 0
        self.released: list[tuple[str, str]] = []
        """``(placement group name, why)`` of each set given back, oldest first (the last 20)."""

    def held(self) -> WarmSet | None:
        return self._held

    def describe(self) -> str | None:
        """One line for ``%distributed_jobs`` and the doctor, or ``None`` when nothing is held."""
        held = self._held
        return None if held is None else held.describe(keep_warm_s())

    def take(self, shape: tuple) -> WarmSet | None:
        """The warm set for a job of ``shape``, taken (no one else gets it), or ``None``; a set of another shape is
        given back first, so that the job's own placement group can have its resources."""
        with self._lock:
            held, self._held = self._held, None
            self._cancel_timer()
        if held is None:
            return None
        if held.shape == shape and held.driver == driver_id():
            return held
        self._note(held, "a job of another shape" if held.shape != shape else "Ray was shut down")
        give_back(held)
        return None

    def park(self, warm: WarmSet, keep_s: float) -> bool:
        """Keep ``warm`` for ``keep_s`` seconds with no job, for the next job of its shape (replacing a set held
        already); whether it was kept (not when ``keep_s`` is 0 or a job waits for the cluster's resources: then it
        is given back at once)."""
        with self._lock:
            old, self._held = self._held, None
            self._cancel_timer()
            kept = keep_s > 0 and self._waiting == 0
            if kept:
                self._held = warm
                self._timer = threading.Timer(keep_s, self._expire, args=(warm,))
                self._timer.daemon = True
                self._timer.start()
        if old is not None:
            self._note(old, "a newer job's set")
            give_back(old)
        if not kept:
            self._note(warm, "a job waits for the cluster's resources" if keep_s > 0 else "ray_keep_warm_s is 0")
            give_back(warm)
        return kept

    def release(self, why: str = "sgpu_magic.release()") -> str | None:
        """Give the warm set back to the cluster now; what was given back (:meth:`WarmSet.what`), or ``None``."""
        with self._lock:
            held, self._held = self._held, None
            self._cancel_timer()
            if held is not None:
                self._note(held, why)
        if held is None:
            return None
        give_back(held)
        return held.what()

    def waiting(self, delta: int) -> None:
        """A job starts (``+1``) or stops (``-1``) waiting for the cluster's resources; while one waits, a set is
        given back at once (it may hold what the job waits for)."""
        with self._lock:
            self._waiting += delta
        if delta > 0:
            self.release("a job waits for the cluster's resources")

    def _expire(self, warm: WarmSet) -> None:
        with self._lock:
            if self._held is not warm:
                return
            self._held, self._timer = None, None
            self._note(warm, f"idle for {keep_warm_s():g} s")
        give_back(warm)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _note(self, warm: WarmSet, why: str) -> None:
        """Record why ``warm`` is given back: before it is (that takes Ray calls), so one who sees nothing held
        sees why."""
        self.released = [*self.released[-19:], (warm.name, why)]


def give_back(warm: WarmSet) -> None:
    """Kill the set's agents (their ranks and zygotes die with them) and remove its placement group."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized() or warm.driver != driver_id():
        return  # the driver that owned them is gone, and Ray removed them with it
    for actor in warm.actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - a dead actor
            pass
    try:
        ray.util.remove_placement_group(warm.pg)
    except Exception:  # noqa: BLE001 - removed already
        pass


WARM = WarmRanks()
"""The kernel's warm Ray ranks."""

atexit.register(WARM.release, "the kernel ended")
