"""multiprocessing.forkserver's private internals (the forkserver the launch host's warm ranks fork from).

Checked against CPython 3.10.13, 3.11.7, 3.12.1 and 3.13.0 (torch.multiprocessing uses this same forkserver).
"""

from __future__ import annotations

import multiprocessing.forkserver as _forkserver_module
import os
from collections.abc import Callable
from typing import Any

from sgpu_magic._compat import missing


def stop_forkserver() -> None:
    """Stop this process's forkserver and forget it (``_forkserver._stop()``, private), so that the next
    ``ensure_running()`` starts a fresh one (with packages installed since). Nothing happens when none runs.

    Raises:
        CompatError: this Python's forkserver has no ``_stop``: a warm launch after a ``%pip install`` would fork
            ranks that miss the new packages, so the launch fails instead.
    """
    stop = getattr(_forkserver_module._forkserver, "_stop", None)
    if stop is None:
        raise missing(
            "python",
            "multiprocessing.forkserver._forkserver._stop",
            "3.10.13-3.13.0",
            "the warm forkserver cannot be restarted after the packages changed",
        )
    stop()


def forkserver_pid() -> int | None:
    """The pid of this process's forkserver (``_forkserver._forkserver_pid``, private), or ``None`` when none was
    started. Missing: ``None`` (the forkserver then ends by itself once this process has exited)."""
    pid = getattr(_forkserver_module._forkserver, "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


_MAIN_PARAMS = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")
"""``multiprocessing.forkserver.main``'s parameters in CPython 3.10-3.13 (3.14 adds an authentication key)."""


def _forkable() -> bool:
    import inspect

    server = _forkserver_module._forkserver
    try:
        params = tuple(inspect.signature(_forkserver_module.main).parameters)
    except (TypeError, ValueError):
        return False
    return params == _MAIN_PARAMS and all(
        hasattr(server, name) for name in ("_lock", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
    )


def fork_forkserver(child_setup: Callable[[], object]) -> int | None:
    """Start this process's forkserver as a fork of this process, with every module it has imported, instead of
    a fresh interpreter that imports them again (``ForkServer.ensure_running()``, which it mirrors: a 0600 Unix
    socket, the "alive" pipe, then ``_forkserver_address`` / ``_forkserver_alive_fd`` / ``_forkserver_pid``, all
    private). Later ``ensure_running()`` calls see it running, and start a fresh one when it has died.

    Call it while this process runs no other thread: the forkserver (and every process it forks) is this
    process's copy at the moment of the call. The forked child closes every file descriptor but 0-2 and its
    socket and pipe (as ``ensure_running()``'s exec does), runs ``child_setup()`` (its value is ignored), then
    ``multiprocessing.forkserver.main``; it exits when this process has ended.

    Returns:
        The forkserver's pid; ``None`` when one was already running or this Python's forkserver is not the
        shape checked (CPython 3.10-3.13): the caller then uses ``ensure_running()``.
    Raises:
        OSError: the socket, the pipe or the fork failed (the socket and pipe are closed).
    """
    import multiprocessing.connection
    import multiprocessing.resource_tracker as resource_tracker
    import multiprocessing.util as util
    import socket
    import traceback

    server: Any = _forkserver_module._forkserver
    connection: Any = multiprocessing.connection  # arbitrary_address: undocumented, what ensure_running() uses
    if not _forkable():
        return None
    with server._lock:
        if server._forkserver_pid is not None:
            return None
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            try:
                pid = os.fork()
            except BaseException:
                os.close(alive_r)
                os.close(alive_w)
                raise
            if pid == 0:  # the forkserver
                code = 1
                try:
                    keep = sorted({0, 1, 2, listener.fileno(), alive_r})
                    for low, high in zip(keep, [*keep[1:], None]):
                        os.closerange(low + 1, high if high is not None else os.sysconf("SC_OPEN_MAX"))
                    child_setup()
                    _forkserver_module.main(listener.fileno(), alive_r, [], None, None)
                    code = 0
                except SystemExit:  # main's way out once the alive pipe is closed
                    code = 0
                except BaseException:  # noqa: BLE001 - said in the host's log, then gone
                    traceback.print_exc()
                finally:
                    os._exit(code)
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
        return pid
