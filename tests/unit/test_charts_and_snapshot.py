"""The panel's charts (min-max bucketing, the live bqplot chart, the snapshot's SVG), the snapshot bundle, closing a
widget tree, and the bounded job list."""

from __future__ import annotations

import math

import ipywidgets as w
import pytest

from sgpu_magic import distributed
from sgpu_magic.job.handle import Job, jobs
from sgpu_magic.job.registry import MAX_ENDED_JOBS
from sgpu_magic.launch.resources import plan_devices
from sgpu_magic.rundir import RunDir
from sgpu_magic.ui.charts import MAX_CHART_POINTS, MetricsChart, minmax_downsample, minmax_indices, svg_chart
from sgpu_magic.ui.snapshot import RankTail, close_tree, plain, snapshot_bundle


def test_minmax_downsample_keeps_ends_and_every_bucket_s_extremes():
    points = [(float(i), math.sin(i / 50)) for i in range(10_000)]
    points[5_003] = (5_003.0, 40.0)  # a spike plain decimation would likely drop
    kept = minmax_downsample(points)
    assert len(kept) <= MAX_CHART_POINTS and kept[0] == points[0] and kept[-1] == points[-1]
    assert (5_003.0, 40.0) in kept and [x for x, _ in kept] == sorted(x for x, _ in kept)
    assert minmax_downsample(points[:10]) == points[:10]  # short series are kept whole
    assert len(minmax_downsample(points, 300)) <= 300


@pytest.mark.parametrize("n", [1001, 1999, 2001, 7777])
def test_minmax_indices_are_each_bucket_s_first_lowest_and_highest_point(n):
    import numpy as np

    values = np.random.default_rng(n).normal(size=n).round(1)  # ties: the first of equal values wins
    values[10:600] = np.nan  # a run of NaN: whole buckets of it give no point
    values[700] = np.inf
    kept = minmax_indices(values, MAX_CHART_POINTS).tolist()
    inner, buckets = list(range(1, n - 1)), (MAX_CHART_POINTS - 2) // 2
    size, wider = divmod(len(inner), buckets)
    starts = [b * size + min(b, wider) for b in range(buckets + 1)]
    expected = [0]
    for start, end in zip(starts, starts[1:]):
        bucket = [i for i in inner[start:end] if not math.isnan(values[i])]
        if bucket:
            low = min(bucket, key=lambda i: (values[i], i))
            high = min(bucket, key=lambda i: (-values[i], i))
            expected += sorted({low, high})
    assert kept == [*expected, n - 1] and len(kept) <= MAX_CHART_POINTS and 700 in kept


def test_the_live_chart_has_a_line_per_rank_and_follows_the_chosen_metric():
    import numpy as np

    steps = np.arange(5000, dtype=float)
    data = {
        "loss": {0: (steps, 1.0 / (steps + 1)), 1: (np.array([0.0, 1.0]), np.array([2.0, 1.5]))},
        "lr": {0: (np.array([0.0]), np.array([1e-3]))},
    }
    fetched = []
    chart = MetricsChart(2)
    chart.update(["loss", "lr"], lambda name: fetched.append(name) or data[name])
    assert fetched == ["loss"]  # only the metric on screen is fetched
    assert chart.metric == "loss" and list(chart.picker.options) == ["loss", "lr"]
    assert len(chart.lines[0].x) == MAX_CHART_POINTS and chart.lines[1].y.tolist() == [2.0, 1.5]
    assert [m.labels for m in chart.figure.marks] == [["rank 0"], ["rank 1"]] and chart.lines[0].display_legend
    chart.picker.value = "lr"  # what picking in the dropdown does
    assert chart.lines[0].y.tolist() == [1e-3] and chart.lines[1].y.tolist() == []
    close_tree(chart.widget)


def test_the_snapshot_svg_draws_finite_points_and_escapes_names():
    svg = svg_chart("a<b>", {0: [(0, 1.0), (1, math.nan), (2, 0.5)], 1: [(0, 3.0)]})
    assert svg.startswith("<svg") and svg.endswith("</svg>") and ">a&lt;b&gt;</text>" in svg
    assert svg.count("<polyline") == 2 and "nan" not in svg.split("<polyline", 1)[1]
    assert "rank 0" in svg and "rank 1" in svg and ">3</text>" in svg and ">0.5</text>" in svg


def test_the_snapshot_bundle_has_html_and_text_without_ansi():
    tails = [
        RankTail(0, "<small><b>exited 0</b> &middot; log: <code>r0.log</code></small>", "\x1b[32mok\x1b[0m <x>\n"),
        RankTail(1, "<small><b>failed</b></small>", "Traceback\n", open=True),
    ]
    bundle = snapshot_bundle("<b>job</b> failed<br>why", tails, {"loss": {0: [(0, 1.0)]}}, "sgpu_magic: job x failed")
    html, text = bundle["text/html"], bundle["text/plain"]
    assert "ok &lt;x&gt;" in html and "\x1b" not in html and "<details open><summary><b>rank 1</b>" in html
    assert "<details><summary><b>rank 0</b>" in html and "<svg" in html
    assert '<div class="sgpu-magic-header"><b>job</b> failed<br>why</div>' in html
    assert "sgpu_magic: job x failed" not in snapshot_bundle("h", tails, {}, "")["text/html"]
    assert text.splitlines()[:3] == ["job failed", "why", "--- rank 0: exited 0 · log: r0.log"]
    assert text.endswith("Traceback\nsgpu_magic: job x failed")
    assert plain("<table><tr><td>a</td><td>1</td></tr></table>") == "a 1 \n"


def test_close_tree_closes_every_widget_held():
    tab = w.Tab(children=[w.Output(), w.Output()])
    box = w.VBox([w.HBox([w.HTML("x"), w.Button()]), tab])
    held = [box, tab, *tab.children, box.children[0], *box.children[0].children, box.layout, tab.layout]
    assert close_tree(box) >= len(held)
    assert all(widget.comm is None for widget in held)


def test_the_job_list_keeps_running_jobs_and_the_last_ended_ones(tmp_path):
    spec = distributed(gpus=1, mlflow=False)(len).spec
    plan = plan_devices(spec)

    def make() -> Job:
        return Job(RunDir.create(tmp_path), spec, plan, get_host=lambda: pytest.fail("nothing launches"))

    running = make()
    ended = []
    try:
        for _ in range(MAX_ENDED_JOBS + 5):
            job = make()
            job.cancel()  # never launched: it ends at once, as cancelled
            ended.append(job)
        make().cancel()  # the next job drops the oldest ended ones beyond MAX_ENDED_JOBS
        listed = jobs()
        assert running in listed and not running.ended
        assert sum(j.ended for j in listed) == MAX_ENDED_JOBS
        assert ended[0] not in listed and ended[-1] in listed
        assert ended[0].state.value == "cancelled"  # a dropped handle still works
    finally:
        running.cancel()
