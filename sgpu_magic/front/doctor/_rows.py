"""The doctor's row model, shared by its checks (``_machine``, ``_services``, ``_system``) and the package's
:class:`~sgpu_magic.front.doctor.Report`: a check's :class:`Status`, the :class:`Check` row and its makers, and
:class:`DoctorConfig`, what the checks run against. The checks import this module, never the package, so the
doctor has no import cycle."""

from __future__ import annotations

import enum
from dataclasses import dataclass

NETWORK_TIMEOUT_S = 2.0
"""How long the MLflow server and a Ray cluster get to answer the doctor."""


class Status(enum.Enum):
    """A row's verdict: ``ok``; ``warning`` (jobs run, but something is off); ``error`` (jobs will fail, or
    lose what they should keep, until it is fixed)."""

    OK = "ok"
    WARNING = "warning"
    ERROR = "error"


@dataclass(frozen=True)
class Check:
    """One row of the report.

    Attributes:
        name: what was checked (``torch``, ``gpu 0``, ``mlflow`` ...).
        status: the verdict.
        details: what was found, in one sentence.
        remedy: what to do about it; ``""`` for an ``ok`` row.
    """

    name: str
    status: Status
    details: str
    remedy: str = ""


def ok(name: str, details: str) -> Check:
    return Check(name, Status.OK, details)


def warning(name: str, details: str, remedy: str) -> Check:
    return Check(name, Status.WARNING, details, remedy)


def error(name: str, details: str, remedy: str) -> Check:
    return Check(name, Status.ERROR, details, remedy)


@dataclass(frozen=True)
class DoctorConfig:
    """What to check against: the kernel's settings (from :class:`~sgpu_magic.front.magics.DistributedMagics`) or
    the environment's (the command line).

    Attributes:
        port: a pinned ``MASTER_PORT`` (``port=`` / ``--port``) to check is free; ``None``: none pinned.
        cluster: a Ray cluster address to check (``cluster=`` / ``--cluster``); ``None``: the configured
            remote cluster (``remote_cluster`` / ``SGPU_MAGIC_REMOTE_CLUSTER``), if any.
        lease_dir: the lease directory (``DistributedMagics.lease_dir``); ``None``: ``$SGPU_MAGIC_LEASE_DIR``,
            else ``<sgpu_magic home>/leases``.
        mlflow: whether jobs are tracked (``DistributedMagics.mlflow``); default True.
        widgets: ``DistributedMagics.widgets`` (``None``: decided by where the code runs).
        remote_cluster: ``DistributedMagics.remote_cluster`` where the kernel has it.
        in_shell: the checks run inside an IPython shell with the extension loaded (``%distributed_doctor``).
        timeout_s: seconds a server gets to answer; default :data:`NETWORK_TIMEOUT_S`.
    """

    port: int | None = None
    cluster: str | None = None
    lease_dir: str | None = None
    mlflow: bool = True
    widgets: bool | None = None
    remote_cluster: str | None = None
    in_shell: bool = False
    timeout_s: float = NETWORK_TIMEOUT_S

    @classmethod
    def from_magics(cls, magics, port: int | None = None, cluster: str | None = None) -> DoctorConfig:
        """The settings of the kernel whose ``DistributedMagics`` instance is ``magics``."""
        return cls(
            port=port,
            cluster=cluster,
            lease_dir=magics.lease_dir or None,
            mlflow=magics.mlflow,
            widgets=magics.widgets,
            remote_cluster=getattr(magics, "remote_cluster", None) or None,
            in_shell=True,
        )
