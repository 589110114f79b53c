"""The frozen :class:`LaunchSpec` and its validation.

Both front doors (``@distributed`` and ``%%distributed``) turn their input into one
``LaunchSpec`` before anything starts; invalid input raises :class:`~sgpu_magic.errors.SpecError`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .errors import SpecError

DEFAULT_TIMEOUT_S: float = 3 * 3600.0
"""Default job timeout, 3 hours, as in the serverless GPU API."""

MAX_RANKS = 1024
MAX_RESTARTS = 1000


@dataclass(frozen=True)
class LaunchSpec:
    """What one launch asks for.

    Attributes:
        gpus: number of ranks, one GPU each (CPU ranks when the machine has no GPU). int >= 1.
        gpu_type: requested GPU model, matched case-insensitively as a substring of the
            device name ("H100" matches "NVIDIA H100 80GB HBM3"); ``None`` = any.
        timeout_s: wall-clock limit in seconds; ``None`` = no limit. Default 3 h.
        port: rendezvous (MASTER_PORT) to use; ``None`` = pick a free port.
        name: the function or cell name, for messages and logs.
        widgets: show the ipywidgets panel (True), the plain-text view (False), or decide
            (None: the panel in a Jupyter kernel with ipywidgets, else text).
        mlflow: track the job as an MLflow run.
        gpu_ids: physical GPU indices (NVML order) to run on, one per rank; ``None`` = any free GPUs.
        wait: when the GPUs are leased by other jobs, wait in the queue (True) or fail at once (False).
        max_restarts: how many times a failed rank group is restarted, all ranks together, before the
            job fails (torchrun's ``--max-restarts``; ranks see ``TORCHELASTIC_RESTART_COUNT``). Default 0.
    """

    gpus: int
    gpu_type: str | None = None
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    port: int | None = None
    name: str = "job"
    widgets: bool | None = None
    mlflow: bool = True
    gpu_ids: tuple[int, ...] | None = None
    wait: bool = True
    max_restarts: int = 0


def _check_gpus(gpus: object) -> int:
    if isinstance(gpus, bool) or not isinstance(gpus, numbers.Integral):
        raise SpecError(f"gpus must be an int >= 1 (the number of ranks), got {gpus!r} of type {type(gpus).__name__}")
    if not 1 <= int(gpus) <= MAX_RANKS:
        raise SpecError(f"gpus must be between 1 and {MAX_RANKS}, got {gpus}")
    return int(gpus)


def _check_gpu_type(gpu_type: object) -> str | None:
    if gpu_type is None:
        return None
    if not isinstance(gpu_type, str) or not gpu_type.strip():
        raise SpecError(f"gpu_type must be a non-empty string such as 'H100', or None for any GPU; got {gpu_type!r}")
    return gpu_type.strip()


def _check_timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise SpecError(f"timeout must be a number of seconds > 0, or None for no limit; got {timeout!r}")
    value = float(timeout)
    if math.isnan(value) or value <= 0:
        raise SpecError(f"timeout must be a number of seconds > 0, or None for no limit; got {timeout!r}")
    return None if math.isinf(value) else value


def _check_port(port: object) -> int | None:
    if port is None:
        return None
    if isinstance(port, bool) or not isinstance(port, numbers.Integral) or not 1 <= int(port) <= 65535:
        raise SpecError(f"port must be an int between 1 and 65535, or None to pick a free port; got {port!r}")
    return int(port)


def _check_gpu_ids(gpu_ids: object, gpus: int) -> tuple[int, ...] | None:
    if gpu_ids is None:
        return None
    if isinstance(gpu_ids, (str, bytes)) or not hasattr(gpu_ids, "__iter__"):
        raise SpecError(f"gpu_ids must be a list of GPU indices such as [0, 1], or None for any free GPUs; "
                        f"got {gpu_ids!r}")
    ids = list(gpu_ids)
    if not ids or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0 for i in ids):
        raise SpecError(f"gpu_ids must be a non-empty list of GPU indices >= 0 such as [0, 1]; got {gpu_ids!r}")
    if len(set(ids)) != len(ids):
        raise SpecError(f"gpu_ids lists a GPU twice: {ids}; give each GPU once")
    if len(ids) != gpus:
        raise SpecError(f"gpu_ids names {len(ids)} GPU(s) ({ids}) but gpus={gpus}; give one GPU index per rank")
    return tuple(int(i) for i in ids)


def _check_max_restarts(max_restarts: object) -> int:
    if (isinstance(max_restarts, bool) or not isinstance(max_restarts, numbers.Integral)
            or not 0 <= int(max_restarts) <= MAX_RESTARTS):
        raise SpecError(f"max_restarts must be an int between 0 and {MAX_RESTARTS} (restarts of the whole rank group "
                        f"after a failure; 0 = none), got {max_restarts!r}")
    return int(max_restarts)


def make_spec(gpus: object, gpu_type: object = None, timeout: object = DEFAULT_TIMEOUT_S,
              port: object = None, name: str = "job", widgets: bool | None = None, mlflow: bool = True,
              gpu_ids: object = None, wait: bool = True, max_restarts: object = 0) -> LaunchSpec:
    """Validate user input into a :class:`LaunchSpec`.

    Raises:
        SpecError: naming the bad option, the value given and what is allowed.
    """
    count = _check_gpus(gpus)
    return LaunchSpec(gpus=count, gpu_type=_check_gpu_type(gpu_type),
                      timeout_s=_check_timeout(timeout), port=_check_port(port), name=name,
                      widgets=None if widgets is None else bool(widgets), mlflow=bool(mlflow),
                      gpu_ids=_check_gpu_ids(gpu_ids, count), wait=bool(wait),
                      max_restarts=_check_max_restarts(max_restarts))
