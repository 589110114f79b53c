"""The libraries users bring into their ranks see the world sgpu_magic starts: Accelerate on CPU ranks."""

from __future__ import annotations

import pytest

from sgpu_magic import distributed

pytest.importorskip("accelerate", reason="Accelerate is in the test extra (pip install -e '.[test]')")


def test_a_plain_accelerator_on_cpu_ranks_sees_every_rank():
    """Under torchrun's environment alone, ``Accelerator()`` counts only GPUs: on CPU ranks it reports
    ``DistributedType.NO`` and one process per rank, and each rank trains alone. sgpu_magic sets what Accelerate
    needs (``ACCELERATE_USE_CPU``) for CPU ranks, so it reports ``MULTI_CPU`` over the job's world."""

    @distributed(gpus=2, mlflow=False, widgets=False)
    def accelerated():
        import torch
        from accelerate import Accelerator

        accelerator = Accelerator()
        total = accelerator.reduce(torch.ones(1), reduction="sum")
        return str(accelerator.distributed_type), accelerator.num_processes, accelerator.process_index, total.item()

    assert accelerated.distributed() == [
        ("DistributedType.MULTI_CPU", 2, 0, 2.0),
        ("DistributedType.MULTI_CPU", 2, 1, 2.0),
    ]


def test_a_kernel_that_sets_accelerate_use_cpu_itself_keeps_its_value(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")

    @distributed(gpus=1, mlflow=False, widgets=False)
    def seen():
        import os

        return os.environ["ACCELERATE_USE_CPU"]

    assert seen.distributed() == ["false"]
