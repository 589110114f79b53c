"""GPU leases shared by every sgpu_magic job on the machine, with a first-come queue.

A job that needs GPUs leases them from a registry in a lease directory before its ranks
start, and gives them back when it ends. Every kernel (of any user account) that uses the
same directory sees the same leases, so no GPU is given to two jobs at once.

- The registry is one JSON file, read and replaced (write-then-rename, never half-written)
  only while holding a :class:`filelock.FileLock` on ``registry.lock``.
- Holders and waiters are recorded with their process ids (the kernel, then also its
  launch host) and those processes' start times. An entry whose processes are all gone is
  dropped by the next job that looks, so a SIGKILLed kernel never keeps its GPUs.
- Waiting jobs queue in arrival order; only the first in the queue may take GPUs.
- The directory is ``$SGPU_MAGIC_LEASE_DIR``, else ``<sgpu_magic home>/leases`` (per user).
  For a team box, point every user at one directory all of them can write (e.g. mode 2775
  with a shared group); files there take the directory's permissions.
"""

from __future__ import annotations

import getpass
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from filelock import FileLock

from sgpu_magic._util.fs import atomic_write
from sgpu_magic.errors import JobCancelledError, ResourceError
from sgpu_magic.launch.resources import Gpu
from sgpu_magic.rundir import default_root

LEASE_DIR_ENV = "SGPU_MAGIC_LEASE_DIR"
POLL_INTERVAL_S = 0.1
"""How often a waiting job looks at the registry again."""


def default_lease_dir() -> Path:
    env = os.environ.get(LEASE_DIR_ENV)
    return Path(env) if env else default_root() / "leases"


def _me(pid: int | None = None) -> list:
    """``[pid, start time]`` of a process: the pair that names it even after its pid is reused."""
    proc = psutil.Process(pid)
    return [proc.pid, round(proc.create_time(), 2)]


def _alive(pids: list) -> bool:
    for pid, created in pids:
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - created) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.Error:
            continue
    return False


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in some containers
        return str(os.getuid())


@dataclass
class Lease:
    """GPUs held by one job; :meth:`release` gives them back (idempotent)."""

    registry: LeaseRegistry
    job_id: str
    gpus: list[Gpu]
    waited_s: float = 0.0
    released: bool = field(default=False)

    def add_process(self, pid: int) -> None:
        """Also count process ``pid`` (the launch host) as a holder: the lease lives while it does."""
        self.registry._update(self.job_id, lambda entry: entry["pids"].append(_me(pid)))

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.registry.release(self.job_id)


class LeaseRegistry:
    """The lease registry in ``directory`` (see the module docstring).

    Args:
        directory: the lease directory; default :func:`default_lease_dir`.
    """

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.dir = Path(directory) if directory is not None else default_lease_dir()
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise ResourceError(
                f"cannot create the GPU lease directory {self.dir} ({exc.strerror}); set "
                f"{LEASE_DIR_ENV} (or DistributedMagics.lease_dir) to a writable directory"
            ) from None
        self._mode = self.dir.stat().st_mode & 0o666
        self.file = self.dir / "registry.json"
        self._lock = FileLock(str(self.dir / "registry.lock"), mode=self._mode)

    # -- the file

    def _load(self) -> dict:
        try:
            data = json.loads(self.file.read_text())
        except FileNotFoundError:
            data = {}
        except (OSError, ValueError) as exc:
            raise ResourceError(
                f"the GPU lease registry {self.file} cannot be read ({exc}); remove it when no sgpu_magic job runs"
            ) from None
        data.setdefault("holders", [])
        data.setdefault("queue", [])
        data["holders"] = [h for h in data["holders"] if _alive(h["pids"])]
        data["queue"] = [w for w in data["queue"] if _alive(w["pids"])]
        return data

    def _save(self, data: dict) -> None:
        atomic_write(self.file, json.dumps(data, indent=1).encode(), mode=self._mode, fsync=True)

    def _update(self, job_id: str, change: Callable[[dict], None]) -> None:
        with self._lock:
            data = self._load()
            for entry in data["holders"]:
                if entry["job_id"] == job_id:
                    change(entry)
            self._save(data)

    def snapshot(self) -> dict:
        """``{"holders": [...], "queue": [...]}`` with dead entries dropped."""
        with self._lock:
            return self._load()

    # -- leasing

    def try_acquire(
        self,
        job_id: str,
        count: int,
        candidates: list[Gpu],
        *,
        explicit: bool = False,
        skip: Callable[[list[Gpu]], dict[str, str]] = lambda gpus: {},
        enqueue: bool = True,
    ) -> tuple[Lease | None, str]:
        """One attempt: lease ``count`` of ``candidates`` (all of them when ``explicit``) if this job is
        first in the queue and they are free.

        Returns ``(lease, "")`` on success, else ``(None, why)`` where ``why`` says how many GPUs are
        free, who holds the rest (job, kernel pid, user, since when) and how many jobs queue ahead;
        the job keeps its place in the queue when ``enqueue``.

        ``skip(free_gpus)`` names free GPUs not to use (uuid -> reason), e.g. ones busy with
        processes outside sgpu_magic.
        """
        with self._lock:
            data = self._load()
            queue = data["queue"]
            mine = next((w for w in queue if w["job_id"] == job_id), None)
            if mine is None:
                mine = {"job_id": job_id, "pids": [_me()], "count": count, "user": _user(), "since_s": time.time()}
                queue.append(mine)
            held = {uuid: h for h in data["holders"] for uuid in h["gpus"]}
            free = [g for g in candidates if g.uuid not in held]
            skipped = skip(free) if free else {}
            usable = [g for g in free if g.uuid not in skipped]
            ahead = queue[: queue.index(mine)]
            if not ahead and len(usable) >= count:
                chosen = usable if explicit else usable[:count]
                data["holders"].append(
                    {
                        "job_id": job_id,
                        "pids": mine["pids"],
                        "gpus": [g.uuid for g in chosen],
                        "indices": [g.index for g in chosen],
                        "user": mine["user"],
                        "since_s": time.time(),
                    }
                )
                queue.remove(mine)
                self._save(data)
                return Lease(self, job_id, chosen), ""
            if not enqueue:
                queue.remove(mine)
            self._save(data)
            return None, _why(count, candidates, usable, held, skipped, ahead, explicit)

    def acquire(
        self,
        job_id: str,
        count: int,
        candidates: list[Gpu],
        *,
        explicit: bool = False,
        wait: bool = True,
        skip: Callable[[list[Gpu]], dict[str, str]] = lambda gpus: {},
        on_wait: Callable[[str], None] = lambda why: None,
        cancelled: threading.Event | None = None,
    ) -> Lease:
        """Lease ``count`` GPUs for ``job_id``, waiting in the queue for them when ``wait``.

        ``on_wait(why)`` is called when the job starts waiting and whenever the reason changes.

        Raises:
            ResourceError: ``wait`` is False and the GPUs are not free now (the message says who holds them).
            JobCancelledError: ``cancelled`` was set while waiting.
            KeyboardInterrupt: interrupted while waiting (the job leaves the queue).
        """
        started = time.monotonic()
        last_why = None
        cancelled = cancelled or threading.Event()
        try:
            while True:
                lease, why = self.try_acquire(job_id, count, candidates, explicit=explicit, skip=skip, enqueue=wait)
                if lease is not None:
                    lease.waited_s = time.monotonic() - started
                    return lease
                if not wait:
                    raise ResourceError(
                        f"job {job_id} cannot start now: {why}. Leave out --no-wait / wait=False to queue for the GPUs"
                    )
                if why != last_why:
                    on_wait(why)
                    last_why = why
                if cancelled.wait(POLL_INTERVAL_S):
                    raise JobCancelledError(f"job {job_id} was cancelled while it waited for GPUs")
        except BaseException:
            self.leave_queue(job_id)
            raise

    def leave_queue(self, job_id: str) -> None:
        with self._lock:
            data = self._load()
            data["queue"] = [w for w in data["queue"] if w["job_id"] != job_id]
            self._save(data)

    def release(self, job_id: str) -> None:
        """Give back the GPUs of ``job_id`` (nothing happens if it holds none)."""
        with self._lock:
            data = self._load()
            data["holders"] = [h for h in data["holders"] if h["job_id"] != job_id]
            self._save(data)


def _indices(gpus) -> str:
    return ",".join(str(i) for i in gpus)


def _why(
    count: int,
    candidates: list[Gpu],
    usable: list[Gpu],
    held: dict,
    skipped: dict[str, str],
    ahead: list[dict],
    explicit: bool,
) -> str:
    """``waiting for 6 GPU(s): 2 of 8 free; GPUs 0,1,2,3,4,5 held by job J (kernel pid 12, user u) since 04:58:12``."""
    wanted = f"GPUs {_indices(g.index for g in candidates)}" if explicit else f"{count} GPU(s)"
    parts = [f"waiting for {wanted}: {len(usable)} of {len(candidates)} free"]
    by_holder: dict[str, tuple[dict, list[int]]] = {}
    index_of = {g.uuid: g.index for g in candidates}
    for uuid, holder in held.items():
        if uuid in index_of:
            by_holder.setdefault(holder["job_id"], (holder, []))[1].append(index_of[uuid])
    for holder, indices in by_holder.values():
        since = time.strftime("%H:%M:%S", time.localtime(holder["since_s"]))
        parts.append(
            f"GPUs {_indices(sorted(indices))} held by job {holder['job_id']} "
            f"(kernel pid {holder['pids'][0][0]}, user {holder['user']}) since {since}"
        )
    for uuid, reason in skipped.items():
        if uuid in index_of:
            parts.append(f"GPU {index_of[uuid]} busy outside sgpu_magic: {reason}")
    if ahead:
        parts.append(f"{len(ahead)} job(s) queued ahead ({', '.join(w['job_id'] for w in ahead)})")
    return "; ".join(parts)


def foreign_processes(gpus: list[Gpu]) -> dict[str, str]:
    """Free GPUs running compute processes outside sgpu_magic (NVML's list, read now): uuid -> description."""
    if not gpus or gpus[0].fake:
        return {}
    from sgpu_magic.launch.resources import list_gpus

    now = {g.uuid: g for g in list_gpus()}
    busy = {}
    for gpu in gpus:
        procs = now.get(gpu.uuid, gpu).processes
        if procs:
            busy[gpu.uuid] = ", ".join(p.describe() for p in procs)
    return busy
