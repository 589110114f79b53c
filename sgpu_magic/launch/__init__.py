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
    :mod:`sgpu_magic.launch.keeper`; with ``spec.cluster`` the keeper supervises the Ray job) or the kernel's launch
    host.

    Raises:
        SpecError / ResourceError: the job cannot run as asked (before any process starts).
    """
    if spec.cluster is not None:
        from sgpu_magic.launch.ray.cluster import is_connected, plan_on_cluster
        from sgpu_magic.launch.ray.launcher import RayLauncher

        if not is_connected():
            note(f"sgpu_magic: connecting to the Ray cluster {spec.cluster} ...")
        plan = plan_on_cluster(spec)
        if spec.detach:  # the run keeper supervises it, as the Ray driver that owns its actors: it outlives the kernel
            from sgpu_magic.launch.keeper import get_keeper
            from sgpu_magic.launch.ray.cluster import driver_address
            from sgpu_magic.launch.ray.warm import keep_warm_s
            from sgpu_magic.wire.host import RayTarget

            on_ray = RayTarget(driver_address(spec.cluster), spec.gpu_type, keep_warm_s())
            return plan, lambda: get_keeper().on_ray(on_ray)
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

    return session_channel.RaySessionChannel(run_dir, world_size, cluster)


def held_warm() -> list[str]:
    """What this kernel keeps warm on a cluster for its next job, and what the user's run keeper keeps for the next
    detached one, one line each (``[]``: nothing; Ray is not imported to say so)."""
    import sys

    warm = sys.modules.get("sgpu_magic.launch.ray.warm")
    line = None if warm is None else warm.WARM.describe()
    lines = [line] if line else []
    keeper = _keeper_holding_warm()
    if keeper is not None:
        lines.append(
            f"Ray, for detached jobs: {keeper.ray_warm}, kept by the run keeper (pid {keeper.pid}); sgpu_magic.release() "
            f"gives it back"
        )
    return lines


def _keeper_holding_warm():
    """The user's run keeper when it runs and keeps something warm on a Ray cluster (for detached jobs), else
    ``None``; nothing is started (and no socket is tried when the keeper folder has none)."""
    from sgpu_magic.launch.keeper import KeeperPaths, running_keeper

    try:
        if not KeeperPaths().socket.exists():
            return None
        keeper = running_keeper()
    except OSError:  # a keeper folder that is not this user's: nothing of ours there
        return None
    return keeper if keeper is not None and keeper.ray_warm else None


def release(why: str = "sgpu_magic.release()") -> list[str]:
    """Give back to the cluster, now, what this kernel keeps warm for its next job: the placement group and rank
    agents of its last Ray job (:mod:`sgpu_magic.launch.ray.warm`), which are otherwise kept for
    ``DistributedMagics.ray_keep_warm_s`` seconds with no job; and what the user's run keeper keeps warm the same
    way for detached Ray jobs (:mod:`sgpu_magic.launch.host.keeper`). Running jobs and live sessions are not touched.

    Returns:
        One line for each thing given back (``[]``: nothing was held).
    """
    import sys

    warm = sys.modules.get("sgpu_magic.launch.ray.warm")
    line = None if warm is None else warm.WARM.release(why)
    lines = [line] if line else []
    keeper = _keeper_holding_warm()
    if keeper is not None:  # what it keeps for the user's detached Ray jobs
        from sgpu_magic.errors import LauncherError

        try:
            from sgpu_magic.wire.host import Release

            keeper.send(Release(why))
            lines.append(f"{keeper.ray_warm}, kept by the run keeper (pid {keeper.pid}) for detached jobs")
        except LauncherError:  # it exited meanwhile, and what it held with it
            pass
    return lines
