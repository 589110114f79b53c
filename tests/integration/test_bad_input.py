"""Hostile input to both front doors is refused with a clear error, before anything starts.

Property-based (hypothesis): every example is a valid base (a ``%%distributed`` line and cell, or
``@distributed`` keyword arguments and a plain function) with exactly one bad part, so it is invalid by
construction and no job can launch. The bad part is drawn at random: wrong types, huge, negative and
zero numbers, NaN and infinities, unknown flags and keywords, unicode, empty strings, unclosed quotes,
empty cells, syntax errors, IPython syntax (``%magic``, ``!shell``, ``x?``) and top-level
``return`` / ``yield`` in cells, objects that cannot run on the ranks. Each must end in the error the
front door documents — ``UsageError`` (magic line, empty cell), ``SyntaxError`` (cell), ``SpecError`` (a
``ValueError``) or ``TypeError`` (decorator) — whose message names the option and what it takes
(pinned with ``match=``), never an exception from deep inside; and nothing may start: no new process
under the kernel or its launch host (ranks are the host's children) and no new run directory.

The inputs that escaped before the validation was tightened are kept below as plain cases.
"""

from __future__ import annotations

import functools
import keyword
import math
import re
import shlex
import string

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

from sgpu_magic import distributed
from sgpu_magic.errors import CellSyntaxError, SpecError

CELL = re.compile(r"Cell In\[\d+\]")
"""How a cell is named in its syntax errors: as IPython names it."""
PROPERTY = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
"""Deterministic (CI sees the same examples every run), no example database written into the repo."""

LONG_OPTIONS = [
    "--gpus",
    "--profile",
    "--gpu-type",
    "--timeout",
    "--port",
    "--no-widgets",
    "--no-mlflow",
    "--gpu-ids",
    "--background",
    "--no-wait",
    "--max-restarts",
    "--output",
]
VALUE_OPTIONS = ["--gpus", "--gpu-type", "--timeout", "--port", "--gpu-ids", "--max-restarts", "-o", "--output"]
BASE_LINES = [
    (1, "--gpus 1"),
    (2, "--gpus 2 --no-mlflow --no-widgets"),
    (1, "--gpus 1 --background -o job"),
    (2, "--gpus 2 --timeout 60 --port 29555 --max-restarts 1"),
    (1, "--gpus 1 --timeout none --no-wait"),
]
"""Valid lines, with their number of ranks; a bad option appended overrides the base's (argparse: last wins)."""
BASE_CELL_LINES = [
    "x = 1",
    "import math",
    "y = [i * 2 for i in range(3)]",
    "def f(a):\n    return a + 1",
    "f(2) if False else 0",
]
ACCEPTED = (
    "gpus, gpu_type, timeout, port, widgets, max_capture_bytes, mlflow, gpu_ids, wait, max_restarts, cluster, "
    "teardown_grace_s, stuck_after_s, remote, num_accelerators, accelerator_type, profile, detach"
)


# --- nothing starts ------------------------------------------------------------------------


def run_magic(ip, line: str, cell: str = "x = 1\n"):
    """``%%distributed <line>`` with ``cell``, through the shell's own cell-magic path."""
    return ip.run_cell_magic("distributed", line, cell)


# --- strategies: one bad part each -----------------------------------------------------------


_CHARS = st.characters(exclude_categories=("Cs",))
"""Any unicode character but lone surrogates (``st.text()``'s default alphabet costs seconds to build)."""


_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


@functools.lru_cache
def _text(min_size: int = 0, max_size: int = 20, exclude: str = "") -> st.SearchStrategy[str]:
    """Any unicode text a magic line can carry: no line breaks (``str.splitlines``'s, which IPython splits cells
    at), no ``{}``/``$`` (IPython expands them in magic lines)."""
    return st.text(
        st.characters(exclude_categories=("Cs",), exclude_characters=_LINE_BREAKS + "{}$" + exclude),
        min_size=min_size,
        max_size=max_size,
    )


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _not_int_in(low: int, high: int) -> st.SearchStrategy[str]:
    """Text that argparse's ``int`` refuses, or an int outside ``[low, high]``, as the magic reads it."""
    ints = st.one_of(st.integers(max_value=low - 1), st.integers(min_value=high + 1)).map(str)
    floats = st.floats().map(repr)
    words = _text().filter(lambda t: (v := _int_or_none(t)) is None or not low <= v <= high)
    return st.one_of(ints, floats, words, st.sampled_from(["", " ", "nan", "inf", "-inf", "1e3", "2.0", "0x10", "一"]))


def _valid_timeout(text: str) -> bool:
    if text.strip().lower() == "none":
        return True
    try:
        return float(text) > 0
    except ValueError:
        return False


def _valid_gpu_ids(text: str, gpus: int) -> bool:
    ids = [_int_or_none(item) for item in text.split(",")]
    return None not in ids and all(i >= 0 for i in ids) and len(set(ids)) == len(ids) == gpus


_IDENT = st.builds(
    str.__add__,
    st.sampled_from(string.ascii_letters + "_"),
    st.text(string.ascii_letters + string.digits + "_", max_size=10),
).filter(lambda n: not keyword.iskeyword(n))
"""A Python name (``st.from_regex`` would cost seconds of set-up for its unicode alphabet)."""
_NOT_PRINTABLE = st.characters(categories=("Cc", "Cf", "Zl", "Zp"), exclude_characters=_LINE_BREAKS)
_BAD_GPU_TYPE = st.one_of(
    st.just(""),
    st.text(" \t\x0b\x0c\u3000\xa0", min_size=1, max_size=4),
    st.tuples(_text(max_size=5), _NOT_PRINTABLE, _text(max_size=5)).map("".join),
)


@st.composite
def bad_lines(draw) -> tuple[str, str]:
    """``(line, message regex)``: a valid base line plus one bad option, flag, token or quote."""
    gpus, base = draw(st.sampled_from(BASE_LINES))
    kind = draw(
        st.sampled_from(
            [
                "gpus",
                "timeout",
                "port",
                "max-restarts",
                "profile",
                "gpu-ids",
                "gpu-type",
                "output",
                "unknown-flag",
                "stray-token",
                "missing-value",
                "unclosed-quote",
            ]
        )
    )
    if kind == "gpus":
        value, refused = (
            draw(_not_int_in(1, 1024)),
            (
                r"argument --gpus: invalid int value: |gpus must be between 1 "
                r"and 1024, got "
            ),
        )
    elif kind == "port":
        value, refused = (
            draw(_not_int_in(1, 65535)),
            (
                r"argument --port: invalid int value: |port must be an int between 1 "
                r"and 65535, or None to pick a free port; got "
            ),
        )
    elif kind == "max-restarts":
        value, refused = (
            draw(_not_int_in(0, 1000)),
            (
                r"argument --max-restarts: invalid int value: |max_restarts must be "
                r"an int between 0 and 1000 \(restarts of the whole rank group"
            ),
        )
    elif kind == "profile":
        value, refused = (
            draw(_not_int_in(1, 1000)),
            (
                r"argument --profile: invalid int value: |profile must be a number of steps to profile between 1 "
                r"and 1000 \(each rank's torch.profiler records that many steps\)"
            ),
        )
    elif kind == "timeout":
        value = draw(
            st.one_of(
                st.floats(max_value=0.0).map(repr),
                st.integers(max_value=0).map(str),
                st.just("nan"),
                _text().filter(lambda t: not _valid_timeout(t)),
            )
        )
        refused = r"--timeout takes a number of seconds > 0, or 'none' for no limit; got "
    elif kind == "gpu-ids":
        items = st.one_of(
            st.integers(-3, 5).map(str), st.integers(min_value=10**20).map(str), _text(max_size=4, exclude=",")
        )
        value = draw(st.lists(items, max_size=4).map(",".join).filter(lambda t: not _valid_gpu_ids(t, gpus)))
        refused = (
            r"--gpu-ids takes GPU indices separated by commas, e\.g\. --gpu-ids 0,1; got |gpu_ids must be a "
            r"non-empty list of GPU indices >= 0 such as \[0, 1\]; got |gpu_ids lists a GPU twice: .*; give each "
            rf"GPU once|gpu_ids names \d+ GPU\(s\) \(.*\) but gpus={gpus}; give one GPU index per rank"
        )
    elif kind == "gpu-type":
        value = draw(_BAD_GPU_TYPE)
        refused = (
            r"gpu_type must be a non-empty string such as 'H100' \(printable characters\), or None for any GPU; got "
        )
    elif kind == "output":
        value = draw(
            st.one_of(
                _text().filter(lambda t: not t.isidentifier() or keyword.iskeyword(t)), st.sampled_from(keyword.kwlist)
            )
        )
        refused = r"-o/--output takes a Python variable name such as job, to store the Job in; got "
    if kind == "profile":  # an optional value: one that starts with "-" (not a number) is a flag of its own
        return f"{base} --profile {shlex.quote(value)}", rf"^({refused}|unrecognized arguments: )"
    if kind in ("gpus", "port", "max-restarts", "timeout", "gpu-ids", "gpu-type", "output"):
        option = "-o" if kind == "output" else f"--{kind}"
        # argparse takes a value that starts with "-" (not a negative number) for an option
        missing = "-o/--output" if kind == "output" else option
        return f"{base} {option} {shlex.quote(value)}", rf"^({refused}|argument {missing}: expected one argument\n)"
    if kind == "unknown-flag":
        flags = st.builds(
            lambda dashes, first, rest: dashes + first + rest,
            st.sampled_from(["-", "--"]),
            st.sampled_from(string.ascii_lowercase),
            st.text(string.ascii_lowercase + string.digits + "-", max_size=12),
        )
        name = draw(flags.filter(lambda f: not any(o.startswith(f) for o in LONG_OPTIONS) and not f.startswith("-o")))
        return f"{base} {name}", rf"^unrecognized arguments: {re.escape(name)}\nusage: %%distributed --gpus GPUS"
    if kind == "stray-token":
        token = draw(_text().filter(lambda t: not t.startswith("-")))
        return (
            f"{base} {shlex.quote(token)}",
            rf"^unrecognized arguments: {re.escape(shlex.quote(token))}\nusage: %%distributed --gpus GPUS",
        )
    if kind == "missing-value":
        option = draw(st.sampled_from(VALUE_OPTIONS))
        shown = "-o/--output" if option in ("-o", "--output") else option
        return f"{base} {option}", rf"^argument {shown}: expected one argument\nusage: %%distributed --gpus GPUS"
    quote = draw(st.sampled_from(["'", '"']))
    text = draw(_text(exclude=quote + "\\"))
    return f"{base} --gpu-type {quote}{text}", r"^cannot read the %%distributed line \(No closing quotation\)"


def _lines_of(draw, size) -> list[str]:
    return draw(st.lists(st.sampled_from(BASE_CELL_LINES), min_size=size[0], max_size=size[1]))


@st.composite
def bad_cells(draw) -> tuple[str, type, str, int | None]:
    """``(cell, exception type, message regex, notebook line it must name)``: valid lines plus one bad line."""
    kind = draw(st.sampled_from(["empty", "syntax", "return", "yield", "ipython", "ipython-cell-magic"]))
    if kind == "empty":
        lines = draw(
            st.lists(st.sampled_from(["", "   ", "\t", "# a note", "    # indented note", "\x0c"]), max_size=4)
        )
        return "\n".join(lines), UsageError, r"cell body is empty|^the %%distributed cell has no code to run", None
    if kind == "ipython-cell-magic":
        body = "\n".join(_lines_of(draw, (0, 2)))
        return f"%%{draw(_IDENT)}\n{body}\n", CellSyntaxError, r"^line 2 of the cell, '%%.*', is IPython syntax", 2
    before, after = _lines_of(draw, (1, 3)), _lines_of(draw, (0, 2))
    name = draw(_IDENT)
    if kind == "syntax":
        unterminated = f"{name} = '" + draw(_text(exclude="'\\?"))
        bad = draw(
            st.sampled_from(
                [
                    f"{name} = (",
                    f"def {name}(:",
                    f"{name} = = 1",
                    f"class {name}",
                    f"{name} +",
                    "else:",
                    unterminated,
                    f"for {name} in",
                    f"{name}) = 1",
                    f"lambda {name}: (yield",
                ]
            )
        )
        message = r"."
    elif kind in ("return", "yield"):
        expr = draw(st.sampled_from(["", f" {name}", " 1 + 2", f" [{name}]"]))
        bad = f"{kind}{expr}" if kind == "return" else draw(st.sampled_from([f"yield{expr}", f"yield from [{name}]"]))
        message = rf"^'{kind}' outside function: a %%distributed cell is not a function"
    else:
        shell = draw(_text(max_size=15, exclude="\\"))
        bad = draw(
            st.sampled_from(
                [
                    f"%{name} {shell}",
                    f"!{shell}",
                    f"{name}?",
                    f"{name}??",
                    f"{name} = !{shell}",
                    f"%time {name} = 1",
                    f"{name} = %env",
                    f"%%{name}",
                ]
            )
        )
    lineno = sum(line.count("\n") + 1 for line in before) + 2  # notebook line of the bad one (line 1: %%distributed)
    if kind == "ipython":
        message = (
            rf"^line {lineno} of the cell, .* is IPython syntax \(a %magic, !shell command or \? help\), but "
            r"ranks run plain Python without IPython; run it in a cell of its own before the %%distributed cell"
        )
    cell = "\n".join([*before, bad, *after]) + "\n"
    return cell, CellSyntaxError, message, (lineno if kind != "syntax" else None)


_NOT_A_NUMBER = st.one_of(
    st.text(_CHARS, max_size=8),
    st.booleans(),
    st.binary(max_size=4),
    st.complex_numbers(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(_CHARS, max_size=3), st.integers(), max_size=2),
    st.decimals(),
    st.just(object()),
)
_NOT_AN_INT = st.one_of(_NOT_A_NUMBER, st.floats(), st.fractions())
"""Neither strategy gives ``None``, which means "default" for timeout and port."""
_NOT_A_SWITCH = st.one_of(
    st.text(_CHARS, max_size=8),
    st.integers().filter(lambda i: i not in (0, 1)),
    st.floats(),
    st.lists(st.booleans(), max_size=2),
    st.just(object()),
)


@st.composite
def bad_gpu_ids(draw, gpus: int):
    """``gpu_ids`` that are wrong for ``gpus`` ranks: not a list, a bad item, a GPU twice, the wrong count, an iterator."""
    good = st.integers(0, 10**6)
    kind = draw(st.sampled_from(["type", "item", "dup", "length", "iterator"]))
    if kind == "type":
        return draw(
            st.one_of(
                st.integers(),
                st.floats(),
                st.text(_CHARS, max_size=5),
                st.binary(max_size=3),
                st.booleans(),
                st.dictionaries(good, good, max_size=2),
                st.just(object()),
            )
        )
    if kind == "item":
        ids = draw(st.lists(good, max_size=3))
        bad = draw(
            st.one_of(
                st.integers(max_value=-1),
                st.floats(),
                st.none(),
                st.booleans(),
                st.text(_CHARS, max_size=3),
                st.lists(good, max_size=1),
            )
        )
        ids.insert(draw(st.integers(0, len(ids))), bad)
        return draw(st.sampled_from([list, tuple]))(ids)
    if kind == "dup":
        ids = draw(st.lists(good, min_size=1, max_size=3))
        return ids + [ids[0]]
    if kind == "length":
        return draw(st.lists(good, unique=True, max_size=5).filter(lambda ids: len(ids) != gpus))
    return iter(draw(st.lists(good, unique=True, min_size=gpus, max_size=gpus)))


@st.composite
def bad_decorator_kwargs(draw) -> tuple[dict, type, str]:
    """``(kwargs, exception type, message regex)``: valid ``@distributed`` keyword arguments, one of them bad."""
    kwargs = draw(
        st.sampled_from(
            [
                {"gpus": 1},
                {"gpus": 2, "timeout": 60, "mlflow": False},
                {"gpus": 2, "gpu_ids": [0, 1], "wait": False, "widgets": False},
                {"gpus": 1, "port": 29555, "max_restarts": 2, "max_capture_bytes": 1024},
            ]
        )
    )
    name = draw(
        st.sampled_from(
            [
                "gpus",
                "gpu_type",
                "timeout",
                "port",
                "gpu_ids",
                "max_restarts",
                "wait",
                "mlflow",
                "widgets",
                "max_capture_bytes",
                "cluster",
                "remote",
                "num_accelerators",
                "accelerator_type",
                "profile",
                "unknown",
            ]
        )
    )
    if name == "unknown":
        bad_name = draw(
            st.one_of(_IDENT, st.text(_CHARS, min_size=1, max_size=8).filter(str.isidentifier)).filter(
                lambda n: n not in ACCEPTED.split(", ")
            )
        )
        kwargs = {**kwargs, bad_name: draw(st.integers())}
        return (
            kwargs,
            TypeError,
            rf"^@distributed got unknown argument\(s\) {re.escape(repr(bad_name))}.*; it takes {ACCEPTED}",
        )
    strategies = {
        # gpus=None is every GPU of the machine (databricks.air's @distributed())
        "gpus": st.one_of(st.integers(max_value=0), st.integers(min_value=1025), _NOT_AN_INT, st.just(10**5000)),
        "gpu_type": st.one_of(
            _BAD_GPU_TYPE,
            st.integers(),
            st.floats(),
            st.binary(max_size=4),
            st.booleans(),
            st.lists(st.text(_CHARS, max_size=4), max_size=2),
        ),
        "timeout": st.one_of(
            st.floats(max_value=0.0),
            st.just(math.nan),
            st.integers(max_value=0),
            st.integers(min_value=2**1024),
            st.fractions(max_value=0),
            _NOT_A_NUMBER,
        ),
        "port": st.one_of(st.integers(max_value=0), st.integers(min_value=65536), _NOT_AN_INT),
        "gpu_ids": bad_gpu_ids(kwargs["gpus"]),
        "max_restarts": st.one_of(st.integers(max_value=-1), st.integers(min_value=1001), _NOT_AN_INT, st.none()),
        "wait": st.one_of(_NOT_A_SWITCH, st.none()),
        "mlflow": st.one_of(_NOT_A_SWITCH, st.none()),
        "widgets": _NOT_A_SWITCH,
        "max_capture_bytes": st.one_of(st.integers(max_value=-1), _NOT_AN_INT, st.none()),
        "cluster": st.one_of(
            st.integers(),
            st.floats(),
            st.booleans(),
            st.binary(max_size=4),
            st.just(""),
            st.text(_CHARS, max_size=8).filter(lambda t: ":" not in t and t.strip() != "auto"),
        ),
        "remote": st.one_of(_NOT_A_SWITCH, st.none()),
        "num_accelerators": st.one_of(st.integers(max_value=0), st.integers(min_value=1025), _NOT_AN_INT),
        "accelerator_type": st.one_of(
            st.integers(),
            st.booleans(),
            st.binary(max_size=4),
            st.just("GPU_0xH100"),
            st.text(_CHARS, max_size=8).filter(lambda t: "x" not in t.lower()),
        ),
        "profile": st.one_of(st.integers(max_value=0), st.integers(min_value=1001), _NOT_AN_INT),
    }
    messages = {
        "gpus": r"^gpus must be (an int >= 1 \(the number of ranks\)|between 1 and 1024), got ",
        "gpu_type": r"^gpu_type must be a non-empty string such as 'H100' \(printable characters\), or None for any GPU; got ",
        "timeout": r"^timeout must be a number of seconds > 0, or None for no limit; got ",
        "port": r"^port must be an int between 1 and 65535, or None to pick a free port; got ",
        "gpu_ids": r"^gpu_ids (must be a (non-empty )?list of GPU indices|lists a GPU twice|names \d+ GPU\(s\))",
        "max_restarts": r"^max_restarts must be an int between 0 and 1000 ",
        "wait": r"^wait must be True or False \(queue for GPUs other jobs hold, or fail at once\); got ",
        "mlflow": r"^mlflow must be True or False \(track the job as an MLflow run\); got ",
        "widgets": r"^widgets must be True, False or None \(the widget panel, plain text, or decide\); got ",
        "max_capture_bytes": r"^max_capture_bytes must be an int >= 0 \(bytes",
        "cluster": r"^cluster(='.*' is not a Ray address| must be 'auto' \(an already running or initialised Ray\))",
        "remote": r"^remote must be True or False \(run on the kernel's remote cluster, or on this machine\); got ",
        "num_accelerators": r"^num_accelerators must be (an int >= 1 \(the number of ranks\)|between 1 and 1024), got ",
        "accelerator_type": r"^accelerator_type takes the serverless GPU API's form 'GPU_<n>x<model>' with n >= 1, "
        r"such as 'GPU_8xH100' or 'GPU_1xA10'; got ",
        "profile": r"^profile must be a number of steps to profile between 1 and 1000 \(each rank's torch.profiler ",
    }
    if name in ("num_accelerators", "accelerator_type"):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("gpus", "gpu_ids")}  # no old name to disagree with
    return {**kwargs, name: draw(strategies[name])}, SpecError, messages[name]


# --- the properties --------------------------------------------------------------------------


@settings(PROPERTY)
@given(case=bad_lines())
@example(case=("--gpus 1 --gpu-type ''", r"^gpu_type must be a non-empty string"))
@example(case=("--gpus " + "9" * 4301, r"^argument --gpus: invalid int value: '9{4301}'"))  # past int()'s digit limit
@example(case=("--gpus 1 \\", r"^cannot read the %%distributed line \(No escaped character\)"))
@example(case=("--no-mlflow --timeout 60", r"^the following arguments are required: --gpus\nusage: %%distributed"))
def test_bad_magic_line_is_a_usage_error_naming_the_option(settled, ip, case):
    """Any bad option, flag, token or quote on the ``%%distributed`` line: ``UsageError`` naming it, nothing started."""
    line, pattern = case
    with settled(), pytest.raises(UsageError, match=pattern) as info:
        run_magic(ip, line)
    assert type(info.value) is UsageError


@settings(PROPERTY)
@given(case=bad_cells())
def test_bad_cell_is_refused_before_launch_naming_its_line(settled, ip, case):
    """Empty cells, syntax errors, top-level return/yield and IPython syntax: refused before launch.

    A SyntaxError carries the cell's file name and, where the bad line is known, its notebook line
    number (line 1 is the ``%%distributed`` line), so IPython points at it.
    """
    cell, error, pattern, lineno = case
    with settled(), pytest.raises(error, match=pattern) as info:
        run_magic(ip, "--gpus 2 --no-mlflow", cell)
    assert type(info.value) is error
    if issubclass(error, SyntaxError) and info.value.filename is not None:
        assert CELL.fullmatch(info.value.filename), info.value.filename
        assert 2 <= info.value.lineno <= cell.count("\n") + 2
    if lineno is not None:
        assert info.value.lineno == lineno


@settings(PROPERTY, max_examples=200)
@given(case=bad_decorator_kwargs())
def test_bad_decorator_argument_is_refused_at_the_decorator_line(settled, case):
    """Any bad ``@distributed(...)`` argument: ``SpecError`` (a ValueError) or ``TypeError`` naming it."""
    kwargs, error, pattern = case
    with settled(), pytest.raises(error, match=pattern) as info:
        distributed(**kwargs)
    assert type(info.value) is error


def _local_objects():
    """Callables that cannot run on the ranks, as a notebook would make them."""

    def plain(x):
        return x

    class Local:
        def method(self):
            return 1

        def __call__(self):
            return 2

    def gen():
        yield 1

    async def coro():
        return 1

    async def agen():
        yield 1

    return [
        (Local, r"got type .*Local, which has no code to send to the ranks; decorate a plain function"),
        (Local(), r"got .*Local, which has no code to send to the ranks"),
        (
            Local().method,
            r"got bound method .*Local\.method, whose object would not reach the ranks; decorate a "
            r"function that calls it instead, e.g\. def run\(\*args\): return obj\.method\(\*args\)",
        ),
        (functools.partial(plain, 1), r"got functools\.partial, which has no code to send to the ranks"),
        ([].append, r"got builtin_function_or_method list\.append, which has no code"),
        (gen, r".*gen is a generator function, whose result cannot be sent back from the ranks"),
        (coro, r".*coro is an async function, whose result cannot be sent back"),
        (
            agen,
            r".*agen is an async function, whose result cannot be sent back from the ranks; make it a plain def "
            r"that returns a value",
        ),
        (
            distributed(gpus=1)(plain),
            r"sgpu_magic\.DistributedFunction .*plain is already decorated with "
            r"@distributed; decorate the function once",
        ),
    ]


@settings(PROPERTY, max_examples=100)
@given(
    target=st.one_of(
        st.integers(),
        st.text(_CHARS, max_size=5),
        st.none(),
        st.floats(),
        st.lists(st.integers(), max_size=2),
        st.dictionaries(st.text(_CHARS, max_size=2), st.integers(), max_size=2),
        st.binary(max_size=3),
    )
)
def test_non_callable_is_refused_when_decorated(settled, target):
    """Decorating something that is not callable: ``SpecError`` at the decorator line, naming its type."""
    pattern = r"^@distributed\(\.\.\.\) decorates a function: got .*, which is not callable$"
    with settled(), pytest.raises(SpecError, match=pattern):
        distributed(gpus=2)(target)


@pytest.mark.parametrize("index", range(len(_local_objects())))
def test_callable_the_ranks_cannot_get_is_refused_with_the_remedy(settled, index):
    """Each kind of callable the ranks cannot get gets its own explanation, before anything starts."""
    target, pattern = _local_objects()[index]
    with settled(), pytest.raises(SpecError, match=r"^@distributed\(\.\.\.\) decorates a function: " + pattern):
        distributed(gpus=2)(target)


# --- inputs that escaped before, kept as plain cases ---------------------------------------------


@pytest.mark.parametrize(
    "line, message",
    [
        # was ValueError("No closing quotation") from shlex, not a UsageError
        (
            "--gpus 1 --gpu-type 'H100",
            r"^cannot read the %%distributed line \(No closing quotation\): \"--gpus 1 --gpu-type "
            r"'H100\"; close the quote$",
        ),
        # were accepted: gpu_type "''" (the quotes kept), or a NUL; on a machine without GPUs a job started
        (
            "--gpus 1 --gpu-type ''",
            r"^gpu_type must be a non-empty string such as 'H100' \(printable characters\), or None "
            r"for any GPU; got ''$",
        ),
        ("--gpus 1 --gpu-type \x00", r"^gpu_type must be a non-empty string .*; got '\\x00'$"),
        # were accepted: the job started, then was stored under a name no code can read
        ("--gpus 1 -o ''", r"^-o/--output takes a Python variable name such as job, to store the Job in; got ''$"),
        (
            "--gpus 1 -o 1abc",
            r"^-o/--output takes a Python variable name such as job, to store the Job in; got '1abc'$",
        ),
        ("--gpus 1 -o class", r"^-o/--output takes a Python variable name .*; got 'class'$"),
        # argparse's own errors now say what the magic takes
        (
            "--gpus 2 --bogus 3",
            r"^unrecognized arguments: --bogus 3\nusage: %%distributed --gpus GPUS \[--gpu-type GPU_TYPE\]",
        ),
        ("--gpus 2 ''", r"^unrecognized arguments: ''\nusage: %%distributed"),
    ],
    ids=[
        "unclosed-quote",
        "gpu-type-empty",
        "gpu-type-nul",
        "output-empty",
        "output-digit",
        "output-keyword",
        "unknown-flag",
        "empty-token",
    ],
)
def test_magic_line_regressions(settled, ip, line, message):
    """Magic lines that escaped validation before: each is now a ``UsageError`` naming the option."""
    with settled(), pytest.raises(UsageError, match=message):
        run_magic(ip, line)


IPYTHON_REMEDY = (
    r", is IPython syntax \(a %magic, !shell command or \? help\), but ranks run plain Python without "
    r"IPython; run it in a cell of its own before the %%distributed cell, or use Python \(e\.g\. "
    r"subprocess\.run\(\[\.\.\.\]\) for a shell command\)"
)


@pytest.mark.parametrize(
    "cell, error, message, lineno",
    [
        # IPython syntax: transformed into get_ipython() calls, which failed only inside the ranks
        # ("NameError: name 'get_ipython' is not defined" in a RankFailedError, after the launch)
        ("%pip list\n", CellSyntaxError, r"^line 2 of the cell, '%pip list'" + IPYTHON_REMEDY, 2),
        ("x = 1\n!ls -l\n", CellSyntaxError, r"^line 3 of the cell, '!ls -l'" + IPYTHON_REMEDY, 3),
        ("x = 1\nx?\n", CellSyntaxError, r"^line 3 of the cell, 'x\?'" + IPYTHON_REMEDY, 3),
        ("\n\nfiles = !ls\n", CellSyntaxError, r"^line 4 of the cell, 'files = !ls'" + IPYTHON_REMEDY, 4),
        ("%%bash\nls\n", CellSyntaxError, r"^line 2 of the cell, '%%bash'" + IPYTHON_REMEDY, 2),
        (
            "for i in range(2):\n    !echo $i\n",
            CellSyntaxError,
            r"^line 3 of the cell, '!echo \$i'" + IPYTHON_REMEDY,
            3,
        ),
        # started a job that ran nothing
        (
            "   \n",
            UsageError,
            r"^the %%distributed cell has no code to run; write the code for the ranks in the cell, "
            r"below the %%distributed line$",
            None,
        ),
        ("# the code is in the next cell\n", UsageError, r"^the %%distributed cell has no code to run", None),
        # was a bare MemoryError from CPython's parser
        (
            "-" * 10_000 + "1\n",
            CellSyntaxError,
            r"^the cell is nested too deeply for Python's compiler; split the expression",
            None,
        ),
        # was a bare RecursionError from CPython's compiler
        ("x = " + "-" * 3_000 + "1\n", CellSyntaxError, r"^the cell is nested too deeply for Python's compiler", None),
        # were SyntaxErrors already; now they say what to do instead
        (
            "x = 1\nreturn x\n",
            CellSyntaxError,
            r"^'return' outside function: a %%distributed cell is not a function; its last "
            r"expression \(on rank 0\) is the cell's output, so end the cell with the value "
            r"instead of return \(Cell In\[\d+\], line 3\)$",
            3,
        ),
        (
            "yield 1\n",
            CellSyntaxError,
            r"^'yield' outside function: a %%distributed cell is not a function and cannot yield; "
            r"collect the values in a list and end the cell with it \(Cell In\[\d+\], line 2\)$",
            2,
        ),
        (
            "await asyncio.sleep(0)\n",
            CellSyntaxError,
            r"^'await' outside function: .*asyncio\.run\(main\(\)\) \(Cell In\[\d+\], line 2\)$",
            2,
        ),
    ],
    ids=[
        "pip",
        "shell",
        "help",
        "assign-shell",
        "cell-magic",
        "indented-shell",
        "blank",
        "comment-only",
        "deep-parse",
        "deep-compile",
        "return",
        "yield",
        "await",
    ],
)
def test_cell_regressions(settled, ip, cell, error, message, lineno):
    """Cells that launched before and failed in the ranks (or started an empty job, or crashed the parser)."""
    with settled(), pytest.raises(error, match=message) as info:
        run_magic(ip, "--gpus 2", cell)
    assert type(info.value) is error
    if lineno is not None:
        assert CELL.fullmatch(info.value.filename) and info.value.lineno == lineno, info.value.filename


class _NoTruth:
    def __bool__(self):
        raise RuntimeError("no truth value")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        # was ValueError "Exceeds the limit (4300 digits) for integer string conversion" from the message itself
        ({"gpus": 10**5000}, SpecError, r"^gpus must be between 1 and 1024, got an int of 16610 bits$"),
        # was OverflowError "int too large to convert to float"
        (
            {"gpus": 1, "timeout": 10**400},
            SpecError,
            r"^timeout must be a number of seconds > 0, or None for no limit; "
            r"got an int of 1329 bits \(too large for a float\)$",
        ),
        # was accepted
        (
            {"gpus": 1, "gpu_type": "H100\x00"},
            SpecError,
            r"^gpu_type must be a non-empty string such as 'H100' "
            r"\(printable characters\), or None for any GPU; got 'H100\\x00'$",
        ),
        # passed the decorator line (which consumed it), then failed at the function with a misleading message
        (
            {"gpus": 1, "gpu_ids": iter([0])},
            SpecError,
            r"^gpu_ids must be a list of GPU indices such as \[0, 1\], or None "
            r"for any free GPUs; got <list_iterator .*> \(an iterator can be "
            r"read only once; pass list\(\.\.\.\)\)$",
        ),
        # was accepted as gpu_ids=[0]
        (
            {"gpus": 1, "gpu_ids": {0: 1}},
            SpecError,
            r"^gpu_ids must be a list of GPU indices such as \[0, 1\], or None "
            r"for any free GPUs; got \{0: 1\}$",
        ),
        # were read as True
        (
            {"gpus": 1, "wait": "no"},
            SpecError,
            r"^wait must be True or False \(queue for GPUs other jobs hold, or fail at "
            r"once\); got 'no'$",
        ),
        (
            {"gpus": 1, "mlflow": "false"},
            SpecError,
            r"^mlflow must be True or False \(track the job as an MLflow run\); "
            r"got 'false'$",
        ),
        # was the object's own RuntimeError, from bool(widgets) inside make_spec
        (
            {"gpus": 1, "widgets": _NoTruth()},
            SpecError,
            r"^widgets must be True, False or None \(the widget panel, plain "
            r"text, or decide\); got <.*_NoTruth object at .*>$",
        ),
        # was accepted; fn.distributed() then raised TypeError "'>' not supported between instances of 'int' and 'str'"
        (
            {"gpus": 1, "max_capture_bytes": "big"},
            SpecError,
            r"^max_capture_bytes must be an int >= 0 \(bytes; captured "
            r"globals larger than this get a warning\), got 'big'$",
        ),
        # was "distributed() got an unexpected keyword argument 'gpu'": now the near miss and what is accepted
        (
            {"gpus": 1, "gpu": 2},
            TypeError,
            rf"^@distributed got unknown argument\(s\) 'gpu' \(did you mean 'gpus'\?\); "
            rf"it takes {ACCEPTED} \(see help\(distributed\)\)$",
        ),
        # was "unknown argument 'remote'", although the docstring claimed the serverless GPU API's shape
        (
            {"gpus": 1, "remote": "yes"},
            SpecError,
            r"^remote must be True or False \(run on the kernel's remote cluster, or "
            r"on this machine\); got 'yes'$",
        ),
        # stuck_after_s was a %config trait only: the decorator now takes it and refuses a bad one as the trait
        (
            {"gpus": 1, "stuck_after_s": -1.0},
            SpecError,
            r"^stuck_after_s must be a number of seconds > 0, or None for no limit; got -1.0$",
        ),
    ],
    ids=[
        "gpus-huge",
        "timeout-huge",
        "gpu-type-nul",
        "gpu-ids-iterator",
        "gpu-ids-dict",
        "wait-string",
        "mlflow-string",
        "widgets-no-truth",
        "max-capture-bytes-string",
        "near-miss",
        "remote-string",
        "stuck-after-negative",
    ],
)
def test_decorator_regressions(settled, kwargs, error, message):
    """Decorator arguments that escaped before: each is now refused at the decorator line, naming the argument."""
    with settled(), pytest.raises(error, match=message) as info:
        distributed(**kwargs)
    assert type(info.value) is error


def test_valid_switch_and_gpu_id_forms_are_still_accepted():
    """The tightened checks keep what was valid: 0/1 for switches, tuples and ranges for gpu_ids, inf timeout."""

    def f():
        return 1

    fn = distributed(gpus=2, gpu_ids=range(2), wait=0, mlflow=1, widgets=None, timeout=math.inf, max_capture_bytes=0)(f)
    assert (fn.spec.gpu_ids, fn.spec.wait, fn.spec.mlflow, fn.spec.widgets, fn.spec.timeout_s) == (
        (0, 1),
        False,
        True,
        None,
        None,
    )
    assert distributed(gpus=2, gpu_ids=(1, 0))(f).spec.gpu_ids == (1, 0)
    assert distributed(gpus=1)(len).spec.name == "len"  # a builtin goes to the ranks by reference


def test_bad_cluster_arguments_are_refused_before_anything_starts():
    """cluster= (Ray) is checked at the decorator line, with or without Ray installed."""
    with pytest.raises(SpecError, match=r"cluster must be 'auto' .* got 42"):
        distributed(gpus=2, cluster=42)
    with pytest.raises(SpecError, match=r"cluster='nowhere' is not a Ray address"):
        distributed(gpus=2, cluster="nowhere")
    with pytest.raises(SpecError, match=r"gpu_ids cannot be used with cluster="):
        distributed(gpus=2, cluster="auto", gpu_ids=[0, 1])
    assert distributed(gpus=2, cluster="auto", max_restarts=1)(len).spec.max_restarts == 1  # restarts on Ray too


def test_cluster_without_ray_installed_says_how_to_get_it(monkeypatch):
    """Where Ray is not installed (sys.modules["ray"] = None makes ``import ray`` fail, as Python documents)."""
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)
    fn = distributed(gpus=2, cluster="auto", mlflow=False, widgets=False)(lambda: 1)
    with pytest.raises(SpecError, match=r'^cluster= needs Ray: pip install "sgpu_magic\[ray\]"'):
        fn.distributed()


def test_a_bad_cluster_on_the_magic_line_is_a_usage_error(settled, ip):
    with pytest.raises(UsageError, match=r"^cluster='nowhere' is not a Ray address"):
        ip.run_cell_magic("distributed", "--gpus 2 --cluster nowhere", "1")


def test_gpus_left_out_is_every_gpu_and_misspelled_is_named():
    """``@distributed()`` is databricks.air's "every GPU of the node": here, with no GPU, 1 CPU rank."""
    assert distributed()(len).spec.gpus == 1
    with pytest.raises(TypeError, match=r"^@distributed got unknown argument\(s\) 'gpu' \(did you mean 'gpus'\?\)"):
        distributed(gpu=2)


def test_a_ray_address_where_nothing_listens_is_refused():
    """Ray's own connect retries for minutes; sgpu_magic checks the address first (CONNECT_CHECK_S)."""
    import socket

    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("this process is already a Ray driver")
    from sgpu_magic.errors import ResourceError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    with pytest.raises(
        ResourceError,
        match=rf"^cannot connect to the Ray cluster '127.0.0.1:{port}': nothing answers "
        rf"at 127.0.0.1:{port} .*start one \(ray start --head\) or check the address",
    ):
        distributed(gpus=2, cluster=f"127.0.0.1:{port}", mlflow=False, widgets=False)(lambda: 1).distributed()
    assert not ray.is_initialized()


def test_the_core_never_imports_ray():
    """Ray is an optional extra: loading the extension and using both front doors imports no Ray."""
    import subprocess
    import sys

    code = (
        "import sys, sgpu_magic, sgpu_magic.front.decorator, sgpu_magic.front.magics, sgpu_magic.job.handle, sgpu_magic.launch.host.process\n"
        "from sgpu_magic import distributed\n"
        "distributed(gpus=2, cluster='auto')(len)\n"  # validating cluster= needs no Ray either
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
