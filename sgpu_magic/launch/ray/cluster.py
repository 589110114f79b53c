"""Run a job's ranks on a Ray cluster: ``@distributed(gpus=16, cluster="ray://head:10001")`` / ``--cluster``.

Ray places and keeps the processes; torch's own rendezvous makes the process group. For one job:

1. one placement group of ``gpus`` bundles (``{"GPU": 1}`` each, ``{"CPU": 1}`` in CPU mode, i.e.
   when the cluster has no GPU), packed onto nodes as Ray packs them (``PACK``); while the cluster
   cannot supply them the job stays ``starting`` and says what is missing (or, with ``wait=False``,
   fails at once with :class:`~sgpu_magic.errors.ResourceError`);
2. one :class:`~sgpu_magic.launch.ray.agent.RankAgent` actor per rank, in its bundle. It starts the rank as a fresh
   ``python -m sgpu_magic.rank.worker`` process on its node, in a private run directory there, with
   torchrun's environment contract: ``MASTER_ADDR`` = the node of rank 0, ``MASTER_PORT`` a port
   free there, ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK`` per node (ranks numbered in
   bundle order, nodes in order of their first rank). The rank dies with its agent
   (``PR_SET_PDEATHSIG``);
3. a supervisor thread in the kernel copies each rank's log, result and error files into the job's
   local run directory and writes ``status.json`` exactly as the local launch host does, so the
   panel, MLflow run, results, errors, timeout and cancel work as for a local job. The first
   failing rank is the root cause; the others are stopped (their actors killed).

The kernel is the Ray driver (``ray.init``), so when the kernel ends, however it ends, Ray removes
the job's actors (and with them the ranks) and its placement group. Ray is optional:
``pip install "sgpu_magic[ray]"``; this module imports it only when a job names a cluster.
"""

from __future__ import annotations

from sgpu_magic.errors import ResourceError, SpecError
from sgpu_magic.launch.ray.warm import WARM, keep_warm_s
from sgpu_magic.launch.resources import DevicePlan

NAMESPACE = "sgpu_magic"
"""The Ray namespace every process of sgpu_magic joins (kernels, the run keeper): a detached session's named rank
agents are found in it."""

PENDING_NOTE_S = 5.0
"""How often a job that waits for the cluster's resources says again what it waits for."""


def ray_module():
    try:
        import ray
    except ImportError:
        raise SpecError('cluster= needs Ray: pip install "sgpu_magic[ray]" (or pip install ray)') from None
    return ray


CONNECT_CHECK_S = 5.0
"""How long an explicit cluster address gets to accept a TCP connection before the job is refused
(Ray's own connect retries for minutes when nothing listens there)."""


def _check_reachable(cluster: str) -> None:
    """Refuse at once an explicit ``host:port`` / ``ray://host:port`` where nothing accepts a connection."""
    import socket

    host, _, port = cluster.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_CHECK_S):
            pass
    except (OSError, ValueError) as exc:
        raise ResourceError(
            f"cannot connect to the Ray cluster {cluster!r}: nothing answers at {host}:{port} "
            f"({exc}); start one (ray start --head) or check the address"
        ) from None


_connected_to: str | None = None
"""The address this kernel's jobs connected Ray to (``None`` until then, or when the user initialised Ray)."""


def connected_to() -> str | None:
    """The address this kernel's jobs connected Ray to; ``None`` before, or when the notebook initialised Ray."""
    return _connected_to


def is_connected() -> bool:
    """Whether this kernel is connected to a Ray cluster already (without importing Ray when it is not)."""
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def connect(cluster: str):
    """Connect the kernel to ``cluster`` (``"auto"``, ``"ray://host:port"`` or a GCS ``host:port``) once.

    Raises:
        ResourceError: nothing answers at the address (within ``CONNECT_CHECK_S``), or Ray cannot connect.
    """
    global _connected_to
    ray = ray_module()
    if ray.is_initialized():
        if _connected_to is not None and cluster not in (_connected_to, "auto"):
            raise ResourceError(
                f"this kernel is connected to the Ray cluster {_connected_to!r}, not {cluster!r}; a kernel "
                f"uses one Ray cluster at a time: restart the kernel (or ray.shutdown() when no job "
                f"runs) to use another"
            )
    else:
        if cluster != "auto":
            _check_reachable(cluster)
        try:
            ray.init(address=cluster, log_to_driver=False, namespace=NAMESPACE, configure_logging=False)
        except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError ...
            raise ResourceError(
                f"cannot connect to the Ray cluster {cluster!r} ({type(exc).__name__}: {exc}); "
                f"start one (ray start --head) or give its address, e.g. cluster='ray://head:10001'"
            ) from None
        _connected_to = cluster
    return ray


def plan_on_cluster(spec) -> DevicePlan:
    """Check the cluster before anything starts: GPU bundles when it has GPUs (nccl), else CPU (gloo).

    Raises:
        ResourceError: the cluster cannot be reached, or it will never have ``spec.gpus`` bundles
            (fewer in total), or ``wait=False`` and they are not free now (what this kernel keeps warm counts as
            free: it is taken, or given back, when the job starts).
        SpecError: ``$SGPU_MAGIC_RAY_KEEP_WARM_S`` is not a number >= 0.
    """
    keep_warm_s()  # a bad SGPU_MAGIC_RAY_KEEP_WARM_S is refused before anything starts
    ray = connect(spec.cluster)
    total = ray.cluster_resources()
    gpu = total.get("GPU", 0) > 0
    unit = "GPU" if gpu else "CPU"
    if spec.gpu_type and not gpu:
        raise ResourceError(f"gpu_type={spec.gpu_type!r}: the Ray cluster {spec.cluster!r} has no GPU")
    if total.get(unit, 0) < spec.gpus:
        raise ResourceError(
            f"the Ray cluster {spec.cluster!r} has {total.get(unit, 0):g} {unit}s in all, fewer than "
            f"the {spec.gpus} ranks asked for; ask for fewer or add nodes"
        )
    if not spec.wait:
        held = WARM.held()  # given back, or taken, when the job starts: free for it
        free = ray.available_resources().get(unit, 0) + (held.shape[0] if held is not None else 0)
        if free < spec.gpus:
            raise ResourceError(
                f"the Ray cluster {spec.cluster!r} has {free:g} of {total.get(unit, 0):g} {unit}s free, "
                f"the job needs {spec.gpus}; wait=False / --no-wait refuses to queue (leave it out "
                f"to wait for them)"
            )
    note = (
        ""
        if gpu
        else (f"sgpu_magic: the Ray cluster has no GPU; running {spec.gpus} CPU rank(s) with gloo, one CPU each")
    )
    return DevicePlan(spec.gpus, "nccl" if gpu else "gloo", (), note, cluster=connected_address(spec.cluster))


def driver_address(cluster: str) -> str:
    """The address another process of this machine (the run keeper) connects to for the cluster this kernel is
    connected to: the GCS address Ray gives (the same for ``"auto"`` and every other way of naming one cluster,
    whatever the keeper's own environment says), or ``cluster`` as given where Ray gives none (a Ray client's
    ``ray://`` connection)."""
    try:
        return str(ray_module().get_runtime_context().gcs_address or cluster)
    except Exception:  # noqa: BLE001 - a Ray client connection, or an older Ray
        return cluster


def connected_address(cluster: str) -> str:
    """``cluster`` as given, plus the address Ray chose for ``"auto"`` (``auto (10.0.0.5:6379)``)."""
    if cluster != "auto":
        return cluster
    try:
        return f"auto ({ray_module().get_runtime_context().gcs_address})"
    except Exception:  # noqa: BLE001 - older Ray, or a Ray client connection
        return cluster
