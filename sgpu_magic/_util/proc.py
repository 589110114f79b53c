"""Process helpers shared by the rank, the launch host and its forkserver: Linux ``prctl`` switches (one ctypes
call site). No psutil here: ranks import this module."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PTRACER = 0x59616D61  # Yama's ("Yama" in ASCII)


def _prctl(option: int, arg: int) -> bool:
    """``prctl(option, arg)`` through libc; whether it could be called (not on a platform without it)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, arg)
    except (OSError, AttributeError):
        return False
    return True


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: int | None = None, exit_code: int = 1) -> bool:
    """Have the OS send ``sig`` to this process when its parent ends, however it ends (``PR_SET_PDEATHSIG``).

    ``expected_parent``: the pid the parent should have; when this process's parent is another one by now (the
    expected one died before the death signal was armed), exit at once with ``exit_code`` (``os._exit``)."""
    armed = _prctl(PR_SET_PDEATHSIG, sig)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(exit_code)
    return armed


def adopt_orphans() -> bool:
    """Become the subreaper of this process's descendants: orphans are re-parented here, not to init
    (``PR_SET_CHILD_SUBREAPER``), so they can be found and reaped."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def allow_tracing_by(pid: int) -> bool:
    """Let process ``pid`` and its descendants trace this one where Yama's ``ptrace_scope`` is 1, which otherwise
    allows only a tracer's own descendants (``PR_SET_PTRACER``): a rank names the launch host, so the py-spy it
    starts can read the rank's stack. Without Yama the call fails and nothing changes (``False``)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, pid, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
