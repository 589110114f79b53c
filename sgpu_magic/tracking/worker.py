"""The kernel's MLflow writes, off every launch's and cell's path: one thread that runs them in order.

A tracked job's run is created, parameterised and ended here while the job itself goes on: the launch does not
wait for the store (nor for ``import mlflow``, on a kernel's first tracked job), and ``result()`` returns before
the run is ended. Tasks run in the order they were submitted, so a run is always created before it is ended and a
session's run before its cells' child runs. Each task runs in a copy of the submitting thread's context, so what
it prints (a warning) goes to the cell that started the job. At the interpreter's exit the queue is drained
(at most :data:`EXIT_DRAIN_S`), so a kernel that shuts down or restarts loses nothing it had queued, and each cell
starts once the runs of the jobs that ended before it are ended (:func:`settle_ended_runs`); a kernel that
is killed leaves its runs to the launch host, which ends those still RUNNING (see
:func:`sgpu_magic.launch.host.cleanup.end_mlflow_run`).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextvars
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

EXIT_DRAIN_S = 30.0
"""How long the interpreter's exit waits for queued MLflow writes."""
SETTLE_BEFORE_CELL_S = 30.0
"""How long a cell waits, before it runs, for the runs of the jobs that ended before it to be ended."""
WORKER_NICENESS = 10
"""How much lower than the kernel's the worker thread's CPU priority is, on Linux (``setpriority`` on its thread
id, as ``renice`` does): its store writes (about 30 ms of CPU to make a run in a sqlite store) give way to the
ranks and the launch host, which a short job on a machine with few cores would otherwise wait for (measured on 2
cores: a warm 1-rank job tracked 1.27x untracked, 1.13x with it)."""


class TrackingWorker:
    """A daemon thread that runs submitted tasks one at a time, in order (started on the first task)."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[contextvars.Context, Callable[[], Any], concurrent.futures.Future]]
        self._tasks = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._ends: set[concurrent.futures.Future] = set()

    def submit(self, task: Callable[[], Any], ends_a_run: bool = False) -> concurrent.futures.Future:
        """Queue ``task``; a future of its value (or of its exception: a task's failure never stops the worker).
        ``ends_a_run``: the task ends the run of a job that has ended (:meth:`settle_ended_runs` waits for it)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((contextvars.copy_context(), task, future))
        with self._lock:
            if ends_a_run:
                self._ends.add(future)
                future.add_done_callback(self._ends.discard)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="sgpu_magic-mlflow-writer", daemon=True)
                self._thread.start()
        return future

    def settle_ended_runs(self, timeout_s: float | None = None) -> bool:
        """Wait until the runs of the jobs that have ended so far are ended in the store; whether they were within
        ``timeout_s``. Called before each cell (IPython's ``pre_run_cell``): the end of a job's run overlaps
        whatever follows in its own cell and the user's pause, and a later cell that reads the run (``mlflow.
        search_runs``) finds it in its final state, as if it had been ended before the result came back."""
        with self._lock:
            ends = list(self._ends)
        if not ends:
            return True
        _, pending = concurrent.futures.wait(ends, timeout_s)
        return not pending

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every task submitted so far has run; whether they had within ``timeout_s``."""
        try:
            self.submit(lambda: None).result(timeout_s)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def _run(self) -> None:
        if sys.platform == "linux":  # elsewhere PRIO_PROCESS takes a process id, not a thread's
            try:
                me = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + WORKER_NICENESS))
            except OSError:  # a sandbox without the call: the writes just compete as any thread does
                pass
        while True:
            context, task, future = self._tasks.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(context.run(task))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)


_worker: TrackingWorker | None = None
_worker_lock = threading.Lock()


def worker() -> TrackingWorker:
    """This kernel's tracking worker (made on first use, drained at the interpreter's exit)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = TrackingWorker()
            atexit.register(_drain)
        return _worker


def settle_ended_runs(*_: object) -> None:
    """IPython's ``pre_run_cell`` callback: :meth:`TrackingWorker.settle_ended_runs` (at most
    :data:`SETTLE_BEFORE_CELL_S`; after that the cell runs and the runs end on their own)."""
    if _worker is not None:
        _worker.settle_ended_runs(SETTLE_BEFORE_CELL_S)


def _drain() -> None:
    if _worker is not None and not _worker.flush(EXIT_DRAIN_S):
        log.warning(
            "sgpu_magic: MLflow writes still queued at exit after %g s; the launch host ends the runs", EXIT_DRAIN_S
        )
