"""Stacks of running ranks, taken from outside with py-spy and read as the notebook shows its code.

`py-spy <https://github.com/benfred/py-spy>`_ (a dependency; its wheel ships the binary) reads a process's Python
stack from its memory, with no cooperation from the process: ``py-spy dump --json --pid <pid>``. The launch host
takes every running rank's stack this way just before its run machine stops a job that timed out or was cancelled
(:func:`take_stacks`, then :func:`write_stacks`; on Ray each rank's agent takes it on its node), and the kernel does
for ``job.stacks()`` (:func:`live_stacks`). Each rank gets its own
py-spy, all at once, each bounded by :data:`DUMP_TIMEOUT_S`; a rank whose stack cannot be taken gets one line that
says why.

Frames from the notebook read as the notebook shows them: ``Cell In[4] line 7`` rather than a temporary file or
``<%%distributed cell>``, from the job's :class:`CodeMap` (``code.json`` in the run directory, written by the kernel
from the payload). A stack's summary names the deepest frame of the user's code and the call it makes there:
``dist.broadcast at Cell In[4] line 7``.
"""

from __future__ import annotations

import ast
import json
import linecache
import os
import re
import secrets
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sgpu_magic.errors import SgpuError
from sgpu_magic.rundir import RunDir, atomic_write_bytes, atomic_write_json, read_json, read_private
from sgpu_magic.status import HostStatus
from sgpu_magic.wire.host import StacksReply

if TYPE_CHECKING:
    from sgpu_magic.wire.payload import Payload

DUMP_TIMEOUT_S = 5.0
"""Seconds one rank's ``py-spy dump`` may take (all ranks are dumped at once) before it is killed."""

MAX_NAME = 160
"""Characters of a frame's name shown (a native C++ frame's can run to thousands)."""

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # sgpu_magic/
_LIBRARIES = tuple(
    {os.path.realpath(sysconfig.get_path(name)) + os.sep for name in ("stdlib", "platstdlib", "purelib", "platlib")}
)


@dataclass(frozen=True)
class CodeMap:
    """How the notebook names the job's code: written by the kernel into ``code.json`` before the launch.

    Attributes:
        labels: ``{filename: "Cell In[4]"}``, as IPython labels cells in its tracebacks (the payload's
            ``display_names``, plus the ``%%distributed`` cell's own).
        sources: ``{filename: source text}`` of the notebook's cells and functions that the job runs (a
            ``%%distributed`` cell's is aligned with the notebook's lines: :func:`sgpu_magic.front.cell.checked_source`).
    """

    labels: dict[str, str] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_payload(cls, payload: Payload) -> CodeMap:
        """The map of a job's payload (its display names and sources, and a cell's own source and label)."""
        return cls(*payload.code_labels())

    @classmethod
    def read(cls, path: Path) -> CodeMap:
        """The map in ``path`` (``code.json``); an empty one when there is none (frames keep their file names)."""
        data = read_json(path) or {}
        return cls(data.get("labels", {}), data.get("sources", {}))

    def write(self, path: Path) -> None:
        atomic_write_json(path, {"labels": self.labels, "sources": self.sources})

    def is_user(self, filename: str) -> bool:
        """Whether ``filename`` is the user's code: a notebook cell or function, or a file outside sgpu_magic,
        the standard library and the installed packages (a script, a module next to the notebook), never a
        native frame (``--native``)."""
        if filename in self.labels or filename in self.sources:
            return True
        if not filename.endswith(".py"):  # <string>, <frozen ...>, a native frame's shared library
            return False
        path = os.path.realpath(filename)
        return not (filename.startswith(_PACKAGE) or path.startswith(_PACKAGE) or path.startswith(_LIBRARIES))

    def place(self, filename: str, line: int) -> str:
        """``Cell In[4] line 7`` for a notebook frame, else ``path/to/file.py line 7``."""
        return f"{self.labels.get(filename, filename)} line {line}"

    def line_text(self, filename: str, line: int) -> str:
        """The source of line ``line``, stripped; ``""`` when unknown."""
        if filename in self.sources:
            lines = self.sources[filename].splitlines()
            return lines[line - 1].strip() if 0 < line <= len(lines) else ""
        return linecache.getline(filename, line).strip() if not filename.startswith("<") else ""


@dataclass(frozen=True)
class Frame:
    """One frame of a py-spy stack: function ``name`` at ``filename`` (``short``: as py-spy shortens it) ``line``."""

    name: str
    filename: str
    short: str
    line: int


@dataclass(frozen=True)
class Thread:
    """One Python thread of a rank: py-spy's header line and its frames, innermost first."""

    header: str
    frames: tuple[Frame, ...]


def call_name(text: str, inner: tuple[Frame, ...] = ()) -> str | None:
    """The call a line of source makes, as written: ``dist.broadcast`` for ``dist.broadcast(t, src=1)``.

    Of several calls, the one whose name is among the ``inner`` frames (those it called), else the outermost.
    """
    try:
        calls = [node.func for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Call)]
        names = [ast.unparse(func) for func in calls if isinstance(func, ast.Name | ast.Attribute)]
    except SyntaxError:  # a part of a statement that spans lines: `dist.broadcast(t,`
        names = re.findall(r"([A-Za-z_][\w.]*)\s*\(", text)
    called = {frame.name for frame in inner}
    return next((n for n in names if n.rsplit(".", 1)[-1] in called), names[0] if names else None)


def where(threads: list[Thread], code: CodeMap) -> str:
    """Where a rank is: ``dist.broadcast at Cell In[4] line 7`` (the deepest frame of the user's code, in the
    main thread if it has one, and the call made there), else the innermost frame: ``wait at threading.py:320``."""
    found = user_frame(threads, code)
    if found is not None:
        thread, i = found
        frame = thread.frames[i]
        call = call_name(code.line_text(frame.filename, frame.line), thread.frames[:i])
        return f"{call or frame.name} at {code.place(frame.filename, frame.line)}"
    frames = [t.frames[0] for t in threads if t.frames]
    return f"{frames[0].name} at {frames[0].short}:{frames[0].line}" if frames else "no Python frame"


def user_frame(threads: list[Thread], code: CodeMap) -> tuple[Thread, int] | None:
    """The deepest frame of the user's code (``(thread, index in its frames)``), the main thread's first; ``None``
    when no thread runs the user's code."""
    for thread in sorted(threads, key=lambda t: "MainThread" not in t.header and not t.header.endswith("(main)")):
        for i, frame in enumerate(thread.frames):
            if code.is_user(frame.filename):
                return thread, i
    return None


def _in_collective(threads: list[Thread], code: CodeMap) -> bool:
    """Whether the user's deepest frame called into ``torch.distributed`` (a collective or point-to-point call,
    which waits in C++ for the other ranks)."""
    found = user_frame(threads, code)
    if found is None:
        return False
    thread, i = found
    return any("/torch/distributed/" in frame.filename for frame in thread.frames[:i])


def _render_thread(thread: Thread, code: CodeMap) -> list[str]:
    """The thread as py-spy prints it, notebook frames named as the notebook does and followed by their source
    line; the frames outside the outermost user frame (sgpu_magic's rank entry) summed up in one line."""
    user = [i for i, frame in enumerate(thread.frames) if code.is_user(frame.filename)]
    shown = thread.frames[: user[-1] + 1] if user else thread.frames
    lines = [thread.header]
    for frame in shown:
        if code.is_user(frame.filename):
            lines.append(f"    {frame.name} ({code.place(frame.filename, frame.line)})")
            text = code.line_text(frame.filename, frame.line)
            lines += [f"        {text}"] if text else []
        else:
            name = frame.name if len(frame.name) <= MAX_NAME else frame.name[: MAX_NAME - 3] + "..."
            lines.append(f"    {name} ({frame.short}:{frame.line})")
    if len(shown) < len(thread.frames):
        lines.append(f"    ... {len(thread.frames) - len(shown)} frames of sgpu_magic's rank entry")
    return lines


@dataclass(frozen=True)
class RankStack:
    """One rank's stack (``text``: every Python thread, innermost frame first) and its one-line ``where``; when
    it could not be taken, ``where`` says why (``no stack: ...``)."""

    rank: int
    pid: int
    where: str
    text: str
    line: str = ""
    """The source line of the user's deepest frame (``dist.all_reduce(t)``); ``""`` when unknown."""
    in_collective: bool = False
    """Whether that frame is in a ``torch.distributed`` call (a collective waiting for its peers)."""


def _parse(rank: int, pid: int, out: str, code: CodeMap) -> RankStack:
    threads = []
    for t in json.loads(out):
        state = ("active" if t.get("active") else "idle") + (", holds the GIL" if t.get("owns_gil") else "")
        name = (
            f': "{t["thread_name"]}"' if t.get("thread_name") else (" (main)" if t.get("os_thread_id") == pid else "")
        )
        frames = tuple(
            Frame(
                f.get("name", "?"),
                f.get("filename", "?"),
                f.get("short_filename") or f.get("filename", "?"),
                f.get("line", 0),
            )
            for f in t.get("frames", [])
        )
        threads.append(Thread(f"Thread {t.get('os_thread_id') or t.get('thread_id')} ({state}){name}", frames))
    at = where(threads, code)
    body = [line for thread in threads for line in [*_render_thread(thread, code), ""]]
    found = user_frame(threads, code)
    source = code.line_text(found[0].frames[found[1]].filename, found[0].frames[found[1]].line) if found else ""
    text = "\n".join([f"rank {rank} (pid {pid}): {at}", *body]).rstrip() + "\n"
    return RankStack(rank, pid, at, text, source, _in_collective(threads, code))


def py_spy_path() -> str | None:
    """The ``py-spy`` executable: beside this interpreter (its ``scripts`` folder), else on ``PATH``."""
    for candidate in (
        os.path.join(sysconfig.get_path("scripts"), "py-spy"),
        os.path.join(os.path.dirname(sys.executable), "py-spy"),
    ):
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("py-spy")


def no_stack(rank: int, pid: int, why: str) -> RankStack:
    """Rank ``rank``'s stack that could not be taken, saying ``why``."""
    return RankStack(rank, pid, f"no stack: {why}", f"rank {rank} (pid {pid}): no stack: {why}\n")


def _dump(exe: str, rank: int, pid: int, code: CodeMap, native: bool, timeout_s: float) -> RankStack:
    """One rank's stack through ``py-spy dump``, or why there is none."""
    argv = [exe, "dump", "--json", "--pid", str(pid), *(["--native"] if native else [])]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return no_stack(rank, pid, f"py-spy took longer than {timeout_s:g} s")
    except OSError as exc:
        return no_stack(rank, pid, f"py-spy could not run ({exc})")
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        if not os.path.exists(f"/proc/{pid}"):
            why = "the process had ended"
        return no_stack(rank, pid, f"py-spy: {why}")
    try:
        return _parse(rank, pid, done.stdout, code)
    except (ValueError, TypeError, AttributeError) as exc:
        return no_stack(rank, pid, f"py-spy's output could not be read ({type(exc).__name__}: {exc})")


def take_stacks(
    pids: dict[int, int], code: CodeMap, native: bool = False, timeout_s: float = DUMP_TIMEOUT_S
) -> dict[int, RankStack]:
    """Every rank's stack at once, each by its own ``py-spy dump`` bounded by ``timeout_s`` seconds.

    Args:
        pids: ``{rank: process id}`` of the ranks to dump.
        code: how the notebook names the job's code.
        native: also show C/C++ frames (``py-spy dump --native``; slower).
        timeout_s: seconds each dump may take (default :data:`DUMP_TIMEOUT_S`).

    Returns:
        ``{rank: RankStack}`` in rank order; a rank whose stack could not be taken has ``where`` ``no stack: <why>``.
    """
    exe = py_spy_path()
    if exe is None:
        return {r: no_stack(r, pid, "py-spy is not installed (pip install py-spy)") for r, pid in sorted(pids.items())}
    if not pids:
        return {}
    with ThreadPoolExecutor(max_workers=len(pids)) as pool:
        futures = {r: pool.submit(_dump, exe, r, pid, code, native, timeout_s) for r, pid in sorted(pids.items())}
        return {r: future.result() for r, future in futures.items()}


def write_stacks(rd: RunDir, stacks: dict[int, RankStack]) -> dict[str, str]:
    """Write ``stacks`` (taken here or by the ranks' Ray agents on their nodes) to ``stacks/rank_<r>.txt`` (0600 in
    a 0700 folder); ``{rank: where}``, string keys, for ``status.json``'s ``stacks``."""
    if stacks:
        rd.stacks_dir.mkdir(mode=0o700, exist_ok=True)
    for rank, stack in stacks.items():
        atomic_write_bytes(rd.stack_file(rank), stack.text.encode())
    return {str(rank): stack.where for rank, stack in stacks.items()}


def summary(stacks: dict[int, str]) -> str:
    """``rank 0: dist.broadcast at Cell In[4] line 7; rank 1: time.sleep at Cell In[4] line 9``."""
    return "; ".join(f"rank {rank}: {at}" for rank, at in sorted(stacks.items()))


def saved_note(rd: RunDir) -> str:
    """Where the stacks taken when the job was stopped are, or that none were."""
    if any(rd.stacks_dir.glob("rank_*.txt")):
        return f"the stacks taken when it was stopped are in {rd.stacks_dir}"
    return "no stacks were saved (they are taken when a job times out or is cancelled while ranks run)"


REPLY_WAIT_S = DUMP_TIMEOUT_S + 10.0
"""Seconds :func:`live_stacks` waits for the launch host's answer (its dumps' bound, plus a busy host's delay)."""


def answer(rd: RunDir, token: str, pids: dict[int, int] | None, native: bool) -> None:
    """The launch host's side of :func:`live_stacks`: the stacks of ``pids`` (``None``: the job has ended) into
    the reply file ``token`` names, for the kernel to read."""
    take = None if pids is None else (lambda: take_stacks(pids, CodeMap.read(rd.code_map_file), native))
    reply_stacks(rd, token, take)


def reply_stacks(rd: RunDir, token: str, take: Callable[[], dict[int, RankStack]] | None) -> None:
    """Write the answer to a stacks request into the reply file ``token`` names: what ``take()`` gives (``None``:
    the job's ranks are gone), or the error it raised."""
    reply = StacksReply(ended=True)
    try:
        if take is not None:
            reply = StacksReply({rank: stack.text for rank, stack in take().items()})
    except Exception as exc:  # noqa: BLE001 - said to the kernel, which raises it
        reply = StacksReply(error=f"{type(exc).__name__}: {exc}")
    atomic_write_bytes(rd.stacks_reply_file(token), reply.encode())


def _asked(rd: RunDir, ask: Callable[[str], None], wait_s: float) -> dict[int, str] | None:
    """Ask the launch host for the stacks (``ask(token)``) and wait for its answer up to ``wait_s`` seconds;
    ``None`` if the job ended."""
    token = secrets.token_hex(4)
    path = rd.stacks_reply_file(token)
    ask(token)
    deadline = time.monotonic() + wait_s
    while (reply := _read_reply(path)) is None:
        if time.monotonic() > deadline:
            raise SgpuError(f"the launch host did not send the stacks of job {rd.job_id} within {wait_s:g} s")
        time.sleep(0.01)
    path.unlink(missing_ok=True)
    if reply.error:
        raise SgpuError(f"the launch host could not take the stacks of job {rd.job_id}: {reply.error}")
    if reply.ended:
        return None
    return dict(reply.stacks)


def _read_reply(path: Path) -> StacksReply | None:
    """The host's answer in ``path``, or ``None`` while it is not there (written atomically: whole or absent)."""
    try:
        return StacksReply.decode(read_private(path))
    except FileNotFoundError:
        return None


def live_stacks(
    rd: RunDir,
    status: Callable[[], HostStatus],
    native: bool = False,
    ask: Callable[[str], None] | None = None,
    wait_s: float = REPLY_WAIT_S,
) -> dict[int, str]:
    """:meth:`Job.stacks <sgpu_magic.job.handle.Job.stacks>`: each running rank's stack, as text.

    Args:
        status: the job's status now.
        ask: sends the launch host a request for the stacks with a reply token (the ranks name the host their
            tracer, so it may trace them where Yama's ``ptrace_scope`` 1 forbids the kernel to); ``None``: py-spy
            runs here.
        wait_s: seconds to wait for the host's answer (default :data:`REPLY_WAIT_S`).

    Raises:
        SgpuError: the job has ended (saying where its saved stacks are), its ranks have not started, or the
            launch host did not answer or could not take them.
    """
    now = status()
    if not now.final and not now.pids:
        raise SgpuError(
            f"job {rd.job_id} has no running ranks yet (state {now.state.value}); take its stacks once it runs"
        )
    if not now.final:
        stacks = _asked(rd, ask, wait_s) if ask is not None else _here(rd, now.pids, native)
        if stacks is not None:
            return stacks
        now = status()
    raise SgpuError(f"job {rd.job_id} has ended ({now.state.value}): its ranks are gone; {saved_note(rd)}")


def _here(rd: RunDir, pids: dict[int, int], native: bool) -> dict[int, str]:
    return {rank: stack.text for rank, stack in take_stacks(pids, CodeMap.read(rd.code_map_file), native).items()}
