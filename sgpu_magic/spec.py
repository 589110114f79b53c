"""The frozen :class:`LaunchSpec` and its validation.

Both front doors (``@distributed`` and ``%%distributed``) turn their input into one
``LaunchSpec`` before anything starts; invalid input raises :class:`~sgpu_magic.errors.SpecError`.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast, overload

from sgpu_magic.errors import SpecError

if TYPE_CHECKING:
    from typing_extensions import TypeIs

DEFAULT_TIMEOUT_S: float = 3 * 3600.0
"""Default job timeout, 3 hours, as in the serverless GPU API."""

DEFAULT_TEARDOWN_GRACE_S: float = 10.0
"""How long a rank may take to exit after its outcome is written before the launch host ends it."""

DEFAULT_STUCK_AFTER_S: float = 300.0
"""A running job with no new log byte and no metric point from any rank for this long is reported possibly stuck."""

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
        cluster: a Ray cluster to run on (``"auto"``, ``"ray://host:port"`` or a GCS ``"host:port"``;
            see :mod:`sgpu_magic.launch.ray.cluster`); ``None`` = this machine. Default ``None``.
        teardown_grace_s: seconds a rank may take to exit (destructors, ``atexit`` handlers) after its value
            or error is written; a rank still running then is ended (SIGTERM, then SIGKILL) and the job keeps
            its outcome (see :mod:`sgpu_magic.launch.teardown`). Default 10.
        stuck_after_s: seconds without a log byte or metric point from any rank, while all run, after which the job
            is reported possibly stuck, with each rank's stack (:mod:`sgpu_magic.launch.progress`); ``None``:
            never. Default 300.
        profile_steps: profile this many steps on every rank with ``torch.profiler`` (after one step of wait and one
            of warm-up: :mod:`sgpu_magic.rank.profile`); ``None``: no profiling. Default ``None``.
        detach: run the ranks under the user's run keeper (:mod:`sgpu_magic.launch.host.keeper`) instead of the
            kernel's launch host, so the job outlives the kernel and any kernel of the user may attach to it
            (:func:`sgpu_magic.attach`). This machine only. Default ``False``: no rank outlives the kernel.
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
    cluster: str | None = None
    teardown_grace_s: float = DEFAULT_TEARDOWN_GRACE_S
    stuck_after_s: float | None = DEFAULT_STUCK_AFTER_S
    profile_steps: int | None = None
    detach: bool = False


def shown(value: object) -> str:
    """``repr(value)`` for an error message: at most about 80 characters, and never an error itself.

    A huge int (whose ``repr`` Python refuses past ``sys.get_int_max_str_digits()``) is described by its
    size; an object whose ``__repr__`` raises, by its type.
    """
    if isinstance(value, int) and not isinstance(value, bool) and abs(value).bit_length() > 256:
        return f"an int of {abs(value).bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real problem
        return f"a {type(value).__name__} object"
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _is_int(value: object) -> TypeIs[numbers.Integral]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_gpus(gpus: object, name: str = "gpus") -> int:
    """Validate a number of ranks (``gpus``, or the serverless GPU API's ``num_accelerators``): an int in 1..1024.

    Raises:
        SpecError: naming ``name`` and the value given.
    """
    if not _is_int(gpus):
        raise SpecError(
            f"{name} must be an int >= 1 (the number of ranks), got {shown(gpus)} of type {type(gpus).__name__}"
        )
    if not 1 <= int(gpus) <= MAX_RANKS:
        raise SpecError(f"{name} must be between 1 and {MAX_RANKS}, got {shown(int(gpus))}")
    return int(gpus)


def _check_gpu_type(gpu_type: object) -> str | None:
    if gpu_type is None:
        return None
    if not isinstance(gpu_type, str) or not gpu_type.strip() or not gpu_type.isprintable():
        raise SpecError(
            f"gpu_type must be a non-empty string such as 'H100' (printable characters), or None for any "
            f"GPU; got {shown(gpu_type)}"
        )
    return gpu_type.strip()


def check_timeout(timeout: object, name: str = "timeout") -> float | None:
    """``timeout`` (the option ``name``) as seconds, ``None`` for no limit (also for infinity).

    Raises:
        SpecError: not a number of seconds > 0 or None, naming ``name`` and the value given.
    """
    if timeout is None:
        return None
    message = f"{name} must be a number of seconds > 0, or None for no limit; got {shown(timeout)}"
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise SpecError(message)
    try:
        value = float(timeout)
    except (OverflowError, ValueError):  # an int or Fraction beyond the float range
        raise SpecError(f"{message} (too large for a float)") from None
    if math.isnan(value) or value <= 0:
        raise SpecError(message)
    return None if math.isinf(value) else value


def _check_port(port: object) -> int | None:
    if port is None:
        return None
    if not _is_int(port) or not 1 <= int(port) <= 65535:
        raise SpecError(f"port must be an int between 1 and 65535, or None to pick a free port; got {shown(port)}")
    return int(port)


def _gpu_id_list(gpu_ids: object) -> list[object]:
    """The items of ``gpu_ids``: a list, tuple, range or array, iterated once."""
    if isinstance(gpu_ids, (str, bytes, Mapping, Iterator)) or not isinstance(gpu_ids, Iterable):
        one_shot = " (an iterator can be read only once; pass list(...))" if isinstance(gpu_ids, Iterator) else ""
        raise SpecError(
            f"gpu_ids must be a list of GPU indices such as [0, 1], or None for any free GPUs; "
            f"got {shown(gpu_ids)}{one_shot}"
        )
    try:
        return list(gpu_ids)
    except Exception as exc:  # noqa: BLE001 - a broken container is the caller's bad input
        raise SpecError(
            f"gpu_ids must be a list of GPU indices such as [0, 1]; {shown(gpu_ids)} could not be read "
            f"({type(exc).__name__}: {exc})"
        ) from None


def _check_gpu_ids(gpu_ids: object, gpus: int) -> tuple[int, ...] | None:
    if gpu_ids is None:
        return None
    items = _gpu_id_list(gpu_ids)
    if not items or any(not _is_int(i) or i < 0 for i in items):
        raise SpecError(f"gpu_ids must be a non-empty list of GPU indices >= 0 such as [0, 1]; got {shown(gpu_ids)}")
    ids = [int(cast("numbers.Integral", i)) for i in items]  # each checked just above
    if len(set(ids)) != len(ids):
        raise SpecError(f"gpu_ids lists a GPU twice: {shown(ids)}; give each GPU once")
    if len(ids) != gpus:
        raise SpecError(f"gpu_ids names {len(ids)} GPU(s) ({shown(ids)}) but gpus={gpus}; give one GPU index per rank")
    return tuple(ids)


def _check_max_restarts(max_restarts: object) -> int:
    if not _is_int(max_restarts) or not 0 <= int(max_restarts) <= MAX_RESTARTS:
        raise SpecError(
            f"max_restarts must be an int between 0 and {MAX_RESTARTS} (restarts of the whole rank group "
            f"after a failure; 0 = none), got {shown(max_restarts)}"
        )
    return int(max_restarts)


@overload
def check_switch(name: str, value: object, meaning: str, allow_none: Literal[False] = False) -> bool: ...
@overload
def check_switch(name: str, value: object, meaning: str, allow_none: bool) -> bool | None: ...
def check_switch(name: str, value: object, meaning: str, allow_none: bool = False) -> bool | None:
    """``True`` / ``False`` (also ``1`` / ``0``), or ``None`` where allowed; a string such as "false" is refused."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or (_is_int(value) and value in (0, 1)):
        return bool(value)
    choices = "True, False or None" if allow_none else "True or False"
    raise SpecError(f"{name} must be {choices} ({meaning}); got {shown(value)}")


def check_max_capture_bytes(max_capture_bytes: object) -> int:
    """Validate the decorator's ``max_capture_bytes``: an int >= 0.

    Raises:
        SpecError: naming the value given.
    """
    if not _is_int(max_capture_bytes) or max_capture_bytes < 0:
        raise SpecError(
            f"max_capture_bytes must be an int >= 0 (bytes; captured globals larger than this get a "
            f"warning), got {shown(max_capture_bytes)}"
        )
    return int(max_capture_bytes)


def check_teardown_grace(grace_s: object) -> float:
    """Validate ``teardown_grace_s``: a finite number of seconds >= 0.

    Raises:
        SpecError: naming the value given.
    """
    message = (
        f"teardown_grace_s must be a number of seconds >= 0 (how long a rank may take to exit after its "
        f"value is written, before it is ended), got {shown(grace_s)}"
    )
    if isinstance(grace_s, bool) or not isinstance(grace_s, numbers.Real):
        raise SpecError(message)
    try:
        value = float(grace_s)
    except (OverflowError, ValueError):
        raise SpecError(message) from None
    if not math.isfinite(value) or value < 0:
        raise SpecError(message)
    return value


def make_spec(
    gpus: object,
    gpu_type: object = None,
    timeout: object = DEFAULT_TIMEOUT_S,
    port: object = None,
    name: str = "job",
    widgets: object = None,
    mlflow: object = True,
    gpu_ids: object = None,
    wait: object = True,
    max_restarts: object = 0,
    cluster: object = None,
    teardown_grace_s: object = DEFAULT_TEARDOWN_GRACE_S,
    stuck_after_s: object = DEFAULT_STUCK_AFTER_S,
    profile_steps: object = None,
    detach: object = False,
) -> LaunchSpec:
    """Validate user input into a :class:`LaunchSpec`.

    ``widgets``, ``mlflow`` and ``wait`` take ``True`` / ``False`` (or ``1`` / ``0``); a string such as
    ``"false"`` is refused rather than read as true. Example: ``make_spec(2, timeout=600, gpu_ids=[0, 1])``.

    Raises:
        SpecError: naming the bad option, the value given (shortened to about 80 characters) and what is allowed.
    """
    count = check_gpus(gpus)
    detached = check_switch("detach", detach, "run under the run keeper, so the job outlives the kernel")
    return LaunchSpec(
        gpus=count,
        gpu_type=_check_gpu_type(gpu_type),
        timeout_s=check_timeout(timeout),
        port=_check_port(port),
        name=name,
        widgets=check_switch("widgets", widgets, "the widget panel, plain text, or decide", True),
        mlflow=check_switch("mlflow", mlflow, "track the job as an MLflow run"),
        gpu_ids=_check_gpu_ids(gpu_ids, count),
        wait=check_switch("wait", wait, "queue for GPUs other jobs hold, or fail at once"),
        max_restarts=_check_max_restarts(max_restarts),
        cluster=_check_cluster(cluster, gpu_ids),
        teardown_grace_s=check_teardown_grace(teardown_grace_s),
        stuck_after_s=check_timeout(stuck_after_s, "stuck_after_s"),
        profile_steps=check_profile_steps(profile_steps),
        detach=detached,
    )


MAX_PROFILE_STEPS = 1000


def check_profile_steps(steps: object, name: str = "profile") -> int | None:
    """``steps`` (the option ``name``) as a number of steps to profile, ``None`` for no profiling.

    Raises:
        SpecError: not an int in 1..1000 or None, naming ``name`` and the value given.
    """
    if steps is None:
        return None
    if not _is_int(steps) or not 1 <= int(steps) <= MAX_PROFILE_STEPS:
        raise SpecError(
            f"{name} must be a number of steps to profile between 1 and {MAX_PROFILE_STEPS} (each rank's "
            f"torch.profiler records that many steps), or None for none; got {shown(steps)}"
        )
    return int(steps)


_ACCELERATOR_TYPE = re.compile(r"GPU_([0-9]+)x([A-Za-z0-9][A-Za-z0-9_-]*)", re.IGNORECASE)


def parse_accelerator_type(accelerator_type: object) -> tuple[int, str]:
    """Split the serverless GPU API's ``accelerator_type`` into ``(GPUs per node, GPU model)``.

    The current generation of that API (``databricks.air``) names hardware as ``GPU_<n>x<model>``
    (``"GPU_1xA10"``, ``"GPU_1xH100"``, ``"GPU_8xH100"``: n GPUs of that model on one node). Case is
    ignored in the ``GPU_`` prefix and the ``x``. Example: ``parse_accelerator_type("GPU_8xH100") == (8, "H100")``.

    Raises:
        SpecError: not a string of that form, or ``n`` is 0; the message gives the form and an example.
    """
    match = _ACCELERATOR_TYPE.fullmatch(accelerator_type.strip()) if isinstance(accelerator_type, str) else None
    if match is None or int(match.group(1)) < 1:
        raise SpecError(
            f"accelerator_type takes the serverless GPU API's form 'GPU_<n>x<model>' with n >= 1, such as "
            f"'GPU_8xH100' or 'GPU_1xA10'; got {shown(accelerator_type)}{_accelerator_hint(accelerator_type)}"
        )
    return int(match.group(1)), match.group(2)


def _accelerator_hint(value: object) -> str:
    """The near miss: ``8xH100`` (the prefix left out), or ``H100`` (a model, which is ``gpu_type``)."""
    text = value.strip() if isinstance(value, str) else ""
    if _ACCELERATOR_TYPE.fullmatch(f"GPU_{text}") and not text.startswith("0"):
        return f" (write 'GPU_{text}')"
    if re.fullmatch(r"[A-Za-z][A-Za-z0-9-]*", text):
        return f" (for a GPU model alone, write gpu_type={text!r})"
    return ""


def _check_cluster(cluster: object, gpu_ids: object) -> str | None:
    """``None``, ``"auto"``, ``"ray://host:port"`` or ``"host:port"``; what a cluster cannot honour is refused."""
    if cluster is None:
        return None
    if not isinstance(cluster, str) or not cluster.strip() or any(c.isspace() for c in cluster.strip()):
        raise SpecError(
            f"cluster must be 'auto' (an already running or initialised Ray), 'ray://host:port' (a Ray "
            f"client address) or 'host:port' (a Ray GCS address), got {shown(cluster)}"
        )
    cluster = cluster.strip()
    if cluster != "auto" and ":" not in cluster:
        raise SpecError(f"cluster={cluster!r} is not a Ray address: give 'auto', 'ray://host:port' or 'host:port'")
    if gpu_ids is not None:
        raise SpecError("gpu_ids cannot be used with cluster=: Ray places the ranks; use gpu_type to choose GPUs")
    return cluster
