"""The run keeper's program: the launch host's boot (:func:`sgpu_magic.launch.host.boot.main`) with the Ray backend
plugged in, so the keeper can supervise detached jobs on a Ray cluster (:mod:`sgpu_magic.launch.host.keeper`).

The launch host and the Ray backend import neither each other (an import contract); this module, at the layer above
both, joins them. Ray itself is imported only when the keeper gets its first Ray job.
"""

from __future__ import annotations

from sgpu_magic.launch.host.boot import main as boot_main
from sgpu_magic.launch.ray.launcher import RayLauncher
from sgpu_magic.launch.ray.warm import WARM, set_keep_warm_s


class KeeperRay(RayLauncher):
    """The Ray launcher in the run keeper, with what the keeper asks of its warm set
    (:class:`sgpu_magic.launch.host.keeper.RayJobs`): as a kernel does, it keeps the placement group and rank agents
    of its last Ray job for the next detached job of that shape, for the keep-warm time the job's kernel sent
    (``%config DistributedMagics.ray_keep_warm_s`` there), and gives them back on ``sgpu_magic.release()`` in any
    kernel of the user's, or when it exits."""

    def keep_warm(self, seconds: float | None) -> None:
        set_keep_warm_s(seconds)

    def warm(self) -> str | None:
        held = WARM.held()
        return None if held is None else held.what()

    def release(self, why: str) -> str | None:
        return WARM.release(why)


def ray_jobs(cluster: str, gpu_type: str | None) -> KeeperRay:
    """The supervisor of the keeper's detached Ray jobs on ``cluster``."""
    return KeeperRay(cluster, gpu_type)


def main(argv: list[str]) -> None:
    """The keeper's ``main``: ``argv`` as :func:`sgpu_magic.launch.host.boot.main` takes it."""
    boot_main(argv, ray_jobs)
