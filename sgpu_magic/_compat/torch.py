"""torch's private internals outside elastic: ``torch.distributed.distributed_c10d``, ``torch.library`` and the
autograd engine.

Checked against torch 2.13.0. Two uses make a rank's exit quicker or safer; when a private is missing, the
function does nothing and the launch host's teardown grace still bounds the exit. The third aborts NCCL
communicators for a session's recover; when it is missing the rank does not return and the kernel says so. The
fourth queues a callback at the end of a backward pass, for step timing; when it is missing, the time a backward
pass waits for DDP's gradient all-reduce counts as busy time.
"""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any


def keep_groups_of(c10d: Any, kept: list[Any]) -> None:
    """Wrap ``c10d._update_default_pg`` (private; called with the new default group by ``init_process_group``,
    with ``None`` by ``destroy_process_group()`` while every group is still in the private ``_world.pg_map``) so
    that each group is appended to ``kept`` before it would be dropped. Idempotent.

    ``c10d``: the module ``torch.distributed.distributed_c10d``. Missing ``_update_default_pg``: nothing is
    wrapped; missing ``_world.pg_map``: the groups of that call are not kept.
    """
    original = getattr(c10d, "_update_default_pg", None)
    if original is None or getattr(original, "__sgpu_keeps_groups__", False):
        return

    def update_default_pg(pg: Any) -> Any:
        try:
            kept.extend([pg] if pg is not None else list(c10d._world.pg_map))
        except Exception:  # noqa: BLE001 - a torch without these internals: the teardown grace still bounds the exit
            pass
        return original(pg)

    update_default_pg.__sgpu_keeps_groups__ = True  # type: ignore[attr-defined] # markers on the function object
    update_default_pg.__wrapped__ = original  # type: ignore[attr-defined] # (the same)
    c10d._update_default_pg = update_default_pg


def skip_library_finalizers() -> int:
    """Leave torch's operator-library finalizers out of the exit (``weakref.finalize.atexit = False``); returns
    how many were left out.

    Each of them (~170 once torch._dynamo is loaded) undoes a registration inside this process with a call into
    torch, 30-100 ms per rank together, and a rank ends with ``os._exit`` right after. Other finalizers
    (``tempfile.TemporaryDirectory``'s, the user's) still run. Uses ``torch.library._del_library`` (private, the
    finalizers' function; torch.library is looked up in ``sys.modules``) and ``weakref.finalize._registry``
    (CPython's private registry, checked against 3.10.13, 3.11.7, 3.12.1 and 3.13.0). Missing either, or
    torch.library not loaded: nothing is left out (returns 0).
    """
    del_library = getattr(sys.modules.get("torch.library"), "_del_library", None)
    registry = getattr(weakref.finalize, "_registry", None)
    if del_library is None or not isinstance(registry, dict):
        return 0
    collecting = gc.isenabled()
    gc.disable()  # a collection while the registry is copied runs finalizers, which delete their own entries
    try:
        entries = list(registry.items())
    finally:
        if collecting:
            gc.enable()
    skipped = 0
    for finalizer, info in entries:
        if getattr(info, "func", None) is del_library:
            finalizer.atexit = False
            skipped += 1
    return skipped


def abort_process_groups(c10d: Any) -> bool:
    """Abort every process group of this process through ``c10d._abort_process_group()`` (private; for NCCL it
    aborts the communicators, so a collective waiting in one returns with an error); whether it was called.

    ``c10d``: the module ``torch.distributed.distributed_c10d``. Missing ``_abort_process_group``: nothing is
    aborted and ``False`` (the kernel then says the rank did not return and a restart is needed).
    """
    abort = getattr(c10d, "_abort_process_group", None)
    if abort is None:
        return False
    abort()
    return True


def autograd_callback_queue() -> Any:
    """The autograd engine's ``queue_callback`` (``torch.autograd.Variable._execution_engine.queue_callback``,
    private; FSDP uses it likewise): called from a hook during a backward pass, it runs its argument once every
    gradient of that pass is computed, before the callbacks queued after it (DDP's, which waits for its gradient
    all-reduce). ``None`` when torch has no such function."""
    variable = getattr(sys.modules.get("torch.autograd"), "Variable", None)
    engine = getattr(variable, "_execution_engine", None)
    return getattr(engine, "queue_callback", None)
