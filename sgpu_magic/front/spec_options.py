"""From the front doors' options to a :class:`~sgpu_magic.spec.LaunchSpec`: defaults that follow ``%config
DistributedMagics.<trait>``, the serverless GPU API's two generations of names (``gpus`` / ``gpu_type``,
``num_accelerators`` / ``accelerator_type``), ``remote=`` and the kernel's remote cluster, and :func:`job_spec`, shared
by ``@distributed``, :func:`~sgpu_magic.run_script`, ``Session`` and the magics."""

from __future__ import annotations

import os
from typing import Any

from sgpu_magic.errors import SpecError
from sgpu_magic.launch.resources import list_gpus
from sgpu_magic.spec import (
    DEFAULT_STUCK_AFTER_S,
    DEFAULT_TEARDOWN_GRACE_S,
    DEFAULT_TIMEOUT_S,
    LaunchSpec,
    check_gpus,
    check_switch,
    make_spec,
    parse_accelerator_type,
    shown,
)

__all__ = ["REMOTE_CLUSTER_ENV", "FromConfig", "config_default", "job_spec", "remote_cluster", "resolve_config"]


class FromConfig:
    """Default that follows ``%config DistributedMagics.<trait>`` when the extension is loaded."""

    def __init__(self, trait: str, fallback: Any) -> None:
        self.trait, self.fallback = trait, fallback

    def resolve(self) -> Any:
        try:
            from IPython import get_ipython
        except ImportError:
            return self.fallback
        shell = get_ipython()
        magics = shell.magics_manager.registry.get("DistributedMagics") if shell is not None else None
        return getattr(magics, self.trait) if magics is not None else self.fallback

    def __repr__(self) -> str:
        return repr(self.fallback)


def config_default(trait: str, fallback: Any) -> Any:
    """A parameter's default that follows ``%config DistributedMagics.<trait>`` (a :class:`FromConfig`), typed
    as whatever the parameter takes: it stands in for the value until :func:`resolve_config` reads it."""
    return FromConfig(trait, fallback)


def resolve_config(value: Any) -> Any:
    return value.resolve() if isinstance(value, FromConfig) else value


REMOTE_CLUSTER_ENV = "SGPU_MAGIC_REMOTE_CLUSTER"
"""Environment variable naming the kernel's remote cluster for ``remote=True`` when the trait is not set."""


def remote_cluster() -> str | None:
    """The cluster ``remote=True`` runs on: ``%config DistributedMagics.remote_cluster``, else
    ``$SGPU_MAGIC_REMOTE_CLUSTER``, else ``None`` (none configured)."""
    configured = resolve_config(FromConfig("remote_cluster", "")) or os.environ.get(REMOTE_CLUSTER_ENV, "")
    return configured.strip() or None


def _cluster_for(remote: object, cluster: object) -> object:
    """``cluster=`` as given, or the kernel's remote cluster for ``remote=True`` (the serverless GPU API's switch).

    Raises:
        SpecError: ``remote`` is not True/False, ``remote=True`` with no remote cluster configured, or
            ``remote=True`` together with a different ``cluster=``.
    """
    if not check_switch("remote", remote, "run on the kernel's remote cluster, or on this machine"):
        return cluster
    configured = remote_cluster()
    if configured is None:
        raise SpecError(
            f"remote=True runs the job on this kernel's remote cluster, and none is configured: set "
            f"%config DistributedMagics.remote_cluster = 'ray://head:10001' (or {REMOTE_CLUSTER_ENV} in "
            f"the kernel's environment), pass cluster='ray://head:10001', or use remote=False to run on "
            f"this machine"
        )
    if cluster is not None and cluster != configured:
        raise SpecError(
            f"remote=True runs on the configured remote cluster {configured!r} but "
            f"cluster={shown(cluster)} names another; give one of them"
        )
    return configured


def _same(old: str, new: str, old_value: object, new_value: object) -> None:
    if old_value is not None and new_value is not None and old_value != new_value:
        raise SpecError(
            f"{old}={shown(old_value)} and {new}={shown(new_value)} disagree: {new} is the current "
            f"serverless GPU API's name for {old}; give one of them"
        )


def _ranks_and_type(
    gpus: object, gpu_type: object, num_accelerators: object, accelerator_type: object
) -> tuple[object, object]:
    """``(gpus, gpu_type)`` from either generation's names: ``gpus`` / ``gpu_type`` (serverless_gpu) or
    ``num_accelerators`` / ``accelerator_type="GPU_<n>x<model>"`` (databricks.air). ``gpus`` stays ``None``
    when neither gives a count (the caller then takes every GPU of the machine)."""
    per_node, model = (None, None) if accelerator_type is None else parse_accelerator_type(accelerator_type)
    if num_accelerators is not None:
        check_gpus(num_accelerators, "num_accelerators")
    _same("gpus", "num_accelerators", gpus, num_accelerators)
    if isinstance(gpu_type, str) and model is not None and gpu_type.strip().lower() != model.lower():
        raise SpecError(
            f"gpu_type={gpu_type!r} and accelerator_type={accelerator_type!r} name different GPU models; "
            f"give one of them"
        )
    count = next((c for c in (gpus, num_accelerators, per_node) if c is not None), None)
    return count, gpu_type if gpu_type is not None else model


def _every_gpu(gpu_type: object, cluster: object) -> int:
    """The default world size: every GPU of this machine (matching ``gpu_type``), as ``databricks.air``'s
    ``@distributed()`` uses every GPU of its node; 1 CPU rank on a machine without GPUs."""
    if cluster is not None:
        raise SpecError(
            "a job on a Ray cluster needs its number of ranks: give gpus=N (or num_accelerators=N, or "
            "accelerator_type='GPU_<n>x<model>')"
        )
    gpus = list_gpus()
    if isinstance(gpu_type, str) and gpu_type.strip():
        gpus = [g for g in gpus if gpu_type.strip().lower() in g.name.lower()] or gpus
    return max(1, len(gpus))


def job_spec(
    name: str,
    gpus: object = None,
    gpu_type: object = None,
    timeout: object = DEFAULT_TIMEOUT_S,
    *,
    port: object = None,
    widgets: object = None,
    mlflow: object = True,
    gpu_ids: object = None,
    wait: object = True,
    max_restarts: object = 0,
    cluster: object = None,
    teardown_grace_s: object = DEFAULT_TEARDOWN_GRACE_S,
    stuck_after_s: object = config_default("stuck_after_s", DEFAULT_STUCK_AFTER_S),
    remote: object = False,
    num_accelerators: object = None,
    accelerator_type: object = None,
    profile: object = None,
    detach: object = False,
) -> LaunchSpec:
    """The :class:`LaunchSpec` for the decorator's and :func:`~sgpu_magic.run_script`'s options (both
    generations of the serverless GPU API's names, ``remote=``), validated before anything starts.
    ``stuck_after_s`` follows ``%config DistributedMagics.stuck_after_s`` unless given.

    Raises:
        SpecError: naming the bad option (see :func:`distributed`).
    """
    cluster = _cluster_for(remote, cluster)
    count, gpu_type = _ranks_and_type(gpus, gpu_type, num_accelerators, accelerator_type)
    if count is None and isinstance(gpu_ids, (list, tuple, range)) and len(gpu_ids):
        count = len(gpu_ids)  # one rank per GPU named
    if count is None:
        count = _every_gpu(gpu_type, cluster)
    return make_spec(
        count,
        gpu_type,
        timeout,
        port,
        name=name,
        widgets=widgets,
        mlflow=mlflow,
        gpu_ids=gpu_ids,
        wait=wait,
        max_restarts=max_restarts,
        cluster=cluster,
        teardown_grace_s=teardown_grace_s,
        stuck_after_s=resolve_config(stuck_after_s),
        profile_steps=profile,
        detach=detach,
    )
