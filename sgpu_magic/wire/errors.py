"""``errors/rank_<r>.json``: the exception a rank raised (:class:`RankError`), and its codec.

Written by the rank (``rank/payload.write_error``; ``rank/worker`` for a non-zero ``sys.exit``), by the Ray supervisor
for a rank on a node (the agent hands it back); read by the launchers' root-cause order (``launch/base``), the job's
error (``job/outcome``), ``job.locals(rank)`` and a session's messages (``session/outcome``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sgpu_magic.errors import RecordError


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
        try:
            return cls(
                rank=int(data["rank"]),
                exc_type=str(data["exc_type"]),
                message=str(data.get("message") or ""),
                traceback=str(data.get("traceback") or ""),
                time_s=float(data.get("time_s") or 0.0),
                cuda=bool(data.get("cuda")),
                saved_locals={str(k): str(v) for k, v in (data.get("locals") or {}).items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RecordError(f"a rank's error record lacks or mangles {exc}: not written by sgpu_magic") from None

    @classmethod
    def decode(cls, raw: bytes) -> RankError:
        """Raises:
        RecordError: not JSON, or :meth:`from_json` refuses it."""
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise RecordError(f"a rank's error record is not JSON: {exc}") from None
        return cls.from_json(data)
