"""ipykernel's private internals: where a comm's incoming messages are routed.

Checked against ipykernel 7.4.0. The object is given by the caller (a widget's comm); ipykernel is not imported.
"""

from __future__ import annotations

from typing import Any


def forget_reply_route(comm: Any) -> bool:
    """Let the frontend's messages on ``comm`` go to the kernel subshell the frontend picked; whether a route was
    there to drop.

    JupyterLab 4.4+ sends widget messages to a kernel subshell, which ipykernel 7 runs on its own thread while a
    cell runs. But ipykernel 7.4 sends a comm's incoming messages to the subshell that last published on that
    comm (``BaseComm._reply_subshell_for``, meant for replies to a request a cell waits on): for widgets made by
    the running cell that is the main shell, so a click would wait until the cell ends. This drops the comm's
    private ``_reply_subshell_id`` under its private ``_reply_subshell_lock``. A comm without them (``None``,
    another kernel, an older ipykernel): nothing happens, returns ``False``.
    """
    lock = getattr(comm, "_reply_subshell_lock", None)
    if lock is None:
        return False
    with lock:
        return vars(comm).pop("_reply_subshell_id", None) is not None
