"""``DataLoader``: torch's, with defaults for streaming files from a volume, timing every batch fetch (in ranks)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.data

from sgpu_magic._compat.imports import import_mlflow
from sgpu_magic._util.mlflow_run import job_run_id
from sgpu_magic.data.dataset import rank_and_world


class DataLoader(torch.utils.data.DataLoader[Any]):
    """``torch.utils.data.DataLoader`` with defaults for streaming files, timing every batch fetch.

    Defaults that differ from torch's: ``num_workers`` = ``min(4, cpus // LOCAL_WORLD_SIZE)`` (at least 1),
    ``prefetch_factor`` = 4 and ``persistent_workers`` = True when there are workers, ``pin_memory`` = True
    when CUDA is available. Every other argument is torch's.

    Each batch's fetch time (seconds the training loop waited in ``next()``) is appended to
    :attr:`fetch_times_s`. When the rank runs in a tracked sgpu_magic job (``MLFLOW_RUN_ID`` set), the
    end of each pass logs them to the job's MLflow run: ``data/fetch_s/rank_<r>`` per batch (step = batch
    index across passes), and ``data/fetch_s_mean/rank_<r>`` and ``data/batches/rank_<r>`` per pass
    (step = pass index). Pass ``log_to_mlflow=False`` to skip that.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset[Any],
        batch_size: int | None = 1,
        *,
        num_workers: int | None = None,
        prefetch_factor: int | None = None,
        pin_memory: bool | None = None,
        persistent_workers: bool | None = None,
        log_to_mlflow: bool = True,
        **kwargs: Any,
    ) -> None:
        if num_workers is None:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
            num_workers = max(1, min(4, (os.cpu_count() or 1) // max(1, local_world)))
        if num_workers > 0:
            prefetch_factor = 4 if prefetch_factor is None else prefetch_factor
            persistent_workers = True if persistent_workers is None else persistent_workers
        pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        super().__init__(
            dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            pin_memory=pin_memory,
            persistent_workers=bool(persistent_workers),
            **kwargs,
        )
        self.log_to_mlflow = log_to_mlflow
        self.fetch_times_s: list[float] = []
        self.passes = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override] # a generator timing each batch, over torch's iterator
        it = super().__iter__()
        start = len(self.fetch_times_s)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            self.fetch_times_s.append(time.perf_counter() - t0)
            yield batch
        self._report(start)
        self.passes += 1

    def _report(self, start: int) -> None:
        times = self.fetch_times_s[start:]
        if not (self.log_to_mlflow and times):
            return
        run_id = job_run_id() or os.environ.get("MLFLOW_RUN_ID")  # the job's run (adopted now if need be), or one
        if not run_id:  # the code's own environment names (outside sgpu_magic)
            return
        _, entities, tracking = import_mlflow("mlflow.entities", "mlflow.tracking")  # never beside another thread's
        Metric, MlflowClient = entities.Metric, tracking.MlflowClient

        rank, _ = rank_and_world()
        now = int(time.time() * 1000)
        metrics = [Metric(f"data/fetch_s/rank_{rank}", t, now, start + i) for i, t in enumerate(times)]
        metrics += [
            Metric(f"data/fetch_s_mean/rank_{rank}", sum(times) / len(times), now, self.passes),
            Metric(f"data/batches/rank_{rank}", float(len(times)), now, self.passes),
        ]
        client = MlflowClient()
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            client.log_batch(run_id, metrics=metrics[i : i + 1000])
