"""``attach.pkl``: what another kernel needs to attach to a detached job (:class:`AttachRecord`), and its codec.

Written by the kernel that starts the job once its run keeper has it (``job/lifecycle``), read by a kernel that
attaches to it, stops it or lists it (``front/detached``), both through the private-read check (a pickle is code).
The job's spec and device plan are the kernel's own types (:class:`~sgpu_magic.spec.LaunchSpec`,
:class:`~sgpu_magic.launch.resources.DevicePlan`), pickled as they are; both kernels are of one installation.
The file holds a plain dict of the record's fields, as the previous version wrote it: a job either version started
attaches from the other.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, fields
from typing import Any

from sgpu_magic.errors import RecordError


@dataclass(frozen=True)
class AttachRecord:
    """A detached job as the kernel that started it handed it over.

    Attributes:
        spec: its ``LaunchSpec``; ``plan``: its ``DevicePlan`` (the GPUs it holds, its backend).
        launcher_pid: the run keeper's process id; ``launcher_log``: the keeper's log file (for errors).
        submitted_s: when the job was submitted, epoch seconds.
    """

    spec: Any
    plan: Any
    launcher_pid: int
    launcher_log: str
    submitted_s: float

    def encode(self) -> bytes:
        """A pickled dict of the fields (not of this class: a kernel of the previous version reads it too)."""
        return pickle.dumps({f.name: getattr(self, f.name) for f in fields(self)}, protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def decode(cls, raw: bytes) -> AttachRecord:
        """Read ``attach.pkl`` (a dict of the fields, as this version and the previous one write it).

        Raises:
            RecordError: it holds anything else.
        """
        try:
            record = pickle.loads(raw)
        except Exception as exc:  # noqa: BLE001 - a pickle of a class this installation lacks, or a torn file
            raise RecordError(f"attach.pkl does not read: {type(exc).__name__}: {exc}") from None
        names = [f.name for f in fields(cls)]
        if isinstance(record, dict) and set(names) <= set(record):
            return cls(**{name: record[name] for name in names})
        raise RecordError(
            f"attach.pkl holds a {type(record).__name__}, not a detached job's attach record of this sgpu_magic; "
            "was it written by another version? Attach from a kernel of the version that started the job"
        )
