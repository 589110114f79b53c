"""The help text of sgpu_magic's magics (``%%distributed?``, ``%distributed_jobs?`` ...).

Each magic's docstring is its help, in the shape of IPython's own magics' (``%timeit?``,
``%%capture?``): the usage line (made by ``@magic_arguments`` from the options), a summary,
the details, the options, then an ``Examples`` section and a ``See also`` list of the other
magics. A magic gets the last two from :func:`magic_help`; a new magic adds its line to
:data:`MAGICS` and follows the same pattern::

    @magic_arguments(name="%distributed")       # a cell magic: its usage line reads %%distributed
    @argument("--gpus", ...)
    @magic_help("%%distributed", examples=\"\"\"
        %%distributed --gpus 2
        print("hello from every rank")
        \"\"\")
    @cell_magic
    def distributed(self, line, cell):
        \"\"\"One-line summary. Details ...\"\"\"
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from typing import Any, TypeVar

MAGICS = {
    "%%distributed": "run the cell on N ranks (%%distributed --gpus N [options])",
    "%distributed_run": "run a script or module on N ranks as torchrun does (%distributed_run --gpus N script.py ...)",
    "%distributed_session": "start, show, restart or stop a live session (ranks that keep their state between cells)",
    "%distributed_push": "copy kernel values into every rank's namespace of a live session",
    "%distributed_pull": "copy a value from a live session's ranks into the kernel",
    "%distributed_debug": "pdb in a rank where a session cell failed; a failed job's saved traceback and locals",
    "%distributed_jobs": "this kernel's jobs: state, world size, elapsed time, MLflow run; --all: your detached runs",
    "%distributed_attach": "attach to a detached run (--detach) from any of your kernels: its panel, every line, result",
    "%distributed_stop": "cancel a job of this kernel (every rank stopped), or all of them with --all",
    "%distributed_stacks": "the Python stack of every running rank of a job, notebook frames as Cell In[N] line L",
    "%mlflow_ui": "a local MLflow UI server for the kernel's store, so run links work",
    "%distributed_doctor": "what a job will use and what is wrong (GPUs, leases, ports, MLflow, widgets, Ray ...)",
}
"""Every magic sgpu_magic adds, with one line each for the ``See also`` sections."""

SEE_ALSO_EXTRA = (
    "%config DistributedMagics : the defaults (timeout_s, widgets, mlflow, max_log_lines, ...) and their help"
)


_F = TypeVar("_F", bound=Callable[..., Any])


def magic_help(name: str, examples: str) -> Callable[[_F], _F]:
    """Decorator: append ``Examples`` (``examples``, code as typed in a cell) and ``See also`` (the
    other :data:`MAGICS`) to the magic's docstring.

    Place it below ``@magic_arguments`` (which turns the docstring into the help text when it runs)
    and above ``@cell_magic`` / ``@line_magic``.

    Args:
        name: the magic as typed, ``"%%distributed"`` or ``"%distributed_jobs"``; left out of its own
            ``See also``.
        examples: one or more examples, blank-line separated.
    """

    def decorate(fn: _F) -> _F:
        fn.__doc__ = help_text(fn.__doc__ or "", name, examples)
        return fn

    return decorate


def help_text(doc: str, name: str, examples: str) -> str:
    """``doc`` (cleaned of its indentation) with the ``Examples`` and ``See also`` sections of :func:`magic_help`."""
    code = textwrap.indent(textwrap.dedent(examples).strip("\n"), "  ")
    others = [f"{magic} : {what}" for magic, what in MAGICS.items() if magic != name] + [SEE_ALSO_EXTRA]
    return (
        f"{inspect.cleandoc(doc)}\n\nExamples\n--------\n::\n\n{code}\n\n"
        f"See also\n--------\n" + "\n".join(others) + "\n"
    )


def usage_line(parser) -> str:
    """The magic's usage on one line, as its help shows it: ``%%distributed --gpus GPUS [--gpu-type ...] ...``."""
    return " ".join(parser.format_usage().replace("::", "", 1).split())
