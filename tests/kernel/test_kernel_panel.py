"""The panel's Metrics tab and the snapshot an ended job leaves, in real Jupyter kernels (jupyter_client, nbclient,
nbconvert): real ranks, real widgets and comms, the notebook saved and converted to HTML with no kernel."""

from __future__ import annotations

import ast

import nbformat
import pytest

from helpers import wait_for
from kernel_utils import collect_all, execute, start_kernel, stop_kernel

pytestmark = pytest.mark.slow

METRICS_JOB = """
import os
from sgpu_magic import distributed

@distributed(gpus=2, mlflow=False, widgets=True, timeout=180)
def logs_then_waits(go):
    import os, time
    from sgpu_magic import runtime

    rank = runtime.get_global_rank()
    for step in range(10):
        runtime.log_metric("loss", 1.0 / (step + 1) + rank, step=step)
        print(f"rank {rank} step {step}", flush=True)
    while not os.path.exists(go):
        time.sleep(0.02)
    print(f"rank {rank} done", flush=True)
    return rank
"""


def kernel_value(kc, expr: str):
    out = execute(kc, f"print(repr({expr}))")
    assert out.error is None, out.error
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_the_metrics_tab_is_fed_live_and_the_ended_job_leaves_a_snapshot(tmp_path):
    """A background job logs ``loss`` from 2 ranks: the panel gets a Metrics tab whose bqplot Lines hold each rank's
    points (read in the kernel while the job runs); once the job ends, the panel's output is replaced in place
    (``update_display_data`` with the panel's display id) by the static snapshot, and every widget is closed."""
    km, kc = start_kernel()
    go = tmp_path / "go"
    try:
        assert execute(kc, METRICS_JOB).error is None
        launch = kc.execute(f"job = logs_then_waits.submit({str(go)!r})")
        seen = collect_all(kc, launch)
        panel_ids = [
            m["content"]["transient"]["display_id"]
            for m in seen
            if m["msg_type"] == "display_data" and "application/vnd.jupyter.widget-view+json" in m["content"]["data"]
        ]
        assert len(panel_ids) == 1
        lines = "[(sorted(l.labels), l.x.tolist(), l.y.tolist()) for l in job.view._chart.lines.values()]"
        fed = wait_for(
            lambda: kernel_value(kc, f"job.view._chart is not None and {lines}") or None,
            120,
            "the Metrics tab to show both ranks' points",
        )
        assert kernel_value(kc, "job.view.tabs.titles") == ("rank 0", "rank 1", "metrics")
        # the off-screen tab is redrawn every 5 s: wait for all 10 points of both ranks
        fed = wait_for(
            lambda: len(value := kernel_value(kc, lines)) == 2 and all(len(x) == 10 for _, x, _ in value) and value,
            60,
            "all 10 points of each rank in the chart",
        )
        assert [labels for labels, _, _ in fed] == [["rank 0"], ["rank 1"]]
        assert fed[0][1] == [float(s) for s in range(10)]
        assert fed[1][2] == pytest.approx([1.0 / (s + 1) + 1 for s in range(10)])
        assert kernel_value(kc, "job.view._chart.metric") == "loss"

        go.touch()
        ended = kc.execute("job.result(timeout_s=120)")
        seen = collect_all(kc, ended)
        assert kernel_value(kc, "job.state.value") == "succeeded"
        # the background thread may replace the panel just after the result is in: wait for the snapshot
        wait_for(lambda: kernel_value(kc, "job.view.snapshot is not None"), 30, "the snapshot")
        closed = kernel_value(kc, "[w.comm is None for w in (job.view.widget, job.view.header, job.view.tabs)]")
        assert closed == [True, True, True]
        assert kernel_value(kc, "(job.view.buffers, job.view.outputs, job.view._chart)") == ([], [], None)
        html = kernel_value(kc, "job.view.snapshot['text/html']")
        assert "succeeded" in html and "rank 1 done" in html and "<svg" in html and "<polyline" in html
        assert "exited 0" in kernel_value(kc, "job.view.snapshot['text/plain']")
    finally:
        go.touch()
        stop_kernel(km, kc)


def test_the_update_replaces_the_panel_by_its_display_id():
    """The snapshot arrives as ``update_display_data`` for the panel's display id, with HTML and plain text."""
    km, kc = start_kernel()
    try:
        cell = "%%distributed --gpus 2 --no-mlflow\nimport os\nprint('hello from', os.environ['RANK'])"
        assert execute(kc, "import os; os.environ['SGPU_MAGIC_WIDGETS'] = '1'").error is None
        seen = collect_all(kc, kc.execute(cell), timeout_s=240)
        shown = [m for m in seen if m["msg_type"] == "display_data"]
        updates = [m for m in seen if m["msg_type"] == "update_display_data"]
        assert len(shown) == 1 and len(updates) == 1
        assert updates[0]["content"]["transient"]["display_id"] == shown[0]["content"]["transient"]["display_id"]
        data = updates[0]["content"]["data"]
        assert set(data) == {"text/html", "text/plain"}
        assert "hello from 1" in data["text/html"] and "hello from 0" in data["text/plain"]
        assert "succeeded" in data["text/plain"]
        closes = [m for m in seen if m["msg_type"] == "comm_close"]
        opens = [m for m in seen if m["msg_type"] == "comm_open"]
        assert {m["content"]["comm_id"] for m in opens} <= {m["content"]["comm_id"] for m in closes}
    finally:
        stop_kernel(km, kc)


NOTEBOOK_CELLS = [
    "%load_ext sgpu_magic",
    "import os\nos.environ['SGPU_MAGIC_WIDGETS'] = '1'",
    "from sgpu_magic import distributed, runtime\n\n@distributed(gpus=2, mlflow=False)\ndef train():\n"
    "    rank = runtime.get_global_rank()\n    for step in range(5):\n"
    "        runtime.log_metric('loss', 2.0 - step / 4 - rank / 10, step=step)\n"
    "        print(f'epoch {step} of rank {rank} <ok>')\n    return rank\n\ntrain.distributed()",
]


def test_a_saved_notebook_converted_to_html_without_a_kernel_shows_the_snapshot(tmp_path):
    """nbclient runs the notebook (the widget's output is replaced by the snapshot in the saved notebook);
    nbconvert's HTMLExporter, with no kernel, renders the state, each rank's last lines and the chart."""
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK_CELLS])
    NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    path = tmp_path / "saved.ipynb"
    nbformat.write(nb, path)
    saved = nbformat.read(path, as_version=4)
    outputs = saved.cells[2].outputs
    assert not [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    snapshots = [o for o in outputs if o.output_type == "display_data" and "text/html" in o.data]
    assert len(snapshots) == 1 and "sgpu-magic-snapshot" in snapshots[0].data["text/html"]
    body, _ = HTMLExporter().from_notebook_node(saved)
    assert "succeeded" in body and "2 x cpu (gloo)" in body
    assert "epoch 4 of rank 1 &lt;ok&gt;" in body and "epoch 0 of rank 0 &lt;ok&gt;" in body
    assert "<svg" in body and body.count("<polyline") == 2 and ">loss</text>" in body
