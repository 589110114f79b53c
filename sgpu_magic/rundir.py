"""The RunDir: one object that names every file of a job, and atomic writes.

The RunDir is the contract between the kernel, the launch host and the ranks
(see DESIGN.md). Run directories are private (0700) because the payload is a pickle,
and pickles are code. Logs stay after the job; the payload is deleted when it ends.

Layout::

    <root>/runs/<job_id>/
        launch.json          what the host needs to start the ranks (written by the kernel)
        payload.pkl          the captured code, globals and arguments (deleted after the job)
        status.json          job state written by the host: running, pids, final state
        logs/rank_<N>.log    stdout and stderr of rank N, in order
        results/rank_<N>.pkl return value of rank N (written by the rank)
        errors/rank_<N>.json exception of rank N (written by the rank)
        elastic/             torch elastic's own per-rank files
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any


def default_root() -> Path:
    """Root directory for run dirs: ``$SGPU_MAGIC_HOME``, else ``$XDG_CACHE_HOME/sgpu_magic``, else ``~/.cache/sgpu_magic``."""
    env = os.environ.get("SGPU_MAGIC_HOME")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "sgpu_magic"


def make_private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) with mode 0700; refuse an existing one owned by another user."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} is owned by uid {st.st_uid}, not by you; set SGPU_MAGIC_HOME to a private directory")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see either nothing or the whole file (write, fsync-free rename)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON atomically."""
    atomic_write_bytes(path, json.dumps(obj, indent=1, default=str).encode())


def write_status(run_dir: "RunDir", status: dict) -> None:
    """The launch host's report: ``status.json`` written atomically, then its follower woken."""
    atomic_write_json(run_dir.status_file, status)
    signal_status(run_dir)


def signal_status(run_dir: "RunDir") -> None:
    """Wake whoever follows ``run_dir`` (one byte into its status FIFO). Does nothing when there is no
    FIFO or nobody reads it; a full FIFO already holds a wake-up."""
    try:
        fd = os.open(run_dir.status_signal, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no FIFO, or no reader (ENXIO)
        return
    try:
        os.write(fd, b"\n")
    except OSError:  # EAGAIN: full
        pass
    finally:
        os.close(fd)


def read_json(path: Path) -> dict | None:
    """Read a JSON file written by :func:`atomic_write_json`; ``None`` when it does not exist yet."""
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return None


_TRACEBACK_MARK = "[sgpu_magic] rank {rank} raised {exc_type}; its traceback follows"


def traceback_marker(rank: int, exc_type: str) -> str:
    """The log line a rank writes just before its traceback (the view shows the line, not the traceback,
    which the kernel shows once in the raised error)."""
    return _TRACEBACK_MARK.format(rank=rank, exc_type=exc_type)


def is_traceback_marker(line: str) -> bool:
    return line.startswith("[sgpu_magic] rank ") and line.endswith("; its traceback follows")


ATTEMPT_MARK = "[sgpu_magic] attempt "


def attempt_marker(attempt: int, attempts: int, why: str) -> str:
    """The line the launch host appends to every rank log before it starts attempt ``attempt`` (max_restarts)."""
    return f"{ATTEMPT_MARK}{attempt} of {attempts}: all ranks restarted after {why}"


def is_attempt_marker(line: str) -> bool:
    return line.startswith(ATTEMPT_MARK)


def new_job_id() -> str:
    """A sortable, unique job id: ``20261130-015715-3fa2c1``."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


class RunDir:
    """Names every file of one job. ``RunDir.create()`` makes a new private one."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls, root: Path | None = None, job_id: str | None = None) -> "RunDir":
        """Make ``<root>/runs/<job_id>`` and its subfolders, all 0700."""
        runs = make_private_dir((root or default_root()) / "runs")
        rd = cls(runs / (job_id or new_job_id()))
        rd.path.mkdir(mode=0o700)
        for sub in ("logs", "results", "errors", "elastic"):
            (rd.path / sub).mkdir(mode=0o700)
        return rd

    @property
    def job_id(self) -> str:
        return self.path.name

    @property
    def launch_file(self) -> Path:
        return self.path / "launch.json"

    @property
    def payload_file(self) -> Path:
        return self.path / "payload.pkl"

    @property
    def status_file(self) -> Path:
        return self.path / "status.json"

    @property
    def status_signal(self) -> Path:
        """A FIFO the kernel makes and reads; the launch host writes a byte to it after each status write
        (see :func:`signal_status`), so a followed job wakes at once instead of polling."""
        return self.path / "status.fifo"

    @property
    def elastic_dir(self) -> Path:
        return self.path / "elastic"

    def log_file(self, rank: int) -> Path:
        return self.path / "logs" / f"rank_{rank}.log"

    def result_file(self, rank: int) -> Path:
        return self.path / "results" / f"rank_{rank}.pkl"

    def error_file(self, rank: int) -> Path:
        return self.path / "errors" / f"rank_{rank}.json"

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"
