"""What the user sees while a job runs: the ipywidgets panel, or plain ``[rank N]`` lines.

Both views follow what progress bars send to a terminal (:mod:`sgpu_magic.ui.terminal`: a tqdm bar is one
updating line, a Rich display its last frame), follow the job from the thread that waits on it, and batch what
they send: the panel flushes at most ``MAX_FLUSHES_PER_S`` times a second, and refreshes the tabs not on screen
at most ``HIDDEN_TAB_FLUSHES_PER_S`` times a second. Once a job logs a metric the panel gets a
Metrics tab (:class:`~sgpu_magic.ui.charts.MetricsChart`), redrawn at most ``CHART_REDRAWS_PER_S`` times a second
while it is on screen. When the job ends the panel replaces
itself in the cell's output with a static snapshot (:mod:`sgpu_magic.ui.snapshot`), closes its
widgets and drops its line buffers.
"""

from __future__ import annotations

import functools
import html
import os
import re
import threading
import time
from typing import TYPE_CHECKING

from sgpu_magic._compat.ipykernel import forget_reply_route
from sgpu_magic.errors import describe_exit
from sgpu_magic.job.follow import JobSink
from sgpu_magic.job.handle import Job
from sgpu_magic.job.state import JobState
from sgpu_magic.ui.header import header_html, metrics_html
from sgpu_magic.ui.snapshot import SNAPSHOT_LINES, RankTail, close_tree, snapshot_bundle
from sgpu_magic.ui.terminal import DEFAULT_MAX_LINES, TerminalBuffer
from sgpu_magic.ui.text import TextView, summary_line, summary_lines, summary_said
from sgpu_magic.wire.errors import TeardownEnd

if TYPE_CHECKING:
    from sgpu_magic.ui.charts import MetricsChart

__all__ = ["Panel", "make_view", "metrics_html", "rank_state", "use_widgets"]

MAX_FLUSHES_PER_S = 5.0


MAX_BYTES_PER_S = 1 << 20
"""Flushes are spaced so that the panel sends at most about this much log text a second."""


LIVE_LINES = 200
"""Lines each tab shows while the job runs (all ``max_lines`` kept lines once it has ended)."""


HIDDEN_TAB_FLUSHES_PER_S = 0.2
"""Tabs not on screen are refreshed at most this often (each refresh resends the tab's lines).
Switching to a tab refreshes it at once, also while a blocking cell runs where the frontend sends
widget messages to kernel subshells (JupyterLab 4.4+); elsewhere this is how a tab picked during a
blocking cell catches up."""

CHART_REDRAWS_PER_S = 2.0
"""The Metrics chart on screen is redrawn with new points at most this often (each redraw resends the metric's line
of every rank: up to 16 KB a rank); off screen every ``1 / HIDDEN_TAB_FLUSHES_PER_S`` seconds, and at once when its
tab is picked."""

HEADER_RENDERS_PER_S = 1.0
"""While a job runs its header (clock in whole seconds, CPU/RSS sampled once a second, last metric values) is
redrawn at most this often; a change of state, an activity or a restart redraws it at once."""


STOP_TOOLTIP = (
    "Cancel the job: every rank is stopped. If this button does not respond while the cell runs (a "
    "frontend without kernel subshells), use the notebook's Interrupt button: it cancels the job too."
)
"""The Stop button's tooltip; the panel itself shows the job's state, and README's "The panel" the rest."""

RELOAD_TOOLTIP = (
    "This cell blocks the kernel while its job runs: a page reloaded or reopened meanwhile cannot show this panel (a "
    "busy kernel answers no widget request), nor the snapshot that replaces it when the job ends; the logs stay in "
    "the run directory, and once the cell has ended job.show() in a new cell (the job of -o job, or fn.last_job) "
    "shows this panel again with every line. Run long jobs with --background or fn.submit(...) to keep their panel "
    "live across reloads (docs/guide/detached.md)."
)
"""The header's tooltip while a blocking job runs (a background job's panel is restored live on a reopened page)."""


def rank_state(exitcode: int | None, running: bool) -> str:
    """``running``, ``exited 0``, ``failed (exit code 1)``, ``killed by signal SIGTERM (15)``."""
    if exitcode is None:
        return "running" if running else "not started"
    if exitcode == 0:
        return "exited 0"
    return describe_exit(exitcode) if exitcode < 0 else f"failed ({describe_exit(exitcode)})"


class Footer:
    """The line above a rank's log in its tab (state, earlier lines, log path), as HTML in ``value``."""

    def __init__(self) -> None:
        self.value = ""


@functools.cache
def _panel_box_class():
    """The panel's outer box class, made on first use (ipywidgets is imported only for a panel)."""
    import ipywidgets as w

    class PanelBox(w.VBox):
        """The panel's outer box; its plain-text form (computed at every ``display``) is one short line
        instead of the repr of every child widget and the text they hold."""

        def __repr__(self) -> str:
            return "sgpu_magic panel"

    return PanelBox


class Panel(TextView):
    """The ipywidgets panel: header (job, state badge, devices, elapsed, MLflow link), Stop, one tab per rank, and a
    Metrics tab once the ranks log a metric.

    Widgets are composed once (the Metrics tab is added with the first metric); later only trait values change,
    from whichever thread follows the job. Log views keep the last ``max_lines`` lines of each rank and say how
    many earlier lines are only in the log file. When the job ends, the panel's place in the cell's output gets
    the static snapshot (``snapshot``: a ``text/html`` and ``text/plain`` bundle that renders without a kernel),
    every widget is closed and the line buffers are dropped.
    """

    needs_every_line = False  # it shows the last max_lines lines: fast logs are read from their tail

    def __init__(self, max_lines: int = DEFAULT_MAX_LINES) -> None:
        import ipywidgets as w

        super().__init__()
        self._w = w
        self.max_lines = max_lines
        self.flushes = 0
        self._lock = threading.Lock()
        self._dirty: set[int] = set()
        self._last_flush = 0.0
        self._last_hidden_flush = 0.0
        self._last_header = 0.0
        self._last_chart = 0.0
        self._last_bytes = 0
        self.live_lines = LIVE_LINES
        # every widget is a comm the kernel opens and keeps in sync: the widgets that set no layout or
        # style of their own share one default Layout and one HTMLStyle instead of making one each
        from ipywidgets.widgets.widget_string import HTMLStyle

        layout, style = w.Layout(), HTMLStyle()
        self.header = w.HTML(layout=layout, style=style)
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="danger", tooltip=STOP_TOOLTIP)
        self.tabs = w.Tab(layout=layout)
        self.widget = _panel_box_class()(
            [w.HBox([self.header, self.stop_button], layout=layout), self.tabs], layout=layout
        )
        self._job: Job | None = None
        self._display = None  # the panel's display handle: the snapshot replaces it in place
        self._chart: MetricsChart | None = None
        self._metrics_new = False
        self.snapshot: dict[str, str] | None = None
        """The snapshot the ended job left in the cell (``{"text/html": ..., "text/plain": ...}``); ``None`` before."""

    def replica(self) -> Panel:
        """A new panel with this one's line limit, shown in the cell that shows the job again."""
        return Panel(self.max_lines)

    def created(self, job: Job) -> None:
        """Build the tabs and show the panel in the cell that starts the job (state pending)."""
        w = self._w
        self._job = job
        self.buffers = [TerminalBuffer(self.max_lines) for _ in range(job.world_size)]
        # each widget object is a comm the kernel opens and keeps in sync, so a tab is one Output widget
        # (sharing one Layout): its first output is the footer line, its second the log text
        self.footers = [Footer() for _ in range(job.world_size)]
        self._log_names = [html.escape(str(path)) for path in job.log_paths]
        self._exitcodes: dict[int, int | None] | None = None  # set once the job has ended
        self._outcomes: dict[int, str] = {}
        self._counted: dict[str, int] | None = None
        self._grace_ended: dict[int, TeardownEnd] = {}  # ranks the host ended after their teardown grace
        log_layout = w.Layout(max_height="30em", overflow="auto")
        self.outputs = [
            w.Output(layout=log_layout, outputs=self._tab_outputs(rank, "")) for rank in range(job.world_size)
        ]
        self.tabs.children = self.outputs
        self.tabs.titles = [f"rank {r}" for r in range(job.world_size)]
        self.stop_button.on_click(lambda _: self._stop())
        self.tabs.observe(self._tab_selected, names="selected_index")
        self._render_header(job, JobState.PENDING)
        from IPython.display import display

        self._display = display(self.widget, display_id=True)  # None outside IPython (nothing shown to replace)
        for widget in (self.stop_button, self.tabs):  # clicks and tab switches while the cell runs
            _forget_reply_route(widget)

    def pending(self, job: Job, why: str) -> None:
        self._render_header(job, JobState.PENDING)

    def started(self, job: Job) -> None:
        if not job.background:  # a page reopened while the cell blocks the kernel cannot restore this panel
            self.header.tooltip = RELOAD_TOOLTIP
        self._render_header(job, JobState.STARTING)

    def _tab_selected(self, change) -> None:
        """The user switched tabs (a comm message, maybe on another thread): show that rank's lines now."""
        rank = change["new"]
        if rank is not None and rank == len(self.outputs) and self._chart is not None and self._job is not None:
            self._metrics_new = False
            self._chart.update(list(self._job.last_metrics()), self._job.metric_arrays)
            return
        if rank is None or not 0 <= rank < len(self.outputs):
            return
        with self._lock:
            self._dirty.discard(rank)
            running = self._job is not None and not self._job.done()
            text = self.buffers[rank].text(self.live_tail_lines if running else None)
        self.outputs[rank].outputs = self._tab_outputs(rank, text)

    def _stop(self) -> None:
        """Stop button handler; may run on a kernel subshell thread while the cell is busy."""
        if self._job is not None:
            self.stop_button.disabled = True
            self.stop_button.description = "Stopping"
            self._job.request_cancel()

    @property
    def tail_lines(self) -> int:  # type: ignore[override] # read-only here: it follows max_lines
        return self.max_lines

    @property
    def live_tail_lines(self) -> int:  # type: ignore[override] # read-only here: it follows live_lines
        return min(self.live_lines, self.max_lines)

    def ranks_on_screen(self) -> set[int] | None:
        selected = self.tabs.selected_index
        return None if selected is None else {selected}

    def output(self, rank: int, text: str) -> None:
        with self._lock:
            self.buffers[rank].write(text)
            self._dirty.add(rank)

    def skipped(self, rank: int, nbytes: int) -> None:
        with self._lock:
            self.buffers[rank].skip(nbytes)
            self._dirty.add(rank)

    def tick(self, job: Job) -> None:
        interval = max(1.0 / MAX_FLUSHES_PER_S, self._last_bytes / MAX_BYTES_PER_S)
        if time.monotonic() - self._last_flush >= interval:
            self._flush(job)

    def restarted(self, job: Job, attempt: int) -> None:
        self._render_header(job, JobState.RUNNING)

    def metrics_logged(self, job: Job) -> None:
        self._metrics_new = True  # drawn at the next flush (the Metrics tab on screen, or off screen every 5 s)

    def state_changed(self, job: Job, state: JobState) -> None:
        if state.final:
            self._retire_stop_button()
        self._render_header(job, state)

    def show_activity(self, job: Job) -> None:
        """Show ``job.activity`` in the header now (the thread may block next: a debugger waits for its line)."""
        self._render_header(job, self._job_state(job))

    def _retire_stop_button(self) -> None:
        """The job has ended: Stop is disabled and grey (not a red button that looks live)."""
        self.stop_button.disabled = True
        self.stop_button.button_style = ""
        self.stop_button.description = "Stop"

    def finished(self, job: Job) -> None:
        self._final_footers(job)
        self._retire_stop_button()
        error = job.exception() if job.state is not JobState.SUCCEEDED else None
        root = getattr(error, "root_cause", None)
        self._render_header(job, job.state, error)
        said = summary_said(job)
        if said:
            for line in summary_lines(job):
                self.note(line)
        self._leave_snapshot(job, root.rank if root is not None else 0, "" if said else summary_line(job))

    def _leave_snapshot(self, job: Job, focus: int, summary: str) -> None:
        """Replace the panel in the cell's output by its static snapshot (each rank's last ``SNAPSHOT_LINES`` lines,
        ``focus``'s shown open; ``summary``: the summary line, unless the cell has it), close every widget and drop
        the line buffers: the kernel keeps nothing of it."""
        with self._lock:
            tails = []
            for rank, buf in enumerate(self.buffers):
                text = buf.text(SNAPSHOT_LINES)
                footer = self._render_footer(rank, text.count("\n"))
                tails.append(RankTail(rank, footer, text, open=rank == focus or len(self.buffers) <= 2))
            self.buffers, self._dirty = [], set()
        metrics = job.metrics()
        self.snapshot = snapshot_bundle(self.header.value, tails, metrics, summary)
        if self._display is not None:
            self._display.update(self.snapshot, raw=True)
        if job.run_url is None:  # a run made after the job ended (the first in a new store): linked once made
            job.after_run_made(lambda: self._relink(job, tails, metrics, summary))
        close_tree(self.widget)
        self.outputs, self.footers, self._chart = [], [], None
        self.tabs.children = ()

    def release(self) -> None:
        """The ended job's closed widget objects go (the snapshot, already in the cell, stays); a session drops those
        of its older cells so that each ended cell keeps only what it needs."""
        with self._lock:
            self.header = self.stop_button = self.tabs = self.widget = None  # the job has ended: none is used again

    def _relink(self, job: Job, tails: list[RankTail], metrics, summary: str) -> None:
        """The snapshot again, its header (and summary line) with the run's link, now that the run exists."""
        if job.run_url is None:
            return
        error = job.exception() if job.state is not JobState.SUCCEEDED else None
        summary = summary_line(job) if summary else ""
        self.snapshot = snapshot_bundle(header_html(job, job.state, error), tails, metrics, summary)
        if self._display is not None:
            self._display.update(self.snapshot, raw=True)

    def _flush(self, job: Job) -> None:
        now = time.monotonic()
        on_screen = self.tabs.selected_index
        hidden_due = now - self._last_hidden_flush >= 1.0 / HIDDEN_TAB_FLUSHES_PER_S
        with self._lock:
            if hidden_due:  # every tab with news
                dirty, self._dirty = self._dirty, set()
                self._last_hidden_flush = now
            else:  # only the tab on screen
                dirty = self._dirty & {on_screen}
                self._dirty -= dirty
            texts = {r: self.buffers[r].text(self.live_tail_lines) for r in dirty}
        self._last_flush = now
        self._last_bytes = sum(len(t) for t in texts.values())
        for rank, text in texts.items():
            self.outputs[rank].outputs = self._tab_outputs(rank, text)
        if texts:
            self.flushes += 1
        chart_due = on_screen == len(self.outputs) and now - self._last_chart >= 1.0 / CHART_REDRAWS_PER_S
        if self._metrics_new and (hidden_due or self._chart is None or chart_due):
            self._last_chart = now
            self._show_metrics(job)
        if now - self._last_header >= 1.0 / HEADER_RENDERS_PER_S:
            self._render_header(job, self._job_state(job))

    def _show_metrics(self, job: Job) -> None:
        """Draw the metrics logged so far; with the first one, import bqplot and add the Metrics tab."""
        self._metrics_new = False
        if self._chart is None:
            from sgpu_magic.ui.charts import MetricsChart

            self._chart = MetricsChart(len(self.outputs))
            self.tabs.children = (*self.outputs, self._chart.widget)
            self.tabs.titles = (*[f"rank {r}" for r in range(len(self.outputs))], "metrics")
        self._chart.update(list(job.last_metrics()), job.metric_arrays)
        # after each update: one that set the dropdown's choices published on its comm, which routes the user's pick
        # back to the main shell (busy with a blocking cell) until dropped
        _forget_reply_route(self._chart.picker)

    @staticmethod
    def _job_state(job: Job) -> JobState:
        return job.shown_state

    def _tab_outputs(self, rank: int, text: str) -> tuple[dict, dict]:
        """A tab's content, in nbformat output form: the footer line (HTML), then the log text (a stream)."""
        footer = self._render_footer(rank, text.count("\n"))  # complete lines shown (each ends with a newline)
        return (
            {
                "output_type": "display_data",
                "metadata": {},
                "data": {"text/html": footer, "text/plain": html.unescape(re.sub(r"<[^>]+>", "", footer))},
            },
            {"output_type": "stream", "name": "stdout", "text": text},
        )

    def _final_footers(self, job: Job) -> None:
        """Once the job has ended: each rank's exit state, and its line count from the launch host."""
        self._exitcodes = job.rank_exitcodes
        status = job.status
        self._counted = status.log_lines
        self._grace_ended = {e.rank: e for e in status.teardown_ended}
        self._outcomes = status.rank_outcomes  # a session cell's ranks: returned / raised / interrupted

    def _render_footer(self, rank: int, shown_lines: int) -> str:
        """The footer of ``rank``'s tab when it shows ``shown_lines`` complete lines: state, earlier lines, log."""
        final = self._exitcodes is not None
        buf = self.buffers[rank]
        counted = (self._counted or {}).get(str(rank))
        if buf.skipped_bytes and counted is not None:
            hidden = f"{counted - shown_lines} earlier lines are only in the log file. "
        elif buf.skipped_bytes:
            hidden = f"earlier output ({buf.skipped_bytes / 2**20:.1f} MiB and more) is only in the log file. "
        else:
            earlier = buf.total_lines - shown_lines
            hidden = f"{earlier} earlier lines are only in the log file. " if earlier > 0 else ""
        state = self._outcomes.get(rank) or rank_state((self._exitcodes or {}).get(rank), not final)
        ended = self._grace_ended.get(rank)
        if ended is not None:
            state = f"{'returned' if ended.outcome == 'value' else 'raised'}; ended after the teardown grace"
        value = f"<small><b>{state}</b> &middot; {hidden}log: <code>{self._log_names[rank]}</code></small>"
        self.footers[rank].value = value
        return value

    def _render_header(self, job: Job, state: JobState, error: BaseException | None = None) -> None:
        self._last_header = time.monotonic()
        self.header.value = header_html(job, state, error)


def _forget_reply_route(widget) -> None:
    """Let the frontend's messages on ``widget``'s comm go to the kernel subshell the frontend picked.

    JupyterLab 4.4+ sends widget messages to a kernel subshell, which ipykernel 7 runs on its own
    thread while a cell runs. But ipykernel 7.4 sends a comm's incoming messages to the subshell that
    last published on that comm (``BaseComm._reply_subshell_for``, meant for replies to a request a
    cell waits on): for the panel's widgets, made by the running cell, that is the main shell, so a
    click on Stop would wait until the cell ends. The Stop button, the tab bar and the Metrics dropdown send no
    replies, so their route is dropped after they are shown (the dropdown's after each change of its choices,
    which publishes on it again). Nothing happens on kernels without that attribute.
    """
    forget_reply_route(getattr(widget, "comm", None))


def _in_kernel_with_widgets() -> bool:
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def use_widgets(widgets: bool | None = None) -> bool:
    """Whether a job shows the panel (True) or the text view (False).

    ``widgets`` forces the choice; when ``None``, ``SGPU_MAGIC_WIDGETS=0`` / ``1`` in the
    environment decides, else where the code runs (a Jupyter kernel with ipywidgets: the panel;
    IPython in a terminal: text).
    """
    if widgets is None:
        env = os.environ.get("SGPU_MAGIC_WIDGETS", "").strip().lower()
        widgets = {"0": False, "false": False, "no": False, "1": True, "true": True, "yes": True}.get(env)
    return _in_kernel_with_widgets() if widgets is None else widgets


def make_view(widgets: bool | None = None, max_lines: int = DEFAULT_MAX_LINES) -> JobSink:
    """The panel in a Jupyter kernel with ipywidgets, else the text view (see :func:`use_widgets`)."""
    return Panel(max_lines) if use_widgets(widgets) else TextView()
