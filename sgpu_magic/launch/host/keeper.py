"""The run keeper: the launch host of detached jobs (``detach=True`` / ``--detach``), one per user and Python.

It is the launch host (:mod:`sgpu_magic.launch.host.process`: the same jobs, leases, restarts, timeouts and stacks)
with two differences. It serves no kernel: it is not started per kernel and never watches one, so a job handed to
it outlives the kernel that started it (a SIGKILL, a restart, a culled server). And its commands come on a Unix
socket, 0600 in the user's 0700 keeper folder (:func:`sgpu_magic.rundir.keeper_dir`), from any kernel of the same
user; a caller of another uid is turned away (``SO_PEERCRED``). Each connection is greeted with one JSON line,
``{"pid": ..., "log": ...}``, then sends the host's command lines (``launch``, ``cancel``, ``stacks``).

It exits once it holds no run: no job, no open connection, for :data:`LINGER_S` seconds; then it takes the start
lock (so no kernel is half-way through connecting), closes and removes its socket, and ends the MLflow runs of
its ended jobs that no kernel ended. Its ranks die with it (as a kernel's host's do) when it is killed.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import time
from pathlib import Path

from filelock import FileLock, Timeout

from sgpu_magic._util.unix_socket import peer_uid
from sgpu_magic.launch.host.process import Host
from sgpu_magic.launch.host.warm_pool import WarmPool

log = logging.getLogger(__name__)

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
    """

    def __init__(
        self, listener: socket.socket, socket_path: Path, lock_path: Path, pool: WarmPool | None, log_path: str
    ) -> None:
        super().__init__(None, pool)
        self.listener = listener
        self.socket_path = socket_path
        self.lock_path = lock_path
        self.greeting = (json.dumps({"pid": os.getpid(), "log": log_path}) + "\n").encode()
        self.clients: dict[int, tuple[socket.socket, bytes]] = {}
        self.idle_since = time.monotonic()
        self.linger_s = linger_s()

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
            sock.sendall(self.greeting)
        except OSError:
            sock.close()
            return
        self.clients[sock.fileno()] = (sock, b"")

    def kernel_alive(self) -> bool:
        """Whether the keeper goes on: it holds a job or a connection, or did less than :func:`linger_s` ago; else
        it closes its socket (:meth:`_close`) and stops, unless a kernel is connecting right then."""
        now = time.monotonic()
        if self.jobs or self.clients:
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
