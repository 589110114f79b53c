"""``errors/rank_<r>.json``: the exception a rank raised (:class:`RankError`), and its codec; how a launcher saw ranks
fail and end (:class:`ObservedFailure`, :class:`FailedAttempt`, :class:`TeardownEnd`: ``status.json``'s ``failures``,
``attempts`` and ``teardown_ended``), a Ray rank's end (:class:`RankOutcome`) and a rank's ``sys.exit(0)``
(:class:`RankExit`).

Written by the rank (``rank/payload.write_error``; ``rank/worker`` for a non-zero ``sys.exit``), by the Ray supervisor
for a rank on a node (the agent hands it back); read by the launchers' root-cause order (``launch/machine``), the job's
error (``job/outcome``), ``job.locals(rank)`` and a session's messages (``session/outcome``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sgpu_magic.errors import RecordError


@contextmanager
def _reading(what: str, remedy: str = "") -> Iterator[None]:
    """Refuse a record that lacks a key or holds a value of the wrong kind: a :class:`RecordError` naming ``what`` and
    the key or value (and ``remedy``)."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RecordError(f"{what} lacks or mangles {exc}{remedy}") from None


@dataclass(frozen=True)
class RankError:
    """The exception one rank raised.

    Attributes:
        rank: the global rank.
        exc_type: the exception's type name (``SystemExit`` for ``sys.exit(<non-zero>)``).
        message: ``str(exception)`` (for ``SystemExit``: its code).
        traceback: the rank's formatted traceback, with notebook cell lines (``""`` for ``SystemExit``).
        time_s: when it was raised, epoch seconds (the earliest of a job's is its root cause).
        cuda: it came from CUDA (raised through ``torch.cuda``, or naming CUDA or NCCL).
        saved_locals: the failing frame's locals as short reprs (``job.locals(rank)``), ``{}`` when none were saved.
    """

    rank: int
    exc_type: str
    message: str = ""
    traceback: str = ""
    time_s: float = 0.0
    cuda: bool = False
    saved_locals: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "exc_type": self.exc_type,
            "message": self.message,
            "traceback": self.traceback,
            "time_s": self.time_s,
            "cuda": self.cuda,
            "locals": dict(self.saved_locals),
        }

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), indent=1, default=str).encode()

    @classmethod
    def from_json(cls, data: Any) -> RankError:
        """Read a rank's error record (any release's: the keys it lacks take the defaults).

        Raises:
            RecordError: it is not an object with ``rank`` and ``exc_type``.
        """
        with _reading("a rank's error record", ": not written by sgpu_magic"):
            return cls(
                rank=int(data["rank"]),
                exc_type=str(data["exc_type"]),
                message=str(data.get("message") or ""),
                traceback=str(data.get("traceback") or ""),
                time_s=float(data.get("time_s") or 0.0),
                cuda=bool(data.get("cuda")),
                saved_locals={str(k): str(v) for k, v in (data.get("locals") or {}).items()},
            )

    @classmethod
    def decode(cls, raw: bytes) -> RankError:
        """Raises:
        RecordError: not JSON, or :meth:`from_json` refuses it."""
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise RecordError(f"a rank's error record is not JSON: {exc}") from None
        return cls.from_json(data)


@dataclass(frozen=True)
class ObservedFailure:
    """One rank's failure as its launcher saw it (``status.json``'s ``failures``, an attempt's ``failures``).

    Attributes:
        rank: the global rank.
        exitcode: its exit status (negative: killed by that signal); ``None`` for a live session's rank that raised
            (it lives on).
        time_s: when the launcher saw it (or, for a rank added as the root cause, when it raised), epoch seconds.
        oom_killed: for a rank killed by SIGKILL: ``True`` when a witness shows the kernel's OOM killer ended it,
            ``None`` when none does (:mod:`sgpu_magic.launch.forensics`); ``None`` for any other end.
        oom: what shows the OOM killer, or how to check (``""`` for an end that is not SIGKILL).
    """

    rank: int
    exitcode: int | None
    time_s: float = 0.0
    oom: str = ""
    oom_killed: bool | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "exitcode": self.exitcode, "time_s": self.time_s}
        if self.oom:
            out |= {"oom": self.oom, "oom_killed": self.oom_killed}
        return out

    @classmethod
    def from_json(cls, data: Any) -> ObservedFailure:
        """Raises:
        RecordError: not a failure entry (no ``rank``)."""
        with _reading("a failure entry of status.json"):
            code = data.get("exitcode")
            return cls(
                rank=int(data["rank"]),
                exitcode=None if code is None else int(code),
                time_s=math.inf if data.get("time_s") is None else float(data["time_s"]),  # unknown: the latest
                oom=str(data.get("oom") or ""),
                oom_killed=data.get("oom_killed"),
            )


@dataclass(frozen=True)
class FailedAttempt:
    """An attempt that failed and was restarted (``status.json``'s ``attempts``; torchrun's ``max_restarts``).

    Attributes:
        attempt: which (from 1).
        failures: its failures, root cause first.
        ended_s: when its ranks were stopped, epoch seconds.
        exitcodes: ``{rank: exit status}`` of its ranks (``None``: not known).
    """

    attempt: int
    failures: tuple[ObservedFailure, ...]
    ended_s: float
    exitcodes: Mapping[int, int | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "failures": [f.to_json() for f in self.failures],
            "ended_s": self.ended_s,
            "exitcodes": {str(r): code for r, code in self.exitcodes.items()},
        }

    @classmethod
    def from_json(cls, data: Any) -> FailedAttempt:
        """Raises:
        RecordError: not an attempt entry."""
        with _reading("an attempt entry of status.json"):
            return cls(
                attempt=int(data["attempt"]),
                failures=tuple(ObservedFailure.from_json(f) for f in data.get("failures") or ()),
                ended_s=float(data.get("ended_s") or 0.0),
                exitcodes={int(r): code for r, code in (data.get("exitcodes") or {}).items()},
            )


@dataclass(frozen=True)
class TeardownEnd:
    """A rank the teardown grace ended (``status.json``'s ``teardown_ended``): it had written its value or error
    (``outcome``: ``"value"`` | ``"error"``) but had not exited ``grace_s`` seconds later (``teardown_grace_s``), so
    its launcher sent it ``signal`` (``"SIGTERM"``, ``"SIGKILL"`` when that did not end it) ``after_s`` seconds after
    its outcome."""

    rank: int
    outcome: str
    grace_s: float = 0.0
    after_s: float = 0.0
    signal: str = "SIGTERM"

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "outcome": self.outcome,
            "after_s": self.after_s,
            "signal": self.signal,
            "grace_s": self.grace_s,
        }

    @classmethod
    def from_json(cls, data: Any) -> TeardownEnd:
        """Raises:
        RecordError: not a teardown entry."""
        with _reading("a teardown entry of status.json"):
            return cls(
                rank=int(data["rank"]),
                outcome=str(data.get("outcome") or ""),
                grace_s=float(data.get("grace_s") or 0.0),
                after_s=float(data.get("after_s") or 0.0),
                signal=str(data.get("signal") or "SIGTERM"),
            )


@dataclass(frozen=True)
class RankOutcome:
    """How a rank on a Ray node ended, as its agent hands it back to the Ray supervisor (a Ray call's value, pickled
    by Ray between one installation's agent and supervisor).

    Attributes:
        exitcode: the rank's exit status (negative: killed by that signal; ``-9`` when its agent died).
        result: its pickled value (``results/rank_<r>.pkl``), ``None`` when it left none.
        error: the exception it saved (``errors/rank_<r>.json``), ``None`` when it saved none.
        teardown: the teardown grace's entry when its agent ended it (it had not exited ``teardown_grace_s`` after
            its value or error), else ``None``.
        profile: a profiled rank's files, ``{name: bytes}``.
        warm: it was forked from its agent's zygote (torch preloaded).
        oom_killed, oom: for a rank killed by SIGKILL, its agent's OOM verdict on its node (as
            :class:`ObservedFailure`'s), else ``None`` and ``""``.
    """

    exitcode: int | None
    result: bytes | None = None
    error: RankError | None = None
    teardown: TeardownEnd | None = None
    profile: Mapping[str, bytes] = field(default_factory=dict)
    warm: bool = False
    oom_killed: bool | None = None
    oom: str = ""

    @property
    def succeeded(self) -> bool:
        """It exited 0, or its agent ended it at the teardown grace after it had written its value."""
        ended_after_value = self.teardown is not None and self.teardown.outcome == "value"
        return self.exitcode == 0 or ended_after_value


@dataclass(frozen=True)
class RankExit:
    """``results/rank_<r>.exit.json``: a rank that ended through ``sys.exit(0)`` (it returned nothing): where it
    called it (``file:line``, as the notebook names its cells) and the payload's kind (a script's ``sys.exit(0)`` is
    its normal end, not a note)."""

    where: str = "?"
    kind: str = ""
    code: int = 0

    def encode(self) -> bytes:
        return json.dumps({"code": self.code, "where": self.where, "kind": self.kind}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> RankExit:
        """Raises:
        RecordError: not a rank's exit record."""
        try:
            data = json.loads(raw)
            return cls(str(data.get("where") or "?"), str(data.get("kind") or ""), int(data.get("code") or 0))
        except (ValueError, TypeError, AttributeError) as exc:
            raise RecordError(f"a rank's exit record is not one this sgpu_magic reads: {exc}") from None
