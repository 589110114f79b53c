"""The kernel's own log file, for third-party INFO lines that do not belong in a cell.

A Jupyter kernel shows everything written to stderr in the cell that runs, so a library's
INFO records (MLflow creating a new store's tables: ``INFO mlflow.store.db.utils: Creating
initial MLflow database tables...``) would land in the user's output. :func:`divert_info`
sends the records below WARNING of the named loggers to ``<sgpu_magic home>/hosts/kernel-<pid>.log``
(private, 0600, made on the first record) instead; warnings and errors still reach the cell.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TextIO

from sgpu_magic.rundir import default_root, make_private_dir


def kernel_log_path() -> Path:
    """``<sgpu_magic home>/hosts/kernel-<pid>.log``: this process's log, next to its launch host's."""
    return default_root() / "hosts" / f"kernel-{os.getpid()}.log"


class _KernelLogHandler(logging.Handler):
    """Appends records to :func:`kernel_log_path`, opening it (0600, in a 0700 folder) on the first one."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self._stream: TextIO | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self._stream is None:
                path = kernel_log_path()
                make_private_dir(path.parent)
                self._stream = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a")
            self._stream.write(self.format(record) + "\n")
            self._stream.flush()
        except Exception:  # noqa: BLE001 - logging must not fail the caller
            self.handleError(record)


class _BelowWarningToKernelLog(logging.Filter):
    """A logger filter: records below WARNING go to the kernel log and no further; others pass."""

    def __init__(self, handler: logging.Handler) -> None:
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        self.handler.handle(record)
        return False


_HANDLER = _KernelLogHandler()


def divert_info(*logger_names: str) -> None:
    """Send the records below WARNING of these loggers to the kernel log instead of the cell (idempotent).

    Only records logged on these loggers themselves are diverted (a logger's filters do not see its
    children's records), so name the loggers that write, e.g. ``mlflow.store.db.utils``.
    """
    for name in logger_names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _BelowWarningToKernelLog) for f in logger.filters):
            logger.addFilter(_BelowWarningToKernelLog(_HANDLER))
