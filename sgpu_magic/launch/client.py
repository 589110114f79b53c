"""Kernel-side client of the launch host (see :mod:`sgpu_magic.launch.host.process`).

One host per kernel process, started in the background on first need (the extension
starts it when it loads). It is detached from the kernel's process group, so Jupyter's
interrupt does not reach it, and it stops every rank and exits when the kernel ends.
If it dies, the next launch starts a new one.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from sgpu_magic.errors import LauncherError
from sgpu_magic.rundir import RunDir, default_root, host_ready_marker, host_warm_marker, make_private_dir
from sgpu_magic.wire.host import Cancel, HostCommand, Launch, Stacks, encode_command

if TYPE_CHECKING:
    from sgpu_magic.status import HostStatus
    from sgpu_magic.wire import StopReason

_HANDSHAKE_TIMEOUT_S = 30.0
_HOST_MAIN = "import sys; from {module} import main; main(sys.argv)"
"""The host runs from ``-c``, not ``-m``: its ``__main__`` then names no module, so each rank forked
from its forkserver skips re-running the host module as ``__mp_main__`` (multiprocessing's prepare)."""


class HostHandle:
    """What the two local launchers share, the kernel's launch host (:class:`LaunchHost`) and the user's run keeper
    (:class:`sgpu_magic.launch.keeper.RunKeeper`): the same host program and commands (launch, cancel, stacks), a
    log whose markers say when it is ready, a process to watch. A subclass says how a command is sent
    (:meth:`send`), sets :attr:`pid` and :attr:`log_path`, and names itself (:attr:`NAME`, :attr:`PREPARING`).

    Attributes:
        pid: the host's process id.
        log_path: where the host writes its own diagnostics.
    """

    NAME = "launch host"
    PREPARING = "starting the launch host (the first launch of this kernel waits while it imports torch)"
    pid: int
    log_path: Path
    _proc: psutil.Process | None = None  # for process_alive(), made on first use

    def send(self, cmd: HostCommand) -> None:
        """Send one command line; raises :class:`LauncherError` if the host is gone."""
        raise NotImplementedError

    @property
    def warm_marker(self) -> Path | None:
        """The file the host's forkserver creates once it has preloaded torch (``None``: every launch is cold,
        ``SGPU_MAGIC_START_METHOD=subprocess``)."""
        if os.environ.get("SGPU_MAGIC_START_METHOD", "forkserver") == "subprocess":
            return None
        return host_warm_marker(self.log_path)

    @property
    def ready_markers(self) -> list[Path]:
        """The files that exist once the host is ready for a fast first launch: it has imported torch, and its
        forkserver (unless every launch is cold) has preloaded it."""
        warm = self.warm_marker
        return [host_ready_marker(self.log_path), *([warm] if warm is not None else [])]

    def where(self) -> str:
        """The host's log file (its own diagnostics), for error messages."""
        return str(self.log_path)

    def preparing(self) -> str | None:
        """:attr:`PREPARING` until the host's ready markers exist (:attr:`ready_markers`); ``None`` after."""
        if all(path.exists() for path in self.ready_markers):
            return None
        return self.PREPARING

    def process_alive(self) -> bool:
        """Whether the host process still runs (a zombie does not)."""
        try:
            if self._proc is None:
                self._proc = psutil.Process(self.pid)
            return self._proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def alive(self) -> bool:
        """Whether the host still runs."""
        return self.process_alive()

    @property
    def warm(self) -> bool:
        """Whether the host's forkserver has finished preloading torch (the marker the host names after its log)."""
        return host_warm_marker(self.log_path).exists()

    def gone(self, exc: BaseException) -> LauncherError:
        """The error of a command that found the host gone, naming its log."""
        return LauncherError(f"the sgpu_magic {self.NAME} (pid {self.pid}) is gone: {exc}; see {self.log_path}")

    def launch(self, run_dir: RunDir) -> None:
        """Ask the host to start the ranks of ``run_dir`` with the kernel's current environment."""
        self.send(Launch(str(run_dir.path), rank_base_env()))

    def cancel(self, run_dir: RunDir, reason: StopReason) -> None:
        """Ask the host to stop a job for ``reason`` (cancelled, timed_out, interrupted)."""
        self.send(Cancel(str(run_dir.path), reason))

    def request_stacks(self, run_dir: RunDir, token: str, native: bool) -> None:
        """Ask the host for the stacks of the job's running ranks, answered in ``run_dir.stacks_reply_file(token)``
        (:func:`sgpu_magic.launch.stacks.live_stacks` waits for it)."""
        self.send(Stacks(str(run_dir.path), token, native))

    def stacks(self, run_dir: RunDir, status: Callable[[], HostStatus], native: bool) -> dict[int, str]:
        """The ranks' stacks, taken by the host: each rank names it its tracer (``PR_SET_PTRACER``), so it may trace
        them where Yama's ``ptrace_scope`` 1 forbids the kernel to."""
        from sgpu_magic.launch.stacks import live_stacks

        return live_stacks(run_dir, status, native, lambda token: self.request_stacks(run_dir, token, native))


class LaunchHost(HostHandle):
    """Handle on a running launch host process, the kernel's own: the local
    :class:`~sgpu_magic.launch.base.Launcher`; its commands go down its stdin, a pipe only this kernel holds."""

    def __init__(self, root: Path | None = None) -> None:
        hosts = make_private_dir((root or default_root()) / "hosts")
        self.log_path = hosts / f"host-{os.getpid()}-{os.urandom(3).hex()}.log"
        proc = subprocess.Popen(
            host_command(sys.executable, self.log_path, str(os.getpid())),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            cwd=os.getcwd(),
            env=host_env(),
        )
        assert proc.stdin is not None  # stdin=PIPE
        try:
            self.pid = handshake(proc, "the sgpu_magic launch host", self.log_path)
        except LauncherError:
            proc.stdin.close()
            raise
        self._stdin = proc.stdin
        self._lock = threading.Lock()

    def alive(self) -> bool:
        """Whether the host process still runs and its command pipe is open."""
        return not self._stdin.closed and self.process_alive()

    def send(self, cmd: HostCommand) -> None:
        data = encode_command(cmd)
        with self._lock:
            try:
                self._stdin.write(data)
                self._stdin.flush()
            except (BrokenPipeError, ValueError, OSError) as exc:
                _close_quietly(self._stdin)
                raise self.gone(exc) from None

    def close(self) -> None:
        """Close the command pipe: the host stops its jobs and exits."""
        with self._lock:
            _close_quietly(self._stdin)


def handshake(proc: subprocess.Popen[bytes], what: str, log_path: Path) -> int:
    """The pid a starting host (or run keeper) says on its stdout, ``ready <pid>``, once it has detached (the
    process started exits then and is reaped here).

    Raises:
        LauncherError: it said ``error <why>`` or nothing within 30 s; the message names ``what`` and its log.
    """
    assert proc.stdout is not None  # stdout=PIPE
    ready, _, _ = select.select([proc.stdout], [], [], _HANDSHAKE_TIMEOUT_S)
    line = proc.stdout.readline().decode() if ready else ""
    proc.stdout.close()
    proc.wait()
    if line.startswith("error "):
        raise LauncherError(f"{what} did not start: {line[6:].strip()}")
    if not line.startswith("ready "):
        raise LauncherError(f"{what} did not start (see {log_path})")
    return int(line.split()[1])


def host_command(
    sys_executable: str, log_path: Path, *args: str, module: str = "sgpu_magic.launch.host.boot"
) -> list[str]:
    """The command line of a launch host logging to ``log_path`` (``module``: the program whose ``main`` it runs;
    the run keeper's is :mod:`sgpu_magic.launch.keeper_main`)."""
    return [sys_executable, "-c", _HOST_MAIN.format(module=module), str(log_path), *args]


def _close_quietly(pipe) -> None:
    try:
        pipe.close()
    except OSError:  # a broken pipe may fail to flush; it is closed all the same
        pass


def host_env() -> dict[str, str]:
    """The environment a launch host (or run keeper) starts with: the kernel's, with this copy of sgpu_magic first
    on ``PYTHONPATH`` and torch elastic handling SIGTERM."""
    env = dict(os.environ)
    pkg_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM"
    return env


def rank_base_env() -> dict[str, str]:
    """The kernel's environment as ranks should see it (inline matplotlib backend dropped)."""
    env = host_env()
    env.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
    if env.get("MPLBACKEND", "").startswith("module://matplotlib_inline"):
        env.pop("MPLBACKEND")
    return env


_host: LaunchHost | None = None
_host_lock = threading.Lock()


def get_host() -> LaunchHost:
    """This kernel's launch host, started (again) if it is not running."""
    global _host
    with _host_lock:
        if _host is None or not _host.alive():
            _host = LaunchHost()
        return _host


def running_host() -> LaunchHost | None:
    """This kernel's launch host if one was started (alive or not), without starting one."""
    return _host


def shutdown_host() -> None:
    """Stop this kernel's launch host and every job it runs (the kernel's end does this too)."""
    global _host
    with _host_lock:
        if _host is not None:
            _host.close()
            _host = None
