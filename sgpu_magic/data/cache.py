"""A per-machine file cache for :class:`sgpu_magic.data.VolumeDataset`.

Files of one volume (a directory or fsspec URL) are copied to ``<cache_dir>/<volume key>/<relative
path>``. Every process on the machine (ranks and their DataLoader workers) shares the cache:

- a copy is written to a temporary name in the same directory and renamed into place, so a reader
  never sees a torn file;
- a per-file ``filelock.FileLock`` makes the first toucher fetch while the others wait, so each
  file is fetched once per machine;
- with ``max_bytes`` set, a size ledger (``.ledger``, changed under one cache-wide lock) tracks
  the bytes held; when an insert takes it over the bound, the least recently served files are
  removed (never the one just fetched) until the cache is at 90% of the bound. Eviction order is
  the files' mtime: a file looked up or fetched for a reader is pinned (mtime one day ahead) until
  the reader is handed it (:meth:`VolumeCache.served` sets the mtime to now), so files fetched ahead
  go last. A pinned file is never evicted (an eviction reads each file's mtime again before it
  unlinks it, and a lookup pins before it checks), so the bound may be exceeded while readers hold
  more than it; a file fetched ahead that is gone when it is yielded anyway (the cache cleared by
  hand) is fetched again.

A cached copy is trusted when its size equals the size the listing reported (or the listing had
no size, as for plain HTTP directory pages); files changed in place at the same size are not
noticed. Clear the cache directory to force a refetch.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from sgpu_magic._util.fs import replacing
from sgpu_magic.rundir import atomic_write_json, read_json

LOCKS_DIR = ".locks"
LEDGER = ".ledger"
EVICT_TO = 0.9
PIN_S = 86400.0
PIN_PROTECT_S = 600.0
"""A file pinned (queued or being read) less than this long ago is never evicted; an older pin (its reader died) can be."""


def default_cache_dir() -> Path:
    """``$SGPU_MAGIC_CACHE_DIR``, else ``<sgpu_magic home>/cache`` (see :func:`sgpu_magic.rundir.default_root`)."""
    env = os.environ.get("SGPU_MAGIC_CACHE_DIR")
    if env:
        return Path(env)
    from sgpu_magic.rundir import default_root

    return default_root() / "cache"


def volume_key(protocol: str, root: str) -> str:
    """Directory name of one volume in the cache: readable tail plus a hash of the full URL."""
    url = f"{protocol}://{root}"
    tail = "".join(c if c.isalnum() or c in "-_." else "_" for c in root.rstrip("/").rsplit("/", 1)[-1])[:40]
    return f"{tail or 'root'}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


class VolumeCache:
    """The cached copies of one volume's files on this machine.

    Args:
        directory: the volume's cache directory (created if missing).
        max_bytes: bound on the bytes held in ``directory``; ``None`` = unbounded.
    """

    def __init__(self, directory: Path, max_bytes: int | None = None) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._dir = str(self.directory)
        (self.directory / LOCKS_DIR).mkdir(parents=True, exist_ok=True)

    def lookup(self, relative: str, size: int | None) -> str | None:
        """The cached copy's local path, or ``None`` when there is none yet (nothing is fetched)."""
        local = os.path.join(self._dir, relative)  # str paths: this is the per-file hot path of a cached epoch
        # Pin before checking: a file checked and then pinned could be evicted in between (by a fetch thread
        # of this reader or by another process), and the path handed out would name nothing.
        if self.max_bytes is not None and not self._pin(local):
            return None
        if not self._valid(local, size):
            return None
        return local

    def get(self, relative: str, size: int | None, fetch: Callable[[str], object]) -> tuple[str, bool]:
        """Return ``(local path, fetched)``: the cached copy, calling ``fetch(tmp_path)`` first if there is none.

        ``fetch`` writes the whole file to the path it is given; it runs at most once per file on
        this machine while the copy stays cached.
        """
        cached = self.lookup(relative, size)
        if cached is not None:
            return cached, False
        local = os.path.join(self._dir, relative)
        digest = hashlib.sha256(relative.encode()).hexdigest()[:24]
        with FileLock(str(self.directory / LOCKS_DIR / f"{digest}.lock")):
            if self._valid(local, size):
                return local, False
            folder = os.path.dirname(local)
            os.makedirs(folder, exist_ok=True)
            with replacing(local, suffix=".part") as tmp:
                fetch(tmp)
        if self.max_bytes is not None:
            self._pin(local)
            self._account(local)
        return local, True

    @staticmethod
    def _valid(local: str, size: int | None) -> bool:
        try:
            st = os.stat(local)
        except FileNotFoundError:
            return False
        return size is None or st.st_size == size

    @staticmethod
    def _pin(local: str) -> bool:
        """Mark a file as about to be served (an mtime in the future puts it last in the eviction order);
        ``False`` when there is no such file."""
        now = time.time()
        try:
            os.utime(local, (now, now + PIN_S))
        except FileNotFoundError:
            return False
        return True

    def still_there(self, local: str) -> bool:
        """Whether a path :meth:`lookup` or :meth:`get` handed out still exists (a bound too small for the
        files read ahead, or an eviction that read the file's mtime just before it was pinned, can remove it)."""
        return self.max_bytes is None or os.path.exists(local)

    def served(self, local: str) -> None:
        """Record that ``local`` was handed to the reader now (it becomes the most recently served file)."""
        if self.max_bytes is not None:
            try:
                os.utime(local)
            except FileNotFoundError:
                pass

    def _account(self, added: str) -> None:
        """Add ``added``'s bytes to the ledger; evict least recently served files when over the bound."""
        assert self.max_bytes is not None  # only a bounded cache keeps a ledger (get)
        with FileLock(str(self.directory / LOCKS_DIR / "cache.lock")):
            ledger = self.directory / LEDGER
            held = (read_json(ledger) or {}).get("bytes")
            try:
                size = os.stat(added).st_size
            except FileNotFoundError:  # already evicted by another process: the bound is below what is in use
                size = 0
            held = self._scan_bytes() if held is None else held + size
            if held > self.max_bytes:
                held = self._evict(keep=added)
            atomic_write_json(ledger, {"bytes": held})

    def _entries(self) -> list[tuple[float, int, Path]]:
        """``(mtime, size, path)`` of every cached file (not locks, the ledger or temporary copies)."""
        entries = []
        for dirpath, dirnames, filenames in os.walk(self.directory):
            dirnames[:] = [d for d in dirnames if d != LOCKS_DIR]
            for name in filenames:
                if name.startswith("."):
                    continue
                path = Path(dirpath, name)
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime, st.st_size, path))
        return entries

    def _scan_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _evict(self, keep: str) -> int:
        """Remove least recently served files until the cache holds at most 90% of ``max_bytes``; return bytes held.

        Files pinned in the last ``PIN_PROTECT_S`` (queued to be yielded, or yielded and still being read)
        are kept even past the bound."""
        assert self.max_bytes is not None  # only a bounded cache evicts (_account)
        entries = self._entries()
        held = sum(size for _, size, _ in entries)
        protected_after = time.time() + PIN_S - PIN_PROTECT_S  # mtime of a file pinned PIN_PROTECT_S ago
        for mtime, size, path in sorted(entries, key=lambda e: e[0]):
            if held <= self.max_bytes * EVICT_TO or mtime > protected_after:
                break  # the rest are pinned by live readers: the bound waits for them
            if str(path) == keep:
                continue
            try:  # read again: a reader may have pinned it since the walk
                if os.stat(path).st_mtime > protected_after:
                    continue
            except FileNotFoundError:
                held -= size
                continue
            path.unlink(missing_ok=True)
            held -= size
        return held
