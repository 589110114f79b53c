"""Step timing, the straggler check and the profiler as a user meets them: ``%%distributed --profile`` in a real
Jupyter kernel (jupyter_client), with the defaults on (MLflow tracking, the panel's decision)."""

import json
from pathlib import Path

import jsonschema
import pytest

from helpers import TRACE_EVENT_SCHEMA
from kernel_utils import execute, start_kernel, stop_kernel

pytestmark = pytest.mark.slow

QUICKSTART_LOOP = """\
%%distributed --gpus 2 --profile 5 -o job
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from sgpu_magic import runtime

dist.init_process_group(runtime.backend())
torch.manual_seed(0)
features = torch.randn(2000, 10)
data = TensorDataset(features, features @ torch.randn(10, 1))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=32, sampler=sampler)
model = DDP(nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1)))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for x, y in loader:  # the quickstart's loop: no runtime.step(), the optimizer's steps are the steps
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
del model, optimizer
dist.destroy_process_group()
"""


def test_profile_of_the_quickstart_loop_gives_a_perfetto_trace_of_both_ranks_and_a_table_that_adds_up(tmp_path):
    km, kc = start_kernel(cwd=tmp_path, env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"})
    try:
        out = execute(kc, QUICKSTART_LOOP, timeout_s=240)
        assert out.error is None, out.error
        text = out.stdout + "".join(out.results)
        assert "profile of 5 step(s) per rank" in text and "top ops by self CPU time, all ranks:" in text
        out = execute(
            kc,
            "import json, mlflow\n"
            "summary = job.profile_summary()\n"
            "arts = [a.path for a in mlflow.MlflowClient().list_artifacts(job.mlflow_run_id, 'profile')]\n"
            "print(json.dumps({'trace': str(job.profile_trace()), 'summary': summary, 'artifacts': arts}))",
        )
        assert out.error is None, out.error
        seen = json.loads(out.stdout.strip().splitlines()[-1])
        trace = json.loads(Path(seen["trace"]).read_bytes())
        jsonschema.validate(trace, TRACE_EVENT_SCHEMA)  # the JSON form Perfetto and chrome://tracing load
        assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
        assert seen["artifacts"] == ["profile/trace.json"]
        for s in seen["summary"].values():
            parts = s["compute_s"] + s["collective_s"] + s["data_s"] + s["idle_s"]
            assert abs(parts - s["wall_s"]) <= 0.05 * s["wall_s"], s
            assert s["steps"] == 5 and s["collective_s"] > 0
    finally:
        stop_kernel(km, kc)
