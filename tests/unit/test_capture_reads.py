"""The names a cell capture ships are the notebook names a run of the cell reads.

Cells are generated (hypothesis) and run against a namespace that records every read which reaches the notebook's
values (a name the cell has not bound itself); :func:`sgpu_magic.capture.cell_global_names` must give exactly those
for straight-line code (assignments, functions called where they are defined, lambdas, comprehensions, classes,
``with`` blocks), and never fewer where the flow depends on values (``if``, loops, ``try``, ``del``).
"""

from __future__ import annotations

import builtins
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgpu_magic import capture

NAMES = ["a", "b", "c", "d", "e"]
"""The notebook's names (each an int); the cells read, bind, shadow and delete them."""


class Recording(dict):
    """A cell's globals: the notebook's values, recording each read of one the cell has not bound itself (once
    bound, the notebook's value is gone for the rest of the cell, a ``del`` of the name included)."""

    def __init__(self, values: dict) -> None:
        super().__init__(values)
        self.bound: set[str] = set()
        self.reads: set[str] = set()

    def note(self, key: str) -> None:
        if key not in self.bound:
            self.reads.add(key)

    def __getitem__(self, key):
        self.note(key)
        return super().__getitem__(key)

    def __setitem__(self, key, value) -> None:
        self.bound.add(key)
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        # a del needs the name to exist; it does not bring the notebook's value back once the cell has bound the
        # name (a second del of it raises NameError in the notebook as in a rank)
        self.note(key)
        super().__delitem__(key)


def run_recorded(source: str) -> set[str]:
    """The notebook names that running ``source`` reads (an error the cell raises ends the run, as in a rank)."""
    ns = Recording(dict.fromkeys(NAMES, 1))

    class ClassBody(dict):
        """A class body's namespace: a name it lacks is looked up in the globals, which bypasses their
        ``__getitem__`` (CPython reads a dict subclass of globals directly there), so it is noted here."""

        def __getitem__(self, key):
            if not dict.__contains__(self, key):
                ns.note(key)
            return super().__getitem__(key)

    class Meta(type):
        @classmethod
        def __prepare__(mcs, name, bases, **kwargs):
            return ClassBody()

    def build_class(func, name, *bases, **kwargs):
        return builtins.__build_class__(func, name, *bases, metaclass=Meta, **kwargs)

    dict.__setitem__(ns, "__builtins__", {**vars(builtins), "__build_class__": build_class})
    try:
        exec(compile(source, "<cell>", "exec"), ns)
    except Exception:  # noqa: BLE001 - a NameError after a del: the reads so far are what counts
        pass
    return ns.reads & set(NAMES)


name = st.sampled_from(NAMES)
expr = st.lists(st.one_of(name, st.integers(0, 3).map(str)), min_size=1, max_size=3).map(" + ".join)
counter = iter(range(10**9))


def fresh(prefix: str) -> st.SearchStrategy[str]:
    return st.builds(lambda: f"{prefix}{next(counter)}")


@st.composite
def function_def(draw) -> str:
    """A function with a local that shadows a notebook name (read only once bound: reading it first would raise
    UnboundLocalError), called where it is defined."""
    fn, target, local = draw(fresh("f")), draw(name), draw(name)
    others = st.sampled_from([n for n in NAMES if n != local])
    body = draw(st.lists(st.one_of(others, st.integers(0, 3).map(str)), min_size=1, max_size=3).map(" + ".join))
    return f"def {fn}():\n    {local} = {body}\n    return {draw(expr)}\n{target} = {fn}()"


def _class(cls, attr, body_expr, target) -> str:
    return f"class {cls}:\n    {attr} = {body_expr}\n    def get(self):\n        return {cls}.{attr}\n{target} = {cls}().get()"


simple = st.one_of(
    st.builds("{} = {}".format, name, expr),
    st.builds("{} += {}".format, name, expr),
    st.builds("str({})".format, expr),
    function_def(),
    st.builds("{} = (lambda {}: {})({})".format, name, name, expr, expr),
    st.builds("{} = sum([{} for {} in range(2)])".format, name, expr, name),
    st.builds(_class, fresh("K"), name, expr, name),
    st.builds("from math import pi as {}".format, name),
)


def indented(block: list[str]) -> str:
    return textwrap.indent("\n".join(block), "    ")


def with_block(block: list[str]) -> str:
    return "import contextlib\nwith contextlib.nullcontext():\n" + indented(block)


straight = st.recursive(
    st.lists(simple, min_size=1, max_size=4),
    lambda inner: st.lists(st.one_of(simple, inner.map(with_block)), min_size=1, max_size=4),
    max_leaves=12,
)


def _if(test, body, orelse) -> str:
    text = f"if {test} > 2:\n{indented(body)}"
    return text + (f"\nelse:\n{indented(orelse)}" if orelse else "")


def _loop(var, count, body) -> str:
    return f"for {var} in range({count}):\n{indented(body)}"


def _while(test, body) -> str:
    """A ``while`` whose body runs at most once (the values are the cell's: an unbounded loop could run forever)."""
    return f"while {test} > 9:\n{indented([*body, 'break'])}"


def _try(body, handler) -> str:
    return f"try:\n{indented(body)}\nexcept ZeroDivisionError:\n{indented(handler)}"


branching = st.recursive(
    st.lists(
        st.one_of(simple, st.builds("del {}".format, name), st.builds("{} = 1 // ({} - 1)".format, name, name)),
        min_size=1,
        max_size=4,
    ),
    lambda inner: st.lists(
        st.one_of(
            simple,
            st.builds(_if, expr, inner, st.one_of(st.just([]), inner)),
            st.builds(_loop, name, st.integers(0, 2), inner),
            st.builds(_while, expr, inner),
            st.builds(_try, inner, inner),
            inner.map(with_block),
        ),
        min_size=1,
        max_size=4,
    ),
    max_leaves=16,
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(straight)
def test_straight_line_cells_capture_exactly_the_notebook_names_they_read(block):
    source = "\n".join(block) + "\n"
    assert capture.cell_global_names(source) & set(NAMES) == run_recorded(source), source


@SETTINGS
@given(branching)
def test_cells_with_branches_capture_every_notebook_name_they_read(block):
    source = "\n".join(block) + "\n"
    assert capture.cell_global_names(source) >= run_recorded(source), source


@pytest.mark.parametrize(
    ("source", "captured"),
    [
        # the cases: a function's own local, a loop target inside a def, a name bound before it is read
        ("def h():\n    X = [1, 2, 3]\n    return X\nh()\n", set()),
        ("def h(n):\n    for _ in range(n):\n        pass\nh(3)\n", set()),
        ("X = [1, 2, 3]\nlen(X)\n", set()),
        ("Y = [y for y in range(3)]\n", set()),
        # read before bound, bound in one branch only, bound inside a loop, deleted
        ("X = X + [1]\n", {"X"}),
        ("if flag:\n    X = 1\nX\n", {"flag", "X"}),
        ("if flag:\n    X = 1\nelse:\n    X = 2\nX\n", {"flag"}),
        ("for i in range(2):\n    X = i\nX\n", {"X"}),
        ("X = 1\ndel X\nX\n", {"X"}),
        # a del after the cell bound the name does not need the notebook's value (found by hypothesis)
        ("b = a\nfor a in range(2):\n    del b\n", {"a"}),
        # functions read at their definition; a recursive one reads itself; classes and methods
        ("def f():\n    return g(X)\n", {"g", "X"}),
        ("X = 1\ndef f():\n    return X\nf()\n", set()),
        ("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\nfib(5)\n", set()),
        ("class C:\n    w = Q\n    def m(self):\n        return C, Z\n", {"Q", "Z"}),
        ("import torch\nmodel = torch.nn.Linear(2, 2)\nwith torch.no_grad():\n    out = model(x)\nout\n", {"x"}),
    ],
)
def test_cell_global_names_follows_the_cells_own_bindings(source, captured):
    assert capture.cell_global_names(source) - {"__name__"} == captured


def test_a_cell_capture_ships_no_notebook_value_the_cell_shadows():
    """The issue's measurement: a cell whose function defines its own ``X`` does not ship the notebook's large ``X``,
    and ``for _ in range(n)`` inside a ``def`` does not try to pickle IPython's ``_`` (the previous output)."""
    import threading

    warnings: list[str] = []
    namespace = {"X": bytes(200 * 2**20), "_": (threading.Lock(),), "n": 3}
    source = "def h():\n    X = [1, 2, 3]\n    for _ in range(n):\n        pass\n    return X\nh()\n"
    payload = capture.capture_cell(source, namespace, warn=warnings.append)
    assert set(payload.globals) == {"n"} and warnings == []
