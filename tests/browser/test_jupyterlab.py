"""The panel as a person sees it: JupyterLab and Notebook 7 in headless chromium, cells run and buttons clicked in
the page. Every test runs once per frontend (the ``jupyter`` fixture), one server and browser at a time.

1. The quickstart notebook's ``%%distributed --gpus $RANKS`` cell (2 CPU ranks): the panel appears, its header goes to
   succeeded, each rank's tab (switched by clicking) shows that rank's lines, the tqdm bar is one line,
   and the MLflow link points at a server that answers for that run.
2. A blocking ``fn.distributed(...)`` job stopped with the panel's Stop button while its cell runs.
3. The same with a ``%%distributed --background`` job.
4. Live sessions: an interrupted cell keeps the ranks' state; pdb's prompt in the input box.
5. A job logging two metrics: the Metrics tab's bqplot figure draws a line per rank; the ended job's snapshot keeps
   the charts as inline SVG; the notebook, saved and reopened once its kernel was shut down, still shows it.
6. A page closed and reopened while a background job prints: the reopened page shows the live panel, with every line
   printed while the page was away, and keeps updating (the kernel is idle, so the widget manager restores the
   panel's live models from it).

Once a job ends its panel is replaced by a static snapshot (header, each rank's last lines, the charts), which the
tests read where they read the panel before.

Screenshots of each scenario are written to the session's temporary directory, or to
``$SGPU_MAGIC_SCREENSHOTS`` when set (Notebook 7's with a ``notebook7-`` prefix).
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import nbformat
import psutil
import pytest

from helpers import wait_for

JOB_TIMEOUT_MS = 240_000
"""A 2-rank CPU job on a loaded 2-core machine, first launch included."""


def open_notebook(page, jupyter, name: str):
    """Open ``name`` alone (in JupyterLab, in a workspace of its own) and wait until its kernel is connected."""
    page.goto(jupyter.notebook_url(name))
    notebook = page.locator(".jp-NotebookPanel .jp-Notebook")
    expect_count(page.locator(".jp-NotebookPanel"), 1, timeout_ms=60_000)  # the first load on a busy machine
    # a cell run before the notebook's kernel is up is dropped: wait until the page shows it idle
    from playwright.sync_api import expect

    if jupyter.frontend.name == "jupyterlab":
        expect(page.locator("#jp-main-statusbar")).to_contain_text("(ipykernel) | Idle", timeout=120_000)
    else:  # Notebook 7 has no status bar, and its toolbar's indicator says idle before the kernel starts too
        wait_kernel_connected(jupyter, name)
        expect(page.locator(".jp-NotebookPanel-toolbar .jp-Notebook-ExecutionIndicator")).to_have_attribute(
            "data-status", "idle", timeout=60_000
        )
    notebook.locator(".jp-CodeCell").first.wait_for()
    return notebook


def wait_kernel_connected(jupyter, name: str, timeout_s: float = 120) -> None:
    """The server's session of notebook ``name`` has an idle kernel with the page's websocket connected."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kernels = [s["kernel"] for s in jupyter.api("sessions") if s.get("path") == name and s.get("kernel")]
        if kernels and kernels[0].get("execution_state") == "idle" and kernels[0].get("connections", 0) >= 1:
            return
        time.sleep(0.25)  # the server's own view: asked again shortly
    raise AssertionError(f"the kernel of {name} was not connected and idle within {timeout_s} s")


def expect_count(locator, n: int, timeout_ms: int = 15_000) -> None:
    from playwright.sync_api import expect

    expect(locator).to_have_count(n, timeout=timeout_ms)


def run_cell(page, notebook, index: int):
    """Click into code cell ``index`` and press Shift+Enter, as a person runs a cell; return the cell."""
    cell = notebook.locator(".jp-CodeCell").nth(index)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    return cell


def wait_cell_done(cell, timeout_ms: int = JOB_TIMEOUT_MS) -> None:
    """The cell's prompt shows its execution count (``[*]`` while it runs)."""
    from playwright.sync_api import expect

    expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"), timeout=timeout_ms)


def panel_of(cell):
    """The cell's panel while its job runs, and the static snapshot that replaces it once the job has ended."""
    return (
        cell.locator(".jp-OutputArea-output .widget-vbox, .jp-OutputArea-output .sgpu-magic-snapshot")
        .filter(has_text=re.compile("sgpu_magic (job|session)"))
        .first
    )


def header_of(panel):
    """The header of a live panel or of its snapshot."""
    return panel.locator(".widget-html, .sgpu-magic-header").filter(has_text=re.compile("sgpu_magic ")).first


def snapshot_of(cell):
    return cell.locator(".jp-OutputArea-output .sgpu-magic-snapshot")


def shown_log(panel) -> str:
    """The text of the rank tab on screen (the other tabs' outputs are hidden)."""
    return panel.locator(".widget-tab-contents .widget-output:visible .jp-RenderedText").last.inner_text()


def write_notebook(path: Path, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nbformat.write(nb, path)


def running_job_pids(jupyter, timeout_s: float = 120) -> tuple[str, list[int]]:
    """(job id, rank pids) of the one running job under the server's sgpu_magic home, from its status.json."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for status_file in sorted((jupyter.home / "runs").glob("*/status.json")):
            try:
                status = json.loads(status_file.read_text())
            except (OSError, ValueError):  # replaced while read
                continue
            if status.get("state") == "running" and status.get("pids"):
                return status_file.parent.name, [int(pid) for pid in status["pids"].values()]
        time.sleep(0.2)  # the launch host writes it: look again shortly
    raise AssertionError(f"no running job under {jupyter.home / 'runs'} within {timeout_s} s")


def assert_gone(pids: list[int], timeout_s: float = 30) -> None:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"rank processes still running after Stop: {[p.pid for p in alive]}"


def test_quickstart_panel_tabs_tqdm_and_mlflow_link(jupyter, page, screenshots):
    from playwright.sync_api import expect

    notebook = open_notebook(page, jupyter, "01_quickstart.ipynb")
    for index in (0, 1, 2, 3):  # %load_ext, imports, the model, setup/make_loader
        wait_cell_done(run_cell(page, notebook, index), 120_000)
    magic_cell = notebook.locator(".jp-CodeCell").nth(7)
    assert magic_cell.locator(".jp-InputArea-editor").inner_text().startswith("%%distributed --gpus $RANKS")
    run_cell(page, notebook, 7)

    panel = panel_of(magic_cell)
    panel.wait_for(timeout=60_000)  # shown when the job is created, before the ranks start
    header = header_of(panel)
    expect(header).to_contain_text("2 x cpu (gloo)")
    expect(header).to_contain_text("succeeded", timeout=JOB_TIMEOUT_MS)
    wait_cell_done(magic_cell)

    # the ended job's panel is replaced by its snapshot (it renders without a kernel): each rank's last lines
    snapshot = snapshot_of(magic_cell)
    expect(snapshot).to_have_count(1, timeout=30_000)
    expect(magic_cell.locator(".jp-OutputArea-output .widget-vbox")).to_have_count(0)
    for rank in (0, 1):
        tail = snapshot.locator("details").filter(has=page.locator("summary", has_text=f"rank {rank}"))
        expect(tail.locator("summary")).to_contain_text("exited 0")
        lines = tail.locator("pre").inner_text().splitlines()
        assert not any(line.startswith(f"rank {1 - rank}") for line in lines), lines  # only this rank's lines
        assert [line for line in lines if line.startswith(f"rank {rank}: epoch ")] == [
            line for line in lines if re.match(rf"rank {rank}: epoch \d/3 mean loss", line)
        ] and len([line for line in lines if line.startswith(f"rank {rank}: epoch ")]) == 3, lines
        bars = [line for line in lines if line.startswith(f"rank {rank} epochs:")]
        assert len(bars) == 1 and "100%" in bars[0] and "3/3" in bars[0], lines  # the bar is one updating line
    prefix = jupyter.frontend.screenshot_prefix
    page.screenshot(path=str(screenshots / f"{prefix}quickstart-page.png"))
    snapshot.screenshot(path=str(screenshots / f"{prefix}quickstart-snapshot.png"))

    link = header.locator("a", has_text="MLflow run")
    href = link.get_attribute("href")
    parts = re.match(r"(http://127\.0\.0\.1:\d+)/#/experiments/(\w+)/runs/(\w+)$", href or "")
    assert parts, href
    base, experiment_id, run_id = parts.groups()
    # the run is ended off the job's path, after the result came back: the server shows it ended once it is
    run = _get_run(base, run_id, until=lambda run: run["info"]["status"] != "RUNNING")
    assert run["info"]["run_id"] == run_id and run["info"]["experiment_id"] == experiment_id
    assert run["info"]["status"] == "FINISHED"
    with urllib.request.urlopen(href.split("#")[0], timeout=30) as response:  # the page the link opens
        assert response.status == 200 and b"<html" in response.read(2000).lower()


def _get_run(base: str, run_id: str, timeout_s: float = 90, until=lambda run: True) -> dict:
    """The run from the MLflow server behind the link, once ``until(run)`` holds (the server may still be starting,
    and the run still being ended: asked again until then)."""
    url = f"{base}/api/2.0/mlflow/runs/get?{urllib.parse.urlencode({'run_id': run_id})}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                run = json.loads(response.read())["run"]
            if until(run) or time.monotonic() > deadline:
                return run
        except (urllib.error.URLError, ConnectionError) as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"the MLflow server at {base} did not answer for run {run_id}: {exc}") from None
        time.sleep(0.5)  # another process's server, not listening yet, or a run not ended yet: ask again shortly


SLEEPER = """\
from sgpu_magic import distributed

@distributed(gpus=2, mlflow=False)
def sleeper(seconds):
    import os
    import time

    print(f"rank {os.environ['RANK']} sleeping", flush=True)
    time.sleep(seconds)
"""


@pytest.mark.parametrize("mode", ["blocking", "background"])
def test_stop_button_cancels_a_running_job(jupyter, page, mode, screenshots):
    from playwright.sync_api import expect

    call = (
        "sleeper.distributed(600)"
        if mode == "blocking"
        else "%%distributed --gpus 2 --background --no-mlflow -o bg\nimport os, time\n"
        "print(f\"rank {os.environ['RANK']} sleeping\", flush=True)\ntime.sleep(600)"
    )
    name = f"stop_{mode}.ipynb"
    write_notebook(jupyter.root / name, ["%load_ext sgpu_magic", SLEEPER, call])
    notebook = open_notebook(page, jupyter, name)
    for index in (0, 1):
        wait_cell_done(run_cell(page, notebook, index), 120_000)
    job_cell = run_cell(page, notebook, 2)
    panel = panel_of(job_cell)
    panel.wait_for(timeout=60_000)
    header = header_of(panel)
    expect(panel.locator(".widget-tab-contents .widget-output:visible")).to_contain_text(
        "rank 0 sleeping", timeout=JOB_TIMEOUT_MS
    )
    job_id, pids = running_job_pids(jupyter)
    expect(header).to_contain_text(job_id)
    if mode == "blocking":
        expect(job_cell.locator(".jp-InputPrompt")).to_have_text("[*]:")  # the cell is still executing
    else:
        wait_cell_done(job_cell, 60_000)  # a background job's cell ends at once; its panel stays live
        expect(header).to_contain_text("running")

    panel.locator("button", has_text="Stop").click()
    expect(header).to_contain_text("cancelled", timeout=60_000)
    wait_cell_done(job_cell, 60_000)
    assert_gone(pids)
    status = json.loads((jupyter.home / "runs" / job_id / "status.json").read_text())
    assert status["state"] == "cancelled"
    if mode == "blocking":  # the blocking call raised: the job was cancelled, not finished
        expect(job_cell.locator(".jp-Cell-outputArea")).to_contain_text("JobCancelledError")
    expect(snapshot_of(job_cell)).to_contain_text("cancelled")  # the panel left its snapshot, Stop went with it
    expect(job_cell.locator("button", has_text="Stop")).to_have_count(0)
    page.screenshot(path=str(screenshots / f"{jupyter.frontend.screenshot_prefix}stop-{mode}-page.png"))


def test_interrupting_a_session_cell_keeps_the_ranks_state(jupyter, page, screenshots):
    """A live session: a cell sets ``w`` on every rank, the next one loops until the notebook's Interrupt (pressed
    as a person does: Escape, then i i), which raises CellInterruptedError; the cell after it still sees ``w``."""
    from playwright.sync_api import expect

    name = "session_interrupt.ipynb"
    loop = "%%distributed --session\nimport time\nprint('looping', flush=True)\nwhile True:\n    time.sleep(0.05)"
    write_notebook(
        jupyter.root / name,
        [
            "%load_ext sgpu_magic",
            "%distributed_session start --gpus 2 --no-mlflow -o sess",
            "%%distributed --session\nimport os\nw = 40 + int(os.environ['RANK'])",
            loop,
            "%%distributed --session\nw",
        ],
    )
    notebook = open_notebook(page, jupyter, name)
    for index in (0, 1, 2):
        wait_cell_done(run_cell(page, notebook, index), JOB_TIMEOUT_MS)
    loop_cell = run_cell(page, notebook, 3)
    panel = panel_of(loop_cell)
    panel.wait_for(timeout=60_000)
    expect(panel.locator(".widget-tab-contents .widget-output:visible")).to_contain_text("looping", timeout=60_000)
    page.keyboard.press("Escape")
    page.keyboard.press("i")
    page.keyboard.press("i")
    wait_cell_done(loop_cell, 60_000)
    expect(loop_cell.locator(".jp-Cell-outputArea")).to_contain_text("CellInterruptedError")
    expect(loop_cell.locator(".jp-Cell-outputArea")).to_contain_text("the ranks and their state are kept")
    last = run_cell(page, notebook, 4)
    wait_cell_done(last, 60_000)
    expect(last.locator(".jp-OutputArea-output").last).to_contain_text("40")
    expect(header_of(panel_of(last))).to_contain_text("sgpu_magic session s1 cell 3")
    expect(snapshot_of(last).locator("details").first).to_be_visible()
    expect(panel_of(loop_cell)).to_contain_text("interrupted")
    page.screenshot(path=str(screenshots / f"{jupyter.frontend.screenshot_prefix}session-interrupt-page.png"))


def test_the_debugger_prompt_of_a_failed_session_cell_is_the_notebooks_input_box(jupyter, page, screenshots):
    """``%distributed_debug`` after a session cell failed: pdb's prompt appears in the frontend's input box, a
    command typed there is answered by the rank, ``q`` ends it."""
    from playwright.sync_api import expect

    name = "session_debug.ipynb"
    write_notebook(
        jupyter.root / name,
        [
            "%load_ext sgpu_magic",
            "%distributed_session start --gpus 2 --no-mlflow --no-widgets",
            "%%distributed --session\nimport os\nsecret = 6 * (int(os.environ['RANK']) + 1)\n"
            "if os.environ['RANK'] == '0':\n    raise ValueError('look')",
            "%distributed_debug",
        ],
    )
    notebook = open_notebook(page, jupyter, name)
    for index in (0, 1, 2):
        wait_cell_done(run_cell(page, notebook, index), JOB_TIMEOUT_MS)
    debug_cell = run_cell(page, notebook, 3)
    box = debug_cell.locator(".jp-Stdin-input").last  # (JupyterLab keeps an answered prompt's box beside the new one)
    box.wait_for(timeout=60_000)
    expect(debug_cell.locator(".jp-Stdin-prompt").last).to_contain_text("(Pdb)")
    box.fill("p secret")
    box.press("Enter")
    expect(debug_cell.locator(".jp-Cell-outputArea")).to_contain_text("6", timeout=30_000)
    page.screenshot(path=str(screenshots / f"{jupyter.frontend.screenshot_prefix}session-debug-page.png"))
    expect(debug_cell.locator(".jp-Stdin-input")).to_have_count(2, timeout=30_000)  # the next prompt
    box = debug_cell.locator(".jp-Stdin-input").last
    box.fill("q")
    box.press("Enter")
    wait_cell_done(debug_cell, 60_000)
    expect(debug_cell.locator(".jp-Cell-outputArea")).to_contain_text("pdb in rank 0 of session s1")


def test_a_breakpoint_shows_in_the_panel_and_its_prompt_in_the_input_box(jupyter, page, screenshots):
    """``runtime.breakpoint(rank=1)`` in a session cell with the panel: the header says ``rank 1 in debugger``, pdb's
    prompt is the frontend's input box, ``c`` lets the cell's all_reduce finish."""
    from playwright.sync_api import expect

    name = "session_breakpoint.ipynb"
    write_notebook(
        jupyter.root / name,
        [
            "%load_ext sgpu_magic",
            "%distributed_session start --gpus 2 --no-mlflow",
            "%%distributed --session\nimport torch, torch.distributed as dist\nfrom sgpu_magic import runtime\n"
            "dist.init_process_group('gloo')",
            "%%distributed --session\nx = torch.ones(1) * (dist.get_rank() + 1)\nruntime.breakpoint(rank=1)\n"
            "dist.all_reduce(x)\nx.item()",
        ],
    )
    notebook = open_notebook(page, jupyter, name)
    for index in (0, 1, 2):
        wait_cell_done(run_cell(page, notebook, index), JOB_TIMEOUT_MS)
    cell = run_cell(page, notebook, 3)
    box = cell.locator(".jp-Stdin-input").last
    box.wait_for(timeout=60_000)
    expect(header_of(panel_of(cell))).to_contain_text("rank 1 in debugger")
    page.screenshot(path=str(screenshots / f"{jupyter.frontend.screenshot_prefix}session-breakpoint-page.png"))
    box.fill("c")
    box.press("Enter")
    wait_cell_done(cell, 60_000)
    expect(cell.locator(".jp-OutputArea-output").last).to_contain_text("3.0")
    expect(header_of(panel_of(cell))).not_to_contain_text("in debugger")


METRICS_CELL = """\
%%distributed --gpus 2 --background --no-mlflow -o mjob
import math, os, time
from sgpu_magic import runtime

rank = runtime.get_global_rank()
for step in range(40):
    runtime.log_metric("loss", math.exp(-step / 12) + 0.05 * rank + 0.02 * math.sin(step), step=step)
    runtime.log_metric("accuracy", 1 - math.exp(-step / 10) - 0.03 * rank, step=step)
    print(f"rank {rank} step {step}", flush=True)
    time.sleep(0.05)
deadline = time.monotonic() + 300
while not os.path.exists("go") and time.monotonic() < deadline:
    time.sleep(0.05)
print(f"rank {rank} done", flush=True)
"""


def test_the_metrics_tab_draws_each_rank_and_the_snapshot_keeps_the_chart(jupyter, page, screenshots):
    """A job logging two metrics from 2 ranks: the panel gets a Metrics tab whose bqplot figure draws a line per
    rank with a legend, the rank tabs still switch; once the job ends, the snapshot's inline SVG has both metrics."""
    from playwright.sync_api import expect

    name = "metrics.ipynb"
    (jupyter.root / "go").unlink(missing_ok=True)
    write_notebook(jupyter.root / name, ["%load_ext sgpu_magic", METRICS_CELL])
    notebook = open_notebook(page, jupyter, name)
    wait_cell_done(run_cell(page, notebook, 0), 120_000)
    cell = run_cell(page, notebook, 1)
    panel = panel_of(cell)
    panel.wait_for(timeout=60_000)
    tabs = panel.locator(".lm-TabBar-tab")
    expect(tabs).to_have_text(["rank 0", "rank 1", "metrics"], timeout=JOB_TIMEOUT_MS)
    expect(panel.locator(".widget-tab-contents .widget-output:visible")).to_contain_text(
        "rank 0 step 39", timeout=60_000
    )
    tabs.nth(1).click()
    expect(panel.locator(".widget-tab-contents .widget-output:visible")).to_contain_text("rank 1 step 39")
    tabs.nth(2).click()
    figure = panel.locator(".bqplot.figure").first
    expect(figure).to_be_visible(timeout=30_000)
    expect(panel.locator("select")).to_have_value("accuracy")  # the first metric by name
    expect(figure).to_contain_text("rank 0")
    expect(figure).to_contain_text("rank 1")
    lines = figure.locator("g.curve path.line")  # the marks' lines (the legend draws its own)
    expect(lines).to_have_count(2, timeout=30_000)
    for index in (0, 1):  # each rank's line has all 40 points (a path of 39 segments)
        expect(lines.nth(index)).to_have_attribute("d", re.compile(r"^M[^ML]+(L[^ML]+){39}$"), timeout=30_000)
    panel.screenshot(path=str(screenshots / f"{jupyter.frontend.screenshot_prefix}metrics.png"))

    (jupyter.root / "go").touch()
    snapshot = snapshot_of(cell)
    expect(snapshot).to_contain_text("succeeded", timeout=JOB_TIMEOUT_MS)
    expect(cell.locator(".jp-OutputArea-output .widget-vbox")).to_have_count(0)
    expect(snapshot.locator("svg")).to_have_count(2)
    expect(snapshot.locator("svg polyline")).to_have_count(4)
    expect(snapshot).to_contain_text("rank 1 done")
    snapshot.screenshot(path=str(screenshots / f"{jupyter.frontend.screenshot_prefix}metrics-snapshot.png"))

    # saved, its kernel shut down, reopened: the job is still there (the snapshot is plain HTML in the notebook)
    page.keyboard.press("Control+s")
    saved = jupyter.root / name  # the frontend writes it through the server
    wait_for(lambda: "sgpu-magic-snapshot" in saved.read_text(), 60, "the saved notebook with the snapshot")
    for kernel in jupyter.api("kernels"):
        request = urllib.request.Request(jupyter.url(f"api/kernels/{kernel['id']}"), method="DELETE")
        urllib.request.urlopen(request, timeout=30).close()
    assert jupyter.api("kernels") == []
    page.goto(jupyter.notebook_url(name))
    reopened = snapshot_of(page.locator(".jp-NotebookPanel .jp-Notebook .jp-CodeCell").nth(1))
    expect(reopened).to_contain_text("succeeded", timeout=60_000)
    expect(reopened).to_contain_text("rank 1 done")
    expect(reopened.locator("svg polyline")).to_have_count(4)
    reopened.screenshot(path=str(screenshots / f"{jupyter.frontend.screenshot_prefix}metrics-reopened.png"))


STRAGGLER_CELL = """\
%%distributed --gpus 2 --timeout 300
import os, time
import torch, torch.distributed as dist
from sgpu_magic import runtime

dist.init_process_group("gloo")
rank = runtime.get_global_rank()
for step in range(40):
    with runtime.step():
        x = torch.randn(200, 200) @ torch.randn(200, 200)
        if rank == 1:
            time.sleep(0.03)  # rank 1's shard is slower: rank 0 waits for it in all_reduce
        dist.all_reduce(x)
print(f"rank {rank} trained", flush=True)
deadline = time.monotonic() + 240
while not os.path.exists("go") and time.monotonic() < deadline:
    time.sleep(0.05)
dist.destroy_process_group()
"""


def test_the_header_names_a_straggler_while_the_job_runs_and_the_snapshot_keeps_it(jupyter, page, screenshots):
    """A 2-rank job whose rank 1 takes 30 ms longer per step: the running panel's header gets the straggler badge and
    line; the Metrics tab charts step_time_s per rank; the ended job's snapshot still names it."""
    from playwright.sync_api import expect

    name = "straggler.ipynb"
    (jupyter.root / "go").unlink(missing_ok=True)
    write_notebook(jupyter.root / name, ["%load_ext sgpu_magic", STRAGGLER_CELL])
    notebook = open_notebook(page, jupyter, name)
    wait_cell_done(run_cell(page, notebook, 0), 120_000)
    cell = run_cell(page, notebook, 1)
    panel = panel_of(cell)
    panel.wait_for(timeout=60_000)
    expect(panel.locator(".widget-tab-contents .widget-output:visible")).to_contain_text(
        "rank 0 trained", timeout=JOB_TIMEOUT_MS
    )
    header = header_of(panel)
    expect(header).to_contain_text("straggler: rank 1 is", timeout=30_000)
    # 39: the 40th block's step stays open until the code ends (a step runs to the next block's entry)
    expect(header).to_contain_text("slower than the median rank over the last 39 steps")
    expect(header.locator("span", has_text=re.compile(r"^straggler$"))).to_have_count(1)
    panel.locator(".lm-TabBar-tab", has_text="metrics").click()
    lines = panel.locator(".bqplot.figure g.curve path.line")
    expect(lines).to_have_count(2, timeout=30_000)
    for index in (0, 1):  # each rank's line has its 39 steps (a path of 38 segments): step_collective_s, first
        expect(lines.nth(index)).to_have_attribute("d", re.compile(r"^M[^ML]+(L[^ML]+){38}$"), timeout=30_000)
    first = lines.nth(1).get_attribute("d")
    panel.locator("select").select_option("step_time_s")
    expect(lines.nth(1)).not_to_have_attribute("d", first, timeout=30_000)  # redrawn with rank 1's step times
    expect(lines.nth(1)).to_have_attribute("d", re.compile(r"^M[^ML]+(L[^ML]+){38}$"))
    panel.screenshot(path=str(screenshots / f"{jupyter.frontend.screenshot_prefix}straggler.png"))
    (jupyter.root / "go").touch()
    snapshot = snapshot_of(cell)
    expect(snapshot).to_contain_text("succeeded", timeout=JOB_TIMEOUT_MS)
    expect(snapshot).to_contain_text("straggler: rank 1 is")


RECONNECT_CELL = """%%distributed --gpus 2 --background --no-mlflow -o job
import time
for i in range(120):
    print("line", i, flush=True)
    time.sleep(0.5)
"""


def last_line(log) -> int:
    """The number of the last ``line N`` rank 0 has printed (its log file)."""
    found = re.findall(r"^line (\d+)$", log.read_text(), re.MULTILINE)
    return int(found[-1]) if found else -1


def test_a_reopened_page_shows_a_background_jobs_live_panel_with_the_lines_printed_while_away(
    jupyter, browser, page, screenshots
):
    from playwright.sync_api import expect

    name = f"reconnect-{jupyter.frontend.name}.ipynb"
    path = jupyter.root / name
    write_notebook(path, ["%load_ext sgpu_magic", RECONNECT_CELL])
    notebook = open_notebook(page, jupyter, name)
    run_cell(page, notebook, 0)
    cell = run_cell(page, notebook, 1)
    expect(panel_of(cell)).to_contain_text("line 3", timeout=JOB_TIMEOUT_MS)
    page.keyboard.press("Control+s")
    wait_for(lambda: "application/vnd.jupyter.widget-view+json" in path.read_text(), 30, "the notebook saved")
    log = sorted((jupyter.home / "runs").glob("*/logs/rank_0.log"))[-1]
    left_at = last_line(log)
    page.close()
    wait_for(lambda: last_line(log) >= left_at + 12, 60, "12 more lines while the page is away")
    away = last_line(log)

    reopened = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    notebook = open_notebook(reopened, jupyter, name)
    panel = panel_of(notebook.locator(".jp-CodeCell").nth(1))
    expect(panel).to_contain_text(f"line {away}\n", timeout=30_000)  # printed while the page was away
    expect(panel).to_contain_text(f"line {last_line(log) + 4}\n", timeout=30_000)  # and it goes on, live
    text = panel.inner_text()
    assert all(f"line {i}\n" in text for i in range(away + 1)), text  # none lost
    assert "running" in text
    reopened.screenshot(path=str(screenshots / f"{jupyter.frontend.name}-reconnect.png"))
    reopened.context.close()


BLOCKING_CELL = """%%distributed --gpus 2 --no-mlflow -o job
import time
for i in range(40):
    print("line", i, flush=True)
    time.sleep(0.25)
"""


def test_a_page_reopened_while_a_blocking_cell_ran_shows_its_panel_again_with_job_show(
    jupyter, browser, page, screenshots
):
    """The documented fallback for a blocking cell (a busy kernel answers no widget request, so a page reopened
    meanwhile cannot restore its panel): once the kernel is free, ``job.show()`` in the reopened page's next cell
    shows the panel again with every line, those printed while the page was away included."""
    from playwright.sync_api import expect

    name = f"reopen-blocking-{jupyter.frontend.name}.ipynb"
    path = jupyter.root / name
    write_notebook(path, ["%load_ext sgpu_magic", BLOCKING_CELL, "job.show()"])
    notebook = open_notebook(page, jupyter, name)
    run_cell(page, notebook, 0)
    cell = run_cell(page, notebook, 1)
    expect(panel_of(cell)).to_contain_text("line 3", timeout=JOB_TIMEOUT_MS)
    expect(panel_of(cell).locator("[title*='job.show()']")).to_have_count(1)  # the header's tooltip says so
    page.keyboard.press("Control+s")
    wait_for(lambda: "application/vnd.jupyter.widget-view+json" in path.read_text(), 30, "the notebook saved")
    page.close()

    reopened = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    notebook = open_notebook(reopened, jupyter, name)  # waits until the kernel is idle: the cell has ended
    cell = run_cell(reopened, notebook, 2)
    snapshot = snapshot_of(cell)
    expect(snapshot).to_contain_text("succeeded", timeout=60_000)
    text = snapshot.inner_text()
    assert all(f"line {i}" in text for i in range(30, 40)), text  # the last lines, printed while the page was away
    reopened.screenshot(path=str(screenshots / f"{jupyter.frontend.name}-reopened-blocking.png"))
    reopened.context.close()
