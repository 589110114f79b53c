"""File helpers shared by every process: the one atomic replace (readers see the old file or the whole new one), and
the private marker file (:func:`touch_private`)."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[str]:
    """Yield an unused temporary name beside ``path`` (``.<name>.<pid>.<random><suffix>``) for the block to write;
    once the block ends without an error that file replaces ``path`` (one ``rename``); on an error it is removed
    and ``path`` is left as it was."""
    folder, name = os.path.split(os.fspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write(path: str | os.PathLike, data: bytes, mode: int | None = None, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` through :func:`replacing`; ``mode``: the file's permission bits (default 0600);
    ``fsync``: flush it to the disk before the rename (a file other processes rely on after a crash)."""
    with replacing(path) as tmp:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)


def touch_private(path: str | os.PathLike) -> None:
    """Make the empty file ``path`` (0600) if it does not exist, leaving one that does as it is: a marker."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))


def count_lines(paths: list[Path]) -> dict[str, int]:
    """Lines in each rank's log (a view that skipped over fast output reports them); {} above 4 GiB."""
    if sum(p.stat().st_size for p in paths if p.exists()) > 4 * 2**30:
        return {}
    counts = {}
    for rank, path in enumerate(paths):
        n = 0
        try:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    n += block.count(b"\n")
        except FileNotFoundError:
            continue
        counts[str(rank)] = n
    return counts


def site_packages_fingerprint(sys_path: Sequence[str]) -> tuple:
    """The modification times of the ``site-packages`` / ``dist-packages`` folders on ``sys_path``: it changes when
    a package is installed or removed there (``%pip install``), so a process that preloaded packages knows it is
    stale. Folders that cannot be read are left out."""
    stamps = []
    for entry in sys_path:
        if os.path.basename(entry.rstrip(os.sep)) not in ("site-packages", "dist-packages"):
            continue
        try:
            stamps.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            continue
    return tuple(stamps)
