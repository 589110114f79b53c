"""Which globals a piece of code reads: the compiled code's global loads, and for a cell, only the reads that can
reach the notebook.

What the compiler emits decides, not the names in the source: a function's own locals, a comprehension's variable
or a loop target inside a ``def`` are fast locals, never global loads. For a cell (run as a module's top level is:
``LOAD_NAME``), a name that the cell itself has surely bound before a read does not reach the notebook either:
``X = [1, 2, 3]`` then ``len(X)`` reads the cell's ``X``. "Surely" follows the cell's control flow statement by
statement: a binding inside an ``if`` counts after the ``if`` only when every branch makes it, one inside a loop or
a ``try`` only inside it; a ``with`` block is taken as running to its end (a context manager that swallows an
exception is not followed). A function defined in the cell reads the globals its code loads when it is called,
which is not known here: its reads count from the point where it is defined. So the result is exactly the
notebook names a run of straight-line code reads, and a superset (never fewer) where the flow depends on values.
"""

from __future__ import annotations

import ast
import dis
import functools
import types
from collections.abc import Iterable
from typing import Any

GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS", "DELETE_GLOBAL", "DELETE_NAME"})
"""The instructions that need a global to exist: loads, and deletes (``del x`` of a notebook name needs it there)."""
GLOBAL_OPS = GLOBAL_LOADS | {"STORE_GLOBAL", "STORE_NAME"}


@functools.lru_cache(maxsize=512)
def code_names(code: types.CodeType, ops: frozenset[str] = GLOBAL_OPS) -> frozenset[str]:
    """Global names that ``code`` and its nested code objects use through one of ``ops``, remembered per code
    object (a function launched again is not disassembled again)."""
    names: set[str] = set()
    for ins in dis.get_instructions(code):
        if ins.opname in ops:
            names.add(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= code_names(const, ops)
    return frozenset(names)


def _loads(node: ast.expr | ast.stmt) -> set[str]:
    """Global names an expression or a statement may read when it runs at a module's top level (its own code and
    any function, lambda, class or comprehension it creates)."""
    tree: ast.Expression | ast.Module
    if isinstance(node, ast.expr):
        tree, mode = ast.Expression(node), "eval"
    else:
        tree, mode = ast.Module([node], type_ignores=[]), "exec"
    code: types.CodeType = compile(ast.fix_missing_locations(tree), "<cell>", mode, ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    return set(code_names(code, GLOBAL_LOADS))


def _bound(targets: Iterable[ast.AST]) -> set[str]:
    """Names that assignment targets bind (``a, (b, *c) = ...``; attributes and subscripts bind none)."""
    names: set[str] = set()
    for target in targets:
        for node in ast.walk(target):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def _deleted(targets: Iterable[ast.AST]) -> set[str]:
    """Names that ``del`` targets unbind."""
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Del)}


def _binds(stmt: ast.stmt) -> set[str]:
    """Names a simple statement binds once it has run (an import, an assignment, a ``def`` or ``class``)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names if a.name != "*"}
    if isinstance(stmt, ast.Assign):
        return _bound(stmt.targets)
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and stmt.value is not None:
        return _bound([stmt.target])
    return set()


_TRY = (ast.Try, getattr(ast, "TryStar", ast.Try))  # try/except* (3.11) has the same fields


class _Flow:
    """Walks a cell's statements in order, keeping the names surely bound so far (:attr:`bound`) and collecting
    every global read that is not (:attr:`reads`)."""

    def __init__(self) -> None:
        self.reads: set[str] = set()

    def read(self, node: ast.expr | ast.stmt | None, bound: set[str]) -> None:
        if node is not None:
            self.reads |= _loads(node) - bound

    def block(self, body: list[ast.stmt], bound: set[str]) -> set[str]:
        """Walk ``body`` from ``bound`` (not changed); the names surely bound at its end."""
        bound = set(bound)
        for stmt in body:
            self.statement(stmt, bound)
        return bound

    def statement(self, stmt: ast.stmt, bound: set[str]) -> None:
        """Walk one statement, adding to ``bound`` what it surely binds."""
        if isinstance(stmt, ast.If):
            self.read(stmt.test, bound)
            bound |= self.block(stmt.body, bound) & self.block(stmt.orelse, bound)
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            self.read(stmt.iter, bound)
            self.block(stmt.body, bound | _bound([stmt.target]))
            self.block(stmt.orelse, bound)
        elif isinstance(stmt, ast.While):
            self.read(stmt.test, bound)
            self.block(stmt.body, bound)
            self.block(stmt.orelse, bound)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                self.read(item.context_expr, bound)
                bound |= _bound([item.optional_vars]) if item.optional_vars is not None else set()
            bound |= self.block(stmt.body, bound)
        elif isinstance(stmt, _TRY):
            self._try(stmt, bound)
        elif isinstance(stmt, ast.Match):
            self.read(stmt.subject, bound)
            for case in stmt.cases:
                self.read(ast.Match(subject=ast.Constant(None), cases=[case]), bound)  # its pattern and guard
        elif isinstance(stmt, ast.Delete):
            self.read(stmt, bound)
            bound -= _deleted(stmt.targets)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self._def(stmt, bound)
        elif isinstance(stmt, ast.ClassDef):
            self._class(stmt, bound)
        elif not isinstance(stmt, (ast.Pass, ast.Break, ast.Continue)):  # (these two cannot compile alone)
            self.read(stmt, bound)
            bound |= _binds(stmt)

    def _def(self, stmt: ast.FunctionDef | ast.AsyncFunctionDef, bound: set[str]) -> None:
        """A ``def``: its decorators and defaults now; its body's reads too (when it runs is not known), but not of
        its own name (bound before the body can run: a recursive function reads itself)."""
        outer = [*stmt.decorator_list, *stmt.args.defaults, *(d for d in stmt.args.kw_defaults if d is not None)]
        for node in outer:
            self.read(node, bound)
        self.reads |= _loads(stmt) - bound - {stmt.name}
        bound.add(stmt.name)

    def _class(self, stmt: ast.ClassDef, bound: set[str]) -> None:
        """A ``class``: its decorators, bases and body now; the functions its body defines later, when the class's
        own name is bound (a method that names its class reads the cell's)."""
        for node in [*stmt.decorator_list, *stmt.bases, *(k.value for k in stmt.keywords)]:
            self.read(node, bound)
        module = compile(ast.fix_missing_locations(ast.Module([stmt], type_ignores=[])), "<cell>", "exec")
        for body in (c for c in module.co_consts if isinstance(c, types.CodeType)):
            nested = [c for c in body.co_consts if isinstance(c, types.CodeType)]
            own = {i.argval for i in dis.get_instructions(body) if i.opname in GLOBAL_LOADS}
            later = set().union(*(code_names(c, GLOBAL_LOADS) for c in nested))
            self.reads |= (own - bound) | (later - bound - {stmt.name})
        bound.add(stmt.name)

    def _try(self, stmt: Any, bound: set[str]) -> None:
        """A ``try``: its body, handlers, ``else`` and ``finally`` each from what is bound before it (any of them
        may run after a part of the body); what ``finally`` binds is bound after it."""
        self.block(stmt.body, bound)
        for handler in stmt.handlers:
            self.read(handler.type, bound)
            self.block(handler.body, bound | ({handler.name} if handler.name else set()))
        self.block(stmt.body + stmt.orelse, bound)
        bound |= self.block(stmt.finalbody, bound)


def cell_reads(source: str) -> set[str]:
    """The global names a cell (plain Python, after IPython's transforms) may read from the namespace it runs in
    (see the module docstring); builtins included when the code reads them.

    Raises:
        SyntaxError: when the cell is not valid Python.
    """
    flow = _Flow()
    flow.block(ast.parse(source).body, set())
    return flow.reads
