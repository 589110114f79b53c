"""``launch.json``: what a job runs, as the kernel hands it to its launcher (:class:`LaunchRecord`), and its codec.

The kernel writes it once per job (``job/lifecycle``); the launch host (``launch/host/job``, its ``cleanup``), the Ray
supervisor (``launch/ray/launcher``), each Ray rank agent (``launch/ray/agent``, a copy on its node), each rank
(``rank/worker``: the kernel's cwd and ``sys.path``) and the detached-run listing (``front/detached``) read it. Its keys
exist only here: every other module takes the typed record (``tests/unit/test_wire.py`` fails on a module outside
``sgpu_magic/wire`` that subscripts a launch dict by a string key).

Schema history (the ``schema`` key): 2 had no ``schema`` key (every release before 0.3; read as written, ``tracked``
false, ``session`` false); 3 adds ``schema`` and ``tracked``. A newer schema than this version knows is refused
(:class:`~sgpu_magic.errors.RecordError`) rather than half-read: a rank or host that misreads what to run is worse than
one that says so.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sgpu_magic.errors import RecordError

LAUNCH_SCHEMA = 3
"""The ``schema`` this version writes into ``launch.json``; it reads this one and every older one (from 2)."""

_OLDEST = 2


@dataclass(frozen=True)
class LaunchRecord:
    """What a job runs, as ``launch.json`` holds it (written by the kernel before it hands the run dir over).

    Attributes:
        job_id: the job's id (its run directory's name).
        world_size: how many ranks (torchrun's ``WORLD_SIZE``).
        backend: the process group backend the plan chose: ``"gloo"`` (CPU ranks) or ``"nccl"``.
        cwd: the kernel's working directory when the job started (each rank enters it).
        sys_path: the kernel's ``sys.path`` then (each rank takes it).
        name: the function or cell name, for messages and logs.
        env: variables the ranks get on top of the launcher's environment (the job's GPUs, MLflow's run file, ...).
        cuda_visible_devices: ``CUDA_VISIBLE_DEVICES`` for the ranks (``""``: a fake GPU inventory, ranks on CPU);
            ``None``: left as the launcher's environment has it.
        timeout_s: wall-clock limit in seconds from the ranks' start; ``None``: none.
        port: the rendezvous port (``MASTER_PORT``) to use; ``None``: the launcher picks a free one.
        max_restarts: how many times the launcher restarts all ranks after a failure before the job fails.
        teardown_grace_s: seconds a rank may take to exit after its outcome; ``None``: the launcher's default.
        stuck_after_s: seconds without a log byte or metric point after which the job is reported possibly stuck;
            ``None``: never.
        detached: the job outlives the kernel that started it (the run keeper supervises it).
        lease_dir: the GPU lease registry the job's GPUs were leased from (the launcher gives them back as soon as
            the ranks are gone); ``None``: no lease.
        tracked: the job has an MLflow run (the launch host then imports mlflow while idle, to end the run if the
            kernel dies first).
        session: a Ray rank agent's copy: the job is a live session, whose rank FIFOs the agent makes.
        schema: the layout version the record was read from (:data:`LAUNCH_SCHEMA` for one made here).
    """

    job_id: str
    world_size: int
    backend: str
    cwd: str
    sys_path: tuple[str, ...]
    name: str = "job"
    env: Mapping[str, str] = field(default_factory=dict)
    cuda_visible_devices: str | None = None
    timeout_s: float | None = None
    port: int | None = None
    max_restarts: int = 0
    teardown_grace_s: float | None = None
    stuck_after_s: float | None = None
    detached: bool = False
    lease_dir: str | None = None
    tracked: bool = False
    session: bool = False
    schema: int = LAUNCH_SCHEMA

    @property
    def gpus(self) -> list[int]:
        """The machine's GPU indices the job's ranks run on (``SGPU_MAGIC_GPUS``); ``[]``: CPU ranks."""
        return [int(i) for i in self.env.get(GPUS_ENV, "").split(",") if i]

    def prepared(self, extra: Mapping[str, Any]) -> LaunchRecord:
        """This record with what a job sink's ``prepare`` adds: ``env`` merged into :attr:`env`, any other key set.

        Raises:
            RecordError: ``extra`` names a field a launch record does not have (a sink's mistake).
        """
        change = dict(extra)
        env = {**self.env, **change.pop("env", {})}
        unknown = set(change) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise RecordError(f"a job sink prepared {sorted(unknown)} for launch.json, which has no such field")
        return dataclasses.replace(self, env=env, **change)

    def for_rank_agent(self, session: bool) -> LaunchRecord:
        """The copy a Ray rank agent writes on its node: no ``env`` (the agent is given each rank's own) and no lease
        (the kernel's machine holds it); ``session``: the job is a live session."""
        return dataclasses.replace(self, env={}, lease_dir=None, session=session)

    def to_json(self) -> dict[str, Any]:
        """The JSON object ``launch.json`` holds."""
        out = dataclasses.asdict(self)
        out["sys_path"], out["env"], out["schema"] = list(self.sys_path), dict(self.env), LAUNCH_SCHEMA
        return out

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), indent=1).encode()

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LaunchRecord:
        """Read a ``launch.json`` object of schema 2 or later.

        Raises:
            RecordError: it is not an object, its schema is newer than this version reads, or a required field
                (``job_id``, ``world_size``, ``backend``, ``cwd``, ``sys_path``) is missing; the message names it.
        """
        if not isinstance(data, Mapping):
            raise RecordError(f"launch.json holds {type(data).__name__}, not an object")
        schema = int(data.get("schema", _OLDEST))
        if schema > LAUNCH_SCHEMA:
            raise RecordError(
                f"launch.json has schema {schema}, newer than this sgpu_magic reads ({LAUNCH_SCHEMA}): the run was "
                "started by a newer sgpu_magic; use that version to read it (pip install -U sgpu_magic)"
            )
        missing = [k for k in ("job_id", "world_size", "backend", "cwd", "sys_path") if k not in data]
        if missing:
            raise RecordError(f"launch.json lacks {', '.join(missing)}: it was not written by sgpu_magic")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}  # keys an older version wrote and this one dropped
        values.update(
            world_size=int(data["world_size"]),
            sys_path=tuple(str(p) for p in data["sys_path"]),
            env={str(k): str(v) for k, v in (data.get("env") or {}).items()},
            max_restarts=int(data.get("max_restarts") or 0),
            detached=bool(data.get("detached")),
            tracked=bool(data.get("tracked")),
            session=bool(data.get("session")),
            schema=schema,
        )
        return cls(**values)

    @classmethod
    def decode(cls, raw: bytes) -> LaunchRecord:
        """Read ``launch.json``'s bytes.

        Raises:
            RecordError: not JSON, or :meth:`from_json` refuses it.
        """
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise RecordError(f"launch.json is not JSON: {exc}") from None
        return cls.from_json(data)


GPUS_ENV = "SGPU_MAGIC_GPUS"
"""The ranks' variable naming the machine's GPU indices the job runs on (``"0,1"``), set in :attr:`LaunchRecord.env`."""
