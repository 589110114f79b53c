"""torch.distributed.elastic's private internals (``torch.distributed.elastic.multiprocessing.api``).

Checked against torch 2.13.0. What each function uses and what it does when that is missing is in its docstring;
every fallback keeps jobs correct (slower exits, or a poll on the host's next tick instead of at once).
"""

from __future__ import annotations

import sys
from typing import Any

_API = "torch.distributed.elastic.multiprocessing.api"


class _AlreadySet:
    """Stands in for elastic's "parent has read every return value" event: see :func:`wrap_no_wait`."""

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def is_set(self) -> bool:
        return True


def wrap_no_wait(local_rank: int, *args: object) -> None:
    """elastic's per-process wrapper (the private ``api._wrap``), except that a rank exits as soon as it has handed
    back its return value instead of waiting until every rank has (``_wrap``'s last-but-one argument, a
    ``multiprocessing.synchronize.Event``, is replaced by one that is already set).

    Return values go through a ``SimpleQueue``, whose ``put`` writes to the pipe before it returns, so nothing is
    lost; exits are then spread over the job instead of all at its end, where eight address spaces torn down at
    once cost ~50 ms on 2 cores. Runs in the rank, which elastic starts with this function (pickled by name) when
    :func:`context_class` swapped it in, so ``_wrap`` was there moments ago in the host: a torch without it
    raises :class:`~sgpu_magic._compat.CompatError`.
    """
    from multiprocessing.synchronize import Event

    import torch.distributed.elastic.multiprocessing.api as api

    wrap = getattr(api, "_wrap", None)
    if wrap is None:
        from sgpu_magic._compat import missing

        raise missing("torch", f"{_API}._wrap", "2.13.0", "a warm rank cannot start")
    wrap(local_rank, *(_AlreadySet() if isinstance(arg, Event) else arg for arg in args))


def context_class(base: type[Any], close_timeout_s: float) -> type[Any]:
    """A subclass of elastic's ``PContext`` class ``base`` (``MultiprocessContext`` or ``SubprocessContext``).

    - A ``MultiprocessContext`` starts its processes through :func:`wrap_no_wait`: its private ``_start`` reads
      the module's private ``_wrap`` when it hands the wrapper to ``torch.multiprocessing.start_processes``, so
      ``_wrap`` is swapped for the call; its private ``_worker_finished_event`` marks the context that takes the
      event. Missing: the processes start through elastic's own wrapper (each rank waits for all at its end).
    - ``close()`` first remembers in ``first_failures`` (``{local rank: ProcessFailure}``) the ranks that had
      failed before it stopped the rest (``SubprocessContext``'s private ``_failures``; the stopped ranks are
      added to it by the close). Missing: ``first_failures`` is ``{}`` and the caller uses the result's failures.

    - A ``SubprocessContext`` starts each process with exactly the environment it is given
      (:func:`_with_exact_env`), not that merged over the starting process's ``os.environ``.

    ``close_timeout_s``: seconds ``close()`` waits by default after SIGTERM before SIGKILL.
    """

    class Context(base):  # a subclass of the elastic context given
        """An elastic PContext that remembers which ranks failed before it stopped the rest, and whose
        warm ranks exit as soon as they are done (:func:`wrap_no_wait`)."""

        first_failures: dict[int, Any] = {}  # replaced by close(), never mutated

        def _start(self) -> None:
            api: Any = sys.modules[_API]
            if not hasattr(self, "_worker_finished_event"):  # a SubprocessContext
                return _with_exact_env(api, super()._start)
            original = getattr(api, "_wrap", None)
            if original is None:
                return super()._start()
            api._wrap = wrap_no_wait  # read by MultiprocessContext._start, pickled by name
            try:
                super()._start()
            finally:
                api._wrap = original

        def close(self, death_sig: Any = None, timeout: float = close_timeout_s) -> None:
            if not self.first_failures:
                self.first_failures = dict(getattr(self, "_failures", {}))
            super().close(death_sig, timeout)

    return Context


def _with_exact_env(api: Any, start: Any) -> None:
    """Call ``start`` (a ``SubprocessContext``'s ``_start``) with the private ``api.get_subprocess_handler`` that it
    reads swapped for one whose processes get exactly the ``env`` they are given. elastic's ``SubprocessHandler``
    starts a process with its ``os.environ`` updated by that ``env``; in the launch host, which serves several jobs
    of one kernel, each job's environment is its own (a variable that only another job has must not reach this
    one's ranks). Its ``_popen(args, env)`` receives the merged environment: the subclass hands ``Popen`` the given
    one instead. Missing (no ``get_subprocess_handler`` there, or no ``_popen``): elastic's own handler, so a
    process also sees the launch host's environment (the kernel's as the host started) where its own does not
    set a variable."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as sh

    original = getattr(api, "get_subprocess_handler", None)
    base = getattr(sh, "SubprocessHandler", None)
    if original is None or base is None or not hasattr(base, "_popen"):
        return start()

    class ExactEnvHandler(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._exact_env = dict(kwargs["env"] if "env" in kwargs else args[2])
            super().__init__(*args, **kwargs)

        def _popen(self, args: tuple, env: dict[str, str]) -> Any:
            return super()._popen(args, self._exact_env)

    api.get_subprocess_handler = lambda *args, **kwargs: ExactEnvHandler(*args, **kwargs)
    try:
        return start()
    finally:
        api.get_subprocess_handler = original


def exitcodes(ctx: Any) -> dict[int, int | None]:
    """``{local rank: exit code or None while it runs}`` of an elastic context's processes.

    ``SubprocessContext``: its public ``subprocess_handlers``; ``MultiprocessContext``: the private ``_pc``
    (torch.multiprocessing's ``ProcessContext``) and its ``processes``. Missing, or not started: ``{}``.
    """
    if hasattr(ctx, "subprocess_handlers"):
        return {r: h.proc.returncode for r, h in ctx.subprocess_handlers.items()}
    pc = getattr(ctx, "_pc", None)
    return {r: p.exitcode for r, p in enumerate(pc.processes)} if pc is not None else {}


def wake_fds(ctx: Any) -> list[int]:
    """File descriptors that become readable when a ``MultiprocessContext``'s rank returns or exits: its process
    sentinels (the private ``_pc``'s ``sentinels``) and the read ends of its return-value queues (the private
    ``_ret_vals``, ``multiprocessing.SimpleQueue``'s private ``_reader``; the reader of a queue already closed is
    left out). Missing (or a ``SubprocessContext``): ``[]``, and the host polls on its next tick instead."""
    pc = getattr(ctx, "_pc", None)
    if pc is None:
        return []
    fds = list(getattr(pc, "sentinels", {}))
    for queue in getattr(ctx, "_ret_vals", {}).values():
        reader = getattr(queue, "_reader", None)
        if reader is not None and not reader.closed:
            fds.append(reader.fileno())
    return fds
