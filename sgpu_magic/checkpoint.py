"""torch.distributed.checkpoint (DCP) storage for volumes: :class:`VolumeWriter` and :class:`VolumeReader`.

Modelled on the Databricks serverless GPU API's volume checkpoint storage, for any path fsspec
understands (a local directory, ``file://``, ``s3://``, ``gs://`` ...; ``http(s)://`` for reading).
They follow DCP's file layout (one ``__<rank>_<n>.distcp`` file per rank and write bucket, plus one
``.metadata`` file), so a checkpoint they write also loads with ``FileSystemReader`` once it is on local
disk, and DCP reshards on load: a checkpoint saved by 2 ranks loads on 1 or 4.

A checkpoint counts as complete only when its ``.metadata`` exists:

- the coordinator removes an old ``.metadata`` at the target before any rank writes a shard, so
  overwriting a checkpoint in place never leaves an old ``.metadata`` over new, partial shards;
- each rank writes its shards to local disk (the target itself when it is local, else a staging
  directory), then uploads them; DCP gathers every rank's write results before the coordinator's
  ``finish``, which writes ``.metadata`` under a temporary name and renames it into place last;
- :class:`VolumeReader` raises :class:`~sgpu_magic.errors.CheckpointError` for a directory without
  ``.metadata`` (a save that never finished) and for a ``.metadata`` naming a shard file that is missing.

Example, inside a decorated function::

    import torch.distributed.checkpoint as dcp
    from sgpu_magic.checkpoint import VolumeWriter, VolumeReader, is_complete

    dcp.save({"model": model.state_dict()}, storage_writer=VolumeWriter("s3://bucket/ckpt/step-100"))
    if is_complete("s3://bucket/ckpt/step-100"):
        state = {"model": model.state_dict()}
        dcp.load(state, storage_reader=VolumeReader("s3://bucket/ckpt/step-100"))
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

from sgpu_magic.errors import CheckpointError

__all__ = ["VolumeWriter", "VolumeReader", "is_complete", "CheckpointError"]

METADATA = ".metadata"
SHARD_SUFFIX = ".distcp"


def _resolve(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None
) -> tuple[AbstractFileSystem, str, bool]:
    import fsspec.core
    from fsspec.implementations.local import LocalFileSystem

    fs, root = fsspec.core.url_to_fs(os.fspath(path), **(storage_options or {}))
    return fs, root.rstrip("/") or "/", isinstance(fs, LocalFileSystem)


def is_complete(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``path`` holds a checkpoint whose save finished (its ``.metadata`` exists).

    Args:
        path: checkpoint directory, local or fsspec URL.
        storage_options: passed to the fsspec filesystem.
    Returns:
        ``bool``; ``False`` also when ``path`` does not exist.
    """
    fs, root, _ = _resolve(path, storage_options)
    return bool(fs.exists(f"{root}/{METADATA}"))


class VolumeWriter(FileSystemWriter):
    """DCP ``StorageWriter`` for a local directory or fsspec URL; usable with ``dcp.save`` and ``dcp.async_save``.

    Args:
        path (str | os.PathLike): checkpoint directory; created if missing. Keep one directory per saved
            step to keep the last complete checkpoint while the next one is written.
        stage (bool | None): write shards to a local staging directory and upload them. ``None`` (default)
            stages for every non-local filesystem and writes a local target in place.
        staging_dir (str | os.PathLike[str] | None): where staging directories are made; default the system temp dir.
        storage_options (dict | None): passed to the fsspec filesystem.
        **kwargs: passed to ``torch.distributed.checkpoint.FileSystemWriter`` (``thread_count``,
            ``single_file_per_rank``, ``sync_files``, ...).

    Raises:
        CheckpointError: ``path`` names a filesystem that cannot be written (``http(s)://``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        stage: bool | None = None,
        staging_dir: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._storage_options = storage_options
        self._stage_opt, self._staging_parent = stage, staging_dir
        self._target(path)
        super().__init__(self._local, **kwargs)

    def _target(self, path: str | os.PathLike[str]) -> None:
        self.url = os.fspath(path)
        self._fs, self._root, is_local = _resolve(path, self._storage_options)
        if type(self._fs).__name__ == "HTTPFileSystem":
            raise CheckpointError(
                f"VolumeWriter: cannot write a checkpoint to {self.url}: http(s) URLs are read-only "
                f"here; save to a local directory or an object store URL (s3://, gs://, ...)"
            )
        self._staged = (not is_local) if self._stage_opt is None else bool(self._stage_opt)
        self._local = tempfile.mkdtemp(prefix="sgpu-dcp-", dir=self._staging_parent) if self._staged else self._root

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.url:
            self._target(checkpoint_id)
        super().reset(self._local)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._fs.makedirs(self._root, exist_ok=True)
        if is_coordinator and self._fs.exists(f"{self._root}/{METADATA}"):
            self._fs.rm(f"{self._root}/{METADATA}")  # before any shard is written (DCP plans collectively first)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self._staged:
            return super().prepare_local_plan(plan)
        Path(self._local).mkdir(parents=True, exist_ok=True)
        return plan  # staging is always empty: skip FileSystemWriter's "existing checkpoint" warning

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        if self._staged:
            for name in sorted({r.storage_data.relative_path for r in future.wait()}):
                local = os.path.join(self._local, name)
                self._fs.put_file(local, f"{self._root}/{name}")
                os.remove(local)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        if self._staged:
            tmp = f"{self._root}/{METADATA}.{os.getpid()}.tmp"
            self._fs.put_file(os.path.join(self._local, METADATA), tmp)
            self._fs.mv(tmp, f"{self._root}/{METADATA}")
            shutil.rmtree(self._local, ignore_errors=True)


class VolumeReader(FileSystemReader):
    """DCP ``StorageReader`` for a local directory or fsspec URL; usable with ``dcp.load``.

    Remote files are downloaded to a local staging directory (only the shard files this rank needs)
    and removed after the read. Resharding is DCP's: load into state dicts sharded for any world size.

    Args:
        path (str | os.PathLike): checkpoint directory written by :class:`VolumeWriter` or DCP's FileSystemWriter.
        staging_dir (str | os.PathLike[str] | None): where staging directories are made; default the system temp dir.
        storage_options (dict | None): passed to the fsspec filesystem.

    Raises:
        CheckpointError: when made: the directory is missing, has no ``.metadata`` (a save that did not finish),
            or (local paths) lacks a shard file its ``.metadata`` names. Inside ``dcp.load`` (a remote shard found
            missing while reading, or a reader made before the checkpoint changed) DCP wraps the same message in
            its ``CheckpointException``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        staging_dir: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self._storage_options, self._staging_parent = storage_options, staging_dir
        self._target(path)
        super().__init__(self._local)
        self._fetch(METADATA, self._incomplete_message)  # here, where the error is not wrapped by DCP
        if not self._staged:
            self._check_shards()

    def _target(self, path: str | os.PathLike[str]) -> None:
        self.url = os.fspath(path)
        self._fs, self._root, is_local = _resolve(path, self._storage_options)
        self._staged = not is_local
        self._local = tempfile.mkdtemp(prefix="sgpu-dcp-", dir=self._staging_parent) if self._staged else self._root

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.url:
            self._target(checkpoint_id)
        super().reset(self._local)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # DCP asks for a rank's own metadata when the global one is missing
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        self._fetch(
            name, self._incomplete_message if rank is None else (lambda: f"no rank-local {name} at {self.url} either")
        )
        try:
            return super().read_metadata(*args, **kwargs)
        finally:
            if self._staged:
                Path(self._local, name).unlink(missing_ok=True)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        names = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        for name in names:
            self._fetch(name, functools.partial(self._damaged_message, name))
        try:
            return super().read_data(plan, planner)
        finally:
            if self._staged:
                for name in names:
                    Path(self._local, name).unlink(missing_ok=True)
                shutil.rmtree(self._local, ignore_errors=True)

    def _check_shards(self) -> None:
        """Every shard file a local checkpoint's ``.metadata`` names must exist (remote ones are checked as they are read)."""
        names = {info.relative_path for info in super().read_metadata().storage_data.values()}
        missing = sorted(n for n in names if not os.path.exists(os.path.join(self._local, n)))
        if missing:
            raise CheckpointError(self._damaged_message(missing[0]))

    def _damaged_message(self, name: str) -> str:
        return (
            f"checkpoint at {self.url} is damaged: shard file {name!r} named in its .metadata is missing; "
            f"load another checkpoint"
        )

    def _fetch(self, name: str, message: Callable[[], str]) -> None:
        """Make ``name`` readable under the local path (download it when staged), or raise CheckpointError."""
        local = os.path.join(self._local, name)
        if not self._staged:
            if not os.path.exists(local):
                raise CheckpointError(message())
        elif not os.path.exists(local):
            os.makedirs(self._local, exist_ok=True)
            try:
                self._fs.get_file(f"{self._root}/{name}", local)
            except FileNotFoundError:
                raise CheckpointError(message()) from None

    def _incomplete_message(self) -> str:
        if not self._fs.exists(self._root):
            return f"no checkpoint at {self.url}: the directory does not exist"
        shards = [p for p in self._fs.ls(self._root, detail=False) if str(p).endswith(SHARD_SUFFIX)]
        return (
            f"checkpoint at {self.url} is incomplete: {len(shards)} shard file(s) but no {METADATA}, so the save "
            f"that wrote it did not finish (a rank failed or was stopped mid-save); load an earlier checkpoint, "
            f"or check first with sgpu_magic.checkpoint.is_complete(path)"
        )
