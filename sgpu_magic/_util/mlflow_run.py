"""Which MLflow run a rank's job has: the kernel makes it while the ranks start and names it in the run directory.

The kernel writes ``mlflow.json`` (``run_id``, ``tracking_uri``, ``experiment_id``, ``experiment_name``,
``registry_uri``; ``run_id`` null when tracking could not start) once the run exists, and gives the ranks its path
as ``SGPU_MAGIC_MLFLOW_RUN_FILE``. :func:`job_run_id` adopts it in a rank on first need (see
:mod:`sgpu_magic.rank.mlflow_guard`), setting the variables MLflow reads (``MLFLOW_RUN_ID``, ...) in the rank's
environment; code that reads ``MLFLOW_RUN_ID`` itself calls it first (:class:`sgpu_magic.data.DataLoader`).
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from sgpu_magic.errors import RecordError
from sgpu_magic.rundir import RunDir

RUN_ID_ENV = "SGPU_MAGIC_MLFLOW_RUN_ID"
RUN_FILE_ENV = "SGPU_MAGIC_MLFLOW_RUN_FILE"
RUN_WAIT_S = 120.0
"""How long a rank waits for the kernel to make the job's run (the first tracked job of a kernel may wait for
mlflow's import and a new store's tables, seconds on a busy machine); then it goes on untracked."""


def run_env(run_file: str, wait_s: float = RUN_WAIT_S) -> dict[str, str]:
    """The MLflow variables of the job's run named in ``run_file`` (``mlflow.json``:
    :class:`~sgpu_magic.wire.mlflow.MlflowRunRecord`), waiting for the kernel to write it (at most ``wait_s``);
    ``{}`` when tracking could not start, the file did not come, or it is not a run record this version reads. The
    file is read through the private-read check (0600, owned by this user)."""

    deadline, rd = time.monotonic() + wait_s, RunDir(Path(run_file).parent)
    while True:
        try:
            record = rd.read_mlflow_run()
        except RecordError:
            return {}
        except OSError:
            record = None
        if record is not None or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    if record is None or not record.tracked:
        return {}
    return {**record.mlflow_env(), RUN_ID_ENV: str(record.run_id)}


@functools.cache
def job_run_id() -> str | None:
    """The job's run id (``SGPU_MAGIC_MLFLOW_RUN_ID``), adopting it from the kernel's ``mlflow.json`` first if this
    rank has not yet (:func:`run_env`: it sets the run's MLflow variables in this process's environment); ``None``
    when the job is not tracked."""
    run_file = os.environ.get(RUN_FILE_ENV)
    if not os.environ.get(RUN_ID_ENV) and run_file:
        os.environ.update(run_env(run_file))
    return os.environ.get(RUN_ID_ENV) or None
