"""The run keeper: the launch host of detached jobs (``detach=True`` / ``--detach``), one per user and Python.

It is the launch host (:mod:`sgpu_magic.launch.host.process`: the same jobs, leases, restarts, timeouts and stacks)
with two differences. It serves no kernel: it is not started per kernel and never watches one, so a job handed to
it outlives the kernel that started it (a SIGKILL, a restart, a culled server). And its commands come on a Unix
socket, 0600 in the user's 0700 keeper folder (:func:`sgpu_magic.rundir.keeper_dir`), from any kernel of the same
user; a caller of another uid is turned away (``SO_PEERCRED``). Each connection is greeted with one JSON line,
``{"pid": ..., "log": ...}``, then sends the host's command lines (``launch``, ``cancel``, ``stacks``).

A detached job on a Ray cluster (``cluster=`` with ``detach=True``: its launch command has ``"ray": {"cluster": ...,
"gpu_type": ...}``) is supervised here, as a kernel supervises its own Ray jobs
(:class:`sgpu_magic.launch.ray.launcher.RayLauncher`): the keeper is then the Ray driver that owns the job's
placement group and rank actors, so they outlive the kernel, and Ray removes them (and the ranks die with their
actors) if the keeper is killed. Ray is imported only for such a job. As a kernel does, the keeper keeps the
placement group and rank agents of its last Ray job warm for the next one of its shape (for the keep-warm time
the job's kernel sent) and holds on while it does; ``{"op": "release"}`` (``sgpu_magic.release()`` in any kernel of
the user's) gives them back.

It exits once it holds no run: no job, no open connection, nothing kept warm on a Ray cluster, for :data:`LINGER_S`
seconds; then it takes the start
lock (so no kernel is half-way through connecting), closes and removes its socket, and ends the MLflow runs of
its ended jobs that no kernel ended. Its ranks die with it (as a kernel's host's do) when it is killed.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from filelock import FileLock, Timeout

from sgpu_magic._util.unix_socket import peer_uid
from sgpu_magic.launch.host.cleanup import end_mlflow_run
from sgpu_magic.launch.host.process import Host
from sgpu_magic.launch.host.warm_pool import WarmPool
from sgpu_magic.launch.machine import fail_unstarted
from sgpu_magic.rundir import RunDir, read_json
from sgpu_magic.wire import StopReason, read_state
from sgpu_magic.wire.host import Cancel, HostCommand, KeeperGreeting, Launch, RayTarget, Release


class RayJobs(Protocol):
    """What the keeper needs of the Ray backend's supervisor of jobs
    (:class:`sgpu_magic.launch.ray.launcher.RayLauncher`; the launch host imports no backend: the keeper's program,
    :mod:`sgpu_magic.launch.keeper_main`, hands it a factory)."""

    cluster: str
    gpu_type: str | None

    def launch_with_env(self, run_dir: RunDir, base_env: dict[str, str] | None) -> None: ...
    def cancel(self, run_dir: RunDir, reason: StopReason) -> None: ...
    def answer_stacks(self, run_dir: RunDir, token: str, native: bool) -> None: ...
    def running(self) -> list[str]: ...
    def stop_all(self, reason: StopReason, wait_s: float) -> None: ...
    def keep_warm(self, seconds: float | None) -> None: ...
    def warm(self) -> str | None: ...
    def release(self, why: str) -> str | None: ...


log = logging.getLogger(__name__)

RAY_STOP_WAIT_S = 20.0
"""Seconds a keeper that is told to exit (SIGTERM) gives its running Ray jobs to stop and say so."""

LINGER_S = 10.0
"""Seconds the keeper stays with no run and no connection before it exits (``$SGPU_MAGIC_KEEPER_LINGER_S`` where
set): a detached job started soon after finds it warm, and a kernel following a job that just ended ends its
MLflow run first (the keeper ends the runs no kernel ended on its way out)."""


def linger_s() -> float:
    """:data:`LINGER_S`, or ``$SGPU_MAGIC_KEEPER_LINGER_S`` when it is a number >= 0."""
    try:
        value = float(os.environ.get("SGPU_MAGIC_KEEPER_LINGER_S", LINGER_S))
    except ValueError:
        return LINGER_S
    return value if value >= 0 else LINGER_S


class Keeper(Host):
    """The run keeper's loop (see the module docstring).

    Args:
        listener: the bound, listening socket (:func:`sgpu_magic._util.unix_socket.bind_private`).
        socket_path: where it is bound, removed on the way out.
        lock_path: the start lock kernels hold while they connect or start a keeper.
        pool: the forkserver, as for a kernel's host.
        log_path: the keeper's log, named in each greeting.
        ray_jobs: makes the supervisor of detached Ray jobs for a cluster address and GPU type, on the first one
            (:func:`sgpu_magic.launch.keeper_main.ray_jobs`).
    """

    def __init__(
        self,
        listener: socket.socket,
        socket_path: Path,
        lock_path: Path,
        pool: WarmPool | None,
        log_path: str,
        ray_jobs: Callable[[str, str | None], RayJobs],
    ) -> None:
        super().__init__(None, pool)
        self.listener = listener
        self.socket_path = socket_path
        self.lock_path = lock_path
        self.log_path = log_path
        self.clients: dict[int, tuple[socket.socket, bytes]] = {}
        self.idle_since = time.monotonic()
        self.linger_s = linger_s()
        self.make_ray_jobs = ray_jobs
        self.ray: RayJobs | None = None
        """The supervisor of detached Ray jobs, made for the first one."""
        self.ray_envs: dict[str, tuple[RunDir, dict[str, str]]] = {}
        """Each Ray job's run directory and environment, to end its MLflow run if no kernel does."""

    def greeting(self) -> bytes:
        """The line each connection is greeted with: the keeper's pid and log, and what it keeps warm on a Ray
        cluster (``None``: nothing)."""
        warm = self.ray.warm() if self.ray is not None else None
        return KeeperGreeting(os.getpid(), self.log_path, warm).encode()

    def handle(self, cmd: HostCommand) -> None:
        """The host's commands (:meth:`Host.handle`); those of a detached Ray job go to its supervisor here, and
        :class:`~sgpu_magic.wire.host.Release` gives back what it keeps warm on the Ray cluster."""
        if isinstance(cmd, Release):
            if self.ray is not None:
                self.ray.release(cmd.why)
            return
        run_dir = RunDir(cmd.run_dir)
        if isinstance(cmd, Launch) and cmd.ray is not None:
            self._launch_on_ray(run_dir, cmd.ray, dict(cmd.env))
        elif self.ray is not None and run_dir.job_id in self.ray_envs and not isinstance(cmd, Launch):
            if isinstance(cmd, Cancel):
                self.ray.cancel(run_dir, cmd.reason)
            else:
                threading.Thread(
                    target=self.ray.answer_stacks, args=(run_dir, cmd.token, cmd.native), daemon=True
                ).start()
        else:
            super().handle(cmd)

    def _launch_on_ray(self, run_dir: RunDir, ray_job: RayTarget, env: dict[str, str]) -> None:
        try:
            if self.ray is None:
                self.ray = self.make_ray_jobs(ray_job.cluster, ray_job.gpu_type)
            elif self.ray.cluster != ray_job.cluster:
                raise RuntimeError(
                    f"the run keeper (pid {os.getpid()}) drives detached jobs on the Ray cluster {self.ray.cluster!r}, "
                    f"not {ray_job.cluster!r}: a process joins one Ray cluster; run this job once the keeper has "
                    f"exited ({self.linger_s:g} s after its last run ends), or without detach"
                )
            self.ray.gpu_type = ray_job.gpu_type
            self.ray.keep_warm(ray_job.keep_warm_s)  # the job's kernel's: read when the job ends
            self.ray_envs[run_dir.job_id] = (run_dir, env)
            self.ray.launch_with_env(run_dir, env)
        except Exception as exc:  # noqa: BLE001 - reported to the kernel through status.json
            fail_unstarted(run_dir, exc)

    def run(self) -> None:
        try:
            super().run()
        finally:
            self._end_ray_jobs()

    def _end_ray_jobs(self) -> None:
        """On the way out: stop the Ray jobs still running (told to exit), then end the MLflow runs no kernel
        ended, as :meth:`Host.run` does for the keeper's local jobs."""
        if self.ray is None:
            return
        self.ray.stop_all(StopReason.CANCELLED, RAY_STOP_WAIT_S)
        self.ray.release("the run keeper exits")
        for run_dir, env in self.ray_envs.values():
            if not run_dir.mlflow_ended_file.exists():
                status = read_json(run_dir.status_file) or {}
                end_mlflow_run(run_dir, read_state(status)[0], env)  # a job not started (no state) ends KILLED too

    def inputs(self) -> list[int]:
        return [self.listener.fileno(), *self.clients]

    def on_input(self, fd: int) -> bool:
        if fd == self.listener.fileno():
            self._accept()
            return True
        sock, buffer = self.clients[fd]
        try:
            chunk = sock.recv(1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            del self.clients[fd]
            sock.close()
            self.idle_since = time.monotonic()
            return True
        self.clients[fd] = (sock, self.handle_lines(buffer + chunk))
        return True

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        uid = peer_uid(sock)
        if uid is not None and uid != os.getuid():
            log.warning(f"sgpu_magic keeper: turned away a connection of uid {uid}")
            sock.close()
            return
        try:
            sock.sendall(self.greeting())
        except OSError:
            sock.close()
            return
        self.clients[sock.fileno()] = (sock, b"")

    def kernel_alive(self) -> bool:
        """Whether the keeper goes on: it holds a job or a connection, or did less than :func:`linger_s` ago; else
        it closes its socket (:meth:`_close`) and stops, unless a kernel is connecting right then."""
        now = time.monotonic()
        if self.jobs or self.clients or (self.ray is not None and (self.ray.running() or self.ray.warm())):
            self.idle_since = now
            return True
        if now - self.idle_since < self.linger_s:
            return True
        return not self._close()

    def _close(self) -> bool:
        """Close and remove the socket, holding the start lock so that no kernel is connecting meanwhile; ``False``
        (and the keeper goes on) when a kernel holds the lock or has just connected."""
        lock = FileLock(self.lock_path, mode=0o600)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return False
        try:
            waiting, _, _ = select.select([self.listener], [], [], 0)
            if waiting:
                return False
            self.socket_path.unlink(missing_ok=True)
            self.listener.close()
            log.info("sgpu_magic keeper: no run left; exiting")
            return True
        finally:
            lock.release()
