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

from sgpu_magic.rundir import read_json

RUN_ID_ENV = "SGPU_MAGIC_MLFLOW_RUN_ID"
RUN_FILE_ENV = "SGPU_MAGIC_MLFLOW_RUN_FILE"
RUN_WAIT_S = 120.0
"""How long a rank waits for the kernel to make the job's run (the first tracked job of a kernel may wait for
mlflow's import and a new store's tables, seconds on a busy machine); then it goes on untracked."""
_RUN_ENV_KEYS = {
    "tracking_uri": "MLFLOW_TRACKING_URI",
    "run_id": "MLFLOW_RUN_ID",
    "experiment_id": "MLFLOW_EXPERIMENT_ID",
    "experiment_name": "MLFLOW_EXPERIMENT_NAME",
    "registry_uri": "MLFLOW_REGISTRY_URI",
}


def run_env(run_file: str, wait_s: float = RUN_WAIT_S) -> dict[str, str]:
    """The MLflow variables of the job's run named in ``run_file`` (``mlflow.json``), waiting for the kernel to write
    it (at most ``wait_s``); ``{}`` when tracking could not start or the file did not come. The file is read through
    the private-read check (0600, owned by this user)."""

    deadline, path = time.monotonic() + wait_s, Path(run_file)
    while True:
        try:
            record = read_json(path, private=True)
        except OSError:
            record = None
        if record is not None or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    if not record or not record.get("run_id"):
        return {}
    env = {var: str(record[key]) for key, var in _RUN_ENV_KEYS.items() if record.get(key)}
    env[RUN_ID_ENV] = str(record["run_id"])
    return env


@functools.cache
def job_run_id() -> str | None:
    """The job's run id (``SGPU_MAGIC_MLFLOW_RUN_ID``), adopting it from the kernel's ``mlflow.json`` first if this
    rank has not yet (:func:`run_env`: it sets the run's MLflow variables in this process's environment); ``None``
    when the job is not tracked."""
    run_file = os.environ.get(RUN_FILE_ENV)
    if not os.environ.get(RUN_ID_ENV) and run_file:
        os.environ.update(run_env(run_file))
    return os.environ.get(RUN_ID_ENV) or None
