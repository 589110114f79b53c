"""The metrics file's writer and parser, the kernel's downsampled series, and ``runtime.log_metric``'s checks."""

from __future__ import annotations

import math

import pytest

from sgpu_magic import runtime
from sgpu_magic._util import metrics as metrics_file
from sgpu_magic._util.metrics import (
    BATCH_POINTS,
    RECORD_SIZE,
    MetricsWriter,
    decode_names,
    decode_records,
    encode,
    name_line,
    names_file,
    read_points,
)
from sgpu_magic.job.metrics import MAX_POINTS, MetricsPump, Series

from helpers import wait_for


def test_records_round_trip_and_an_unfinished_record_waits():
    data = encode(("loss", 0.5, 3, 17)) + encode(("x", math.inf, 0, 18)) + encode(("half", 1.0, 0, 0))[:20]
    records, used = decode_records(data)
    assert used == 2 * RECORD_SIZE and data[used:] == encode(("half", 1.0, 0, 0))[:20]
    names, _ = decode_names(name_line("loss") + name_line("x"))
    assert [(names[i], v, s, t) for i, v, s, t in records.tolist()] == [("loss", 0.5, 3, 17), ("x", math.inf, 0, 18)]
    assert math.isnan(decode_records(encode(("n", math.nan, 0, 0)))[0]["value"][0])
    table = b"not json\n5\n" + name_line("ok") + b'[1, 2]\n["half line'
    names, used = decode_names(table)
    assert list(names.values()) == ["ok"] and table[used:] == b'["half line'


def test_the_writer_batches_and_forwards_in_order(tmp_path):
    writer, sent = MetricsWriter(), []
    writer.forward = sent.extend
    path = tmp_path / "metrics" / "rank_0.bin"
    writer.record("dropped", 1.0, 0, 0, None, forward=True)  # no file yet: not kept
    assert writer.dropped == 1
    writer.use(path)
    for step in range(BATCH_POINTS - 1):
        writer.record("loss", float(step), step, 0, "run-a", forward=True)
    assert not path.exists() and names_file(path).read_bytes() == name_line("loss")  # the name is written at once
    writer.record("loss", -1.0, BATCH_POINTS - 1, 0, None, forward=False)  # a full batch: written by this call
    assert path.stat().st_size == BATCH_POINTS * RECORD_SIZE
    writer.flush()
    assert [p[1][2] for p in sent] == list(range(BATCH_POINTS - 1)) and sent[0][0] == "run-a"
    assert [p[2] for p in read_points(path)] == list(range(BATCH_POINTS))
    modes = [p.stat().st_mode & 0o777 for p in (path.parent, path, names_file(path))]
    assert modes == [0o700, 0o600, 0o600]


def test_a_forked_child_appends_with_the_same_name_ids(tmp_path):
    """A DataLoader worker is a fork: it inherits the names its parent wrote and agrees on every id."""
    import os

    writer = MetricsWriter()
    path = tmp_path / "rank_0.bin"
    writer.use(path)
    writer.record("loss", 1.0, 0, 0, None, forward=False)
    writer.flush()
    pid = os.fork()
    if pid == 0:  # the child: one known name, one new one
        writer.record("loss", 2.0, 1, 0, None, forward=False)
        writer.record("worker", 3.0, 0, 0, None, forward=False)
        writer.flush()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    writer.record("loss", 4.0, 2, 0, None, forward=False)
    writer.flush()
    assert sorted(read_points(path)) == [
        ("loss", 1.0, 0, 0),
        ("loss", 2.0, 1, 0),
        ("loss", 4.0, 2, 0),
        ("worker", 3.0, 0, 0),
    ]
    assert names_file(path).read_bytes().count(b'"loss"') == 1


def test_the_writer_s_thread_writes_a_slow_rank_s_points(tmp_path):
    writer = MetricsWriter()
    path = tmp_path / "rank_0.bin"
    writer.use(path)
    writer.record("acc", 0.5, 0, 0, None, forward=False)
    wait_for(lambda: path.exists() and path.read_bytes(), 10 * metrics_file.FLUSH_INTERVAL_S + 5, "the point written")
    assert read_points(path) == [("acc", 0.5, 0, 0)]


def test_a_series_keeps_an_even_sample_with_first_and_last():
    series = Series()
    n = 5 * MAX_POINTS + 3
    for step in range(n):
        series.add(step, float(step))
    points = series.values()
    assert len(points) <= MAX_POINTS + 1 and points[0] == (0, 0.0) and points[-1] == (n - 1, float(n - 1))
    assert {b[0] - a[0] for a, b in zip(points[:-2], points[1:-1])} == {series.stride}


@pytest.mark.parametrize("chunk", [1, 3, 7, 256, 1000, 2001, 4096, 30000])
def test_points_taken_in_chunks_keep_what_one_at_a_time_keeps(chunk):
    import numpy as np

    n = 7 * MAX_POINTS + 11
    one, many = Series(), Series()
    steps, values = np.arange(n, dtype=np.int64) * 3, np.random.default_rng(chunk).normal(size=n)
    for i in range(0, n, chunk):
        for j in range(i, min(n, i + chunk)):
            one.add(int(steps[j]), float(values[j]))
        many.add_many(steps[i : i + chunk], values[i : i + chunk])
        assert (many.seen, many.stride, len(many.points)) == (one.seen, one.stride, len(one.points))
    assert many.values() == one.values() and (many.stride, many.seen, many.last) == (one.stride, one.seen, one.last)


def test_the_pump_reads_only_whole_records_and_their_names(tmp_path):
    path = tmp_path / "rank_0.bin"
    pump = MetricsPump([path, tmp_path / "rank_1.bin"])
    assert pump.pump(final=True) is False  # no file yet
    second = encode(("loss", 2.0, 1, 0))
    names_file(path).write_bytes(name_line("loss") + name_line("acc"))
    path.write_bytes(encode(("loss", 1.0, 0, 0)) + second[:9])
    assert pump.pump(final=True) is True
    assert pump.snapshot() == {"loss": {0: [(0, 1.0)]}}
    with open(path, "ab") as f:
        f.write(second[9:] + encode(("acc", 0.5, 0, 0)) + encode(("unnamed", 9.0, 0, 0)))
    pump.pump(final=True)
    assert pump.snapshot() == {"acc": {0: [(0, 0.5)]}, "loss": {0: [(0, 1.0), (1, 2.0)]}}
    assert pump.last_values() == {"acc": {0: 0.5}, "loss": {0: 2.0}}


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


def test_a_copy_kept_up_to_date_by_offsets_reads_as_the_original(tmp_path):
    """How another node's file is copied (Ray jobs): whole records and whole name lines only, then appended."""
    from sgpu_magic._util.metrics import append, read_new

    source, copy = tmp_path / "node" / "rank_0.bin", tmp_path / "kernel" / "rank_0.bin"
    names_file(source).parent.mkdir()
    names_file(source).write_bytes(name_line("loss") + b'[1, "half')
    source.write_bytes(encode(("loss", 1.0, 0, 0)) + encode(("loss", 2.0, 1, 0))[:5])
    records, names = read_new(source, 0), read_new(names_file(source), 0)
    assert (len(records), names) == (RECORD_SIZE, name_line("loss"))
    assert read_new(tmp_path / "missing.bin", 0) == b""
    append(names_file(copy), names)
    append(copy, records)
    assert read_points(copy) == [("loss", 1.0, 0, 0)]
    assert [oct(p.stat().st_mode & 0o777) for p in (copy.parent, copy, names_file(copy))] == ["0o700", "0o600", "0o600"]


def test_a_record_whose_name_is_not_in_the_table_yet_waits_for_it_until_the_final_read(tmp_path):
    path = tmp_path / "rank_0.bin"
    pump = MetricsPump([path])
    names_file(path).write_bytes(name_line("a"))
    path.write_bytes(encode(("a", 1.0, 0, 0)) + encode(("b", 2.0, 0, 0)) + encode(("a", 3.0, 1, 0)))
    assert pump.pump() is True and pump.snapshot() == {"a": {0: [(0, 1.0)]}}  # "b" and what follows wait
    with open(names_file(path), "ab") as f:
        f.write(name_line("b"))
    pump.pump(final=True)
    assert pump.snapshot() == {"a": {0: [(0, 1.0), (1, 3.0)]}, "b": {0: [(0, 2.0)]}}
