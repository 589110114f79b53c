"""``%distributed_jobs``: the table of this kernel's jobs."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from IPython.core.error import UsageError

from sgpu_magic.front.sessions import sessions
from sgpu_magic.job.handle import Job, jobs


def listed_jobs() -> list[Job]:
    """The kernel's jobs (:func:`~sgpu_magic.job.registry.jobs`) as ``%distributed_jobs`` lists them: each live
    session's job followed by the cell that runs in it now. A session's cells are its own, not the kernel's jobs
    (an ended one is in ``sess.jobs`` only), so a thousand cells never push the kernel's jobs out of the list."""
    running_cells: dict[str, list[Job]] = {}
    for session in sessions():
        if session.job is not None:
            running_cells[session.job.job_id] = [cell for cell in session.jobs if not cell.ended]
    listed = []
    for job in jobs():
        listed.append(job)
        listed.extend(running_cells.get(job.job_id, ()))
    return listed


class JobTable:
    """``%distributed_jobs`` output: an HTML table in Jupyter, aligned text elsewhere.

    The MLflow column has each tracked job's run id, linked to its run page whenever a server shows
    it now (a tracking server, or ``%mlflow_ui`` started before or after the job); the text form
    adds a ``run page`` column with those links. The ``what`` column names the function, cell or script,
    and a live session (``session s1``) and, on the rows under it, the cell that runs in it now (``session s1 cell
    3``, its id indented: :func:`listed_jobs`). Below the table, a line for
    what the kernel holds on a cluster between jobs (``held``: :func:`sgpu_magic.launch.held_warm`).
    """

    COLUMNS = ("job", "state", "world size", "GPUs", "elapsed", "MLflow run", "what")

    def __init__(self, listed: list[Job], held: Sequence[str] = ()) -> None:
        self.held = list(held)
        self.rows, self.urls = [], []
        kernels = {id(job) for job in jobs()}
        self.nested = [id(job) not in kernels for job in listed]  # a session's running cell, under its session
        for job in listed:
            elapsed = job.elapsed_s
            self.rows.append(
                (
                    job.job_id,
                    job.state.label,
                    str(job.world_size),
                    ",".join(map(str, job.gpus)) or "cpu" if not job.plan.needs_lease or job.gpus else "-",
                    "-" if elapsed is None else f"{elapsed:.1f} s",
                    job.mlflow_run_id or "-",
                    job.title if not job.title.startswith("job ") else job.spec.name,
                )
            )
            self.urls.append(job.run_url)

    def __repr__(self) -> str:
        return "\n".join([self._text(), *self.held])

    def _text(self) -> str:
        if not self.rows:
            return "no sgpu_magic jobs in this kernel yet"
        columns: tuple[str, ...] = self.COLUMNS
        rows: Sequence[tuple[Any, ...]] = [
            (f"  {job_id}" if nested else job_id, *rest) for (job_id, *rest), nested in zip(self.rows, self.nested)
        ]
        if any(self.urls):
            columns += ("run page",)
            rows = [(*row, url or "-") for row, url in zip(rows, self.urls)]
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [columns, *rows])

    def _repr_html_(self) -> str:
        return self._html() + "".join(f"<p>{html.escape(line)}</p>" for line in self.held)

    def _html(self) -> str:
        if not self.rows:
            return "<i>no sgpu_magic jobs in this kernel yet</i>"
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.COLUMNS)
        body = ""
        for (job_id, *cells, run_id, what), url, nested in zip(self.rows, self.urls, self.nested):
            indent = ' style="padding-left: 1.5em"' if nested else ""
            run = (
                f'<a href="{html.escape(url)}" target="_blank">{html.escape(run_id)}</a>'
                if url
                else html.escape(run_id)
            )
            body += (
                f"<tr><td{indent}>{html.escape(job_id)}</td>"
                + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
                + f"<td>{run}</td><td>{html.escape(what)}</td></tr>"
            )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def find_job(part: str) -> Job:
    """The one job of this kernel (or cell running in one of its sessions: :func:`listed_jobs`) whose id contains
    ``part`` (``%distributed_stop a1b2c3``).

    Raises:
        UsageError: no job or several jobs match; the message names ``part`` and the kernel's jobs.
    """
    listed = listed_jobs()
    chosen = [job for job in listed if part in job.job_id]
    if len(chosen) != 1:
        known = ", ".join(job.job_id for job in listed) or "none yet"
        what = "matches no job" if not chosen else f"matches {len(chosen)} jobs"
        raise UsageError(
            f"{part!r} {what} of this kernel (jobs: {known}); give more of the id, as %distributed_jobs lists them"
        )
    return chosen[0]


def latest_running(magic: str) -> Job:
    """The latest job of this kernel (or cell running in one of its sessions) that has not ended.

    Raises:
        UsageError: none runs; the message says how to name an ended one and where ``%distributed_jobs`` lists them.
    """
    listed = sorted(listed_jobs(), key=lambda job: job.submitted_s)  # a session's cell came after its session
    running = [job for job in listed if not job.done()]
    if not running:
        last = listed[-1].job_id if listed else None
        also = f" (the latest, {last}, has ended: {magic} {last} says where its saved stacks are)" if last else ""
        raise UsageError(f"no job of this kernel is running{also}; %distributed_jobs lists them")
    return running[-1]
