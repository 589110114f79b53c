"""Helpers for code running inside a rank.

They read torchrun's environment contract (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK), which sgpu_magic sets for every rank as torchrun does,
so the same code also works under torchrun. Outside a job they describe a single
process: rank 0 of a world of size 1.

The ``get_*`` functions are those the serverless GPU API's runtime module lists in its public
reference (https://api-docs.databricks.com/python/serverless_gpu/api/generated/serverless_gpu.runtime.html:
``get_global_rank([group])``, ``get_local_rank()``, ``get_local_world_size()``, ``get_node_rank()``,
``get_replica_rank()``, ``get_world_size()``), with the same names and signatures, so
``from serverless_gpu.runtime import get_local_rank`` becomes ``from sgpu_magic.runtime import
get_local_rank``. ``backend()`` and ``device()`` are sgpu_magic's own.

Example::

    import torch.distributed as dist
    from sgpu_magic import runtime
    dist.init_process_group(runtime.backend())
    model = model.to(runtime.device())
"""

from __future__ import annotations

import operator
import os
import sys
import time
from typing import TYPE_CHECKING

from sgpu_magic._util.metrics import WRITER
from sgpu_magic._util.mlflow_run import job_run_id
from sgpu_magic.rank import steps as _steps

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = [
    "get_global_rank",
    "get_local_rank",
    "get_world_size",
    "get_local_world_size",
    "get_node_rank",
    "get_replica_rank",
    "backend",
    "device",
    "log_metric",
    "step",
    "get_mlflow_run_id",
    "breakpoint",
]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def get_global_rank(group: ProcessGroup | None = None) -> int:
    """This process's global rank, in ``[0, world_size - 1]``: ``RANK``, 0 outside a job.

    Args:
        group (torch.distributed.ProcessGroup | None): a ``torch.distributed`` process group; when given, this
            process's rank in it (``torch.distributed.get_rank(group)``). Default ``None``: the ``RANK`` variable, as the
            serverless GPU API's ``get_global_rank(group=None)`` documents.
    """
    if group is not None:
        import torch.distributed as dist

        return dist.get_rank(group)
    return _env_int("RANK", 0)


def get_local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``), 0 outside a job."""
    return _env_int("LOCAL_RANK", 0)


def get_world_size() -> int:
    """Number of ranks in the job (``WORLD_SIZE``), 1 outside a job."""
    return _env_int("WORLD_SIZE", 1)


def get_local_world_size() -> int:
    """Number of ranks on this node (``LOCAL_WORLD_SIZE``), 1 outside a job."""
    return _env_int("LOCAL_WORLD_SIZE", 1)


def get_node_rank() -> int:
    """Index of this node (``GROUP_RANK``, torchrun's node rank), 0 on a single machine.

    With 2 nodes of 2 ranks each, global ranks 0-1 have node rank 0 and ranks 2-3 node rank 1.
    """
    return _env_int("GROUP_RANK", 0)


def get_replica_rank() -> int:
    """Index of this job among replicas of the same job; 0 in an sgpu_magic job.

    The serverless GPU API's runtime reference lists ``get_replica_rank() -> int`` without describing
    it. sgpu_magic launches each job once (no replicas), so every rank of a job is in replica 0;
    outside a job it is 0 too. Code that shards work by replica therefore does one replica's share.
    """
    return 0


def backend() -> str:
    """The process-group backend to use: ``"nccl"`` when CUDA is available, else ``"gloo"``."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    """This rank's ``torch.device``: ``cuda:<LOCAL_RANK>`` with CUDA, else ``cpu``."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", get_local_rank() % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


_next_step: dict[str, int] = {}
"""Per metric name: the step a point logged without one gets (one more than the last step logged)."""


def _number(name: str, value: object) -> float:
    if not isinstance(value, (str, bytes)):
        try:
            return float(value)  # type: ignore[arg-type] # anything with __float__: int, numpy and 0-d torch values
        except (TypeError, ValueError):
            pass
    raise TypeError(
        f"log_metric({name!r}, ...): the value must be a real number (int, float, or a one-element "
        f"numpy/torch value), not {type(value).__name__} {value!r:.40}"
    )


def _step(name: str, step: object) -> int:
    if step is None:
        return _next_step.get(name, 0)
    if not isinstance(step, bool):
        try:
            return operator.index(step)  # type: ignore[arg-type] # int, numpy integers
        except TypeError:
            pass
    raise TypeError(f"log_metric({name!r}, ...): step must be an int or None, not {type(step).__name__} {step!r:.40}")


def _active_run_id() -> str | None:
    """The MLflow run active in this thread, when the rank's code has imported mlflow (else ``None``: the job's)."""
    mlflow = sys.modules.get("mlflow")
    run = getattr(mlflow, "active_run", lambda: None)() if mlflow is not None else None
    return run.info.run_id if run is not None else None


def get_mlflow_run_id() -> str | None:
    """The MLflow run id of this rank's job, or ``None`` when the job is not tracked (or outside an sgpu_magic job).

    The kernel makes the job's run while the ranks start (off the launch's path): this waits for it if it is not
    made yet (at most two minutes), then sets ``MLFLOW_RUN_ID``, ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_ID``
    (and ``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_REGISTRY_URI``) in this process's environment, as importing mlflow
    in a rank does. Call it before reading those variables in code that does not import mlflow first (handing the
    run to a library's logger, a subprocess).

    Returns:
        The run id (a hex string), or ``None``.

    Example::

        from sgpu_magic import runtime
        run_id = runtime.get_mlflow_run_id()   # e.g. MLFlowLogger(run_id=run_id) in Lightning
    """
    return job_run_id()


def log_metric(name: str, value: float, step: int | None = None) -> None:
    """Record one point of metric ``name`` from this rank: for the panel, ``job.metrics()``, and MLflow.

    The point is appended to this rank's metrics file in the job's run directory
    (``metrics/rank_<r>.bin``), written in batches (at least every 0.2 s, and before the rank
    reports), which the kernel follows as it follows the logs. When the job is tracked it is also logged to
    MLflow under the same ``name``, from a background thread (the first such batch imports mlflow): to the
    run active in this thread (a rank's ``with mlflow.start_run():`` run), else the job's run, where every
    rank logs the same key: put the rank in the name, or log from one rank, to tell them apart there. A call
    costs microseconds and never waits for the disk or MLflow. Outside an sgpu_magic job the point is
    checked, then dropped.

    Args:
        name (str): the metric's name, not empty (MLflow's rules apply in a tracked job: letters, digits,
            ``_ - . / `` and spaces).
        value (float): a real number: ``int``, ``float``, or a one-element numpy or torch value (a CUDA tensor
            is copied to the host, which waits for the GPU).
        step (int | None): the point's step; default ``None``: one more than the last step this rank logged for
            ``name`` (0 for the first).

    Raises:
        TypeError: ``name`` is not a str, ``value`` is not a real number, or ``step`` is not an int.
        ValueError: ``name`` is empty.

    Example::

        from sgpu_magic import runtime
        for step in range(100):
            loss = train_step()
            runtime.log_metric("loss", loss.item(), step=step)
    """
    if not isinstance(name, str):
        raise TypeError(f"log_metric: the name must be a str, not {type(name).__name__} {name!r:.40}")
    if not name:
        raise ValueError("log_metric: the name must not be empty")
    number, at = _number(name, value), _step(name, step)
    _next_step[name] = at + 1
    WRITER.record(name, number, at, int(time.time() * 1000), _active_run_id(), forward=True)


def step() -> _steps.Step:
    """Mark a training step of this rank, for step timing and straggler detection; returns a context manager.

    ``with runtime.step(): ...`` around each iteration's work, or a bare ``runtime.step()`` at the top of each
    iteration: a step runs from one mark to the next (a block's entry is its mark), so what the loop does between two
    blocks, such as fetching the next batch, is part of the step (a slow data shard shows); the last block's step
    ends where the block ends, and the step still open after the last bare call is not recorded. Each step records two
    metrics of the rank: ``step_time_s`` (its wall time) and ``step_collective_s`` (the part of it spent inside
    ``torch.distributed``'s blocking collectives), for the panel's Metrics tab, ``job.step_times()``, the straggler
    check (``Job.straggler``) and MLflow (``step_time_s/rank_<r>`` in a tracked job: the mean of the steps since its
    last point, at most once a second, logged by the kernel when the job ends). Without any ``runtime.step()``
    call, each ``optimizer.step()`` of the first optimizer that steps marks a boundary instead
    (:mod:`sgpu_magic.rank.steps`). A call costs 2-4 µs; outside an sgpu_magic job the points are dropped.

    Returns:
        A context manager; leaving it ends the step.

    Example::

        from sgpu_magic import runtime
        for batch in loader:
            with runtime.step():
                loss = model(batch).sum()
                loss.backward()
                optimizer.step()
    """
    return _steps.step()


def breakpoint(rank: int | None = 0) -> None:
    """Stop rank ``rank`` in pdb at the caller's next line, with pdb's prompt in the notebook cell that runs (a live
    session's cell: ``%%distributed --session`` or ``Session.run_cell``); ``rank=None`` stops every rank, one
    prompt after another.

    The other ranks run on until they wait in a collective for the stopped one; ``c`` continues, and ``q``
    detaches (the rank runs on, so its peers' collective completes). Outside a live session's cell (a job,
    whose ranks have no channel to the kernel) it says so on stderr and returns. Like :func:`pdb.set_trace`, it
    starts at its caller's frame.

    Args:
        rank: the global rank to stop (default 0), or ``None`` for every rank.
    """
    if rank is not None and get_global_rank() != rank:
        return
    import sys

    from sgpu_magic.rank.debug import breakpoint_here

    breakpoint_here(sys._getframe(1))
