"""Capture what a cell or function needs from the notebook into a payload for the ranks.

Only the globals the code reads are captured. Modules go by reference (the rank imports
them); functions, classes and values defined in the notebook go by value with cloudpickle.
A global larger than ``max_bytes`` gets a warning; one that cannot be pickled gets a
warning and is replaced in the ranks by a placeholder that raises
:class:`~sgpu_magic.errors.UnpicklableGlobalError` with the same explanation on first use.
Arguments that cannot be pickled are refused with :class:`~sgpu_magic.errors.CaptureError`
before anything starts.

Non-goal (as in cloudpickle): every rank runs the same interpreter and library versions
as the kernel.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import io
import linecache
import marshal
import pickle
import sys
import types
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from sgpu_magic._util.reads import cell_reads, code_names
from sgpu_magic.errors import CaptureError, Unpicklable, unpicklable_message  # noqa: F401 - Unpicklable: capture.Unpicklable
from sgpu_magic.wire.payload import Cell, FunctionCode, FunctionRef, Payload

DEFAULT_MAX_BYTES = 100 * 2**20
_MAX_LINECACHE_CHARS = 2_000_000


class _Pickler(cloudpickle.Pickler):
    """cloudpickle that keeps code objects whole (with their file names), so rank tracebacks show notebook lines."""

    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):
            return marshal.loads, (marshal.dumps(obj),)
        return super().reducer_override(obj)


def dumps(value: object) -> bytes:
    """Pickle ``value`` for the ranks (cloudpickle, code objects kept whole)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buf.getvalue()


def type_name(value: object) -> str:
    """``_thread.lock``, ``torch.Tensor``, ``list``: the qualified name of ``type(value)``."""
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def format_bytes(n: int) -> str:
    """``1.0 GiB``, ``12.3 MiB``, ``512 B``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def estimate_nbytes(value: object) -> int | None:
    """Cheap size estimate for arrays, tensors and byte strings, without pickling; ``None`` if unknown."""
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        return len(value)
    nbytes = getattr(value, "nbytes", None)  # numpy arrays, torch tensors (>= 2.1)
    if isinstance(nbytes, int):
        return nbytes
    if type(value).__module__.startswith("torch") and hasattr(value, "element_size"):
        tensor: Any = value
        return int(tensor.element_size() * tensor.nelement())
    return None


def large_message(name: str, tname: str, nbytes: int, max_bytes: int, ranks: int | None = None) -> str:
    """The warning for a captured global over ``max_bytes``; ``ranks``: how many ranks get a copy (``None``: unknown,
    "every rank")."""
    to = "every rank" if ranks is None else f"{ranks} rank{'' if ranks == 1 else 's'}"
    return (
        f"global '{name}' ({tname}, {format_bytes(nbytes)}) is larger than {format_bytes(max_bytes)}; "
        f"it is pickled and copied to {to}. Load or create it inside the cell or function instead."
    )


@dataclass
class Captured:
    """Captured globals: name -> entry, plus the warnings to show before launch."""

    entries: dict[str, tuple] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    on_warning: Callable[[str], None] | None = None

    def warn(self, text: str) -> None:
        """Record a warning and show it now (through ``on_warning``), before the rest is pickled."""
        self.warnings.append(text)
        if self.on_warning is not None:
            self.on_warning(text)


def _capture_one(name: str, value: object, max_bytes: int, out: Captured, ranks: int | None = None) -> None:
    if isinstance(value, types.ModuleType) and getattr(value, "__spec__", None) is not None:
        out.entries[name] = ("module", value.__name__)
        return
    nbytes = estimate_nbytes(value)
    try:
        data = dumps(value)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is reported, not raised
        reason = f"{type(exc).__name__}: {exc}"
        out.warn(unpicklable_message(name, type_name(value), reason))
        out.entries[name] = ("unpicklable", name, type_name(value), reason)
        return
    if nbytes is None and len(data) > max_bytes:
        out.warn(large_message(name, type_name(value), len(data), max_bytes, ranks))
    out.entries[name] = ("value", data)


def capture_names(
    names: set[str],
    namespace: dict,
    max_bytes: int = DEFAULT_MAX_BYTES,
    warn: Callable[[str], None] | None = None,
    skip: Collection[str] = (),
    ranks: int | None = None,
) -> Captured:
    """Capture ``names`` that exist in ``namespace`` (builtins, dunders and ``skip`` left out: a live session's
    ranks already have those). ``ranks``: how many ranks get a copy of each, for the large-global warning.

    ``warn(text)`` is called for each warning as soon as it is known: globals whose size can be
    estimated without pickling (arrays, tensors, byte strings) are warned about before anything
    is pickled; others once pickled.
    """
    out = Captured(on_warning=warn)
    chosen = []
    for name in sorted(names):
        if name.startswith("__") or name not in namespace or name in skip:
            continue
        value = namespace[name]
        if name in vars(builtins) and value is vars(builtins)[name]:
            continue
        chosen.append((name, value))
    for name, value in chosen:  # first the cheap size estimates, so a large array is warned about at once
        nbytes = None if isinstance(value, types.ModuleType) else estimate_nbytes(value)
        if nbytes is not None and nbytes > max_bytes:
            out.warn(large_message(name, type_name(value), nbytes, max_bytes, ranks))
    for name, value in chosen:
        _capture_one(name, value, max_bytes, out, ranks)
    return out


def cell_global_names(source: str) -> set[str]:
    """Names a cell (plain Python, after IPython's transforms) may read from the notebook: its compiled code's
    global loads at any depth, less builtins and the names the cell has surely bound itself before it reads them
    (:func:`sgpu_magic._util.reads.cell_reads`). A function's own locals, comprehension and loop variables are
    not among them.

    Raises:
        SyntaxError: when the cell is not valid Python.
    """
    return cell_reads(source) - set(dir(builtins))


def ipython_syntax_line(tree: ast.Module) -> int | None:
    """First line of a cell (after IPython's transforms) that needs the kernel's IPython, or ``None``.

    IPython turns ``%magic``, ``%%magic``, ``!shell`` and ``name?`` lines into ``get_ipython()`` calls;
    ranks run plain Python without IPython, where that name does not exist. A cell that binds
    ``get_ipython`` itself (``from IPython import get_ipython``) is left alone.
    """
    loads, bound = [], False
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "get_ipython":
            if isinstance(node.ctx, ast.Load):
                loads.append(node.lineno)
            else:
                bound = True
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == "get_ipython":
            bound = True
        elif isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) == "get_ipython":
            bound = True
        elif isinstance(node, ast.arg) and node.arg == "get_ipython":
            bound = True
    return None if bound or not loads else min(loads)


def code_global_names(code: types.CodeType) -> set[str]:
    """Global names a code object and its nested code objects load or store."""
    return set(code_names(code))


def _importable_reference(fn: Callable) -> tuple[str, str] | None:
    """``(module, qualname)`` when ``fn`` lives in an importable module, else ``None``."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if (
        not isinstance(module, str)
        or module == "__main__"
        or module not in sys.modules
        or not isinstance(qualname, str)
        or "<locals>" in qualname
    ):
        return None
    obj: Any = sys.modules[module]
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is fn or getattr(obj, "__wrapped__", None) is fn:
        return module, qualname
    return None


def function_problem(fn: object) -> str | None:
    """Why ``fn`` cannot run on the ranks through :func:`capture_function`, or ``None`` when it can.

    Ranks get a plain function (``def`` or ``lambda``) by its code, and anything importable from a
    module (a function, a class, a builtin) by reference. Bound methods would lose ``self``; generator
    and ``async def`` functions would return objects that cannot come back; other callables (partials,
    instances with ``__call__``, notebook classes) have no code to send.
    """
    what = f"{type_name(fn)} {getattr(fn, '__qualname__', '')}".rstrip()
    if not callable(fn):
        return f"got {what}, which is not callable"
    if getattr(fn, "__sgpu_function__", None) is not None and _importable_reference(fn) is None:
        return f"{what} is already decorated with @distributed; decorate the function once"
    if isinstance(fn, types.MethodType):
        return (
            f"got bound method {fn.__qualname__}, whose object would not reach the ranks; decorate a function "
            f"that calls it instead, e.g. def run(*args): return obj.{fn.__name__}(*args)"
        )
    if isinstance(fn, types.FunctionType):
        if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
            kind = "a generator" if inspect.isgeneratorfunction(fn) else "an async"
            return (
                f"{fn.__qualname__} is {kind} function, whose result cannot be sent back from the ranks; make "
                f"it a plain def that returns a value (e.g. a list, or asyncio.run(...) inside it)"
            )
        return None
    if _importable_reference(fn) is not None:
        return None
    return (
        f"got {what}, which has no code to send to the ranks; decorate a plain function (def or lambda), or "
        f"one importable from a module, that calls it"
    )


def source_cache(filenames: set[str]) -> dict[str, str]:
    """Source text of notebook cells named in ``filenames``, so rank tracebacks show lines."""
    out, total = {}, 0
    for filename in filenames:
        entry = linecache.cache.get(filename)
        if entry and len(entry) > 2 and entry[2]:  # (a lazy entry, (get_lines,), has no lines yet)
            text = "".join(entry[2])
            total += len(text)
            if total > _MAX_LINECACHE_CHARS:
                break
            out[filename] = text
    return out


def _code_filenames(code: types.CodeType) -> set[str]:
    names = {code.co_filename}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_filenames(const)
    return names


def capture_function(
    fn: Callable,
    max_bytes: int = DEFAULT_MAX_BYTES,
    warn: Callable[[str], None] | None = None,
    skip: Collection[str] = (),
    ranks: int | None = None,
) -> Payload:
    """The payload of a function (its arguments still to set): a reference, or its code plus captured globals
    (except ``skip``); ``ranks``: how many ranks get a copy (said in the large-global warning).

    Raises:
        CaptureError: when the function's defaults or closure cannot be pickled.
    """
    ref = _importable_reference(fn)
    if ref is not None:
        return Payload(FunctionRef(ref[0], ref[1]))
    code = fn.__code__
    captured = capture_names(code_global_names(code), fn.__globals__, max_bytes, warn, skip, ranks)
    closure = [c.cell_contents for c in (fn.__closure__ or ())]
    shell = {
        "code": code,
        "name": fn.__name__,
        "qualname": fn.__qualname__,
        "defaults": fn.__defaults__,
        "kwdefaults": fn.__kwdefaults__,
        "closure": closure,
    }
    try:
        shell_bytes = dumps(shell)
    except Exception as exc:
        raise CaptureError(
            f"{fn.__qualname__}'s default arguments or closure cannot be pickled "
            f"({type(exc).__name__}: {exc}); pass such values as arguments or create them inside the function"
        ) from exc
    filenames = _code_filenames(code) | _notebook_filenames(fn.__globals__, captured)
    return Payload(FunctionCode(shell_bytes), captured.entries, source_cache(filenames), captured.warnings)


def _notebook_filenames(namespace: dict, captured: Captured) -> set[str]:
    """Cell filenames of the notebook functions and classes among the captured globals."""
    out = set()
    for name in captured.entries:
        value = namespace.get(name)
        code = getattr(value, "__code__", None) or getattr(getattr(value, "__init__", None), "__code__", None)
        if isinstance(code, types.CodeType):
            out |= _code_filenames(code)
    return out


def capture_cell(
    source: str,
    namespace: dict,
    max_bytes: int = DEFAULT_MAX_BYTES,
    warn: Callable[[str], None] | None = None,
    skip: Collection[str] = (),
    ranks: int | None = None,
    filename: str = "<cell>",
    quiet: bool = False,
    cell_label: str | None = None,
) -> Payload:
    """The payload of a cell: its source (compiled as ``filename``; ``quiet``: no value; ``cell_label``: as IPython
    names it) plus the globals it reads from ``namespace`` (except ``skip``); ``ranks``: how many ranks get a copy
    (said in the large-global warning).

    Raises:
        SyntaxError: when the cell is not valid Python.
    """
    captured = capture_names(cell_global_names(source), namespace, max_bytes, warn, skip, ranks)
    return Payload(
        Cell(source, filename, quiet, cell_label),
        captured.entries,
        source_cache(_notebook_filenames(namespace, captured)),
        captured.warnings,
    )


def _argument_error(label: str, call: str, value: object, exc: Exception) -> CaptureError:
    tname = type_name(value)
    if inspect.isgenerator(value) or inspect.isasyncgen(value):
        remedy = "pass a list (e.g. list(gen)) or build the generator inside the function"
    else:
        remedy = "pass something picklable, or create this object inside the function"
    return CaptureError(
        f"{label} of {call} is a {tname}, which cannot be sent to the ranks "
        f"({type(exc).__name__}: {exc}); {remedy}. Nothing was started."
    )


def _dumps_argument(label: str, call: str, value: object) -> bytes:
    try:
        return dumps(value)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is the user's argument: said with its name
        raise _argument_error(label, call, value, exc) from None


def capture_arguments(call: str, args: tuple, kwargs: dict) -> tuple[list[bytes], dict[str, bytes]]:
    """Pickle each of the call's arguments, refusing any that cannot be sent, naming it.

    Args:
        call: how the user called it, e.g. ``"g.distributed"``, for messages.

    Returns:
        ``(args, kwargs)`` with each value pickled on its own.

    Raises:
        CaptureError: naming ``argument <i>`` or ``keyword argument '<k>'`` and its type.
    """
    return (
        [_dumps_argument(f"argument {i}", call, v) for i, v in enumerate(args)],
        {k: _dumps_argument(f"keyword argument '{k}'", call, v) for k, v in kwargs.items()},
    )
