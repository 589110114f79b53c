"""CPython's import machinery: one thread imports a package while others wait for it (:func:`import_mlflow`).

Two internals of ``importlib._bootstrap`` are read (checked against CPython 3.10 to 3.13): a module's
``__spec__._initializing`` (set while its module code runs) and the ``<frozen importlib._bootstrap>`` file name of
the import machinery's frames. Without the first, a module counts as imported once it is in ``sys.modules`` (as
before 3.8); without the second (another file name), every import of a waiting thread waits (never longer than
:data:`GATE_WAIT_S`).
"""

from __future__ import annotations

import builtins
import importlib
import sys
import threading
from typing import Any

GATE_WAIT_S = 60.0
"""How long another thread's ``import mlflow.<sub>`` waits for :func:`import_mlflow` to finish before it goes on
anyway (an import that never ends must not hang the code)."""


class _ImportGate:
    """``builtins.__import__`` while one thread imports ``package``: another thread's ``import package.<sub>`` (and
    ``import package``) first waits until that import has finished, so it never takes a submodule's import lock
    while the package is half initialised. Imports of other names pass at once, and so does an import made while
    the thread is inside another import (it may hold a lock the package's import waits for: that thread started
    importing the package first and imports it whole, top level first)."""

    def __init__(self, package: str) -> None:
        self.package, self.owner = package, threading.get_ident()
        self.done = threading.Event()
        self.original = builtins.__import__

    def __call__(self, name, globals=None, locals=None, fromlist=(), level=0):
        if (
            level == 0
            and not self.done.is_set()
            and (name == self.package or name.startswith(self.package + "."))
            and threading.get_ident() != self.owner
            and not _inside_import(sys._getframe(1))
        ):
            self.done.wait(GATE_WAIT_S)
        return self.original(name, globals, locals, fromlist, level)


_MLFLOW_IMPORT = threading.Lock()


def import_mlflow(*submodules: str) -> list[Any]:
    """Import ``mlflow`` (its top level first), then each of ``submodules`` (``"mlflow.entities"``); returns them.

    mlflow is imported off the main thread: by the kernel's tracking worker (warming up after ``%load_ext``) and by a
    rank's metrics writer (forwarding points). Another thread's ``from mlflow.entities import Metric`` run meanwhile
    (the notebook's next cell; the rank's code, or the data loader's epoch report) would take the submodule's import
    lock while mlflow is half initialised, and CPython breaks the cycle of module locks by handing one of the two a
    partially initialised module (``ImportError: cannot import name 'Run' from partially initialized module
    'mlflow.entities'``). So here one thread at a time imports mlflow, the top level first, and while it does,
    ``import mlflow...`` statements of other threads wait for it (:class:`_ImportGate`, at most
    :data:`GATE_WAIT_S`); ``importlib.import_module`` called by other code is not held.
    """
    names = ("mlflow", *submodules)
    if all(_ready(name) for name in names):
        return [sys.modules[name] for name in names]
    with _MLFLOW_IMPORT:
        gate = _ImportGate("mlflow")
        builtins.__import__ = gate
        try:
            return [importlib.import_module(name) for name in names]
        finally:
            if builtins.__import__ is gate:
                builtins.__import__ = gate.original
            gate.done.set()


def _inside_import(frame) -> bool:
    """Whether ``frame`` runs inside an import (a frame of importlib's bootstrap below it: a module being executed)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _ready(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)
