"""Metrics from ranks (issue 21): ``runtime.log_metric`` in real rank processes, the per-rank metrics files, the
kernel's ``job.metrics()`` (live and after the job, downsampled) and the summary's last-value table.

Untracked jobs here; what reaches MLflow (and ``mlflow.log_metric`` intercepted in a rank) is in
``test_tracking.py``.
"""

from __future__ import annotations

import os
import re
import stat

import pytest

from sgpu_magic import distributed
from sgpu_magic._util.metrics import names_file, read_points
from sgpu_magic.job.metrics import MAX_POINTS

from helpers import wait_for

START_DEADLINE_S = 120.0


@distributed(gpus=2, mlflow=False, widgets=False)
def many_points(n):
    from sgpu_magic import runtime

    rank = runtime.get_global_rank()
    for step in range(n):
        runtime.log_metric("loss", 1.0 / (step + 1) + rank, step=step)
    for _ in range(3):
        runtime.log_metric("lr", 0.1 * (rank + 1))  # no step: 0, 1, 2
    return rank


def test_every_rank_s_points_reach_job_metrics_downsampled_with_first_and_last(sgpu_home):
    n = 3 * MAX_POINTS + 7
    assert many_points.distributed(n) == [0, 1]
    job = many_points.last_job
    metrics = job.metrics()
    assert sorted(metrics) == ["loss", "lr"]
    assert metrics["lr"] == {0: [(0, 0.1), (1, 0.1), (2, 0.1)], 1: [(0, 0.2), (1, 0.2), (2, 0.2)]}
    for rank, points in metrics["loss"].items():
        steps = [s for s, _ in points]
        assert len(points) <= MAX_POINTS + 1
        assert len(points) > MAX_POINTS // 2
        assert points[0] == (0, 1.0 + rank) and points[-1] == (n - 1, 1.0 / n + rank)
        gaps = {b - a for a, b in zip(steps[:-2], steps[1:-1])}
        assert len(gaps) == 1, gaps  # evenly spaced, but for the last point
        assert dict(points)[steps[1]] == 1.0 / (steps[1] + 1) + rank
    assert job.metrics("lr") == {"lr": metrics["lr"]}
    assert job.metrics("nothing such") == {}
    arrays = job.metric_arrays("loss")  # the same points as numpy arrays, for plotting
    assert sorted(arrays) == [0, 1] and job.metric_arrays("nothing such") == {}
    for rank, (steps, values) in arrays.items():
        assert steps.dtype == values.dtype == "float64"
        assert list(zip(steps.tolist(), values.tolist())) == [(float(s), v) for s, v in metrics["loss"][rank]]
    # the files behind it: every point, private
    folder = job.run_dir / "metrics"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for rank in range(2):
        path = folder / f"rank_{rank}.bin"
        assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(names_file(path).stat().st_mode) == 0o600
        points = read_points(path)
        assert len(points) == n + 3 and [p[2] for p in points if p[0] == "loss"] == list(range(n))


@distributed(gpus=2, mlflow=False, widgets=False, timeout=120)
def logs_then_waits(folder):
    import os
    import time

    from sgpu_magic import runtime

    for step in range(5):
        runtime.log_metric("acc", step / 10, step=step)
    deadline = time.monotonic() + 100
    while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
        time.sleep(0.02)
    runtime.log_metric("acc", 1.0, step=5)


def test_points_show_while_the_job_runs(tmp_path):
    """A rank that logs 5 points and then blocks: they are in ``job.metrics()`` before it goes on (the writer's
    thread wrote them within its interval, without a full batch)."""
    job = logs_then_waits.submit(str(tmp_path))
    try:
        seen = wait_for(
            lambda: [len(p) for p in job.metrics().get("acc", {}).values()] == [5, 5] and job.metrics(),
            START_DEADLINE_S,
            "5 points of each rank",
        )
        assert seen["acc"] == {rank: [(s, s / 10) for s in range(5)] for rank in (0, 1)}
        assert not job.done()
    finally:
        (tmp_path / "go").touch()
    job.result(timeout_s=60)
    assert job.metrics("acc")["acc"][1][-1] == (5, 1.0)


SUMMARY_CELL = """%%distributed --gpus 2 --no-mlflow -o metrics_job
from sgpu_magic import runtime
r = runtime.get_global_rank()
for step in range(4):
    runtime.log_metric("loss", 2.0 - step / 2 + r / 100, step=step)
runtime.log_metric("throughput/samples_per_s", 1234.5 * (r + 1))
"""


def test_the_summary_ends_with_a_last_value_table(run_cell):
    result, out, err = run_cell(SUMMARY_CELL)
    assert result.error_in_exec is None, (out, err)
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if re.match(r"sgpu_magic: job \S+ succeeded", line))
    after = [line for line in lines[at + 1 :] if not line.startswith("sgpu_magic: peak RSS per rank: ")]
    assert after == [
        "sgpu_magic: metrics, last value per rank:",
        "sgpu_magic:   loss                      rank 0: 0.5  rank 1: 0.51",
        "sgpu_magic:   throughput/samples_per_s  rank 0: 1234  rank 1: 2469",
    ], out


@distributed(gpus=1, mlflow=False, widgets=False)
def logs_wrongly(how):
    from sgpu_magic import runtime

    runtime.log_metric(*how)


@pytest.mark.parametrize(
    ("how", "error"),
    [
        (("", 1.0), r"ValueError: log_metric: the name must not be empty"),
        (
            ("loss", "1.5"),
            r"TypeError: log_metric\('loss', \.\.\.\): the value must be a real number .* not str '1\.5'",
        ),
    ],
)
def test_a_bad_point_fails_the_rank_with_what_was_wrong(how, error):
    from sgpu_magic.errors import RankFailedError

    with pytest.raises(RankFailedError, match=error):
        logs_wrongly.distributed(how)
    assert not os.path.exists(logs_wrongly.last_job.run_dir / "metrics" / "rank_0.bin")
