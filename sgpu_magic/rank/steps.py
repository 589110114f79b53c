"""Step timing in a rank: each training step's wall time and the time it spent inside ``torch.distributed``'s
collectives, recorded as two metrics of the rank (``step_time_s`` and ``step_collective_s``), from which the
kernel finds a straggler (:mod:`sgpu_magic.job.steps`).

A step is marked in one of two ways:

- :func:`sgpu_magic.runtime.step`: ``with runtime.step(): ...`` around a step, or a bare ``runtime.step()``
  between steps. Either way a step runs from one mark to the next (a block's entry is its mark), so what the loop
  does between two blocks (fetching the next batch: a slow data shard) is in the step; the last block's step ends
  where the block ends, and the step still open after the last bare call is not recorded. Once the code has called
  it, only it marks steps.
- without it, ``optimizer.step()``: a global post-hook on ``torch.optim.Optimizer.step``
  (``torch.optim.optimizer.register_optimizer_step_post_hook``, torch's public API) ends a step each time the
  *first* optimizer that steps in the job (or session cell) steps again, so a loop of N optimizer steps records
  N - 1 steps (each from one ``optimizer.step()`` to the next: a whole iteration) and a second optimizer (a GAN's)
  does not double-count.

Time in collectives: ``torch.distributed``'s collective and point-to-point functions (:data:`COLLECTIVES`) are
wrapped in the rank, once it imports ``torch.distributed``, to add how long each call took to the open step
(a nested call, such as ``all_gather_object``'s own ``all_gather``, is counted once). A call with
``async_op=True`` returns at once and adds only its issue time (the wait on its ``Work`` counts as busy time). DDP's
gradient all-reduce runs in its C++ reducer during ``backward()``: there the time from the end of the pass's
gradient computation to ``backward()``'s return is what counts (``torch.autograd.backward`` is wrapped to measure
it; FSDP's reduce-scatter wait is counted the same way). On CUDA, collectives run on the device asynchronously, so
these are host times (see ``docs/guide/performance.md``).

MLflow, in a tracked job, gets ``step_time_s/rank_<r>`` from the kernel when the job (or session cell) has ended, read
from the metrics files (:func:`sgpu_magic.tracking.run.step_time_points`): a rank never imports mlflow for its step
times (a rank that did paid 1-4 s at its end for the import and the store, on every training job).

Cost: a step mark is a ``perf_counter`` and two points buffered by the metrics writer (about 2-4 µs,
``benchmarks.metrics_cost``); a wrapped collective adds two ``perf_counter`` calls. Imports nothing beyond the
standard library here: torch is patched only once the rank's code imports it.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

from sgpu_magic._compat import torch as torch_compat
from sgpu_magic._util.imports import after_import
from sgpu_magic._util.metrics import STEP_COLLECTIVE, STEP_TIME, WRITER
from sgpu_magic.rank.profile import COLLECTIVE_SPAN, RankProfiler
from sgpu_magic.rundir import RunDir

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
)
"""The ``torch.distributed`` functions whose time counts as time in collectives."""

_C10D = "torch.distributed.distributed_c10d"
_OPTIMIZER = "torch.optim.optimizer"
_AUTOGRAD = "torch.autograd"


class StepClock:
    """The open step of this process: when it began, the time in collectives since, and how steps are marked."""

    __slots__ = (
        "profiler",
        "started",
        "exited",
        "collective_s",
        "depth",
        "index",
        "explicit",
        "optimizer",
    )

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every step: a new job or session cell begins (its steps count from 0)."""
        self.profiler: RankProfiler | None = None
        self.started: float | None = None
        self.exited: float | None = None
        self.collective_s = 0.0
        self.depth = 0
        self.index = 0
        self.explicit = False
        self.optimizer: int | None = None

    def mark(self) -> None:
        """End the open step (if any) and begin the next."""
        if self.started is not None:
            self._record(time.perf_counter() - self.started)
        if self.profiler is not None:
            self.profiler.step()  # (its start or export at a window's edge is in neither step's time)
        self.started, self.exited, self.collective_s = time.perf_counter(), None, 0.0

    def exit(self) -> None:
        """A ``with runtime.step()`` block was left: its step stays open until the next mark (so the batch fetched
        between two blocks counts), and ends here if none comes (:func:`finish`)."""
        if self.started is not None:
            self.exited = time.perf_counter()

    def _record(self, wall_s: float) -> None:
        time_ms = int(time.time() * 1000)
        step = self.index
        self.index += 1
        WRITER.record(STEP_TIME, wall_s, step, time_ms, None, forward=False)
        WRITER.record(STEP_COLLECTIVE, min(self.collective_s, wall_s), step, time_ms, None, forward=False)

    def close(self) -> None:
        """The code has ended: the last ``with`` block's step is recorded up to where the block was left; a step
        still open after a bare mark is dropped."""
        if self.started is not None and self.exited is not None:
            self._record(self.exited - self.started)
        self.started = self.exited = None


CLOCK = StepClock()
"""This process's clock (one per rank: a job's code, or a session's cells one after another)."""


class Step:
    """What :func:`sgpu_magic.runtime.step` returns: made, it has begun a step; as a context manager, leaving it
    ends that step."""

    __slots__ = ()

    def __enter__(self) -> Step:
        return self

    def __exit__(self, *exc_info: object) -> None:
        CLOCK.exit()

    def __repr__(self) -> str:
        return "<sgpu_magic step mark: recorded in a rank of an sgpu_magic job, dropped elsewhere>"


_STEP = Step()


def step() -> Step:
    """Mark a step boundary (see :func:`sgpu_magic.runtime.step`)."""
    CLOCK.explicit = True
    CLOCK.mark()
    return _STEP


def _optimizer_stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The global optimizer post-hook: a step boundary when the job's first optimizer steps (and no
    ``runtime.step()`` marks steps)."""
    if CLOCK.explicit:
        return
    if CLOCK.optimizer is None:
        CLOCK.optimizer = id(optimizer)
    if CLOCK.optimizer == id(optimizer):
        CLOCK.mark()


def _timed(fn: Any) -> Any:
    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> Any:
        clock = CLOCK
        if clock.depth:
            return fn(*args, **kwargs)
        clock.depth = 1
        span = _span() if clock.profiler is not None else None
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.collective_s += time.perf_counter() - began
            clock.depth = 0
            if span is not None:
                span.__exit__(None, None, None)

    collective.__sgpu_timed__ = True  # type: ignore[attr-defined] # a marker on the function object
    return collective


def _time_collectives(c10d: Any) -> None:
    """Wrap the :data:`COLLECTIVES` of ``c10d`` (``torch.distributed.distributed_c10d``), and the same names of
    ``torch.distributed`` when that module already holds them; idempotent."""
    package = sys.modules.get("torch.distributed")
    for name in COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "__sgpu_timed__", False):
            continue
        wrapped = _timed(original)
        setattr(c10d, name, wrapped)
        if package is not None and getattr(package, name, None) is original:
            setattr(package, name, wrapped)


def _time_backward(autograd: Any) -> None:
    """Wrap ``autograd.backward`` (``torch.autograd``, which ``Tensor.backward`` calls) so that, in an open step of a
    rank with a process group, the time from the end of the pass's gradient computation to its return counts as
    time in collectives: DDP waits there for its gradient all-reduce (and FSDP for its reduce-scatter), in
    callbacks queued after the one this queues (:func:`sgpu_magic._compat.torch.autograd_callback_queue`)."""
    original = getattr(autograd, "backward", None)
    if original is None or getattr(original, "__sgpu_timed__", False):
        return

    @functools.wraps(original)
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        root = _root(tensors)
        c10d = sys.modules.get(_C10D)
        queue = torch_compat.autograd_callback_queue()
        if CLOCK.started is None or root is None or queue is None or c10d is None or not c10d.is_initialized():
            return original(tensors, *args, **kwargs)
        computed: list[float] = []
        spans: list[Any] = []

        def computed_now() -> None:
            computed.append(time.perf_counter())
            if CLOCK.profiler is not None:  # the wait that follows is a collective span of the profile
                spans.append(_span())

        def prehook(grad_outputs: Any) -> None:
            queue(computed_now)

        handle = root.register_prehook(prehook)
        try:
            return original(tensors, *args, **kwargs)
        finally:
            handle.remove()
            if computed and not CLOCK.depth:
                CLOCK.collective_s += time.perf_counter() - computed[0]
            for span in spans:
                span.__exit__(None, None, None)

    backward.__sgpu_timed__ = True  # type: ignore[attr-defined] # a marker on the function object
    autograd.backward = backward


def _root(tensors: Any) -> Any:
    """The first gradient function of ``backward``'s tensors (a tensor, or a sequence of them), or ``None``."""
    for tensor in (tensors,) if hasattr(tensors, "grad_fn") else tensors if isinstance(tensors, (list, tuple)) else ():
        grad_fn = getattr(tensor, "grad_fn", None)
        if grad_fn is not None:
            return grad_fn
    return None


_optimizer_hook: list[Any] = []
"""The handle of the global optimizer hook, once registered (once per process)."""


def _hook_optimizers(module: Any) -> None:
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is not None and not _optimizer_hook:
        _optimizer_hook.append(register(_optimizer_stepped))


def _span() -> Any:
    """An entered ``torch.profiler.record_function`` span named :data:`~sgpu_magic.rank.profile.COLLECTIVE_SPAN`."""
    from torch.profiler import record_function

    span = record_function(COLLECTIVE_SPAN)
    span.__enter__()
    return span


def begin(profile_steps: int | None = None, run_dir: RunDir | None = None) -> None:
    """A job's code or a session cell begins: steps count from 0, and the hooks are in place (now if torch is
    loaded, a warm rank; else once the code imports it). ``profile_steps``: profile that many steps, writing into
    ``run_dir`` (:mod:`sgpu_magic.rank.profile`)."""
    CLOCK.reset()
    if profile_steps is not None and run_dir is not None:
        CLOCK.profiler = RankProfiler(profile_steps, run_dir, int(os.environ.get("RANK", "0")))
    after_import(_C10D, _time_collectives)
    after_import(_OPTIMIZER, _hook_optimizers)
    after_import(_AUTOGRAD, _time_backward)


def finish() -> None:
    """The code has ended: the step of the last ``with runtime.step()`` block is recorded up to the block's end, a step
    still open after a bare ``runtime.step()`` is dropped."""
    CLOCK.close()
    profiler, CLOCK.profiler = CLOCK.profiler, None
    if profiler is not None:
        try:
            profiler.stop()
        except Exception as exc:  # noqa: BLE001 - the code's outcome stands; the kernel says the profile is missing
            print(f"sgpu_magic: the profile could not be saved ({type(exc).__name__}: {exc})", file=sys.stderr)
