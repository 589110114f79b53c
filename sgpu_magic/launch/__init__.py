"""Starting ranks (layer 2): GPUs and leases, the kernel's client of the launch host, the host itself, Ray.

The backend a job runs on is chosen here, once (:func:`launcher_for`, :func:`session_channel_for`): ``job`` and
``session`` import no backend (an import contract), and the launch host's modules import neither these functions'
backends nor each other's."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sgpu_magic.launch.base import Launcher
    from sgpu_magic.launch.ray.session_channel import RaySessionChannel
    from sgpu_magic.launch.resources import DevicePlan
    from sgpu_magic.rundir import RunDir
    from sgpu_magic.spec import LaunchSpec


def launcher_for(spec: LaunchSpec, note: Callable[[str], None]) -> tuple[DevicePlan, Callable[[], Launcher]]:
    """The device plan of a job of ``spec`` and a factory of its :class:`~sgpu_magic.launch.base.Launcher`: the
    Ray cluster's (``spec.cluster``; Ray places the ranks: no local GPUs, no leases, no local port; ``note`` is told
    when the kernel connects to the cluster first), the user's run keeper (``spec.detach``:
    :mod:`sgpu_magic.launch.keeper`) or the kernel's launch host.

    Raises:
        SpecError / ResourceError: the job cannot run as asked (before any process starts).
    """
    if spec.cluster is not None:
        from sgpu_magic.launch.ray.cluster import is_connected, plan_on_cluster
        from sgpu_magic.launch.ray.launcher import RayLauncher

        if not is_connected():
            note(f"sgpu_magic: connecting to the Ray cluster {spec.cluster} ...")
        plan = plan_on_cluster(spec)
        launcher = RayLauncher(spec.cluster, spec.gpu_type)
        return plan, lambda: launcher
    from sgpu_magic.launch.resources import check_port_free, plan_devices

    plan = plan_devices(spec)
    if spec.port is not None:
        check_port_free(spec.port)
    if spec.detach:  # the user's run keeper: the job outlives the kernel
        from sgpu_magic.launch.keeper import get_keeper

        return plan, get_keeper
    from sgpu_magic.launch.client import get_host

    return plan, get_host


def session_channel_for(run_dir: RunDir, world_size: int, cluster: str | None) -> RaySessionChannel | None:
    """The Ray backend's session channel for a session on the Ray cluster ``cluster``
    (:class:`~sgpu_magic.launch.ray.session_channel.RaySessionChannel`); ``None`` on this machine (the session's
    own FIFOs)."""
    if cluster is None:
        return None
    from sgpu_magic.launch.ray import session_channel

    return session_channel.RaySessionChannel(run_dir, world_size)


def held_warm() -> list[str]:
    """What this kernel keeps warm on a cluster for its next job, one line each (``[]``: nothing; Ray is not
    imported to say so)."""
    import sys

    warm = sys.modules.get("sgpu_magic.launch.ray.warm")
    line = None if warm is None else warm.WARM.describe()
    return [line] if line else []


def release(why: str = "sgpu_magic.release()") -> list[str]:
    """Give back to the cluster, now, what this kernel keeps warm for its next job: the placement group and rank
    agents of its last Ray job (:mod:`sgpu_magic.launch.ray.warm`), which are otherwise kept for
    ``DistributedMagics.ray_keep_warm_s`` seconds with no job. Running jobs and live sessions are not touched.

    Returns:
        One line for each thing given back (``[]``: nothing was held).
    """
    import sys

    warm = sys.modules.get("sgpu_magic.launch.ray.warm")
    line = None if warm is None else warm.WARM.release(why)
    return [line] if line else []
