"""sgpu_magic: run distributed PyTorch from a notebook.

``%load_ext sgpu_magic`` adds the ``%%distributed`` cell magic and ``%distributed_run``; ``from sgpu_magic
import distributed`` gives the decorator, call-compatible with both generations of the Databricks
serverless GPU API (``serverless_gpu``, ``databricks.air``); ``run_script`` runs a script as torchrun does.
Ranks are fresh processes started by torch.distributed.elastic in a per-kernel launch
host; with no GPU they run on CPU with gloo.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

# PEP 562: every public name is imported on first use, so that a rank, the launch host and the forkserver
# (which import sgpu_magic.rank / sgpu_magic.launch.host) never load the front doors, the panel or MLflow
_LAZY = {
    "distributed": "sgpu_magic.front.decorator",
    "DistributedFunction": "sgpu_magic.front.decorator",
    "run_script": "sgpu_magic.front.script",
    "Session": "sgpu_magic.front.session",
    "current_session": "sgpu_magic.front.sessions",
    "release": "sgpu_magic.launch",
    "attach": "sgpu_magic.front.detached",
    "detached_runs": "sgpu_magic.front.detached",
    "Job": "sgpu_magic.job",
    "JobState": "sgpu_magic.job",
    **dict.fromkeys(
        (
            "SgpuError",
            "SpecError",
            "ResourceError",
            "CaptureError",
            "LauncherError",
            "RankFailedError",
            "JobTimeoutError",
            "JobCancelledError",
            "UnpicklableGlobalError",
            "CheckpointError",
            "SessionError",
            "CellInterruptedError",
        ),
        "sgpu_magic.errors",
    ),
}
_SUBMODULES = {"runtime", "errors", "data", "checkpoint"}

if TYPE_CHECKING:  # what type checkers and IDEs see
    from collections.abc import Callable

    from IPython.core.interactiveshell import InteractiveShell

    from sgpu_magic import checkpoint, data, errors, runtime  # noqa: F401 - what type checkers see
    from sgpu_magic.errors import (
        CaptureError,
        CellInterruptedError,
        CheckpointError,
        JobCancelledError,
        JobTimeoutError,
        LauncherError,
        RankFailedError,
        ResourceError,
        SessionError,
        SgpuError,
        SpecError,
        UnpicklableGlobalError,
    )
    from sgpu_magic.front.decorator import DistributedFunction, distributed
    from sgpu_magic.front.detached import attach, detached_runs
    from sgpu_magic.front.script import run_script
    from sgpu_magic.front.session import Session
    from sgpu_magic.front.sessions import current_session
    from sgpu_magic.job import Job, JobState
    from sgpu_magic.launch import release

__all__ = [
    "distributed",
    "DistributedFunction",
    "run_script",
    "Session",
    "current_session",
    "release",
    "attach",
    "detached_runs",
    "Job",
    "JobState",
    "runtime",
    "SgpuError",
    "SpecError",
    "ResourceError",
    "CaptureError",
    "LauncherError",
    "RankFailedError",
    "JobTimeoutError",
    "JobCancelledError",
    "UnpicklableGlobalError",
    "CheckpointError",
    "SessionError",
    "CellInterruptedError",
    "load_ipython_extension",
]


@functools.cache
def _package_version() -> str:
    """The installed distribution's version (its metadata); in a source checkout that was never installed,
    the ``version`` line of its ``pyproject.toml``; else ``"0+unknown"``."""
    import importlib.metadata
    import re
    from pathlib import Path

    try:
        return importlib.metadata.version("sgpu_magic")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    except OSError:
        return "0+unknown"
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return match.group(1) if match else "0+unknown"


def __getattr__(name: str) -> Any:
    # ``__version__`` is read from the package metadata on first use (~40 ms), not by every rank's import
    if name == "__version__":
        return _package_version()
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | {"__version__"})


def _after_this_cell(ipython: InteractiveShell, task: Callable[[], None]) -> None:
    """Run ``task`` once the running cell has ended (IPython's ``post_run_cell`` event), or now outside a cell."""
    events = getattr(ipython, "events", None)
    if events is None or not getattr(ipython, "execution_count", 0):
        task()
        return

    def once(*_: object) -> None:
        events.unregister("post_run_cell", once)
        task()

    events.register("post_run_cell", once)


def load_ipython_extension(ipython: InteractiveShell) -> None:
    """``%load_ext sgpu_magic``: register ``%%distributed``, ``%distributed_run`` and ``%mlflow_ui``, start the
    launch host and import mlflow in the background."""
    from sgpu_magic.launch.client import get_host

    get_host()  # first: its forkserver preloads torch while the rest loads (the first launch waits for it)

    from sgpu_magic.front.magics import DistributedMagics
    from sgpu_magic.front.session_magics import SessionMagics

    ipython.register_magics(DistributedMagics)
    ipython.register_magics(SessionMagics)
    magics = ipython.magics_manager.registry.get("DistributedMagics")
    import os

    from sgpu_magic.tracking.uri import pin_default_store

    pin_default_store(os.getcwd())  # MLflow's default store stays in the notebook's folder after a %cd
    from sgpu_magic.tracking.worker import settle_ended_runs

    if settle_ended_runs not in ipython.events.callbacks["pre_run_cell"]:  # a cell reads earlier jobs' runs ended
        ipython.events.register("pre_run_cell", settle_ended_runs)
    if magics is None or magics.mlflow:
        from sgpu_magic.tracking.run import warm_up

        # import mlflow (~2 s) on the tracking worker once this cell has ended, before the first tracked job's run
        # is made there (no launch waits for it)
        _after_this_cell(ipython, warm_up)
