"""Import hooks shared by the rank's guards: run code right after a module is imported by its real loader."""

from __future__ import annotations

import importlib.abc
import sys


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; runs ``callback(module)`` once ``name`` has been imported by its real loader."""

    def __init__(self, name: str, callback) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader, callback = spec.loader, self.callback
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_call(module):
            exec_module(module)
            callback(module)

        loader.exec_module = exec_then_call  # type: ignore[method-assign] # the hook: wrap this loader's exec_module
        return spec
