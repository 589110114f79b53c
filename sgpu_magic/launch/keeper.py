"""Kernel-side client of the run keeper (:mod:`sgpu_magic.launch.host.keeper`): the launcher of detached jobs.

:func:`get_keeper` finds the user's keeper through its socket (``<sgpu_magic home>/keeper/keeper-<tag>.sock``, 0600
in a 0700 folder; one keeper per user and Python, see :func:`sgpu_magic._util.unix_socket.keeper_tag`) or starts
one, holding the folder's start lock so that two kernels start one keeper between them, and none connects while
an idle keeper closes. A :class:`RunKeeper` is a :class:`~sgpu_magic.launch.base.Launcher`: each command is one
short connection (greeting, command line, close), so no kernel holds the keeper open, and a kernel that dies
leaves its jobs running there.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from filelock import FileLock

from sgpu_magic._util.unix_socket import keeper_tag
from sgpu_magic.errors import RecordError
from sgpu_magic.launch.client import HostHandle, handshake, host_command, host_env, rank_base_env
from sgpu_magic.rundir import RunDir, keeper_dir
from sgpu_magic.wire.host import HostCommand, KeeperGreeting, Launch, RayTarget, encode_command

CONNECT_TIMEOUT_S = 60.0
"""How long a command waits for the keeper's greeting: at once from its loop, or once a keeper just started has
imported torch (seconds)."""

START_LOCK_TIMEOUT_S = 60.0
"""How long a kernel waits for another one that is starting the keeper."""


class KeeperPaths:
    """The files of the user's run keeper for this Python, under ``<root>/keeper`` (``root``: the sgpu_magic home,
    :func:`sgpu_magic.rundir.default_root`)."""

    def __init__(self, root: Path | None = None) -> None:
        self.dir = keeper_dir(root)
        tag = keeper_tag()
        self.socket = self.dir / f"keeper-{tag}.sock"
        self.lock = self.dir / f"keeper-{tag}.lock"


def _greeting(path: Path) -> tuple[socket.socket, KeeperGreeting]:
    """Connect to the keeper at ``path`` and read its greeting line.

    Raises:
        OSError: no keeper listens there (``FileNotFoundError``, ``ConnectionRefusedError``), or it closed first, or
            what greeted is not a keeper (``ConnectionResetError``).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT_S)
    try:
        sock.connect(os.fspath(path))
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionResetError(f"the run keeper at {path} closed the connection")
            data += chunk
        return sock, KeeperGreeting.decode(data)
    except (OSError, RecordError) as exc:
        sock.close()
        raise exc if isinstance(exc, OSError) else ConnectionResetError(str(exc)) from None


class RunKeeper(HostHandle):
    """The user's run keeper, as a :class:`~sgpu_magic.launch.base.Launcher` (see the module docstring): the launch
    host's commands, each sent on a short connection to its socket.

    Attributes:
        pid: the keeper's process id (a detached job's GPU lease lives while it does).
        log_path: the keeper's own log.
    """

    NAME = "run keeper"
    PREPARING = "starting the run keeper (the first detached job waits while it imports torch)"

    def __init__(self, pid: int, log_path: str | os.PathLike, paths: KeeperPaths, warm: str | None = None) -> None:
        self.pid = pid
        self.log_path = Path(log_path)
        self.paths = paths
        self.ray_warm = warm
        """What the keeper said it keeps warm on a Ray cluster when this handle was made (``None``: nothing)."""
        self.ray: RayTarget | None = None

    def on_ray(self, ray_job: RayTarget) -> RunKeeper:
        """This keeper, launching its jobs on the Ray cluster ``ray_job`` names: the keeper supervises them
        (:class:`sgpu_magic.launch.host.keeper.Keeper`)."""
        self.ray = ray_job
        return self

    def launch(self, run_dir: RunDir) -> None:
        """Ask the keeper to start the ranks of ``run_dir`` with the kernel's current environment (on the Ray cluster
        :meth:`on_ray` named)."""
        self.send(Launch(str(run_dir.path), rank_base_env(), self.ray))

    def send(self, cmd: HostCommand) -> None:
        """Send one command line to the keeper.

        Raises:
            LauncherError: this keeper is gone (none listens, or another one does now).
        """
        try:
            with FileLock(self.paths.lock, timeout=START_LOCK_TIMEOUT_S, mode=0o600):
                sock, hello = _greeting(self.paths.socket)
            with sock:
                if hello.pid != self.pid:
                    raise ConnectionRefusedError(f"another run keeper (pid {hello.pid}) listens there now")
                sock.sendall(encode_command(cmd))
        except OSError as exc:
            raise self.gone(exc) from None


def get_keeper(root: Path | None = None) -> RunKeeper:
    """The user's run keeper for this Python, started if none runs (see the module docstring).

    Raises:
        LauncherError: it could not be started (the message says why and names its log).
        PermissionError: the keeper folder is not this user's (:func:`sgpu_magic.rundir.keeper_dir`).
    """
    paths = KeeperPaths(root)
    with FileLock(paths.lock, timeout=START_LOCK_TIMEOUT_S, mode=0o600):
        running = _listening(paths)
        if running is not None:
            return running
        # none runs (or a killed one left its socket): start one
        log_path = paths.dir / f"keeper-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}.log"
        proc = subprocess.Popen(
            host_command(
                sys.executable,
                log_path,
                "keeper",
                str(paths.socket),
                str(paths.lock),
                module="sgpu_magic.launch.keeper_main",
            ),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            cwd=paths.dir,
            env=host_env(),
        )
        pid = handshake(proc, "the sgpu_magic run keeper", log_path)
        return RunKeeper(pid, log_path, paths)


def running_keeper(root: Path | None = None) -> RunKeeper | None:
    """The user's run keeper if one runs now (none is started)."""
    paths = KeeperPaths(root)
    with FileLock(paths.lock, timeout=START_LOCK_TIMEOUT_S, mode=0o600):
        return _listening(paths)


def _listening(paths: KeeperPaths) -> RunKeeper | None:
    """The keeper that greets on ``paths.socket`` now, or ``None`` (the caller holds the start lock)."""
    try:
        sock, hello = _greeting(paths.socket)
        sock.close()
        return RunKeeper(hello.pid, hello.log, paths, hello.warm)
    except OSError:
        return None
