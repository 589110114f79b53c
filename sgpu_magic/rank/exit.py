"""How a rank ends: its outcome first, then the exit of a Python process.

A rank writes its return value (or its error) before anything the user's code made is
destroyed; what follows is teardown, which the launch host bounds by the job's teardown grace
(``DistributedMagics.teardown_grace_s``): a rank that has not exited that long after its outcome
was written is ended, and the job keeps its outcome (see :mod:`sgpu_magic.launch.host.process`).

- :func:`keep_process_groups`: the process groups a rank creates stay referenced until the
  process ends, as they do under torchrun (there, module-level defaults such as
  ``torch.distributed.nn.functional``'s ``group=group.WORLD``, evaluated when DDP's first use
  imports ``torch._dynamo`` after ``init_process_group``, keep the default group alive). A warm
  rank has those modules preloaded from before any group existed, so freeing a DDP model after
  ``destroy_process_group()`` ran ``~ProcessGroupGloo`` on the main thread, GIL held, joining a gloo
  worker that waited for the GIL to drop its last work (pytorch#56297's family): the rank wedged.
- :func:`call_holding_frame`: calls the user's function so that its frame, hence its locals,
  outlives the return until the caller has written the value.
- :func:`exit_like_python`: non-daemon threads, ``atexit`` handlers and stream flushes, in
  CPython's order (``Py_FinalizeEx``); the process then ends with ``os._exit``.

Imports nothing but the standard library (and its hook, :mod:`sgpu_magic._util.imports`, and the seam to
CPython's and torch's privates, :mod:`sgpu_magic._compat`); torch is patched only once the rank imports it.
"""

from __future__ import annotations

import os
import re
import sys
import traceback

from sgpu_magic._compat import stdlib
from sgpu_magic._compat import torch as torch_compat
from sgpu_magic._util.imports import after_import

_C10D = "torch.distributed.distributed_c10d"
_kept_groups: list = []
"""Process groups kept alive until the process ends (os._exit runs no destructor)."""


def _keep_groups_of(c10d) -> None:
    """Keep the groups of ``c10d`` (``torch.distributed.distributed_c10d``) in :data:`_kept_groups`."""
    torch_compat.keep_groups_of(c10d, _kept_groups)


def keep_process_groups() -> None:
    """Keep every process group this rank creates alive until the process ends: now if torch.distributed is
    loaded (a warm rank), else once the rank's code imports it (torch is not imported here)."""
    after_import(_C10D, _keep_groups_of)


def call_holding_frame(fn, args: list, kwargs: dict, held: list):
    """``fn(*args, **kwargs)``, keeping in ``held`` the frame of the first Python function the call enters.

    A frame object still referenced when its function returns keeps the function's locals (CPython
    moves them into the frame object), so nothing the function created is destroyed before the
    caller has its value; clearing ``held`` frees them. A profile hook sees only the call's first
    event and removes itself, so the code runs unprofiled.
    """
    caller = sys._getframe()
    previous = sys.getprofile()

    def on_call(frame, event, arg):
        if event == "call" and frame.f_back is caller:
            held.append(frame)
            sys.setprofile(previous)

    sys.setprofile(on_call)
    try:
        return fn(*args, **kwargs)
    finally:
        if sys.getprofile() is on_call:  # fn was a C callable that called no Python function
            sys.setprofile(previous)


def exit_like_python() -> None:
    """End as a Python program ends (CPython's ``Py_FinalizeEx``): wait for non-daemon threads (``threading``'s
    own exit callbacks first, e.g. ``concurrent.futures`` pools), run the ``atexit`` handlers (an MLflow run the
    rank's ``mlflow.log_metric`` started ends FINISHED; ``logging`` flushes its handlers), flush stdout and
    stderr. A handler that raises is reported on stderr, as Python does, and the rest still run."""
    try:
        stdlib.shut_down_threading()
    except Exception:  # noqa: BLE001 - as at interpreter exit: reported, not fatal
        traceback.print_exc()
    try:
        torch_compat.skip_library_finalizers()
    except Exception:  # noqa: BLE001 - a speed-up only: the finalizers then run, as in a plain process
        traceback.print_exc()
    stdlib.run_atexit_handlers()  # prints a handler's exception itself ("Exception ignored in atexit callback")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


_SKIPPED_MODULES = ("_sitebuiltins",)  # exit() and quit() raise SystemExit from there


def raise_site(exc: BaseException, labels: dict[str, str]) -> str:
    """``file:line`` of the innermost frame of ``exc``'s traceback outside sgpu_magic (and ``exit()``'s own
    frame), with notebook cells named as IPython names them (``Cell In[3]:5``); ``"?"`` if none."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # sgpu_magic/
    where = "?"
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        filename = frame.f_code.co_filename
        path = os.path.abspath(filename)
        if path.startswith(package) or frame.f_globals.get("__name__") in _SKIPPED_MODULES:
            continue
        where = f"{labels.get(filename, filename)}:{lineno}"
    return where


_CUDA_WORD = re.compile(r"\b(cuda|nccl)\b", re.IGNORECASE)


def involves_cuda(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it chains) came from CUDA: raised through ``torch.cuda``'s code (e.g.
    ``torch.cuda.set_device``, the lazy CUDA initialisation behind ``.to("cuda")``), or naming CUDA or NCCL."""
    torch = sys.modules.get("torch")
    torch_file = torch.__file__ if torch is not None else None
    cuda_dir = os.path.join(os.path.dirname(torch_file), "cuda") + os.sep if torch_file is not None else None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        exc = current
        seen.add(id(exc))
        if _CUDA_WORD.search(str(exc)):
            return True
        if cuda_dir and any(
            os.path.abspath(frame.f_code.co_filename).startswith(cuda_dir)
            for frame, _ in traceback.walk_tb(exc.__traceback__)
        ):
            return True
        current = exc.__cause__ or exc.__context__
    return False
