"""multiprocessing.forkserver's private internals (the forkserver the launch host's warm ranks fork from).

Checked against CPython 3.10.13, 3.11.7, 3.12.1 and 3.13.0 (torch.multiprocessing uses this same forkserver).
"""

from __future__ import annotations

import multiprocessing.forkserver as _forkserver_module

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
