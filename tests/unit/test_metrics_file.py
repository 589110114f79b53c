"""The metrics file's writer and parser, the kernel's downsampled series, and ``runtime.log_metric``'s checks."""

from __future__ import annotations

import math

import pytest

from sgpu_magic import runtime
from sgpu_magic._util import metrics as metrics_file
from sgpu_magic._util.metrics import BATCH_POINTS, MetricsWriter, decode_lines, encode
from sgpu_magic.job.metrics import MAX_POINTS, MetricsPump, Series

from helpers import wait_for


def test_lines_round_trip_and_an_unfinished_line_waits():
    data = encode(("loss", 0.5, 3, 17)) + encode(("x", math.inf, 0, 18)) + b'["half", 1.0'
    points, used = decode_lines(data)
    assert points == [("loss", 0.5, 3, 17), ("x", math.inf, 0, 18)]
    assert data[used:] == b'["half", 1.0'
    assert math.isnan(decode_lines(encode(("n", math.nan, 0, 0)))[0][0][1])
    assert decode_lines(b"not json\n" + encode(("ok", 1.0, 0, 0)))[0] == [("ok", 1.0, 0, 0)]


def test_the_writer_batches_and_forwards_in_order(tmp_path):
    writer, sent = MetricsWriter(), []
    writer.forward = sent.extend
    path = tmp_path / "metrics" / "rank_0.jsonl"
    writer.record("dropped", 1.0, 0, 0, None, forward=True)  # no file yet: not kept
    assert writer.dropped == 1
    writer.use(path)
    for step in range(BATCH_POINTS - 1):
        writer.record("loss", float(step), step, 0, "run-a", forward=True)
    writer.record("loss", -1.0, BATCH_POINTS - 1, 0, None, forward=False)  # a full batch: written by this call
    assert len(path.read_bytes().splitlines()) == BATCH_POINTS
    writer.flush()
    assert [p[1][2] for p in sent] == list(range(BATCH_POINTS - 1)) and sent[0][0] == "run-a"
    assert (path.parent.stat().st_mode & 0o777, path.stat().st_mode & 0o777) == (0o700, 0o600)


def test_the_writer_s_thread_writes_a_slow_rank_s_points(tmp_path):
    writer = MetricsWriter()
    path = tmp_path / "rank_0.jsonl"
    writer.use(path)
    writer.record("acc", 0.5, 0, 0, None, forward=False)
    wait_for(lambda: path.exists() and path.read_bytes(), 10 * metrics_file.FLUSH_INTERVAL_S + 5, "the point written")
    assert decode_lines(path.read_bytes())[0] == [("acc", 0.5, 0, 0)]


def test_a_series_keeps_an_even_sample_with_first_and_last():
    series = Series()
    n = 5 * MAX_POINTS + 3
    for step in range(n):
        series.add(step, float(step))
    points = series.values()
    assert len(points) <= MAX_POINTS + 1 and points[0] == (0, 0.0) and points[-1] == (n - 1, float(n - 1))
    assert {b[0] - a[0] for a, b in zip(points[:-2], points[1:-1])} == {series.stride}


def test_the_pump_reads_only_complete_lines(tmp_path):
    path = tmp_path / "rank_0.jsonl"
    pump = MetricsPump([path, tmp_path / "rank_1.jsonl"])
    assert pump.pump(final=True) is False  # no file yet
    path.write_bytes(encode(("loss", 1.0, 0, 0)) + b'["loss", 2')
    assert pump.pump(final=True) is True
    assert pump.snapshot() == {"loss": {0: [(0, 1.0)]}}
    with open(path, "ab") as f:
        f.write(b".0, 1, 0]\n")
    pump.pump(final=True)
    assert pump.snapshot("loss") == {"loss": {0: [(0, 1.0), (1, 2.0)]}} and pump.last_values() == {"loss": {0: 2.0}}


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (("", 1.0), ValueError, r"^log_metric: the name must not be empty$"),
        ((3, 1.0), TypeError, r"^log_metric: the name must be a str, not int 3$"),
        (
            ("loss", "1.0"),
            TypeError,
            r"^log_metric\('loss', \.\.\.\): the value must be a real number \(int, float, or a one-element numpy/torch value\), not str '1\.0'$",
        ),
        (("loss", [1.0, 2.0]), TypeError, r"the value must be a real number .*, not list \[1\.0, 2\.0\]$"),
        (("loss", None), TypeError, r"the value must be a real number .*, not NoneType None$"),
        (("loss", 1.0, 1.5), TypeError, r"^log_metric\('loss', \.\.\.\): step must be an int or None, not float 1\.5$"),
        (("loss", 1.0, True), TypeError, r"step must be an int or None, not bool True$"),
    ],
)
def test_log_metric_refuses_what_is_not_a_point(args, error, message):
    with pytest.raises(error, match=message):
        runtime.log_metric(*args)


def test_log_metric_takes_numpy_and_torch_numbers_outside_a_job_and_drops_them():
    import numpy as np
    import torch

    before = metrics_file.WRITER.dropped
    runtime.log_metric("n", np.float32(0.5), step=np.int64(2))
    runtime.log_metric("n", torch.tensor(1.5))
    assert metrics_file.WRITER.dropped == before + 2
