"""The rank's import hook (:func:`sgpu_magic._util.imports.after_import`), in fresh interpreters: several guards
waiting for the same module each run once it is imported (a cold rank's torch.distributed has three: process
groups kept, collectives timed, and so on), and none makes the import recurse."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = """
import sys
from sgpu_magic._util.imports import AfterImport, after_import
seen = []
def first(module): seen.append(("first", module.__name__))
def second(module): seen.append(("second", module.__name__))
after_import("xml.dom.minidom", first)
after_import("xml.dom.minidom", second)
after_import("xml.dom.minidom", first)  # already waiting: not added twice
assert sum(isinstance(f, AfterImport) for f in sys.meta_path) == 1
import xml.dom.minidom
after_import("xml.dom.minidom", second)  # imported already: at once
print(seen)
"""


def test_two_hooks_on_one_module_each_run_once_and_a_late_one_at_once():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "[('first', 'xml.dom.minidom'), ('second', 'xml.dom.minidom'), ('second', 'xml.dom.minidom')]"
    )


def test_a_cold_rank_s_hooks_on_torch_distributed_import_it_without_recursion():
    """What a cold rank does before its code imports torch (found by a Ray job: each rank a fresh interpreter)."""
    code = (
        "from sgpu_magic.rank import exit as rank_exit, steps\n"
        "rank_exit.keep_process_groups()\n"
        "steps.begin()\n"
        "import torch, torch.distributed as dist\n"
        "print(getattr(dist.all_reduce, '__sgpu_timed__', False), getattr(torch.autograd.backward, '__sgpu_timed__', False))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True True"


RACE = """
import os
import sys
import threading
import torch  # noqa: F401 - a rank has torch imported before its code runs
from sgpu_magic.data import DataLoader
from sgpu_magic.rank.mlflow_guard import forward_metrics, guard_job_run
guard_job_run()
loader = DataLoader(list(range(3)), batch_size=1, num_workers=0)
both = threading.Barrier(2)
errors = []
def writer():  # the metrics writer's thread forwarding runtime.step()'s first point
    both.wait()
    forward_metrics([(None, ("step_time_s/rank_0", 0.25, 1, 1000))])
def code():  # the rank's code: ending its first epoch, or importing mlflow's client for itself
    both.wait()
    while "mlflow" not in sys.modules:  # once the writer is inside mlflow's import: the interleaving that failed
        os.sched_yield()
    try:
        CODE_LINE
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=writer), threading.Thread(target=code)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(errors)
"""


@pytest.mark.parametrize(
    "code_line", ["list(loader)", "from mlflow.entities import Metric; from mlflow.tracking import MlflowClient"]
)
def test_a_rank_s_two_threads_importing_mlflow_at_once_both_get_all_of_it(tmp_path, code_line):
    """The metrics writer's first forwarded point and the rank's code (the data loader's epoch report, or its own
    ``from mlflow.entities import ...``) each import mlflow; at once, CPython handed one of them a partly initialised
    ``mlflow.entities`` (found in notebooks/05 in CI: ``cannot import name 'Run' from partially initialized module``,
    in both ranks). The code gets all of mlflow and the writer's point reaches the job's run."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("race")
    for _ in range(3):  # the race is lost on most tries without the fix; each try is a fresh interpreter
        run_id = client.create_run(experiment).info.run_id
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "SGPU_MAGIC_MLFLOW_RUN_ID": run_id}
        code = RACE.replace("CODE_LINE", code_line)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == "[]", done.stdout
        assert "could not be logged" not in done.stderr, done.stderr[-2000:]
        assert [m.value for m in client.get_metric_history(run_id, "step_time_s/rank_0")] == [0.25]
        batches = [m.value for m in client.get_metric_history(run_id, "data/batches/rank_0")]
        assert batches == ([3.0] if code_line == "list(loader)" else [])
