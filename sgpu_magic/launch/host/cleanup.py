"""What the launch host does on the way out of a job: give back its GPUs, kill and reap what its ranks left behind,
end its MLflow run when the kernel could not."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator

import psutil

from sgpu_magic.errors import RecordError
from sgpu_magic.rundir import RunDir
from sgpu_magic.wire import LaunchRecord, RunState

log = logging.getLogger(__name__)


def release_lease(launch: LaunchRecord) -> None:
    """Give back the job's GPUs as soon as its ranks are gone, also when the kernel is gone (a kernel
    that is shut down or killed never gets to); the kernel's own release is then a no-op."""
    if not launch.lease_dir:
        return
    try:
        from sgpu_magic.launch.leases import LeaseRegistry

        LeaseRegistry(launch.lease_dir).release(launch.job_id)
    except Exception as exc:  # noqa: BLE001 - the next job reclaims it once this host is gone
        log.warning(f"sgpu_magic host: could not release the GPUs of job {launch.job_id}: {exc}")


def _belongs_to(process: psutil.Process, job_id: str | None) -> bool:
    """Whether ``process`` was started for job ``job_id``: it carries the job's ``SGPU_MAGIC_JOB_ID``."""
    if not job_id:
        return False
    try:
        return process.environ().get("SGPU_MAGIC_JOB_ID") == job_id
    except (psutil.Error, OSError):
        return False


def kill_leftovers(rank_pids: set[int], job_id: str | None = None) -> None:
    """SIGKILL what the ranks left behind and reap it: every descendant of this host (a subreaper, so it
    adopts orphans) in a rank's session, or carrying the job's ``SGPU_MAGIC_JOB_ID`` in its environment
    (children that started their own session, double-forked daemons)."""
    victims = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid in rank_pids or os.getsid(child.pid) in rank_pids or _belongs_to(child, job_id):
                if child.status() != psutil.STATUS_ZOMBIE and child.pid not in rank_pids:
                    child.kill()
                    victims.append(child)
        except (psutil.Error, ProcessLookupError):
            continue
    # A SIGKILLed process takes a moment to die: reaping at once with WNOHANG left it a zombie.
    # psutil's wait reaps the victims that are already this process's children.
    psutil.wait_procs(victims, timeout=1.0)
    reap_adopted(rank_pids)


_RUN_STATUS = {RunState.SUCCEEDED: "FINISHED", RunState.FAILED: "FAILED"}  # cancelled, timed out: KILLED


_mlflow_import: threading.Thread | None = None

IMPORT_MLFLOW_NICENESS = 10
"""How much lower than the host's the CPU priority of its background ``import mlflow`` is (Linux)."""


def _import_mlflow() -> None:
    if sys.platform == "linux":  # elsewhere PRIO_PROCESS takes a process id, not a thread's
        try:
            me = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + IMPORT_MLFLOW_NICENESS))
        except OSError:
            pass
    __import__("mlflow")


def import_mlflow_in_background() -> None:
    """Import mlflow (about 2 s of CPU) on a thread at a lower CPU priority, so that ending a run on the host's way
    out (:func:`end_mlflow_run`) takes no import time. The host calls it once no job has started for a while
    (:data:`sgpu_magic.launch.host.process.IMPORT_MLFLOW_AFTER_S`): not while a job's ranks start."""
    global _mlflow_import
    if _mlflow_import is None:
        _mlflow_import = threading.Thread(target=_import_mlflow, name="import-mlflow", daemon=True)
        _mlflow_import.start()


@contextlib.contextmanager
def _environ(env: dict[str, str] | None) -> Iterator[None]:
    """``os.environ`` is ``env`` inside the block (``None``: as it is), and as before after it. Only for the host's
    way out, when no job runs any more: MLflow reads a store's credentials (``MLFLOW_TRACKING_TOKEN``, ...) from
    ``os.environ`` at each request, and a job's are in its own environment, not the host's."""
    if env is None:
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def end_mlflow_run(run_dir: RunDir, state: RunState, env: dict[str, str] | None = None) -> None:
    """End the job's MLflow run if it is still RUNNING, and its child runs still RUNNING (a session's cells', the
    ranks' own): the host is exiting, so the kernel is gone (or let go of the host) and may have died before it
    ended them; a job stopped now ends KILLED. The run is the one the kernel named in ``mlflow.json`` once it made
    it (read through the private-read check); none there (not made yet, or untracked): nothing to end.

    mlflow is imported only here; a failure is logged, never raised.
    """
    try:
        record = run_dir.read_mlflow_run()
    except (OSError, RecordError) as exc:
        log.warning(f"sgpu_magic host: the MLflow run of {run_dir.job_id} cannot be read, so not ended: {exc}")
        return
    if record is None or not record.run_id:
        return
    run_id = record.run_id
    status = _RUN_STATUS.get(state, "KILLED")
    try:
        with _environ(env):
            from mlflow import MlflowClient

            client = MlflowClient(record.tracking_uri)
            run = client.get_run(run_id)
            children = client.search_runs(
                [run.info.experiment_id],
                f"tags.mlflow.parentRunId = '{run_id}' and attributes.status = 'RUNNING'",
            )
            for left in [*children, *([run] if run.info.status == "RUNNING" else [])]:
                client.set_terminated(left.info.run_id, status)
    except Exception as exc:  # noqa: BLE001 - the host is on its way out; its log says why
        log.warning(f"sgpu_magic host: could not end MLflow run {run_id} {status}: {type(exc).__name__}: {exc}")


def reap_adopted(keep: set[int]) -> None:
    """Reap exited children of this subreaper, except ``keep`` (live ranks, which their Popen reaps).

    Processes that ranks leave behind are adopted by the host whenever their parent dies (for
    example DataLoader workers that exit after their rank), so this also runs periodically.
    """
    for child in psutil.Process().children():
        if child.pid not in keep:
            try:
                os.waitpid(child.pid, os.WNOHANG)
            except ChildProcessError:
                pass
