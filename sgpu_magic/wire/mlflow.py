"""``mlflow.json``: the job's MLflow run as the kernel made it (:class:`MlflowRunRecord`), and its codec.

Written by the kernel's MLflow worker once the run exists, or with no run id when tracking could not start, so that
no rank waits for it (``tracking/run``). Read, through the private-read check, by each rank on first need
(``_util/mlflow_run``: it sets MLflow's variables in the rank), the Ray supervisor (for the ranks on the nodes), the
launch host on its way out (it ends a run the kernel could not), a kernel that attaches to a detached job (it takes
the run over) and the detached-run listing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from sgpu_magic.wire.errors import _reading

MLFLOW_ENV = {
    "tracking_uri": "MLFLOW_TRACKING_URI",
    "run_id": "MLFLOW_RUN_ID",
    "experiment_id": "MLFLOW_EXPERIMENT_ID",
    "experiment_name": "MLFLOW_EXPERIMENT_NAME",
    "registry_uri": "MLFLOW_REGISTRY_URI",
}
"""The record's fields that MLflow reads from a process's environment, and the variable of each."""


@dataclass(frozen=True)
class MlflowRunRecord:
    """The job's MLflow run.

    Attributes:
        run_id: the run's id; ``None`` when tracking could not start (then ``error`` says so).
        tracking_uri: the store or server the run is in (absolute).
        experiment_id, experiment_name: its experiment.
        registry_uri: the kernel's model registry URI, when the kernel resolved one for the ranks; ``None`` when the
            ranks have it otherwise (``MLFLOW_REGISTRY_URI`` in the kernel's environment reaches them) or resolve
            MLflow's default themselves.
        error: why the job is not tracked, else ``None``.
    """

    run_id: str | None
    tracking_uri: str | None = None
    experiment_id: str | None = None
    experiment_name: str | None = None
    registry_uri: str | None = None
    error: str | None = None

    @property
    def tracked(self) -> bool:
        """Whether there is a run (a record with no run id says tracking could not start)."""
        return bool(self.run_id)

    def mlflow_env(self) -> dict[str, str]:
        """MLflow's variables for a process that adopts the run (``MLFLOW_RUN_ID``, ...); ``{}`` when untracked."""
        if not self.tracked:
            return {}
        return {var: str(getattr(self, name)) for name, var in MLFLOW_ENV.items() if getattr(self, name)}

    def encode(self) -> dict[str, Any]:
        """The file's JSON object (the keys the previous version wrote)."""
        return asdict(self)

    @classmethod
    def decode(cls, raw: Any) -> MlflowRunRecord:
        """Read ``mlflow.json`` (a key this version does not know is passed over: a later version's addition).

        Raises:
            RecordError: it is not an object with a ``run_id`` (and, with a run id, a ``tracking_uri``), or a field
                holds a value that is not a string.
        """
        with _reading("mlflow.json", "; the job's MLflow run cannot be named from it"):
            if not isinstance(raw, dict):
                raise TypeError(f"a JSON {type(raw).__name__}, not an object")
            values = {f.name: raw.get(f.name) for f in fields(cls)}
            if "run_id" not in raw:
                raise KeyError("run_id")
            bad = [name for name, value in values.items() if value is not None and not isinstance(value, str)]
            if bad:
                raise ValueError(f"{bad[0]!r}: {values[bad[0]]!r} is not a string")
            if values["run_id"] and not values["tracking_uri"]:  # a run is named by its id in its store
                raise KeyError("tracking_uri")
            return cls(**values)
