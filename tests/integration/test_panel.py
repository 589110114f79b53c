"""The widget panel without a browser: widget values after real jobs, terminal behaviour, throttling, Stop."""

from __future__ import annotations

import os
import threading
import time

import pytest

from sgpu_magic import JobState, distributed
from sgpu_magic.errors import JobCancelledError
from sgpu_magic.rundir import RunDir
from sgpu_magic.testing import start_job
from sgpu_magic.ui.panel import HIDDEN_TAB_FLUSHES_PER_S, MAX_FLUSHES_PER_S, Panel, make_view, rank_state
from sgpu_magic.ui.terminal import TerminalBuffer
from sgpu_magic.ui.text import TextView

from helpers import wait_for


def run_with_panel(fn, *args, max_lines=2000):
    """Run ``fn`` with a panel; the panel's tab widgets and line buffers (which it drops when the job ends) are kept
    as ``panel.live`` for the tests: ``(outputs, buffers)``."""
    panel = Panel(max_lines=max_lines)
    job = start_job(fn, args, view=panel)  # a blocking job: followed by result()
    panel.live = (list(panel.outputs), list(panel.buffers))
    t0 = time.monotonic()
    try:
        job.result()
    finally:
        elapsed = time.monotonic() - t0
    return panel, job, elapsed


def shown(panel, rank):
    """What rank ``rank``'s tab shows (the log text, after its footer line)."""
    footer, log = panel.outputs[rank].outputs
    assert footer["data"]["text/html"] == panel.footers[rank].value  # the tab's first output is its footer
    return log["text"]


def snapshot_rank(panel, rank) -> tuple[str, list[str]]:
    """Rank ``rank``'s part of the ended job's snapshot (text form): its footer line and its last lines."""
    text = panel.snapshot["text/plain"]
    part = text.split(f"--- rank {rank}: ", 1)[1].split("\n--- rank ", 1)[0]
    footer, *lines = part.splitlines()
    return footer, [line for line in lines if not line.startswith("sgpu_magic: ")]


def test_terminal_buffer_folds_carriage_returns_and_bounds_lines():
    buf = TerminalBuffer(max_lines=3)
    for i in range(5):
        buf.write(f"\rbar {i}/4")
    buf.write("\ndone\n")
    assert buf.text() == "bar 4/4\ndone\n"
    for i in range(10):
        buf.write(f"line {i}\n")
    assert list(buf.lines) == ["line 7", "line 8", "line 9"] and buf.hidden_lines == 9
    buf.write("\x1b[31mred\x1b[0m partial")
    assert buf.text().endswith("\x1b[31mred\x1b[0m partial")


def reference_terminal(text: str, max_lines: int) -> tuple[list[str], str, int]:
    """A plain model of the terminal: (last max_lines complete lines, current line, total lines)."""
    lines, current, pending_cr = [], "", False
    for ch in text:
        if ch == "\n":
            lines.append(current)
            current, pending_cr = "", False
        elif ch == "\r":
            pending_cr = True
        else:
            current = ch if pending_cr else current + ch
            pending_cr = False
    return lines[-max_lines:], current, len(lines)


def test_terminal_buffer_matches_a_plain_terminal_model_on_random_chunks():
    import random

    rng = random.Random(1234)
    for _ in range(2000):
        max_lines = rng.choice([1, 2, 3, 7, 50])
        buf, fed = TerminalBuffer(max_lines=max_lines), ""
        for _ in range(rng.randint(1, 10)):
            chunk = "".join(rng.choice("ab\n\r") for _ in range(rng.randint(0, 40)))
            buf.write(chunk)
            fed += chunk
            lines, current, total = reference_terminal(fed, max_lines)
            assert (list(buf.lines), buf.current, buf.total_lines) == (lines, current, total), repr(fed)


def test_rank_state_words():
    assert rank_state(None, True) == "running"
    assert rank_state(0, False) == "exited 0"
    assert rank_state(1, False) == "failed (exit code 1)"
    assert rank_state(-15, False) == "killed by signal SIGTERM (15)"


def test_view_choice():
    assert isinstance(make_view(False), TextView) and not isinstance(make_view(False), Panel)
    assert isinstance(make_view(True), Panel)
    assert not isinstance(make_view(None), Panel)  # outside a Jupyter kernel: text


@distributed(gpus=2)
def chatty(n_lines):
    import os
    import sys

    from tqdm import tqdm

    rank = int(os.environ["RANK"])
    for _ in tqdm(range(200), desc=f"rank{rank}", mininterval=0, file=sys.stdout):
        pass
    for i in range(n_lines):
        print(f"r{rank} line {i}")
    print(f"\x1b[32mdone {rank}\x1b[0m")
    return rank


def test_panel_after_a_job_with_a_tqdm_bar_and_10000_fast_lines():
    panel, job, elapsed = run_with_panel(chatty, 10_000, max_lines=2000)
    outputs, buffers = panel.live
    assert [len(b.lines) for b in buffers] == [2000, 2000]  # what the tabs held while the job ran
    for rank in (0, 1):
        # the ended job's snapshot: each rank's last SNAPSHOT_LINES (20) lines, ANSI colours left out
        footer, lines = snapshot_rank(panel, rank)
        assert len(lines) == 20 and lines[-1] == f"done {rank}" and lines[0] == f"r{rank} line 9981"
        # the bar line, 10,000 lines, "done": all but the last 20 only in the log file
        assert "9982 earlier lines are only in the log file" in footer
        assert footer.startswith("exited 0") and str(job.log_paths[rank]) in footer
        assert job.logs(rank).count(f"rank{rank}: 100%") >= 1  # the log file keeps the final bar
    assert "succeeded" in panel.header.value and "2 x cpu (gloo)" in panel.header.value
    # the header says once more what the cell said once per kernel (issue 18)
    assert ("(no GPU found)" in panel.header.value) == job.plan.no_gpu
    assert panel.stop_button.disabled
    # the panel shows state, not a manual: the instructions are the Stop button's tooltip (issue 18)
    assert [type(c).__name__ for c in panel.widget.children] == ["HBox", "Tab"]
    assert panel.stop_button.tooltip.startswith(
        "Cancel the job: every rank is stopped. If this button does not respond while the cell runs"
    )
    assert "Interrupt" not in panel.header.value and "Interrupt" not in snapshot_rank(panel, 0)[0]
    assert panel.flushes <= MAX_FLUSHES_PER_S * elapsed + 2  # timing-ok: a rate cap, not a speed target
    # a blocking cell's panel cannot be restored on a page reopened while it runs: its header says so (issue 36)
    assert panel.header.tooltip.startswith("This cell blocks the kernel while its job runs: a page reloaded")


def test_a_background_jobs_panel_has_no_reload_tooltip():
    """A background job leaves the kernel free: a reopened page restores its live panel (tests/browser), so its header
    carries no warning about reloads."""
    panel = Panel()
    job = start_job(chatty, (1,), view=panel, background=True)
    assert job.result(timeout_s=120) == [0, 1]
    assert panel.header.tooltip is None


def test_tabs_off_screen_refresh_every_5_s_and_at_once_when_selected(tmp_path):
    panel = Panel(max_lines=100)
    updates = {0: 0, 1: 0}
    job = start_job(chatty, (60_000,), view=panel)
    for rank in (0, 1):
        panel.outputs[rank].observe(lambda change, r=rank: updates.__setitem__(r, updates[r] + 1), names="outputs")
    t0 = time.monotonic()
    job.result()
    elapsed = time.monotonic() - t0
    assert updates[0] <= MAX_FLUSHES_PER_S * elapsed + 2, (updates, elapsed)  # timing-ok: a rate cap
    assert updates[1] <= HIDDEN_TAB_FLUSHES_PER_S * elapsed + 2, (updates, elapsed)  # timing-ok: a rate cap
    assert snapshot_rank(panel, 1)[1][-1] == "done 1"  # the snapshot has every rank's last lines

    panel = Panel(max_lines=100)  # a tab selected while the job runs shows its rank's lines at once
    job = start_job(waits_for_go, (str(tmp_path),), view=panel, background=True)
    try:
        wait_for(lambda: panel.buffers[1].total_lines > 0, 120, "rank 1's first line")
        panel.tabs.selected_index = 1  # what a click on the tab does
        assert shown(panel, 1).startswith("waiting 1") and 1 not in panel._dirty
    finally:
        (tmp_path / "go").touch()
    job.result(timeout_s=60)


def test_panel_shows_the_bar_as_one_line():
    panel, job, _ = run_with_panel(chatty, 0)
    for rank in (0, 1):
        lines = snapshot_rank(panel, rank)[1]
        bars = [line for line in lines if line.startswith(f"rank{rank}:")]
        assert len(bars) == 1 and "200/200" in bars[0], lines
        assert lines[-1] == f"done {rank}"


@distributed(gpus=2, mlflow=False)
def rich_progress(steps):
    import os
    import time

    os.environ["FORCE_COLOR"] = "1"  # what ranks inherit from ipykernel: Rich animates as in a terminal
    from rich.console import Console
    from rich.progress import Progress

    rank = int(os.environ["RANK"])
    with Progress(console=Console()) as progress:  # refreshed 10 times a second, and at every step below
        tasks = [progress.add_task(f"rank {rank} task {i}", total=steps) for i in range(3)]
        for step in range(steps):
            for task in tasks:
                progress.advance(task)
            if step % 50 == 0:
                print(f"rank {rank} step {step}")  # Rich prints it above its display
            progress.refresh()
            time.sleep(0.005)
    print(f"rank {rank} done")
    return rank


def final_rich_frame(rank: int, lines: list[str]) -> None:
    """``lines`` (colours left out) are what ``rich_progress(200)`` printed, its display as its final frame only."""
    assert lines[:4] == [f"rank {rank} step {step}" for step in (0, 50, 100, 150)], lines
    frame = lines[4:7]
    assert [line.split()[:4] for line in frame] == [["rank", str(rank), "task", str(i)] for i in range(3)], lines
    assert all("100%" in line for line in frame) and lines[7:] == [f"rank {rank} done"], lines


def test_the_text_view_prints_a_rich_progress_display_as_its_final_frame():
    import io
    import re

    out = io.StringIO()
    job = start_job(rich_progress, (200,), view=TextView(out=out, err=out))
    job.follow()
    assert job.result() == [0, 1]
    text = out.getvalue()
    assert "\x1b[1A" not in text and "\x1b[2K" not in text and "\x1b[?25" not in text
    assert "\x1b[35m100%\x1b[0m" in text  # colours stay
    assert job.logs(0).count("\x1b[1A") > 200  # the rank redrew its display over and over
    for rank in (0, 1):
        prefix = f"[rank {rank}] "
        final_rich_frame(
            rank,
            [
                re.sub(r"\x1b\[[0-9;]*m", "", line[len(prefix) :])
                for line in text.splitlines()
                if line.startswith(prefix)
            ],
        )


def test_the_panel_shows_a_rich_progress_display_as_its_final_frame():
    panel, job, _ = run_with_panel(rich_progress, 200)
    _, buffers = panel.live
    for rank in (0, 1):
        footer, lines = snapshot_rank(panel, rank)
        final_rich_frame(rank, lines)
        assert "earlier lines" not in footer and buffers[rank].hidden_lines == 0


def test_failure_selects_the_root_cause_tab_and_names_it_in_the_header():
    @distributed(gpus=2)
    def fails_on_rank_1():
        import os

        if os.environ["RANK"] == "1":
            raise ValueError("bad batch on rank 1")
        return 0

    panel = Panel()
    job = start_job(fails_on_rank_1, (), view=panel)
    assert job.wait() is JobState.FAILED
    assert (
        "failed" in panel.header.value
        and "rank 1 failed (root cause): ValueError: bad batch on rank 1" in panel.header.value
    )
    assert "ValueError: bad batch on rank 1" in "\n".join(snapshot_rank(panel, 1)[1])
    assert "rank 1 failed (root cause): ValueError: bad batch on rank 1" in panel.snapshot["text/html"]


def test_stop_button_from_another_thread_cancels_a_blocking_job(tmp_path):
    @distributed(gpus=2)
    def sleeper(piddir):
        import os
        import time

        open(os.path.join(piddir, str(os.getpid())), "w").close()
        time.sleep(600)

    panel = Panel()

    waited: list[BaseException] = []

    def click_when_running():
        try:
            wait_for(lambda: len(os.listdir(tmp_path)) >= 2, 60, "both ranks to run before Stop is clicked")
        except AssertionError as exc:
            waited.append(exc)  # failed below, in the test's thread; Stop is clicked all the same
        panel.stop_button.click()  # what a kernel subshell does while the cell is busy

    clicker = threading.Thread(target=click_when_running)
    clicker.start()
    job = start_job(sleeper, (str(tmp_path),), view=panel)
    with pytest.raises(JobCancelledError, match=r"was cancelled; every rank was stopped"):
        job.result()
    clicker.join()
    assert waited == []
    assert job.state is JobState.CANCELLED
    assert "cancelled" in panel.header.value and panel.stop_button.disabled


def test_max_log_lines_follows_the_config(ip):
    from sgpu_magic.front.decorator import make_sinks

    ip.run_line_magic("config", "DistributedMagics.max_log_lines = 50")
    try:
        view = make_sinks(distributed(gpus=1, mlflow=False, widgets=True)(len).spec, None)[-1]
        assert isinstance(view, Panel) and view.max_lines == 50
    finally:
        ip.run_line_magic("config", "DistributedMagics.max_log_lines = 2000")


def test_log_follower_skips_to_the_last_lines_of_a_fast_log(tmp_path):
    from sgpu_magic.job.follow import LogFollower

    log = tmp_path / "rank_0.log"
    log.write_bytes(b"start \xc3\xa9\n" + b"".join(b"line %07d\n" % i for i in range(100_000)))
    follower = LogFollower(log)
    skipped, text = follower.read_tail(2000)
    lines = text.splitlines()
    assert skipped > 0 and len(lines) >= 2000 and lines[-1] == "line 0099999"
    assert skipped + len(text.encode()) == log.stat().st_size  # nothing between the skip and the text
    with open(log, "ab") as f:
        f.write(b"one more\npartial \xc3")
    assert follower.read_tail(2000) == (0, "one more\npartial ")  # small news: read whole, UTF-8 kept intact
    with open(log, "ab") as f:
        f.write(b"\xa9 done\n")
    assert follower.read_tail(2000) == (0, "\xe9 done\n")


def test_log_follower_reads_a_short_tail_live_and_the_long_one_again_at_the_end(tmp_path):
    from sgpu_magic.job.follow import LogFollower

    log = tmp_path / "rank_0.log"
    with open(log, "wb") as f:
        f.write(b"".join(b"line %07d\n" % i for i in range(50_000)))
    follower = LogFollower(log)
    first_skip, text = follower.read_tail(200)  # what the panel reads while the job runs
    assert first_skip > 0 and len(text.splitlines()) >= 200  # the first window: TAIL_MIN_BYTES
    with open(log, "ab") as f:  # the file stays open between reads: appended lines are seen
        f.write(b"".join(b"line %07d\n" % i for i in range(50_000, 100_000)))
    second_skip, text = follower.read_tail(200)
    assert text.splitlines()[-1] == "line 0099999" and len(text.splitlines()) < 1000  # the window fits the lines
    more_skip, text = follower.reread_tail(2000)  # the job ended: the last 2000 lines, read again
    lines = text.splitlines()
    assert len(lines) >= 2000 and lines[-1] == "line 0099999"
    # the skips reported add up to the bytes before the text, each byte counted once
    assert first_skip + second_skip + more_skip + len(text.encode()) == log.stat().st_size
    follower.close()
    with open(log, "ab") as f:
        f.write(b"after close\n")
    assert follower.read_tail(2000) == (0, "after close\n")  # reopened where it stopped


def test_a_followed_job_removes_its_status_fifo_when_it_ends():
    panel, job, _ = run_with_panel(chatty, 5)
    assert job.state is JobState.SUCCEEDED and not RunDir(job.run_dir).status_signal.exists()
    assert not (job.run_dir / "status.fifo").exists()  # nothing left that would block a copy of the run dir


def test_the_launch_host_wakes_the_follower_through_the_status_fifo(tmp_path):
    import select
    import stat

    from sgpu_magic.rundir import RunDir, signal_status

    rd = RunDir.create(tmp_path)
    signal_status(rd)  # no FIFO yet: nothing happens, nothing is made
    assert not rd.status_signal.exists()
    os.mkfifo(rd.status_signal, 0o600)
    signal_status(rd)  # a FIFO nobody reads: the host does not block
    fd = os.open(rd.status_signal, os.O_RDWR | os.O_NONBLOCK)
    try:
        assert select.select([fd], [], [], 0)[0] == []
        signal_status(rd)
        assert select.select([fd], [], [], 0)[0] == [fd] and os.read(fd, 16) == b"\n"
        for _ in range(100_000):  # far more than a pipe holds: the writer never blocks
            signal_status(rd)
    finally:
        os.close(fd)
    assert stat.S_ISFIFO(rd.status_signal.stat().st_mode) and stat.S_IMODE(rd.status_signal.stat().st_mode) == 0o600


def test_a_job_without_its_status_fifo_is_followed_by_polling(monkeypatch):
    def no_fifos(*args, **kwargs):
        raise OSError(95, "Operation not supported")  # as on a file system without FIFOs

    monkeypatch.setattr(os, "mkfifo", no_fifos)
    panel, job, _ = run_with_panel(chatty, 5)
    assert job.state is JobState.SUCCEEDED and not RunDir(job.run_dir).status_signal.exists()
    assert snapshot_rank(panel, 0)[1][-1] == "done 0"


@distributed(gpus=2)
def flood(n_lines):
    import os
    import sys

    rank = os.environ["RANK"]
    write = sys.stdout.write
    for i in range(n_lines):
        write(f"r{rank} line {i:07d} " + "x" * 60 + "\n")
    return n_lines


def test_panel_reads_only_the_tail_of_fast_logs_and_counts_every_line_at_the_end():
    panel, job, _ = run_with_panel(flood, 200_000, max_lines=2000)
    _, buffers = panel.live
    for rank in (0, 1):
        assert list(buffers[rank].lines) == job.logs(rank).splitlines()[-2000:]
        assert buffers[rank].skipped_bytes > 0  # the middle of the log was not read
        footer, lines = snapshot_rank(panel, rank)
        assert lines == job.logs(rank).splitlines()[-20:]
        assert "199980 earlier lines are only in the log file" in footer


@distributed(gpus=2, mlflow=False)
def logs_two_metrics():
    from sgpu_magic import runtime

    rank = runtime.get_global_rank()
    for step in range(3):
        runtime.log_metric("loss", 1.0 - step / 10 - rank / 100, step=step)
    if rank == 1:
        runtime.log_metric("grad<norm>", 0.25)


def test_the_header_shows_each_metric_s_last_value_per_rank():
    """The header's table (HTML in the header widget, no widget of its own): one row per metric, a column per rank,
    a rank that did not log a metric left blank; names escaped."""
    panel, job, _ = run_with_panel(logs_two_metrics)
    header = panel.header.value
    assert '<th style="padding:0 8px;text-align:right">rank 1</th>' in header
    assert "<code>loss</code></td>" in header and ">0.8</td>" in header and ">0.79</td>" in header
    assert "<code>grad&lt;norm&gt;</code>" in header and ">0.25</td>" in header
    assert '<code>grad&lt;norm&gt;</code></td><td style="padding:0 8px;text-align:right"></td>' in header
    assert len(panel.widget.children) == 2  # the header row and the tabs: nothing added
    html = panel.snapshot["text/html"]  # the snapshot draws each metric: a line per rank that logged it
    assert html.count("<svg") == 2 and ">grad&lt;norm&gt;</text>" in html and ">loss</text>" in html


@distributed(gpus=2, mlflow=False, timeout=120)
def waits_for_go(folder):
    import os
    import time

    print(f"waiting {os.environ['RANK']}", flush=True)
    deadline = time.monotonic() + 100
    while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_the_header_shows_each_rank_s_cpu_and_rss_live_and_its_peak_at_the_end(tmp_path):
    panel = Panel()
    job = start_job(waits_for_go, (str(tmp_path),), view=panel, background=True)
    cell = 'style="padding:0 8px;text-align:right"'
    try:
        header = wait_for(
            lambda: "<i>RSS MiB</i>" in (value := panel.header.value) and len(job.status.usage) == 2 and value,
            120,
            "the first sample of both ranks in the header",
        )
        assert f"<th {cell}>rank 0</th><th {cell}>rank 1</th>" in header and "<i>cpu %</i>" in header
    finally:
        (tmp_path / "go").touch()
    job.result(timeout_s=60)
    header = panel.header.value
    peaks = [f"<td {cell}>{job.status.usage[r].peak_rss_bytes / 2**20:.0f}</td>" for r in (0, 1)]
    assert f'<td style="padding:0 8px"><i>peak RSS MiB</i></td>{"".join(peaks)}</tr>' in header
    assert "<i>cpu %</i>" not in header


@distributed(gpus=1)
def tracked_quick():
    return 1


@pytest.mark.slow  # ~15 s: starts a real MLflow UI server
def test_a_run_made_after_its_job_ended_is_linked_in_the_snapshot():
    """The run is made off the job's path; when that takes longer than the job (the first run in a new store),
    the snapshot gets the run's link once the run exists."""
    import html as html_lib
    import threading

    from sgpu_magic.testing import wait_for_tracking
    from sgpu_magic.tracking.server import start_ui, stop_ui
    from sgpu_magic.tracking.worker import worker

    assert wait_for_tracking(120.0)
    start_ui()  # the kernel's store, served: runs have a page to link to
    gate = threading.Event()
    try:
        worker().submit(gate.wait)  # the tracking worker is busy: the job's run is made after the job ends
        panel, job, _ = run_with_panel(tracked_quick)
        assert job.result() == [1] and "MLflow run" not in panel.snapshot["text/html"]
        gate.set()
        assert wait_for_tracking(60.0)
        assert job.run_url and f'href="{html_lib.escape(job.run_url)}"' in panel.snapshot["text/html"]
    finally:
        gate.set()
        stop_ui()


def test_a_session_s_cells_older_than_ten_drop_their_widgets_and_keep_their_snapshot_and_results(ip):
    """A long session's kept cells (its last 100) hold what an ended cell needs; the panels of all but the last
    ten let their closed widget objects go (the memory figures: ``benchmarks.run --only session_soak``)."""
    from sgpu_magic import Session
    from sgpu_magic.session.core import LIVE_VIEW_CELLS

    sess = Session(gpus=1, widgets=True, mlflow=False, name="views")
    try:
        cells = [sess.submit_cell(f"print('cell {i}')\n{i}", {}) for i in range(1)]
        cells[0].result()
        for i in range(1, LIVE_VIEW_CELLS + 2):
            cells.append(sess.submit_cell(f"print('cell {i}')\n{i}", {}))
            cells[-1].result()
        old, recent = cells[0], cells[-LIVE_VIEW_CELLS]
        assert isinstance(old.view, Panel) and old.view.widget is None and old.view.header is None
        assert "cell 0" in old.view.snapshot["text/plain"] and old.result() == [0] and "cell 0" in old.logs(0)
        assert recent.view.widget is not None and recent.view.widget.comm is None  # closed, kept
    finally:
        sess.stop()


def test_a_blocking_job_that_ended_before_its_result_was_asked_for_still_leaves_its_snapshot():
    """``result()`` of a blocking job whose status was already final (the ranks ended before anyone polled) tells its
    sinks first: its panel leaves its snapshot, as when the caller was polling (found as a session test failing
    under load: a cell's ``result()`` handed its values back while its panel stayed live and its snapshot unmade)."""
    import json

    from helpers import wait_for

    panel = Panel()
    job = start_job(chatty, (1,), view=panel)  # a blocking job nobody follows yet
    status = RunDir(job.run_dir).status_file
    wait_for(lambda: status.exists() and json.loads(status.read_text())["state"] == "succeeded", 120, "its end")
    assert not job.ended
    assert job.result() == [0, 1]
    assert job.ended and panel.snapshot is not None and "succeeded" in panel.snapshot["text/html"]


@distributed(gpus=2, mlflow=False)
def lines_until(go, n):
    import os
    import time

    for i in range(n):
        print("line", i, flush=True)
        if i == 2:
            while not os.path.exists(go):  # the test shows the job again while it runs
                time.sleep(0.01)
    return n


def test_show_gives_a_jobs_panel_again_with_every_line_running_or_ended(tmp_path, capsys):
    """``job.show()``: the panel (or text view) again, rebuilt from the run directory (every line from the first) and
    following the job live; for a page reopened while a blocking cell ran, or a cleared output. The job's own view
    is left as it was, and no second job is listed."""
    from sgpu_magic.job.handle import jobs

    go = tmp_path / "go"
    panel, live = Panel(), Panel()
    job = start_job(lines_until, (str(go), 30), view=panel, background=True)
    wait_for(lambda: "line 2" in job.logs(1), 120, "rank 1 to print 3 lines")
    listed = list(jobs())
    job.show(live)
    assert jobs() == listed
    wait_for(lambda: "line 2" in shown(live, 1), 30, "the second panel to show what ran so far")
    go.touch()
    assert job.result(timeout_s=60) == [30, 30]
    wait_for(lambda: live.snapshot is not None, 30, "the second panel's snapshot")
    for rank in (0, 1):
        assert snapshot_rank(live, rank) == snapshot_rank(panel, rank)
        assert snapshot_rank(live, rank)[1][-1] == "line 29"
    again = Panel()
    job.show(again)  # ended: its final panel at once
    wait_for(lambda: again.snapshot is not None, 30, "the ended job's panel")
    assert again.snapshot["text/plain"] == panel.snapshot["text/plain"]
    text = start_job(lines_until, (str(go), 3), view=TextView())
    assert text.result(timeout_s=60) == [3, 3]
    capsys.readouterr()
    text.show()  # a text view, as the job's own: every line printed again
    printed: list[str] = []
    done = f"job {text.job_id} succeeded"
    wait_for(lambda: printed.append(capsys.readouterr().out) or done in "".join(printed), 30, "the job printed again")
    out = "".join(printed)
    for rank in (0, 1):
        assert [ln for ln in out.splitlines() if ln.startswith(f"[rank {rank}]")] == [
            f"[rank {rank}] line {i}" for i in range(3)
        ]


def test_show_gives_a_session_cells_panel_again(tmp_path):
    """A session cell is a blocking cell too: ``sess.jobs[-1].show()`` gives its panel back (its lines, its state);
    a running cell's, whose status is only in memory until it ends, follows it live (running, then its end)."""
    from sgpu_magic import Session

    sess = Session(gpus=2, widgets=True, mlflow=False, name="shown")
    try:
        assert sess.run_cell("import os\nprint('hello from', os.environ['RANK'])\n7") == [7, 7]
        again = Panel()
        sess.jobs[-1].show(again)
        wait_for(lambda: again.snapshot is not None, 30, "the cell's panel again")
        assert [snapshot_rank(again, r)[1] for r in (0, 1)] == [["hello from 0"], ["hello from 1"]]
        assert "succeeded" in again.snapshot["text/html"] and "session shown" in again.snapshot["text/plain"]
        go = tmp_path / "go"
        job = sess.submit_cell(
            f"import pathlib, time\nprint('waiting', flush=True)\nwhile not pathlib.Path({str(go)!r}).exists():\n"
            "    time.sleep(0.01)\n8",
            {},
        )
        live = Panel()
        wait_for(lambda: "waiting" in job.logs(1), 60, "rank 1 in the cell")
        job.show(live)
        wait_for(lambda: "running" in live.header.value and "waiting" in shown(live, 1), 30, "the live cell shown")
        go.touch()
        assert job.result() == [8, 8]
        wait_for(lambda: live.snapshot is not None, 30, "the shown cell's end")
        assert "succeeded" in live.snapshot["text/html"]
    finally:
        sess.stop()
