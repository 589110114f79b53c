"""What a rank does with a payload, in a job and in a live session's cells: its globals loaded, the cell,
function or script run, the value pickled for the kernel and an error recorded in the run directory.

Shared by :mod:`sgpu_magic.rank.worker` (a job's rank) and :mod:`sgpu_magic.rank.session` (a session's cells),
which import it and not each other's internals.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import io
import linecache
import os
import pickle
import runpy
import sys
import time
import traceback
import types
import zipfile
from typing import cast

import cloudpickle

from sgpu_magic._util.metrics import WRITER as METRICS
from sgpu_magic.errors import Unpicklable
from sgpu_magic.rank import exit as rank_exit
from sgpu_magic.rank import steps
from sgpu_magic.rank.mlflow_guard import flush_async_logging, settled_value
from sgpu_magic.rundir import RunDir, traceback_marker
from sgpu_magic.wire import RankError
from sgpu_magic.wire.payload import Cell, FunctionCode, FunctionRef, Payload, Script, SessionRanks


def redirect_output(log_file) -> None:
    """Send fds 1 and 2 (Python's and native code's output) to ``log_file`` from now on (appending, 0600)."""
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _load_global(entry: tuple):
    kind = entry[0]
    if kind == "module":
        return importlib.import_module(entry[1])
    if kind == "value":
        return cloudpickle.loads(entry[1])
    return Unpicklable(*entry[1:])


def load_globals(payload: Payload, ns: dict, keep: bool = False) -> None:
    """Put the payload's captured globals into ``ns`` (and its cell sources into linecache); ``keep``: leave the
    names ``ns`` already has (a live session's rank: its own names win). A global that cannot be loaded becomes an
    :class:`~sgpu_magic.errors.Unpicklable` that says why on first use."""
    for filename, text in payload.sources.items():
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    for name, entry in payload.globals.items():
        if keep and name in ns:
            continue
        try:
            ns[name] = _load_global(entry)
        except Exception as exc:  # noqa: BLE001 - reported on use, like an unpicklable global
            reason = (
                f"could not be loaded in the rank ({type(exc).__name__}: {exc}); load or create it in the rank instead"
            )
            ns[name] = Unpicklable(name, str(entry[0]), reason, warned=False)


def build_namespace(payload: Payload) -> dict:
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    ns = main.__dict__
    ns["__builtins__"] = builtins
    load_globals(payload, ns)
    return ns


def _run_cell(source: str, filename: str, ns: dict, quiet: bool = False):
    """Run the cell; the value of its last expression, or ``None`` (also when ``quiet``: the cell ends with ``;``)."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    tree = ast.parse(source, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(cast(ast.Expr, tree.body.pop()).value)
    exec(compile(tree, filename, "exec"), ns)
    value = eval(compile(last, filename, "eval"), ns) if last is not None else None
    return None if quiet else value


def _resolve_function(body: FunctionRef | FunctionCode, ns: dict):
    if isinstance(body, FunctionRef):
        obj = importlib.import_module(body.module)
        for part in body.qualname.split("."):
            obj = getattr(obj, part)
        return getattr(obj, "__sgpu_function__", obj)
    shell = cloudpickle.loads(body.shell)
    closure = tuple(types.CellType(v) for v in shell["closure"]) or None
    fn = types.FunctionType(shell["code"], ns, shell["name"], shell["defaults"], closure)
    fn.__kwdefaults__ = shell["kwdefaults"]
    fn.__qualname__ = shell["qualname"]
    return fn


def _run_script(body: Script, argv: list[str], ns: dict) -> int:
    """Run the payload's script file or module as torchrun would (``python [-m] target args...``) with runpy;
    return its exit status, 0 (``sys.exit(0)`` included); ``sys.exit(n != 0)`` propagates.

    What the script leaves (its globals, or the frames of a ``SystemExit``) is kept in ``ns`` until the
    result is written, so no destructor of the script's objects runs before the rank reports.
    """
    sys.argv = list(argv)
    target = body.script or ""
    if body.module is not None:
        sys.path.insert(0, os.getcwd())  # as python -m
        run = functools.partial(runpy.run_module, body.module, run_name="__main__", alter_sys=True)
    else:
        if not (os.path.isdir(target) or zipfile.is_zipfile(target)):  # runpy inserts a folder or zip itself
            sys.path.insert(0, os.path.dirname(target))  # as python script.py
        run = functools.partial(runpy.run_path, target, run_name="__main__")
    try:
        ns["__sgpu_script_globals__"] = run()
    except SystemExit as exc:
        ns["__sgpu_script_exit__"] = exc
        if exc.code not in (None, 0):
            raise
    return 0


def run_payload(payload: Payload, ns: dict, held: list | None = None, run_dir: RunDir | None = None):
    """Run the captured cell, function or script in ``ns``; return its value (a script's: its exit status).

    ``held``: a list that keeps the function's frame, so its locals outlive its return until the
    caller clears the list (:func:`sgpu_magic.rank.exit.call_holding_frame`). ``run_dir``: the job's (or the
    cell's) run directory, where a profiled payload (``payload.profile_steps``) writes its profile
    (:mod:`sgpu_magic.rank.profile`).

    MLflow's async logging queue (on by default in tracked jobs) is flushed before this returns, so
    every point the user code logged is in the run before the rank reports; a value that is the future
    of an async ``mlflow.log_metric`` call (a cell ending with one) is ``None``, as with sync logging.
    """
    steps.begin(payload.profile_steps if run_dir is not None else None, run_dir)
    body = payload.body
    try:
        if isinstance(body, Script):
            return _run_script(body, payload.argv or [body.script or str(body.module)], ns)
        if isinstance(body, Cell):
            return settled_value(_run_cell(body.source, body.filename, ns, body.quiet))
        if isinstance(body, SessionRanks):
            raise TypeError("a session's payload serves cells (rank/session.py); it is not run as a job's")
        fn = _resolve_function(body, ns)
        args = [cloudpickle.loads(b) for b in payload.args]
        kwargs = {k: cloudpickle.loads(b) for k, b in payload.kwargs.items()}
        return settled_value(rank_exit.call_holding_frame(fn, args, kwargs, [] if held is None else held))
    finally:
        steps.finish()
        METRICS.flush()  # the points reach the file (and MLflow) before the rank reports
        flush_async_logging()


class _ResultPickler(cloudpickle.Pickler):
    """cloudpickle that moves tensors to the CPU, so the kernel never touches a GPU."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return super().reducer_override(obj)


def dump_result(value, rank: int, name: str | None = None) -> bytes:
    """``value`` pickled for the kernel (tensors on the CPU); ``name``: the session name it is pulled from
    (``None``: a return value). Raises TypeError naming what it is and what to send instead."""
    buf = io.BytesIO()
    try:
        _ResultPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception as exc:  # noqa: BLE001 - any pickling failure of a return value is the user's to fix
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        if name is not None:
            raise TypeError(
                f"{name!r} on rank {rank} is a {kind}, which cannot be pickled to be pulled into the kernel "
                f"({type(exc).__name__}: {exc}); pull plain Python, numpy or torch values (a state_dict, not a model)"
            ) from None
        raise TypeError(
            f"the return value of rank {rank} ({kind}) "
            f"cannot be sent back to the kernel ({type(exc).__name__}: {exc}); return plain Python, "
            f"numpy or torch values"
        ) from None
    return buf.getvalue()


def _user_traceback(exc: BaseException, labels: dict[str, str]) -> str:
    """The traceback without sgpu_magic's own frames; notebook cells named as IPython does (``Cell In[3]``)."""
    te = traceback.TracebackException.from_exception(exc)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # sgpu_magic/
    user = [f for f in te.stack if not os.path.abspath(f.filename).startswith(package)]
    for frame in user:
        frame.filename = labels.get(frame.filename, frame.filename)
    te.stack = traceback.StackSummary.from_list(user or list(te.stack))
    return "".join(te.format())


def _failure_locals(exc: BaseException) -> dict[str, str]:
    """The failing frame's locals as reprs (``job.failure_locals(rank)``); ``{}`` if even that fails."""
    from sgpu_magic.rank.debug import failure_locals

    try:
        return failure_locals(exc)
    except Exception:  # noqa: BLE001 - the error file matters more than the locals
        return {}


def write_error(run_dir: RunDir, rank: int, exc: BaseException, labels: dict[str, str] | None = None) -> None:
    text = _user_traceback(exc, labels or {})
    # the error file first: on a full disk it takes the run dir's reserve, and the log may not take a line
    run_dir.write_error(
        RankError(
            rank=rank,
            exc_type=type(exc).__name__,
            message=str(exc),
            traceback=text,
            time_s=time.time(),
            cuda=rank_exit.involves_cuda(exc),
            saved_locals=_failure_locals(exc),
        )
    )
    try:
        sys.stderr.write(traceback_marker(rank, type(exc).__name__) + "\n" + text)
        sys.stderr.flush()
    except OSError:
        pass
