"""Stream a volume's files to every rank: :class:`VolumeDataset` and :class:`DataLoader`.

Modelled on the Databricks serverless GPU API's volume dataset, for any path fsspec understands: a
local directory, ``file://``, ``http(s)://`` (a directory page with links, as ``python -m http.server``
serves), ``s3://``, ``gs://`` ... (the matching fsspec backend must be installed).

Example, inside a decorated function::

    from sgpu_magic.data import VolumeDataset, DataLoader

    ds = VolumeDataset("s3://bucket/shards", pattern="*.pt", transform=torch.load)
    for epoch in range(3):
        for batch in DataLoader(ds, batch_size=None, num_workers=2):
            ...
"""

from __future__ import annotations

import collections
import concurrent.futures
import fnmatch
import functools
import hashlib
import itertools
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.utils.data

from sgpu_magic.data.cache import VolumeCache, default_cache_dir, volume_key
from sgpu_magic.rundir import atomic_write_bytes

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = ["VolumeDataset"]

log = logging.getLogger(__name__)
_ordinals: dict[str, itertools.count[int]] = {}
_CHECK_PREFIX = "sgpu_magic/volume_dataset"


def rank_and_world() -> tuple[int, int]:
    """``(RANK, WORLD_SIZE)`` from torchrun's environment contract; ``(0, 1)`` when neither is set.

    Raises:
        ValueError: exactly one of the two is set, or they do not describe a rank of the world.
    """
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if (rank is None) != (world is None):
        have, missing = ("RANK", "WORLD_SIZE") if world is None else ("WORLD_SIZE", "RANK")
        raise ValueError(
            f"VolumeDataset: {have} is set but {missing} is not; set both (torchrun and sgpu_magic "
            f"set both for every rank) or neither (one process reads every file)"
        )
    if rank is None or world is None:  # neither is set (one without the other was refused above)
        return 0, 1
    try:
        r, w = int(rank), int(world)
    except ValueError:
        raise ValueError(f"VolumeDataset: RANK={rank!r} and WORLD_SIZE={world!r} must be integers") from None
    if w < 1 or not 0 <= r < w:
        raise ValueError(f"VolumeDataset: RANK={r} is not a rank of WORLD_SIZE={w}; need 0 <= RANK < WORLD_SIZE")
    return r, w


class VolumeDataset(torch.utils.data.IterableDataset[Any]):
    """Yield the local, cached path of every file under ``path``, each file to exactly one (rank, worker).

    Files are listed once, when the dataset is built (sorted by their path under ``path``; a ``cache_dir``
    inside a local ``path`` is left out of the listing). On first
    access a file is copied to a cache on local disk shared by every process of the machine; later
    accesses (the next epoch, another job) read the copy and touch nothing remote. Each (rank,
    DataLoader worker) reads the slice ``files[rank * num_workers + worker_id :: world_size * num_workers]``,
    with rank and worker read when iteration starts, so together all slices cover every file once per
    epoch.

    Args:
        path (str | os.PathLike): a local directory or an fsspec URL (``file://``, ``http(s)://``, ``s3://`` ...).
        pattern (str | None): glob matched against each file's path under ``path`` (``"*.pt"``,
            ``"train/*.jsonl"``); ``None`` = every file. Default ``None``.
        cache_dir (str | os.PathLike | None): cache root; default ``$SGPU_MAGIC_CACHE_DIR``, else
            ``<sgpu_magic home>/cache``. Each volume gets its own subdirectory.
        cache_max_bytes (int | None): bound on the bytes this volume keeps cached; least recently served
            files are evicted past it. Default ``None`` (unbounded). Files fetched ahead and the file a
            reader holds (until it asks for the next) are never evicted, so the cache can exceed a bound
            smaller than ranks x DataLoader workers x (``prefetch_files`` + 1) files on the machine.
        transform (Callable[[str], Any] | None): applied to each local path in the worker that fetched it
            (``torch.load``, an image decoder ...); default ``None`` yields the path (``str``).
        storage_options (dict | None): passed to the fsspec filesystem (credentials, endpoint ...).
        prefetch_files (int): files not yet cached are fetched this many ahead of the one being yielded, in
            threads of the reading process (each DataLoader worker has its own). Default 8; 1 = one at a time.

    Raises:
        FileNotFoundError: ``path`` does not exist or holds no file matching ``pattern``.
        ValueError: at iteration, only one of ``RANK`` / ``WORLD_SIZE`` is set, or ranks listed different
            files (the volume changed while the job started) or use different numbers of DataLoader workers
            (compared through the job's rendezvous store at ``MASTER_ADDR:MASTER_PORT`` when one answers,
            as under sgpu_magic and torchrun, else through files beside the cache when every rank runs on
            this machine).

    Ranks get different numbers of files when the count is not a multiple of world_size x num_workers
    (37 files over 4 slices: 10, 9, 9, 9). With DDP every rank must take the same number of steps: stop
    at the smallest count (``all_reduce`` it with ``MIN``) or give the volume a divisible number of files.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        pattern: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_max_bytes: int | None = None,
        transform: Callable[[str], Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        prefetch_files: int = 8,
    ) -> None:
        import fsspec.core

        if not isinstance(prefetch_files, int) or prefetch_files < 1:
            raise ValueError(
                f"VolumeDataset: prefetch_files={prefetch_files!r} must be an int >= 1 (1 = fetch one file at a time)"
            )
        if cache_max_bytes is not None and (not isinstance(cache_max_bytes, int) or cache_max_bytes <= 0):
            raise ValueError(
                f"VolumeDataset: cache_max_bytes={cache_max_bytes!r} must be a positive int of bytes, or None"
            )
        self.url = os.fspath(path)
        self.pattern = pattern
        self.transform = transform
        self.storage_options = dict(storage_options or {})
        fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self._root = root.rstrip("/")
        cache_root = Path(cache_dir or default_cache_dir())
        self.files, self._sizes = self._list(fs, cache_root)
        self.cache = VolumeCache(cache_root / volume_key(_protocol(fs), self._root), cache_max_bytes)
        self._fs, self._fs_pid = fs, os.getpid()
        self.prefetch_files = prefetch_files
        self._count_lock = threading.Lock()
        self.fetches = 0  # files this process fetched (not served from the cache); DataLoader workers count their own
        ident = hashlib.sha256(f"{self.url}\n{pattern}".encode()).hexdigest()[:16]
        self._listing = hashlib.sha256("\n".join(self.files).encode()).hexdigest()[:16]
        self._check_key = f"{_CHECK_PREFIX}/{ident}/{next(_ordinals.setdefault(ident, itertools.count()))}"

    def _list(self, fs: AbstractFileSystem, cache_root: Path) -> tuple[list[str], dict[str, int | None]]:
        try:
            found = fs.find(self._root, detail=True)
        except FileNotFoundError:
            found = {}
        if not found and not fs.exists(self._root):  # one listing request when the path is there
            raise FileNotFoundError(
                f"VolumeDataset: {self.url} does not exist (or is not readable with the given storage_options)"
            )
        # A cache inside a local volume (cache_dir=path/"cache") fills while ranks list: never list it.
        skip = f"{os.path.realpath(cache_root)}/" if _protocol(fs) in ("file", "local") else None
        sizes: dict[str, int | None] = {}
        for name, info in found.items():
            if info.get("type", "file") != "file":
                continue
            if skip is not None and os.path.realpath(name).startswith(skip):
                continue
            rel = name[len(self._root) :].lstrip("/") if name.startswith(self._root) else name.rsplit("/", 1)[-1]
            if self.pattern is None or fnmatch.fnmatch(rel, self.pattern):
                sizes[rel] = info.get("size")
        if not sizes:
            what = f"matching {self.pattern!r}" if self.pattern else "at all"
            raise FileNotFoundError(f"VolumeDataset: no file {what} under {self.url}")
        return sorted(sizes), sizes

    def slice_for(self, rank: int, world_size: int, worker_id: int = 0, num_workers: int = 1) -> list[str]:
        """The files (paths under ``path``) that one (rank, worker) reads, in order."""
        slices = max(1, num_workers)
        return self.files[rank * slices + worker_id :: world_size * slices]

    def fetch(self, relative: str) -> str:
        """Local path of the file ``relative`` (a path under ``path``), copying it into the cache if needed."""
        local, fetched = self.cache.get(relative, self._sizes.get(relative), functools.partial(self._get, relative))
        if fetched:
            with self._count_lock:
                self.fetches += 1
        return local

    def _get(self, relative: str, local_path: str) -> None:
        self._filesystem().get_file(f"{self._root}/{relative}", local_path)

    def _filesystem(self) -> AbstractFileSystem:
        """This process's fsspec filesystem (async ones such as HTTP are not fork-safe: a DataLoader worker makes its own)."""
        if self._fs is None or self._fs_pid != os.getpid():
            import fsspec.core

            self._fs, _ = fsspec.core.url_to_fs(self.url, **self.storage_options)
            self._fs_pid = os.getpid()
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_count_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _count_lock=threading.Lock())

    def __iter__(self) -> Iterator[Any]:
        rank, world = rank_and_world()
        info = torch.utils.data.get_worker_info()
        worker_id, num_workers = (0, 0) if info is None else (info.id, info.num_workers)
        if worker_id == 0 and world > 1:
            self._check_workers(rank, world, max(1, num_workers))
        for local in self._local_paths(self.slice_for(rank, world, worker_id, num_workers)):
            yield local if self.transform is None else self.transform(local)

    def _file_board(self, world: int) -> _FileBoard | None:
        """Files under the cache, per job (``TORCHELASTIC_RUN_ID``), when all ``world`` ranks run on this machine."""
        job = os.environ.get("TORCHELASTIC_RUN_ID")
        if not job or os.environ.get("LOCAL_WORLD_SIZE") != str(world):
            return None
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job)
        return _FileBoard(self.cache.directory.parent / ".worker_counts" / safe)

    def _local_paths(self, files: list[str]) -> Iterator[str]:
        """Local paths of ``files`` in order; files not yet cached are fetched up to ``prefetch_files`` ahead, in threads."""
        window: collections.deque[Any] = collections.deque()
        pool = None
        pending = iter(files)
        reading = None  # the file last yielded: pinned until the reader asks for the next one
        try:
            while True:
                while len(window) < max(1, self.prefetch_files):
                    relative = next(pending, None)
                    if relative is None:
                        break
                    cached = self.cache.lookup(relative, self._sizes.get(relative))
                    if cached is None and self.prefetch_files > 1:
                        pool = pool or concurrent.futures.ThreadPoolExecutor(self.prefetch_files, "sgpu-volume-fetch")
                        window.append((relative, pool.submit(self.fetch, relative)))
                    else:
                        window.append((relative, cached or self.fetch(relative)))
                if not window:
                    return
                relative, head = window.popleft()
                local = head if isinstance(head, str) else head.result()
                if not self.cache.still_there(
                    local
                ):  # evicted while queued: fetch it again rather than hand out nothing
                    local = self.fetch(relative)
                if reading is not None:
                    self.cache.served(reading)
                reading = local
                yield local
        finally:
            if reading is not None:
                self.cache.served(reading)
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def _check_workers(self, rank: int, world: int, slices: int) -> None:
        """Compare DataLoader worker counts with the ranks that got here before us: through the job's rendezvous
        store, or, before any process group exists, through files beside the cache when every rank is on this machine.

        Non-blocking: a rank that iterates alone (evaluation on rank 0) is not held up. Of two ranks
        that disagree, the later one to arrive always sees the other's count and raises.
        """
        store: _CountStore | None = _rendezvous_store() or self._file_board(world)
        if store is None:
            return
        key = self._check_key
        store.set(f"{key}/{rank}", f"{slices} {self._listing} {len(self.files)}")
        others, listings = {}, {}
        for r in range(world):
            if r != rank and store.check([f"{key}/{r}"]):
                value = store.get(f"{key}/{r}")
                count, listing, files = (value.decode() if isinstance(value, bytes) else value).split()
                others[r], listings[r] = int(count), (listing, int(files))
        if any(listing != self._listing for listing, _ in listings.values()):
            seen = ", ".join(
                f"rank {r}: {n} files"
                for r, (_, n) in sorted({**listings, rank: (self._listing, len(self.files))}.items())
            )
            raise ValueError(
                f"VolumeDataset({self.url!r}): ranks listed different files ({seen}; same count = different names). "
                f"Each rank lists the volume when it builds the dataset, so files were added or removed under it while "
                f"the job started. Finish writing the volume before the job lists it, or give a pattern that matches "
                f"only the finished files."
            )
        differ = {r: n for r, n in others.items() if n != slices}
        if differ:
            seen = ", ".join(f"rank {r}: {n}" for r, n in sorted({**others, rank: slices}.items()))
            raise ValueError(
                f"VolumeDataset({self.url!r}): ranks read it with different numbers of DataLoader workers ({seen}; "
                f"0 workers count as 1). Files are split by a stride of world_size x num_workers, so with different "
                f"counts some files would be skipped and others read twice. Give every rank's DataLoader the same "
                f"num_workers."
            )


class _CountStore(Protocol):
    """The store calls :meth:`VolumeDataset._check_workers` makes: a c10d ``Store`` or a :class:`_FileBoard`."""

    def set(self, key: str, value: str) -> None: ...
    def check(self, keys: list[str]) -> bool: ...
    def get(self, key: str) -> bytes | str: ...


class _FileBoard:
    """The three store calls :meth:`VolumeDataset._check_workers` makes, on files in one directory of this machine."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.directory / hashlib.sha256(key.encode()).hexdigest()[:32]

    def set(self, key: str, value: str) -> None:
        atomic_write_bytes(self._path(key), value.encode())

    def check(self, keys: list[str]) -> bool:
        return all(self._path(k).exists() for k in keys)

    def get(self, key: str) -> str:
        return self._path(key).read_text()


def _protocol(fs: AbstractFileSystem) -> str:
    proto = fs.protocol
    return str(proto[0] if isinstance(proto, (tuple, list)) else proto)


def _rendezvous_store() -> torch.distributed.TCPStore | None:
    """A client of the job's c10d store (``MASTER_ADDR:MASTER_PORT``), or ``None`` when nothing listens there."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            pass
        import torch.distributed as dist

        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
    except (OSError, RuntimeError, ValueError) as exc:
        log.debug("no rendezvous store at %s:%s (%s); worker counts not compared", host, port, exc)
        return None
