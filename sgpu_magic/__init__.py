"""sgpu_magic: run distributed PyTorch from a notebook.

``%load_ext sgpu_magic`` adds the ``%%distributed`` cell magic; ``from sgpu_magic import
distributed`` gives the decorator, call-compatible with the Databricks serverless GPU API.
Ranks are fresh processes started by torch.distributed.elastic in a per-kernel launch
host; with no GPU they run on CPU with gloo.
"""

from __future__ import annotations

from . import runtime
from .decorator import DistributedFunction, distributed
from .errors import (CaptureError, CheckpointError, JobCancelledError, JobTimeoutError, LauncherError, RankFailedError, ResourceError, SgpuError,
                     SpecError, UnpicklableGlobalError)
from .job import Job, JobState

__all__ = ["distributed", "DistributedFunction", "Job", "JobState", "runtime", "SgpuError", "SpecError",
           "ResourceError", "CaptureError", "LauncherError", "RankFailedError", "JobTimeoutError", "JobCancelledError",
           "UnpicklableGlobalError", "CheckpointError", "load_ipython_extension"]

__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """``%load_ext sgpu_magic``: register ``%%distributed`` and ``%mlflow_ui``, start the launch host and
    import mlflow in the background."""
    from .launcher import get_host
    from .magics import DistributedMagics

    ipython.register_magics(DistributedMagics)
    host = get_host()
    magics = ipython.magics_manager.registry.get("DistributedMagics")
    if magics is None or magics.mlflow:
        from .tracking import warm_up

        # import mlflow (~2 s) in the background, before the first tracked job needs it, once the host's
        # forkserver is warm (the first launch waits for it; on few cores the import would slow it down)
        warm_up(after=host.warm_marker)
