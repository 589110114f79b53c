"""The launch host: one process per kernel that starts and watches ranks with torch elastic.

Started through :mod:`sgpu_magic.launch.host.boot` (which detaches it from the kernel, answers ``ready <pid>``,
imports torch and forks its forkserver), it then reads the kernel's commands from stdin (:func:`serve`), one JSON
line each (:mod:`sgpu_magic.wire.host`):

- :class:`~sgpu_magic.wire.host.Launch`: start the job's ranks.
- :class:`~sgpu_magic.wire.host.Cancel`: stop them for a :class:`~sgpu_magic.wire.StopReason`.
- :class:`~sgpu_magic.wire.host.Stacks`: the running ranks' stacks into the reply file the token names
  (:func:`sgpu_magic.launch.stacks.answer`).

Ranks are started through torch.distributed.elastic's ``SubprocessContext`` with torchrun's
environment contract; the first failure stops the others (SIGTERM, then SIGKILL after
``GRACE_S``). The host reports through each RunDir's ``status.json``. It exits, stopping
every rank, when stdin reaches EOF or the kernel process is gone: so no rank outlives the
kernel, however it ends.

Its only command channel is that unnamed pipe from the kernel that started it (no socket, no
named file), so no other process can drive it. For each job it serves the rendezvous store on
127.0.0.1 (torchrun's agent store) and points gloo and NCCL at the loopback interface, so a
single-machine job listens on no other address.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import signal
import sys
import threading
import time

import psutil

from sgpu_magic._util.fs import touch_private
from sgpu_magic._util.redact import RedactingFormatter
from sgpu_magic.errors import RecordError
from sgpu_magic.launch.host.cleanup import end_mlflow_run, import_mlflow_in_background, reap_adopted
from sgpu_magic.launch.host.job import HostJob
from sgpu_magic.launch.host.warm_pool import WarmPool
from sgpu_magic.launch.machine import fail_unstarted
from sgpu_magic.launch.stacks import answer as answer_stacks
from sgpu_magic.rundir import RunDir, host_ready_marker
from sgpu_magic.wire import StopReason
from sgpu_magic.wire.host import Cancel, HostCommand, Launch, Release, Stacks, decode_command

log = logging.getLogger(__name__)

POLL_S = 0.02


IDLE_POLL_S = 0.5

IMPORT_MLFLOW_AFTER_S = 3.0
"""Once a tracked job has come, the host imports mlflow (for the run it may have to end on its way out) when no job
has started for this long: an import at the launch competed with the ranks' start-up (2 s of CPU on 2 cores)."""


class Host:
    """The host's loop: commands from stdin, polling of running jobs, shutdown with the kernel."""

    def __init__(self, kernel_pid: int | None, pool: WarmPool | None) -> None:
        self.kernel = psutil.Process(kernel_pid) if kernel_pid is not None else None
        self.pool = pool
        self.jobs: dict[str, HostJob] = {}
        self.ended: collections.deque[HostJob] = collections.deque(maxlen=32)
        """Jobs that ended lately: if the kernel dies before it ends their MLflow runs, the host does."""
        self.buffer = b""

    def kernel_alive(self) -> bool:
        """Whether the host goes on serving: the kernel that started it still runs (the run keeper, which serves
        no kernel, says whether it still holds a run: :class:`sgpu_magic.launch.host.keeper.Keeper`)."""
        try:
            assert self.kernel is not None  # a kernel's host is started with its pid
            return self.kernel.is_running() and self.kernel.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def inputs(self) -> list[int]:
        """The file descriptors commands come in on: the kernel's pipe (stdin)."""
        return [0]

    def on_input(self, fd: int) -> bool:
        """Read what came on ``fd`` (one of :meth:`inputs`) and handle every complete command line; ``False`` when
        the host must stop (the kernel closed its pipe)."""
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return False
        self.buffer = self.handle_lines(self.buffer + chunk)
        return True

    def handle_lines(self, data: bytes) -> bytes:
        """Handle each complete JSON line of ``data``; returns the incomplete rest. A line that is not a command this
        version reads is logged and skipped."""
        *lines, rest = data.split(b"\n")
        for line in lines:
            if line.strip():
                try:
                    cmd = decode_command(line)
                except RecordError as exc:
                    log.warning(f"sgpu_magic host: {exc}")
                    continue
                self.handle(cmd)
        return rest

    def handle(self, cmd: HostCommand) -> None:
        if isinstance(cmd, Release):  # the run keeper's (it keeps Ray agents warm); a kernel's host holds none
            return
        run_dir = RunDir(cmd.run_dir)
        if isinstance(cmd, Launch):
            try:
                self.jobs[run_dir.job_id] = HostJob(run_dir, dict(cmd.env), self.pool)
            except Exception as exc:  # noqa: BLE001 - reported to the kernel through status.json
                try:
                    fail_unstarted(run_dir, exc)
                except OSError as write_exc:
                    log.warning(
                        f"sgpu_magic host: job {run_dir.job_id} could not start ({exc}) nor say so ({write_exc})"
                    )
        elif isinstance(cmd, Stacks):  # answered from a thread: the dumps take up to stacks.DUMP_TIMEOUT_S
            job = self.jobs.get(run_dir.job_id)
            pids = None if job is None else dict(job.pids)
            threading.Thread(target=answer_stacks, args=(run_dir, cmd.token, pids, cmd.native), daemon=True).start()
        elif isinstance(cmd, Cancel) and run_dir.job_id in self.jobs:
            job = self.jobs.pop(run_dir.job_id)
            job.stop(cmd.reason)
            self.ended.append(job)

    def read_commands(self) -> bool:
        """Handle every complete command line waiting on the inputs; ``False`` when the host must stop."""
        wake = [fd for job in self.jobs.values() for fd in job.wake_fds()]
        inputs = self.inputs()
        try:
            ready, _, _ = select.select([*inputs, *wake], [], [], POLL_S if self.jobs else IDLE_POLL_S)
        except (OSError, ValueError):  # a rank's fd closed meanwhile
            ready = []
        return all(self.on_input(fd) for fd in ready if fd in inputs)

    def _import_mlflow_when_quiet(self) -> None:
        jobs = [*self.jobs.values(), *self.ended]
        if any(job.tracked for job in jobs):
            if all(time.time() - job.started_s >= IMPORT_MLFLOW_AFTER_S for job in self.jobs.values()):
                import_mlflow_in_background()

    @staticmethod
    def _poll(job: HostJob) -> None:
        try:
            job.poll()
        except Exception as exc:  # noqa: BLE001 - one broken job must not take the host down
            job.stop(StopReason.FAILED, launch_error=f"the launch host lost this job: {type(exc).__name__}: {exc}")

    def run(self) -> None:
        last_check = 0.0
        try:
            while self.read_commands():
                for job_id, job in list(self.jobs.items()):
                    self._poll(job)
                    if job.done:
                        del self.jobs[job_id]
                        self.ended.append(job)
                for job in self.ended:
                    if job.unwritten:
                        job.write()
                if time.monotonic() - last_check > 0.5:
                    last_check = time.monotonic()
                    if not self.kernel_alive():
                        break
                    if self.pool is not None:
                        self.pool.note_ready()
                    self._import_mlflow_when_quiet()
                    reap_adopted({pid for job in self.jobs.values() for pid in job.pids.values()})
        finally:
            for job in self.jobs.values():
                job.stop(StopReason.CANCELLED, stacks=False)  # the kernel is gone: end at once
            if self.pool is not None:
                self.pool.stop()
            for job in [*self.ended, *self.jobs.values()]:
                if not job.run_dir.mlflow_ended_file.exists():  # the kernel did not get to end it
                    end_mlflow_run(job.run_dir, job.machine.state, job.env)


def host_logging() -> None:
    """sgpu_magic's diagnostics in this process (``logging.getLogger(__name__)`` of its modules) go to the host's
    log file (stderr, once :func:`_detach` has pointed it there) as they did before they were logged: the message
    alone on its line, redacted. A line that cannot be written (a full disk) is lost, not the host."""
    logging.raiseExceptions = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter("%(message)s"))
    package = logging.getLogger("sgpu_magic")
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    package.propagate = False


def _plain_elastic_logging() -> None:
    """Log torch elastic's records through a plain formatter. torch's own formatter imports torch._dynamo
    the first time it formats an exception (2.7 s of CPU; 9 to 12 s on a busy 2-core machine), and
    elastic logs one for every failed rank: that held up the host's first failure report (chaos suite)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(levelname).1s%(asctime)s %(process)d %(name)s] %(message)s", "%m%d %H:%M:%S")
    )
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.addHandler(handler)
    elastic.propagate = False


def serve(
    kernel_pid: int | None,
    pool: WarmPool | None,
    log_path: str | None = None,
    import_s: float | None = None,
    host: Host | None = None,
) -> None:
    """Run the host for kernel ``kernel_pid`` (torch already imported, its forkserver ``pool`` started; ``None``:
    every launch cold) until the kernel closes stdin or dies; called by :func:`sgpu_magic.launch.host.boot.main`,
    which says how long its ``import torch`` took (``import_s``). It first makes the host's ready marker beside
    ``log_path`` (:func:`sgpu_magic.rundir.host_ready_marker`). ``host``: the run keeper's loop instead of a
    kernel's (:class:`sgpu_magic.launch.host.keeper.Keeper`), which serves until it holds no run."""
    host_logging()
    if import_s is not None:
        log.info("imported torch in %.2f s", import_s)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    host = host if host is not None else Host(kernel_pid, pool)
    _plain_elastic_logging()
    if log_path is not None:
        touch_private(host_ready_marker(log_path))
    host.run()
