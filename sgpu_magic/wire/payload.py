"""What a rank runs, typed: ``payload.pkl`` of a job (and of each session cell).

The kernel builds a :class:`Payload` (:mod:`sgpu_magic.capture` and the front doors), pickles it into the run
directory and each rank reads it back through the private-read check (pickles are code). It is written and read by
one installation of sgpu_magic (a job's payload is deleted when the job ends), so it needs no schema number; its
kind is the class of :attr:`Payload.body`:

- :class:`FunctionRef`: a function of an importable module, by name; :class:`FunctionCode`: a notebook function's
  code and closure (cloudpickled), each called with :attr:`Payload.args` / :attr:`Payload.kwargs`;
- :class:`Cell`: a ``%%distributed`` (or session) cell's source;
- :class:`Script`: a script file or ``-m`` module, run as torchrun runs it;
- :class:`SessionRanks`: a live session's ranks, which then serve cells (:mod:`sgpu_magic.rank.session`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

GlobalEntry = tuple
"""One captured global: ``("module", name)``, ``("value", cloudpickled bytes)`` or ``("unpicklable", name, type,
reason)`` (:mod:`sgpu_magic.capture`)."""


@dataclass(frozen=True)
class FunctionRef:
    """A function found by ``importlib.import_module(module)`` then ``qualname`` (an ``@distributed`` one's own
    function when it is one)."""

    module: str
    qualname: str


@dataclass(frozen=True)
class FunctionCode:
    """A notebook function: ``shell`` is its code, name, qualname, defaults, keyword defaults and closure,
    cloudpickled; its globals are the rank's namespace."""

    shell: bytes


@dataclass(frozen=True)
class Cell:
    """A cell's source, compiled as ``filename``; ``quiet``: it ends with ``;`` (no value); ``cell_label``: how
    IPython names it (``Cell In[4]``), for its frames in tracebacks and stacks."""

    source: str
    filename: str = "<cell>"
    quiet: bool = False
    cell_label: str | None = None


@dataclass(frozen=True)
class Script:
    """A script file (``script``) or a module for ``-m`` (``module``), run with :attr:`Payload.argv` as
    ``sys.argv``."""

    script: str | None
    module: str | None = None


@dataclass(frozen=True)
class SessionRanks:
    """A live session's ranks: they serve the kernel's cells (over the FIFOs in their run directory) until the
    session stops; ``detached``: the ranks outlive the kernel, ending after ``idle_timeout_s`` seconds without a
    command (``None``: no limit)."""

    detached: bool = False
    idle_timeout_s: float | None = None


Body = FunctionRef | FunctionCode | Cell | Script | SessionRanks
"""What a payload runs."""

_KINDS: dict[type, str] = {
    FunctionRef: "ref",
    FunctionCode: "code",
    Cell: "cell",
    Script: "script",
    SessionRanks: "session",
}


@dataclass
class Payload:
    """``payload.pkl``: what the ranks run, and what they need around it.

    Attributes:
        body: what runs (its class is the payload's kind).
        globals: ``{name: entry}`` of the notebook's values the code reads (see :data:`GlobalEntry`).
        sources: ``{filename: text}`` of the notebook cells its functions come from (for tracebacks and stacks).
        warnings: what the capture warned about (shown in the kernel before the launch).
        display_names: ``{filename: "Cell In[3]"}``, as IPython labels its cells.
        args, kwargs: a function's arguments, each cloudpickled.
        argv: the ranks' ``sys.argv`` (``None``: the job's name alone).
        profile_steps: profile that many of the run's steps (:mod:`sgpu_magic.rank.profile`; ``None``: none).
    """

    body: Body
    globals: dict[str, GlobalEntry] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    display_names: dict[str, str] = field(default_factory=dict)
    args: list[bytes] = field(default_factory=list)
    kwargs: dict[str, bytes] = field(default_factory=dict)
    argv: list[str] | None = None
    profile_steps: int | None = None

    @property
    def kind(self) -> str:
        """``ref``, ``code``, ``cell``, ``script`` or ``session`` (as a rank's exit record names it)."""
        return _KINDS[type(self.body)]

    def code_labels(self) -> tuple[dict[str, str], dict[str, str]]:
        """``({filename: label}, {filename: source})`` of the notebook code it runs: its display names and sources,
        and a cell's own source under its label."""
        labels, sources = dict(self.display_names), dict(self.sources)
        if isinstance(self.body, Cell):
            sources[self.body.filename] = self.body.source
            if self.body.cell_label:
                labels[self.body.filename] = self.body.cell_label
        return labels, sources
