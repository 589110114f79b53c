"""The commands a kernel sends its launch host or the user's run keeper, and the keeper's greeting, typed, with
their codec: one JSON object per line (the host's stdin pipe; one short connection to the keeper's 0600 socket per
command).

- :class:`Launch`: start the ranks of a run directory (with the kernel's environment; on a Ray cluster for the
  keeper when :attr:`Launch.ray` says so);
- :class:`Cancel`: stop a job's ranks, for a :class:`~sgpu_magic.wire.StopReason`;
- :class:`Stacks`: the running ranks' stacks into the reply file a token names;
- :class:`Release`: the keeper gives back what it keeps warm on its Ray cluster.

A line this version does not know (an ``op`` of a newer kernel) is refused (:class:`~sgpu_magic.errors.RecordError`,
naming it); the host logs it and goes on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sgpu_magic.errors import RecordError
from sgpu_magic.wire.state import StopReason


@dataclass(frozen=True)
class RayTarget:
    """Where the run keeper runs a detached job on Ray: the cluster's GCS address (one name of it, the same for
    ``"auto"`` and its other names), the GPU type asked for, and how long the kernel keeps its agents warm (seconds;
    ``None``: the default)."""

    cluster: str
    gpu_type: str | None = None
    keep_warm_s: float | None = None


@dataclass(frozen=True)
class Launch:
    """Start the ranks of the job in ``run_dir``; ``env``: the kernel's environment for them; ``ray``: on that Ray
    cluster (the run keeper only)."""

    run_dir: str
    env: Mapping[str, str] = field(default_factory=dict)
    ray: RayTarget | None = None


@dataclass(frozen=True)
class Cancel:
    """Stop the ranks of the job in ``run_dir`` (SIGTERM, then SIGKILL) for ``reason``."""

    run_dir: str
    reason: StopReason = StopReason.CANCELLED


@dataclass(frozen=True)
class Stacks:
    """The stacks of the job's running ranks into ``run_dir``'s reply file for ``token``; ``native``: with C frames."""

    run_dir: str
    token: str
    native: bool = False


@dataclass(frozen=True)
class Release:
    """The run keeper gives back the rank agents it keeps warm on its Ray cluster; ``why`` goes in its log."""

    why: str = "sgpu_magic.release()"


HostCommand = Launch | Cancel | Stacks | Release
"""A command to the launch host or the run keeper."""

_OPS: dict[type, str] = {Launch: "launch", Cancel: "cancel", Stacks: "stacks", Release: "release"}


def encode_command(cmd: HostCommand) -> bytes:
    """``cmd`` as the one JSON line the host reads."""
    if isinstance(cmd, Launch):
        body: dict[str, Any] = {"run_dir": cmd.run_dir, "env": dict(cmd.env)}
        if cmd.ray is not None:
            body["ray"] = {"cluster": cmd.ray.cluster, "gpu_type": cmd.ray.gpu_type, "keep_warm_s": cmd.ray.keep_warm_s}
    elif isinstance(cmd, Cancel):
        body = {"run_dir": cmd.run_dir, "reason": cmd.reason.value}
    elif isinstance(cmd, Stacks):
        body = {"run_dir": cmd.run_dir, "token": cmd.token, "native": cmd.native}
    else:
        body = {"why": cmd.why}
    return (json.dumps({"op": _OPS[type(cmd)], **body}) + "\n").encode()


def decode_command(line: bytes) -> HostCommand:
    """One command line as the host reads it.

    Raises:
        RecordError: not a JSON object, an ``op`` this version does not know, or a field missing (the message says
            which).
    """
    try:
        data = json.loads(line)
        op = data["op"]
        if op == "launch":
            ray = data.get("ray")
            target = None if not ray else RayTarget(str(ray["cluster"]), ray.get("gpu_type"), ray.get("keep_warm_s"))
            return Launch(str(data["run_dir"]), {str(k): str(v) for k, v in data.get("env", {}).items()}, target)
        if op == "cancel":
            return Cancel(str(data["run_dir"]), StopReason(data.get("reason", StopReason.CANCELLED.value)))
        if op == "stacks":
            return Stacks(str(data["run_dir"]), str(data["token"]), bool(data.get("native")))
        if op == "release":
            return Release(str(data.get("why") or Release.why))
    except ValueError as exc:  # not JSON, or a stop reason this version does not know
        raise RecordError(f"a host command line is not one this sgpu_magic reads ({exc}): {line[:200]!r}") from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise RecordError(f"a host command lacks {exc}: {line[:200]!r}") from None
    raise RecordError(f"a host command has the op {op!r}, which this sgpu_magic does not know: {line[:200]!r}")


@dataclass(frozen=True)
class KeeperGreeting:
    """The line the run keeper greets each connection with: its pid, its log file, and what it keeps warm on a Ray
    cluster (``None``: nothing)."""

    pid: int
    log: str
    warm: str | None = None

    def encode(self) -> bytes:
        return (json.dumps({"pid": self.pid, "log": self.log, "warm": self.warm}) + "\n").encode()

    @classmethod
    def decode(cls, line: bytes) -> KeeperGreeting:
        """Raises:
        RecordError: not a keeper's greeting."""
        try:
            data = json.loads(line)
            return cls(int(data["pid"]), str(data["log"]), data.get("warm"))
        except (ValueError, KeyError, TypeError) as exc:
            raise RecordError(f"not a run keeper's greeting ({exc!r}): {line[:200]!r}") from None


@dataclass(frozen=True)
class StacksReply:
    """The launch host's (or the run keeper's) answer to :class:`Stacks`, in the reply file its token names: each
    running rank's stack text (``{rank: text}``), or ``ended`` (the job's ranks are gone), or the ``error`` taking
    them raised."""

    stacks: Mapping[int, str] = field(default_factory=dict)
    ended: bool = False
    error: str | None = None

    def encode(self) -> bytes:
        if self.error is not None:
            data: dict[str, Any] = {"error": self.error}
        elif self.ended:
            data = {"ended": True}
        else:
            data = {"stacks": {str(rank): text for rank, text in self.stacks.items()}}
        return json.dumps(data).encode()

    @classmethod
    def decode(cls, data: bytes) -> StacksReply:
        """Raises:
        RecordError: not a stacks answer."""
        try:
            raw = json.loads(data)
            if raw.get("error"):
                return cls(error=str(raw["error"]))
            if raw.get("ended"):
                return cls(ended=True)
            return cls({int(rank): str(text) for rank, text in raw["stacks"].items()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RecordError(f"not a stacks answer this sgpu_magic reads ({exc!r}): {data[:200]!r}") from None
