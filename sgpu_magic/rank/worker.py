"""Entry point of one rank: ``python -m sgpu_magic.rank.worker <run_dir>``.

Started by the launch host through torch.distributed.elastic with torchrun's environment
contract (RANK, LOCAL_RANK, WORLD_SIZE, ...). It sends its stdout and stderr (file
descriptors 1 and 2, so native code and child processes too) to its log file, applies the
kernel's cwd and sys.path, loads the payload, runs it, and writes its result or its error
into the RunDir atomically, before anything the user's code made is destroyed; then it ends as a
Python program ends (see :mod:`sgpu_magic.rank.exit`). It imports nothing from IPython or ipywidgets.
"""

from __future__ import annotations

import ast
import builtins
import functools
import gc
import importlib
import io
import linecache
import multiprocessing
import os
import pickle
import runpy
import signal
import sys
import threading
import time
import traceback
import types
import zipfile
from typing import Any, cast

import cloudpickle

from sgpu_magic._util.metrics import WRITER as METRICS
from sgpu_magic._util.proc import allow_tracing_by, die_with_parent
from sgpu_magic.errors import Unpicklable
from sgpu_magic.rank import exit as rank_exit
from sgpu_magic.rank.mlflow_guard import flush_async_logging, guard_job_run, settled_value
from sgpu_magic.rundir import RunDir, atomic_write_bytes, atomic_write_json, read_json, read_private, traceback_marker


def _redirect_output(log_file) -> None:
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _die_with_parent(expected_parent: int | None) -> None:
    """Exit when the parent (the launch host, or its forkserver) dies (PR_SET_PDEATHSIG), even by SIGKILL.

    Also lead a session of its own, so that what this rank starts can be found and stopped with it, and let the
    launch host's py-spy read this rank's stack under Yama's ``ptrace_scope`` 1 (``job.stacks()``, on a timeout).
    """
    die_with_parent(signal.SIGKILL, expected_parent, signal.SIGKILL + 128)  # as if the signal had come
    host = os.environ.get("SGPU_MAGIC_HOST_PID", "")
    if host.isdigit():
        allow_tracing_by(int(host))
    try:
        os.setsid()
    except PermissionError:
        pass  # already a session leader (started by the host with start_new_session)


def _match_threads_to_env() -> None:
    """In a warm (forkserver) rank torch is already imported, so OMP_NUM_THREADS must be applied by hand."""
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _apply_kernel_context(launch: dict) -> None:
    try:
        os.chdir(launch["cwd"])
    except OSError as exc:
        print(f"sgpu_magic: could not enter the kernel's cwd {launch['cwd']!r}: {exc}", file=sys.stderr)
    sys.path[:] = list(launch["sys_path"])


def _load_global(entry: tuple):
    kind = entry[0]
    if kind == "module":
        return importlib.import_module(entry[1])
    if kind == "value":
        return cloudpickle.loads(entry[1])
    return Unpicklable(*entry[1:])


def load_globals(payload: dict, ns: dict, keep: bool = False) -> None:
    """Put the payload's captured globals into ``ns`` (and its cell sources into linecache); ``keep``: leave the
    names ``ns`` already has (a live session's rank: its own names win). A global that cannot be loaded becomes an
    :class:`~sgpu_magic.errors.Unpicklable` that says why on first use."""
    for filename, text in payload.get("sources", {}).items():
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    for name, entry in payload["globals"].items():
        if keep and name in ns:
            continue
        try:
            ns[name] = _load_global(entry)
        except Exception as exc:  # noqa: BLE001 - reported on use, like an unpicklable global
            reason = (
                f"could not be loaded in the rank ({type(exc).__name__}: {exc}); load or create it in the rank instead"
            )
            ns[name] = Unpicklable(name, str(entry[0]), reason, warned=False)


def _build_namespace(payload: dict) -> dict:
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


def _resolve_function(payload: dict, ns: dict):
    if payload["kind"] == "ref":
        obj = importlib.import_module(payload["module"])
        for part in payload["qualname"].split("."):
            obj = getattr(obj, part)
        return getattr(obj, "__sgpu_function__", obj)
    shell = cloudpickle.loads(payload["shell"])
    closure = tuple(types.CellType(v) for v in shell["closure"]) or None
    fn = types.FunctionType(shell["code"], ns, shell["name"], shell["defaults"], closure)
    fn.__kwdefaults__ = shell["kwdefaults"]
    fn.__qualname__ = shell["qualname"]
    return fn


def _run_script(payload: dict, ns: dict) -> int:
    """Run the payload's script file or module as torchrun would (``python [-m] target args...``) with runpy;
    return its exit status, 0 (``sys.exit(0)`` included); ``sys.exit(n != 0)`` propagates.

    What the script leaves (its globals, or the frames of a ``SystemExit``) is kept in ``ns`` until the
    result is written, so no destructor of the script's objects runs before the rank reports.
    """
    sys.argv = list(payload["argv"])
    target = payload["script"]
    if payload["module"] is not None:
        sys.path.insert(0, os.getcwd())  # as python -m
        run = functools.partial(runpy.run_module, payload["module"], run_name="__main__", alter_sys=True)
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


def run_payload(payload: dict, ns: dict, held: list | None = None):
    """Run the captured cell, function or script in ``ns``; return its value (a script's: its exit status).

    ``held``: a list that keeps the function's frame, so its locals outlive its return until the
    caller clears the list (:func:`sgpu_magic.rank.exit.call_holding_frame`).

    MLflow's async logging queue (on by default in tracked jobs) is flushed before this returns, so
    every point the user code logged is in the run before the rank reports; a value that is the future
    of an async ``mlflow.log_metric`` call (a cell ending with one) is ``None``, as with sync logging.
    """
    try:
        if payload["kind"] == "session":  # a live session's rank: cells until the session stops
            from sgpu_magic.rank.session import serve

            return serve(RunDir(payload["run_dir"]), ns)
        if payload["kind"] == "script":
            return _run_script(payload, ns)
        if payload["kind"] == "cell":
            return settled_value(_run_cell(payload["source"], payload["filename"], ns, bool(payload.get("quiet"))))
        fn = _resolve_function(payload, ns)
        args = [cloudpickle.loads(b) for b in payload["args"]]
        kwargs = {k: cloudpickle.loads(b) for k, b in payload["kwargs"].items()}
        return settled_value(rank_exit.call_holding_frame(fn, args, kwargs, [] if held is None else held))
    finally:
        METRICS.flush()  # the points reach the file (and MLflow) before the rank reports
        flush_async_logging()


class _ResultPickler(cloudpickle.Pickler):
    """cloudpickle that moves tensors to the CPU, so the kernel never touches a GPU."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return super().reducer_override(obj)


def _dump_result(value, rank: int, name: str | None = None) -> bytes:
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


def _write_error(run_dir: RunDir, rank: int, exc: BaseException, labels: dict[str, str] | None = None) -> None:
    text = _user_traceback(exc, labels or {})
    # the error file first: on a full disk it takes the run dir's reserve, and the log may not take a line
    atomic_write_json(
        run_dir.error_file(rank),
        {
            "rank": rank,
            "exc_type": type(exc).__name__,
            "message": str(exc),
            "traceback": text,
            "time_s": time.time(),
            "cuda": rank_exit.involves_cuda(exc),
            "locals": _failure_locals(exc),
        },
    )
    try:
        sys.stderr.write(traceback_marker(rank, type(exc).__name__) + "\n" + text)
        sys.stderr.flush()
    except OSError:
        pass


def teardown(ns: dict) -> None:
    """Drop user objects, then destroy the process group (avoids DDP's teardown deadlock, pytorch#56297);
    when the user code destroyed the group itself, do nothing.

    The rank's process ends with ``os._exit`` (no interpreter finalization), so destroying the
    group only matters while the process still waits for its peers to finish: it closes the
    group's connections, and a peer still blocked in a collective fails fast instead of
    waiting for the collective's timeout. It runs in a thread (tens of ms for gloo), so the
    rank reports done at once; the process exits when every rank has.
    """
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            # Nothing to order: leave the user's objects alone. Dropping a DDP model after its process
            # group was destroyed (user code that calls destroy_process_group first) can block for good
            # in the reducer's destructor; the process ends with os._exit, which runs no destructor.
            return
    except Exception:  # noqa: BLE001 - teardown must not turn success into failure
        return
    ns.clear()
    gc.collect()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass

    threading.Thread(target=destroy, name="sgpu_magic teardown", daemon=True).start()


def _system_exit(run_dir: RunDir, rank: int, exc: SystemExit, payload: dict) -> int:
    """A rank that raised ``SystemExit``: non-zero fails it, as under torchrun; zero returns nothing, noted where.

    As Python ends a program on ``SystemExit``, no traceback is printed or recorded (``sys.exit("message")`` prints
    the message on stderr and exits 1): the rank's last lines (argparse's usage and error) tell what happened."""
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if code:
        if not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr, flush=True)
        atomic_write_json(
            run_dir.error_file(rank),
            {"rank": rank, "exc_type": "SystemExit", "message": str(code), "traceback": "", "time_s": time.time()},
        )
        return code
    atomic_write_json(
        run_dir.exit_file(rank),
        {"code": 0, "where": rank_exit.raise_site(exc, payload.get("display_names") or {}), "kind": payload["kind"]},
    )
    atomic_write_bytes(run_dir.result_file(rank), _dump_result(None, rank))
    return 0


def _run_and_record(run_dir: RunDir, rank: int, payload: dict, ns: dict, held: list) -> int:
    """Run the payload and write its outcome (value or error); the exit code. ``held`` keeps the function's frame."""
    try:
        value = run_payload(payload, ns, held)
        atomic_write_bytes(run_dir.result_file(rank), _dump_result(value, rank))
        return 0
    except SystemExit as exc:
        return _system_exit(run_dir, rank, exc, payload)
    except BaseException as exc:  # noqa: BLE001 - every rank failure is recorded
        _write_error(run_dir, rank, exc, payload.get("display_names"))
        return 1


def _execute(run_dir: RunDir, rank: int) -> int:
    """Load the payload, run it, write its outcome, then free what it made (the teardown the host bounds)."""
    payload = pickle.loads(read_private(run_dir.payload_file))
    if payload["kind"] == "session":
        payload["run_dir"] = str(run_dir.path)
    METRICS.use(run_dir.metrics_file(rank))
    guard_job_run()  # before the payload's globals import mlflow: the kernel owns the run's status
    rank_exit.keep_process_groups()  # before they import torch.distributed (cold) or any group exists (warm)
    sys.argv = list(payload.get("argv") or sys.argv[:1])  # [cell or function name]: parse_args() reads defaults
    ns = _build_namespace(payload)
    held: list = []
    try:
        return _run_and_record(run_dir, rank, payload, ns, held)
    finally:
        held.clear()  # the function's locals go now: its outcome is written
        teardown(ns)


def _run_rank(run_dir: RunDir, expected_parent: int | None) -> int:
    rank = int(os.environ["RANK"])
    _redirect_output(run_dir.log_file(rank))
    _die_with_parent(expected_parent)
    code = 1
    try:
        _apply_kernel_context(
            cast("dict[str, Any]", read_json(run_dir.launch_file, private=True))
        )  # None: caught below
        code = _execute(run_dir, rank)
    except BaseException as exc:  # noqa: BLE001 - payload could not even be loaded
        _write_error(run_dir, rank, exc)
    finally:
        rank_exit.exit_like_python()  # threads, atexit handlers, flushes: inside the host's teardown grace
    return code


def main(argv: list[str]) -> None:
    """Cold start: a fresh interpreter started by the host; ends with ``os._exit``."""
    os._exit(_run_rank(RunDir(argv[1]), int(os.environ["SGPU_MAGIC_HOST_PID"])))


def rank_entry(run_dir: str, env: dict[str, str]) -> None:
    """Warm start: called in a process forked from the host's forkserver (torch already imported).

    torch elastic's wrapper has applied the rank's variables; ``env`` replaces the whole
    environment, so it is the kernel's as of this launch. Returns on success (elastic's
    multiprocessing contract); a failure exits with the rank's code.
    """
    os.environ.clear()
    os.environ.update(env)
    _match_threads_to_env()
    # the forkserver left its own start method as this process's default; a rank's DataLoader
    # workers must get the platform's default, as in a fresh interpreter (fork on Linux <= 3.13)
    multiprocessing.set_start_method(None, force=True)
    code = _run_rank(RunDir(run_dir), None)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main(sys.argv)
