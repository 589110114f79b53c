"""A live session's frames, typed, with their codec: the kernel's commands to a rank, the rank's replies and its
debugger's frames, the control line that releases a stuck rank, and the session record a detached session keeps.

Frames go over the session's private FIFOs (0600 in a 0700 folder, checked before use; on Ray, through each rank's
actor): each command and reply is one pickled dict frame (:mod:`sgpu_magic._util.frames`), its keys spelt only
here, the same keys as the previous version's, so a detached session started by it is still attached. Every command
travels in an envelope with its request's number (``seq``): a reply carries it, and a reply to a request the kernel
gave up is dropped.

- commands (kernel -> rank, its command FIFO): :class:`RunCell`, :class:`Push`, :class:`Pull`, :class:`Debug`,
  :class:`DebugLine`, :class:`Stop`, :class:`Ungroup`, :class:`Regroup`;
- frames (rank -> kernel, its reply FIFO): :class:`Reply` (the one answer to a command; a rank's first reply,
  ``ready``, names its pid), :class:`DebugFrame` (pdb's output and its requests for a line, before the reply);
- control (kernel -> a rank's control thread, one JSON line): :class:`ReleasePeers`;
- :class:`SessionRecord`: ``session.json`` of a detached session (its name and idle timeout).

A frame this version does not know is refused (:class:`~sgpu_magic.errors.RecordError`, naming it).
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from sgpu_magic.errors import RecordError

_PICKLE = pickle.HIGHEST_PROTOCOL


# -- commands


@dataclass(frozen=True)
class RunCell:
    """Run the cell (or function) whose payload is in the cell's run directory ``run_dir``, in the rank's namespace
    (on Ray: the cell's id in the kernel's command, its node-side folder in the rank's)."""

    run_dir: str


@dataclass(frozen=True)
class Push:
    """Set names in the rank's namespace: ``values`` ``{name: cloudpickled value}``."""

    values: Mapping[str, bytes]


@dataclass(frozen=True)
class Pull:
    """Send the value of ``name`` back (tensors on the CPU) after the reply."""

    name: str


@dataclass(frozen=True)
class Debug:
    """pdb at the frame where the rank's last cell failed, its I/O as :class:`DebugFrame` s and :class:`DebugLine` s."""


@dataclass(frozen=True)
class DebugLine:
    """The line the user typed for a rank's pdb (the answer to a ``debug_input`` frame)."""

    line: str


@dataclass(frozen=True)
class Stop:
    """Leave the session loop (the rank then ends as a job's rank does)."""


@dataclass(frozen=True)
class Ungroup:
    """``Session.recover()``: destroy the default process group (the reply names its backend)."""


@dataclass(frozen=True)
class Regroup:
    """``Session.recover()``: make the default process group again with ``backend`` on the job's rendezvous store,
    under the prefix of ``generation``."""

    backend: str
    generation: int


SessionCommand = RunCell | Push | Pull | Debug | DebugLine | Stop | Ungroup | Regroup
"""A command from the kernel to a session's rank."""

_OPS: dict[type, str] = {
    RunCell: "cell",
    Push: "push",
    Pull: "pull",
    Debug: "debug",
    DebugLine: "debug_line",
    Stop: "stop",
    Ungroup: "ungroup",
    Regroup: "regroup",
}


_BARE: dict[str, type[Debug] | type[Stop] | type[Ungroup]] = {"debug": Debug, "stop": Stop, "ungroup": Ungroup}


def encode_command(cmd: SessionCommand, seq: int = 0) -> bytes:
    """``cmd`` as the frame a rank reads, in the envelope of request ``seq``."""
    if isinstance(cmd, RunCell):
        body: dict[str, Any] = {"run_dir": cmd.run_dir}
    elif isinstance(cmd, Push):
        body = {"values": dict(cmd.values)}
    elif isinstance(cmd, Pull):
        body = {"name": cmd.name}
    elif isinstance(cmd, DebugLine):
        body = {"line": cmd.line}
    elif isinstance(cmd, Regroup):
        body = {"backend": cmd.backend, "generation": cmd.generation}
    else:
        body = {}
    return pickle.dumps({"op": _OPS[type(cmd)], "seq": seq, **body}, protocol=_PICKLE)


def decode_command(frame: bytes | bytearray) -> tuple[int, SessionCommand]:
    """One command frame as a rank reads it: ``(seq, command)``.

    Raises:
        RecordError: not a command frame, an ``op`` this version does not know, or a field missing (said which).
    """
    data = _frame_dict(frame, "a session command")
    try:
        op, seq = data["op"], int(data.get("seq", 0))
        cmd: SessionCommand
        if op == "cell":
            cmd = RunCell(str(data["run_dir"]))
        elif op == "push":
            cmd = Push({str(k): bytes(v) for k, v in data["values"].items()})
        elif op == "pull":
            cmd = Pull(str(data["name"]))
        elif op == "debug_line":
            cmd = DebugLine(str(data.get("line", "q")))
        elif op == "regroup":
            cmd = Regroup(str(data["backend"]), int(data["generation"]))
        else:
            bare = _BARE.get(op)
            if bare is None:
                raise RecordError(f"a session command has the op {op!r}, which this sgpu_magic does not know")
            cmd = bare()
    except RecordError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RecordError(f"a session command lacks {exc} (or it has the wrong type): {data!r:.200}") from None
    return seq, cmd


def with_run_dir(cmd: SessionCommand, run_dir: str) -> SessionCommand:
    """A :class:`RunCell` for another folder of the same cell (a Ray rank's node-side one); other commands as
    they are."""
    return RunCell(run_dir) if isinstance(cmd, RunCell) else cmd


# -- a rank's frames


@dataclass(frozen=True)
class Reply:
    """A rank's one answer to a command (or, with :attr:`pid`, its first word: ready).

    Attributes:
        seq: the request it answers (``0`` for ready: it answers the session's start).
        rank: the rank that sent it.
        ok: the command did what it asked (a cell returned, a name was there).
        interrupted: a cell ended by ``KeyboardInterrupt`` (the kernel's interrupt).
        error: why it did not (a pull's missing name, a debugger with nothing to debug, a regroup's exception).
        missing: a pull's name is not in the rank's namespace.
        backend: the process group's backend an ungroup destroyed (``None``: the rank had none).
        pid: the rank's process id, in its ready reply only.
        names: the user's names in the rank's namespace after the command.
        has_value: a pulled value follows in the next frame.
        time_s: wall-clock time (seconds since the epoch) it was sent.
    """

    seq: int
    rank: int
    ok: bool = True
    interrupted: bool = False
    error: str | None = None
    missing: bool = False
    backend: str | None = None
    pid: int | None = None
    names: tuple[str, ...] = ()
    has_value: bool = False
    time_s: float = 0.0

    @property
    def raised(self) -> bool:
        """A cell (or a step) raised, other than by an interrupt."""
        return not self.ok and not self.interrupted

    def encode(self) -> bytes:
        data: dict[str, Any] = {
            "seq": self.seq,
            "rank": self.rank,
            "ok": self.ok,
            "interrupted": self.interrupted,
            "names": list(self.names),
            "has_value": self.has_value,
            "time_s": self.time_s,
        }
        if self.error is not None:
            data["error"] = self.error
        if self.missing:
            data["missing"] = True
        if self.backend is not None:
            data["backend"] = self.backend
        if self.pid is not None:
            data.update(op="ready", pid=self.pid)
        return pickle.dumps(data, protocol=_PICKLE)


DebugKind = Literal["debug_out", "debug_input", "debug_end"]


@dataclass(frozen=True)
class DebugFrame:
    """What a rank's pdb sends before the command's reply: its output (``debug_out``, ``text``), a request for a
    line (``debug_input``; the kernel answers with :class:`DebugLine`), or its end (``debug_end``: it stops
    prompting, the rank runs on)."""

    seq: int
    rank: int
    kind: DebugKind
    text: str = ""

    has_value = False

    def encode(self) -> bytes:
        data = {"seq": self.seq, "rank": self.rank, "stream": self.kind, "text": self.text, "has_value": False}
        return pickle.dumps(data, protocol=_PICKLE)


Frame = Reply | DebugFrame
"""What a rank sends on its reply FIFO."""


def decode_frame(frame: bytes | bytearray) -> Frame:
    """A rank's frame as the kernel (or a Ray rank's actor) reads it.

    Raises:
        RecordError: not a rank's frame, or a field missing (said which).
    """
    data = _frame_dict(frame, "a session rank's frame")
    try:
        if "stream" in data:
            kind = data["stream"]
            if kind not in ("debug_out", "debug_input", "debug_end"):
                raise RecordError(
                    f"a session rank's frame has the stream {kind!r}, which this sgpu_magic does not know"
                )
            return DebugFrame(int(data["seq"]), int(data["rank"]), kind, str(data.get("text", "")))
        pid = data.get("pid") if data.get("op") == "ready" else None
        return Reply(
            seq=int(data["seq"]),
            rank=int(data["rank"]),
            ok=bool(data["ok"]),
            interrupted=bool(data.get("interrupted")),
            error=None if data.get("error") is None else str(data["error"]),
            missing=bool(data.get("missing")),
            backend=None if data.get("backend") is None else str(data["backend"]),
            pid=None if pid is None else int(pid),
            names=tuple(str(n) for n in data.get("names", ())),
            has_value=bool(data.get("has_value")),
            time_s=float(data.get("time_s", 0.0)),
        )
    except RecordError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError(f"a session rank's frame lacks {exc} (or it has the wrong type): {data!r:.200}") from None


def _frame_dict(frame: bytes | bytearray, what: str) -> dict[str, Any]:
    # the frame came over a FIFO private to this user (checked before it was opened): unpickling it is safe
    try:
        data = pickle.loads(frame)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure: not a frame this version reads
        raise RecordError(f"{what} is not a frame this sgpu_magic reads ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise RecordError(f"{what} is not a frame this sgpu_magic reads (a {type(data).__name__})")
    return data


# -- the control line


@dataclass(frozen=True)
class ReleasePeers:
    """Close the rank's connections to the other ranks (``peers``: their pids), so a collective that waits for them
    returns (:mod:`sgpu_magic.rank.recover`)."""

    peers: tuple[int, ...] = field(default_factory=tuple)

    def encode(self) -> bytes:
        """One JSON line."""
        return json.dumps({"op": "release", "peers": list(self.peers)}).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes) -> ReleasePeers:
        """Raises:
        RecordError: not a release line this version reads."""
        try:
            data = json.loads(line)
            if data["op"] != "release":
                raise RecordError(f"a control line has the op {data['op']!r}, which this sgpu_magic does not know")
            return cls(tuple(int(pid) for pid in data.get("peers", ())))
        except RecordError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise RecordError(f"not a control line this sgpu_magic reads ({exc!r}): {line[:200]!r}") from None


# -- a detached session's record


@dataclass(frozen=True)
class SessionRecord:
    """``session.json`` of a detached session: what a kernel attaching to it needs beside its job's record (its
    name, and how long its ranks wait without a command, seconds; ``None``: no limit)."""

    name: str
    idle_timeout_s: float | None = None

    def encode(self) -> bytes:
        return json.dumps({"name": self.name, "idle_timeout_s": self.idle_timeout_s}).encode()

    @classmethod
    def decode(cls, data: bytes) -> SessionRecord:
        """Raises:
        RecordError: not a session record."""
        try:
            raw = json.loads(data)
            timeout = raw.get("idle_timeout_s")
            return cls(str(raw["name"]), None if timeout is None else float(timeout))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RecordError(f"not a session record this sgpu_magic reads ({exc!r})") from None
