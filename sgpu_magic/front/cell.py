"""What ``%%distributed`` checks in its line and its cell before anything starts: the options' values, the cell's
syntax (as IPython compiles it), and whether the cell ends with ``;``."""

from __future__ import annotations

import ast
import contextlib
import keyword
import shlex
from collections.abc import Iterator

from IPython.core.error import UsageError
from IPython.utils.process import arg_split

from sgpu_magic import capture
from sgpu_magic.errors import CellSyntaxError
from sgpu_magic.front.magic_help import usage_line
from sgpu_magic.spec import shown


@contextlib.contextmanager
def as_usage_error(*kinds: type[BaseException]) -> Iterator[None]:
    """The one boundary where an error of what the user typed becomes IPython's ``UsageError`` (shown as its
    message, without a traceback): an error of one of ``kinds`` raised in the block (a
    :class:`~sgpu_magic.errors.SpecError` naming a bad option, a :class:`~sgpu_magic.errors.SessionError` naming an
    unknown session, a script path that does not exist) is re-raised as ``UsageError(str(error))``; anything else
    (a rank's error, an interrupt) passes as it is."""
    try:
        yield
    except kinds as exc:
        raise UsageError(str(exc)) from None


def parse_timeout(text: str | None, default: float | None) -> float | None:
    if text is None:
        return default
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise UsageError(f"--timeout takes a number of seconds > 0, or 'none' for no limit; got {shown(text)}")
    return value


def parse_gpu_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise UsageError(
            f"--gpu-ids takes GPU indices separated by commas, e.g. --gpu-ids 0,1; got {shown(text)}"
        ) from None


def parse_line(parser, line: str, magic: str = "%%distributed"):
    """The magic's options: ``line`` split as a POSIX shell does (``--gpu-type ''`` is an empty value), then argparse.

    Raises:
        UsageError: an unclosed quote, or what argparse refuses (followed by the usage line).
    """
    try:
        argv = arg_split(line, posix=True)
    except ValueError as exc:  # shlex: "No closing quotation"
        raise UsageError(f"cannot read the {magic} line ({exc}): {shown(line)}; close the quote") from None
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # as parse_args, but quoted: an empty or blank argument stays visible
            parser.error(f"unrecognized arguments: {shlex.join(extra)}")
        return args
    except UsageError as exc:
        raise UsageError(f"{exc}\nusage: {usage_line(parser)} ({magic}? shows the help)") from None


def check_output_name(name: str | None) -> None:
    if name is not None and (not name.isidentifier() or keyword.iskeyword(name)):
        raise UsageError(
            f"-o/--output takes a Python variable name such as job, to store the Job in; got {shown(name)}"
        )


CELL_FILENAME = "<%%distributed cell>"
"""File name of the cell's code in the ranks (its frames are shown as ``Cell In[N]``, the cell's label, through the
payload's ``display_names``); line numbers are those of the notebook cell."""


def cell_label(shell) -> str:
    """``Cell In[4]``: the running cell as IPython names it in tracebacks (its execution count)."""
    return f"Cell In[{shell.displayhook.prompt_count}]"


def _aligned_source(cell: str, transformed: str) -> str:
    """Pad ``transformed`` so its line numbers match the notebook cell, whose line 1 is ``%%distributed``.

    IPython's transforms drop the cell's leading blank lines; they are put back here.
    """
    lines = cell.splitlines()
    leading = next((i for i, line in enumerate(lines) if line.strip()), len(lines))
    return "\n" * (1 + leading) + transformed


_OUTSIDE_FUNCTION_HINTS = {
    "'return' outside function": "a %%distributed cell is not a function; its last expression (on rank 0) is the "
    "cell's output, so end the cell with the value instead of return",
    "'yield' outside function": "a %%distributed cell is not a function and cannot yield; collect the values in a "
    "list and end the cell with it",
    "'await' outside function": "ranks run the cell as plain Python, without an event loop; put the code in "
    "async def main(): ... and end the cell with asyncio.run(main())",
}


def _compile_cell(source: str, label: str = CELL_FILENAME) -> ast.Module:
    """Parse and compile the cell as the ranks will; a SyntaxError names the notebook line (and a remedy), the cell
    named ``label`` (``Cell In[4]``, as IPython names it).

    Raises:
        CellSyntaxError: (a ``SyntaxError``) the cell is not Python, or not Python the ranks can run.
    """
    try:
        tree = ast.parse(source, label)
        compile(tree, label, "exec")  # 'return' / 'yield' outside a function are found here, not by parse
    except SyntaxError as exc:
        hint = _OUTSIDE_FUNCTION_HINTS.get(exc.msg)
        lines = source.splitlines()
        lineno = exc.lineno or 0
        text = exc.text if exc.text is not None or not 0 < lineno <= len(lines) else lines[lineno - 1]
        raise CellSyntaxError(
            f"{exc.msg}: {hint}" if hint else exc.msg,
            (exc.filename, exc.lineno, exc.offset, text, exc.end_lineno, exc.end_offset),
        ) from None
    except (RecursionError, MemoryError):  # CPython's parser and compiler give up on very deep nesting this way
        raise CellSyntaxError(
            "the cell is nested too deeply for Python's compiler; split the expression into several statements",
            (label, None, None, None),
        ) from None
    return tree


def ends_quiet(source: str) -> bool:
    """Whether the cell ends with ``;``, so IPython would not show its value (IPython's own rule: the last token
    that is not a newline or comment is ``;``)."""
    from IPython.core.displayhook import DisplayHook

    rule = getattr(DisplayHook, "semicolon_at_end_of_expression", None)
    if rule is not None:
        return bool(rule(source))
    import io
    import tokenize

    for token in reversed(list(tokenize.generate_tokens(io.StringIO(source).readline))):
        if token.type not in (tokenize.ENDMARKER, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            return token.type == tokenize.OP and token.string == ";"
    return False


def checked_source(cell: str, transformed: str, label: str = CELL_FILENAME) -> str:
    """The cell as the ranks run it, refused before launch when it cannot run there; ``label`` names the cell in a
    syntax error (``Cell In[4]``, as IPython names it).

    Raises:
        CellSyntaxError: (a ``SyntaxError``) the cell is not Python, or a line is IPython syntax (``%magic``,
            ``!shell``, ``name?``), which ranks, being plain Python, cannot run; it names the line and the remedy.
        UsageError: the cell has no code.
    """
    source = _aligned_source(cell, transformed)
    tree = _compile_cell(source, label)
    if not tree.body:
        raise UsageError(
            "the %%distributed cell has no code to run; write the code for the ranks in the cell, "
            "below the %%distributed line"
        )
    lineno = capture.ipython_syntax_line(tree)
    if lineno is not None:
        lines = cell.splitlines()
        text = lines[lineno - 2] if 0 <= lineno - 2 < len(lines) else source.splitlines()[lineno - 1]
        raise CellSyntaxError(
            f"line {lineno} of the cell, {shown(text.strip())}, is IPython syntax (a %magic, !shell "
            f"command or ? help), but ranks run plain Python without IPython; run it in a cell of "
            f"its own before the %%distributed cell, or use Python (e.g. subprocess.run([...]) for a "
            f"shell command)",
            (label, lineno, 1, text, lineno, len(text) + 1),
        )
    return source


def show_cell_syntax_errors_alone(shell) -> None:
    """Have IPython show a :class:`~sgpu_magic.errors.CellSyntaxError` as it shows a syntax error in a cell.

    IPython prints a ``SyntaxError`` raised while a cell runs with the frames that raised it (here ten
    of IPython's and sgpu_magic's); through its handler for chosen exception types
    (``InteractiveShell.set_custom_exc``, with the handler its docs show) it prints the cell's line, a
    caret and the message, as for other bad input. The shell has one such slot: one that holds
    another handler is left alone.
    """
    if shell.custom_exceptions:
        return

    def show(shell, etype, value, tb, tb_offset=None) -> None:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)  # a SyntaxError: shown without frames

    shell.set_custom_exc((CellSyntaxError,), show)
