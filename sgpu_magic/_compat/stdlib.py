"""CPython's private internals: how a process that ends with ``os._exit`` still ends as a Python program does.

Checked against CPython 3.10.13, 3.11.7, 3.12.1 and 3.13.0. A missing private makes its step a no-op (the
function returns ``False``), as the exit path ran before these steps existed.
"""

from __future__ import annotations

import atexit
import threading


def shut_down_threading() -> bool:
    """Run ``threading._shutdown()`` (private; what ``Py_FinalizeEx`` calls first): ``threading``'s own exit
    callbacks (``concurrent.futures`` pools), then wait for the non-daemon threads. Call it from the main thread
    only; elsewhere (or missing) it does nothing and returns ``False``. Raises what ``_shutdown`` raises."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None or threading.current_thread() is not threading.main_thread():
        return False
    shutdown()
    return True


def run_atexit_handlers() -> bool:
    """Run (and clear) the ``atexit`` handlers now, through ``atexit._run_exitfuncs`` (private; what interpreter
    exit calls), which reports a handler's exception on stderr itself ("Exception ignored in atexit callback")
    and runs the rest. Missing: nothing runs, returns ``False``."""
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if run_exitfuncs is None:
        return False
    run_exitfuncs()
    return True
