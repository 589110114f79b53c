"""Import hooks shared by the rank's guards: run code right after a module is imported by its real loader."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from typing import Any


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; runs each of its callbacks (``callback(module)``) once ``name`` has been imported by its
    real loader. One finder per module name (:func:`after_import` adds to it)."""

    def __init__(self, name: str, callback: Callable[[Any], None]) -> None:
        self.name, self.callbacks = name, [callback]

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            # the real finders only: another AfterImport would ask this one again (a recursion without end)
            if isinstance(finder, AfterImport) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader, callbacks = spec.loader, self.callbacks
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_call(module):
            exec_module(module)
            for callback in list(callbacks):
                callback(module)

        loader.exec_module = exec_then_call  # type: ignore[method-assign] # the hook: wrap this loader's exec_module
        return spec


def after_import(name: str, callback: Callable[[Any], None]) -> None:
    """``callback(module)`` now if module ``name`` is imported, else once it is (by its real loader); a callback
    already waiting for ``name`` is not added twice."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    for finder in sys.meta_path:
        if isinstance(finder, AfterImport) and finder.name == name:
            if callback not in finder.callbacks:
                finder.callbacks.append(callback)
            return
    sys.meta_path.insert(0, AfterImport(name, callback))
