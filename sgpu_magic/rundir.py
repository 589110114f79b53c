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
        results/rank_<N>.exit.json  how rank N ended when it called sys.exit(0) (written by the rank)
        errors/rank_<N>.json exception of rank N (written by the rank)
        elastic/             torch elastic's own per-rank files
        metrics/rank_<N>.bin the points rank N logged (runtime.log_metric, mlflow.log_metric), 32-byte records appended
                             in batches; rank_<N>.names: their names
        code.json            the notebook's labels and sources of the job's code, to map stack frames (by the kernel)
        stacks/rank_<N>.txt  rank N's stack when the job timed out or was cancelled while it ran (by the host)
        flight_recorder/rank_<N>  rank N's NCCL flight recorder dump (by torch, in a GPU job whose collective timed out)
        session/rank_<N>.cmd, rank_<N>.reply   a live session's channel to rank N (FIFOs, 0600)
"""

from __future__ import annotations

import errno
import functools
import json
import os
import secrets
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sgpu_magic._util.fs import atomic_write
from sgpu_magic.errors import RecordError
from sgpu_magic.wire import LaunchRecord, RankError
from sgpu_magic.wire.errors import RankExit

if TYPE_CHECKING:
    from sgpu_magic.wire.attach import AttachRecord
    from sgpu_magic.wire.mlflow import MlflowRunRecord
    from sgpu_magic.wire.payload import Payload
    from sgpu_magic.wire.session import SessionRecord


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
        raise PermissionError(
            f"{path} is owned by uid {st.st_uid}, not by you; set SGPU_MAGIC_HOME to a private directory"
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _not_private(st: os.stat_result, kind: str) -> str | None:
    """Why a file or directory with this ``stat`` is not private to this user, else ``None``."""
    if st.st_uid != os.getuid():
        return f"{kind} is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"{kind} has mode {oct(st.st_mode & 0o777)}, open to other users (want {'0700' if kind == 'its directory' else '0600'})"
    return None


def read_private(path: Path, run_dir: Path | None = None) -> bytes:
    """The bytes of ``path``, read only when the file, its directory and ``run_dir`` are private to this user.

    Pickles are code, so sgpu_magic reads payloads, results and launch descriptions through this: the file
    (opened without following a symlink) must be owned by this user with no group/other bits, and so must
    its directory and the run directory above it, so another local user cannot plant one.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        PermissionError: ``path`` is a symlink, or it or a directory is not private; the message says which.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionError(
                f"refusing to read {path}: it is a symlink; sgpu_magic reads its pickles and "
                f"launch files only from private run directories"
            ) from None
        raise
    with os.fdopen(fd, "rb") as f:
        why = _not_private(os.fstat(fd), "the file")
        for directory in [path.parent] + ([run_dir] if run_dir is not None and run_dir != path.parent else []):
            why = why or _not_private(os.lstat(directory), "its directory")
        if why:
            raise PermissionError(
                f"refusing to read {path}: {why}. sgpu_magic reads pickles and launch files only "
                f"from private run directories (0700, files 0600, owned by you) so no other user "
                f"can plant one; remove this run directory, or set SGPU_MAGIC_HOME to a private "
                f"directory"
            )
        return f.read()


def make_private_fifo(path: Path) -> None:
    """Create the FIFO ``path`` with mode 0600 (its folder must be private: :func:`make_private_dir`)."""
    os.mkfifo(path, 0o600)
    os.chmod(path, 0o600)  # mkfifo applies the umask; 0600 is what open_private_fifo checks


def open_private_fifo(path: Path, flags: int) -> int:
    """Open the FIFO ``path`` (``flags``: ``os.O_RDONLY``, ``os.O_WRONLY`` or ``os.O_RDWR``) only when it and its
    folder are private to this user, as :func:`read_private` checks a pickle: a session's commands are pickles.

    Returns:
        the file descriptor (close-on-exec).
    Raises:
        FileNotFoundError: there is no such FIFO.
        PermissionError: it is a symlink, not a FIFO, or it or its folder is open to other users.
    """
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    why = _not_private(st, "the file") or _not_private(os.lstat(path.parent), "its directory")
    if not why and not stat.S_ISFIFO(st.st_mode):
        why = "it is not a FIFO"
    if why:
        os.close(fd)
        raise PermissionError(f"refusing to use the session channel {path}: {why}")
    return fd


RESERVE_NAME = ".reserve"
RESERVE_BYTES = 128 << 10
"""Each run dir holds this many bytes in ``.reserve`` from its creation. When its disk fills up (a rank
flooding its log), the first write of a job file that fails with ENOSPC deletes the reserve and tries
again, so the error file, status and results that say what happened still fit."""


RESERVE_LINK = ".reserve-of"
"""In a live session's cell directory (which holds no reserve of its own): a symlink to the session's run
directory, whose reserve the cell's files take on a full disk."""


def release_reserve(path: Path) -> bool:
    """Delete the ``.reserve`` of the run dir holding ``path`` (its folder or the one above; for a session's cell,
    the session's, through :data:`RESERVE_LINK`); whether one was freed."""
    for folder in (path.parent, path.parent.parent):
        try:
            (folder / RESERVE_NAME).unlink()
            return True
        except OSError:
            pass
        try:
            (Path(os.readlink(folder / RESERVE_LINK)) / RESERVE_NAME).unlink()
            return True
        except OSError:
            continue
    return False


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see either nothing or the whole file (write, fsync-free rename).

    On a full disk (ENOSPC) the run dir's reserve is released and the write tried once more.
    """
    try:
        atomic_write(path, data)
    except OSError as exc:
        if exc.errno != errno.ENOSPC or not release_reserve(path):
            raise
        atomic_write(path, data)


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON atomically."""
    atomic_write_bytes(path, json.dumps(obj, indent=1, default=str).encode())


STATUS_SCHEMA = 2
"""Version of ``status.json``'s layout (its ``schema`` key), for readers of run directories kept from older releases
(1: a cancel by a kernel interrupt was the state ``interrupted``; 2: state ``cancelled``, ``stop_reason``
``interrupted``; see :func:`sgpu_magic.wire.read_state`)."""


def write_status(run_dir: RunDir, status: dict) -> None:
    """The launch host's report: ``status.json`` written atomically, then its follower woken.

    When even that fails for lack of space, the file is rewritten in place (truncating it frees its
    blocks first); a reader that catches it half-written keeps the status it had (:func:`read_json`).

    Raises:
        OSError: the status could not be written at all.
    """
    data = json.dumps({"schema": STATUS_SCHEMA, **status}, indent=1, default=str).encode()
    try:
        atomic_write_bytes(run_dir.status_file, data)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        fd = os.open(run_dir.status_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    signal_status(run_dir)


def signal_status(run_dir: RunDir) -> None:
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


def read_json(path: Path, private: bool = False) -> dict | None:
    """Read a JSON file written by :func:`atomic_write_json`; ``None`` when it does not exist yet.

    ``private=True`` reads it through :func:`read_private` (a file that decides what runs: launch.json).
    """
    try:
        return json.loads(read_private(path) if private else path.read_bytes())
    except FileNotFoundError:
        return None
    except ValueError:  # caught half-written in place (a full disk, see write_status): not there yet
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


ID_TRIES = 16
"""A new run directory draws its id (:func:`new_job_id`) again when another has it (3 random bytes per second: a
long session's 100 cells a second meet a drawn id about once in 3,000 seconds); this many draws at most."""


def new_job_id() -> str:
    """A sortable, unique job id: ``20261130-015715-3fa2c1``."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


SUBDIRS = ("logs", "results", "errors", "elastic", "metrics")
"""The folders of every run directory."""


def host_warm_marker(host_log: str | os.PathLike) -> Path:
    """``<host log>.warm``: made by the launch host once its forkserver has preloaded (the first launch waits)."""
    return Path(f"{os.fspath(host_log)}.warm")


def host_ready_marker(host_log: str | os.PathLike) -> Path:
    """``<host log>.ready``: made by the launch host once it has imported torch and serves launches."""
    return Path(f"{os.fspath(host_log)}.ready")


HOST_WARM_STATS = "warm.json"
"""Beside the host logs: the forkserver's remembered preload time (see :mod:`sgpu_magic.launch.host.warm_pool`)."""


def _entry(name: str, doc: str) -> functools.cached_property:
    """A :class:`RunDir` property: the path of its entry ``name`` (made once per RunDir: a session cell's follower
    and writers name the same files many times)."""

    def entry(self: RunDir) -> Path:
        return self.path / name

    entry.__doc__ = doc
    return functools.cached_property(entry)


class RunDir:
    """Names every file of one job. ``RunDir.create()`` makes a new private one."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    @classmethod
    def create(
        cls, root: Path | None = None, job_id: str | None = None, lean: bool = False, reserve_of: Path | None = None
    ) -> RunDir:
        """Make ``<root>/runs/<job_id>`` and its subfolders, all 0700.

        ``lean``: a live session's cell, whose ranks already run: no ``elastic/`` folder and no ``.reserve`` (the
        session's own run directory holds one), which halves what a cell costs before it is sent; ``reserve_of``:
        that session's run directory, whose reserve the cell's files then take on a full disk
        (:data:`RESERVE_LINK`).
        """
        runs = make_private_dir((root or default_root()) / "runs")
        for _ in range(ID_TRIES - 1 if job_id is None else 0):
            rd = cls(runs / new_job_id())
            try:  # mkdir is atomic: of two kernels (or two cells) that drew the same id, one makes it
                rd.path.mkdir(mode=0o700)
                break
            except FileExistsError:
                continue
        else:
            rd = cls(runs / (job_id or new_job_id()))
            rd.path.mkdir(mode=0o700)
        for sub in SUBDIRS:
            if not (lean and sub in ("elastic", "metrics")):  # a cell's ranks make metrics/ when they log
                (rd.path / sub).mkdir(mode=0o700)
        if lean:
            if reserve_of is not None:
                os.symlink(reserve_of, rd.path / RESERVE_LINK)
            return rd
        try:
            atomic_write_bytes(rd.path / RESERVE_NAME, b"\0" * RESERVE_BYTES)  # written, so the blocks are held
        except OSError:
            pass  # already short of space: the job goes on without a reserve
        return rd

    @property
    def job_id(self) -> str:
        return self.path.name

    launch_file = _entry("launch.json", "What the job runs: world size, backend, env, timeout (written by the kernel).")
    payload_file = _entry("payload.pkl", "The pickled cell or function and its captured globals.")
    status_file = _entry(
        "status.json", "The launcher's report (:class:`~sgpu_magic.status.HostStatus`), written until the final state."
    )
    status_signal = _entry(
        "status.fifo",
        "A FIFO the kernel makes and reads; the launch host writes a byte to it "
        "after each status write (see :func:`signal_status`), so a followed job wakes at once.",
    )
    elastic_dir = _entry("elastic", "torch elastic's own files (its error files, per attempt).")
    logs_dir = _entry("logs", "One ``rank_<r>.log`` per rank (stdout and stderr), kept after the job.")
    results_dir = _entry("results", "Each rank's pickled value (``rank_<r>.pkl``) and ``sys.exit`` note.")
    errors_dir = _entry("errors", "Each failed rank's error (``rank_<r>.json``); ``attempt_<k>/`` of earlier attempts.")
    mlflow_file = _entry(
        "mlflow.json",
        "The job's MLflow run once the kernel has made it (``run_id``, ``tracking_uri``, ``experiment_id``, ...; "
        "``run_id`` null when tracking could not start): ranks adopt it when they first need it, and the launch "
        "host ends it if the kernel could not (see :mod:`sgpu_magic.rank.mlflow_guard`).",
    )
    mlflow_ended_file = _entry(
        "mlflow_ended",
        "Left by the kernel once it has ended the job's MLflow run (else the launch host ends it on its way out).",
    )

    attach_file = _entry(
        "attach.pkl",
        "A detached job's spec, device plan and run keeper (pid, log), pickled by the kernel that started it once the "
        "keeper has the job: what :func:`sgpu_magic.attach` rebuilds the Job handle from (read through the "
        "private-read check).",
    )

    session_file = _entry(
        "session.json",
        "A detached session's name and idle timeout, written by the kernel that started it once its ranks "
        "are ready: what a kernel attaching to it (:func:`sgpu_magic.attach`) takes the session over with.",
    )

    code_map_file = _entry(
        "code.json",
        "The notebook's names for the job's code (``Cell In[4]``) and its sources, so stack frames "
        "read as the notebook shows them (written by the kernel; see :mod:`sgpu_magic.launch.stacks`).",
    )
    stacks_dir = _entry(
        "stacks",
        "``rank_<r>.txt``: each running rank's stack, taken when the job timed out or was cancelled (0700, files 0600).",
    )

    flight_recorder_dir = _entry(
        "flight_recorder",
        "``rank_<r>``: each rank's NCCL flight recorder dump (torch's pickle), written by torch on a collective's "
        "timeout in a GPU job (0700; see :mod:`sgpu_magic.launch.flight_recorder`).",
    )

    def stack_file(self, rank: int) -> Path:
        """``stacks/rank_<r>.txt``: rank ``rank``'s stack as the launch host took it before stopping the job."""
        return self.stacks_dir / f"rank_{rank}.txt"

    def stacks_reply_file(self, token: str) -> Path:
        """``.stacks-<token>.json``: the launch host's answer to the kernel's request ``token`` for the running
        ranks' stacks (read and deleted by the kernel)."""
        return self.path / f".stacks-{token}.json"

    session_dir = _entry(
        "session",
        "A live session's channel (:mod:`sgpu_magic.session`): a command, a reply and a control FIFO per rank, "
        "0600 in this 0700 folder, made by the kernel before the ranks start.",
    )

    def session_command(self, rank: int) -> Path:
        """The FIFO the kernel writes rank ``rank``'s session commands to (cells, push, pull, stop)."""
        return self.session_dir / f"rank_{rank}.cmd"

    def session_reply(self, rank: int) -> Path:
        """The FIFO rank ``rank`` writes its replies to (a cell's outcome, a pulled value)."""
        return self.session_dir / f"rank_{rank}.reply"

    def session_control(self, rank: int) -> Path:
        """The FIFO the kernel writes rank ``rank``'s control commands to (JSON lines), read by a thread of the rank
        even while its main thread is blocked in a collective (``Session.recover()``)."""
        return self.session_dir / f"rank_{rank}.ctl"

    def attempt_errors_dir(self, attempt: int) -> Path:
        """``errors/attempt_<k>/``: the error files of attempt ``attempt``, kept when the job restarts."""
        return self.errors_dir / f"attempt_{attempt}"

    metrics_dir = _entry(
        "metrics",
        "``rank_<r>.bin``: the metric points each rank logged, one 32-byte record each, and ``rank_<r>.names``: "
        "their names (:mod:`sgpu_magic._util.metrics`), appended by the rank, followed by the kernel (0700, files 0600).",
    )

    def metrics_file(self, rank: int) -> Path:
        """``metrics/rank_<r>.bin``: the points rank ``rank`` logged (``runtime.log_metric``, ``mlflow.log_metric``);
        their names are in :func:`sgpu_magic._util.metrics.names_file` of it."""
        return self.metrics_dir / f"rank_{rank}.bin"

    profile_dir = _entry(
        "profile",
        "a profiled job's (``profile=``): ``rank_<r>.trace.json``, each rank's ``torch.profiler`` Chrome trace, "
        "``rank_<r>.json``, its breakdown and top ops (:mod:`sgpu_magic.rank.profile`), and ``trace.json``, the "
        "traces merged by the kernel, one process per rank (made by the ranks, 0700, files 0600).",
    )

    def profile_trace_file(self, rank: int) -> Path:
        """``profile/rank_<r>.trace.json``: rank ``rank``'s ``torch.profiler`` trace (Chrome trace format)."""
        return self.profile_dir / f"rank_{rank}.trace.json"

    def profile_summary_file(self, rank: int) -> Path:
        """``profile/rank_<r>.json``: rank ``rank``'s profiled time by kind and its top ops."""
        return self.profile_dir / f"rank_{rank}.json"

    def log_file(self, rank: int) -> Path:
        return self.logs_dir / f"rank_{rank}.log"

    def result_file(self, rank: int) -> Path:
        return self.results_dir / f"rank_{rank}.pkl"

    def error_file(self, rank: int) -> Path:
        return self.errors_dir / f"rank_{rank}.json"

    def exit_file(self, rank: int) -> Path:
        """Written by a rank that ended through ``SystemExit(0)`` (:class:`~sgpu_magic.wire.errors.RankExit`)."""
        return self.results_dir / f"rank_{rank}.exit.json"

    def write_exit(self, rank: int, record: RankExit) -> None:
        """Write rank ``rank``'s exit record (atomically, 0600)."""
        atomic_write_bytes(self.exit_file(rank), record.encode())

    def read_exit(self, rank: int) -> RankExit | None:
        """Rank ``rank``'s exit record, or ``None``: it wrote none (it did not end through ``sys.exit(0)``), or one
        this version does not read."""
        try:
            return RankExit.decode(self.exit_file(rank).read_bytes())
        except (OSError, RecordError):
            return None

    def read_launch(self) -> LaunchRecord:
        """``launch.json`` as its typed record, read through the private-read check (it decides what runs).

        Raises:
            FileNotFoundError: the kernel has not written it (yet).
            PermissionError: it or its folder is not private to this user (:func:`read_private`).
            RecordError: it is not a launch record this version reads (:meth:`LaunchRecord.decode`).
        """
        return LaunchRecord.decode(read_private(self.launch_file))

    def write_launch(self, record: LaunchRecord) -> None:
        """Write ``launch.json`` (atomically, 0600) from ``record``."""
        atomic_write_bytes(self.launch_file, record.encode())

    def write_error(self, record: RankError) -> None:
        """Write ``errors/rank_<r>.json`` for ``record.rank`` (atomically, 0600; on a full disk it takes the run
        directory's reserve)."""
        atomic_write_bytes(self.error_file(record.rank), record.encode())

    def read_error(self, rank: int) -> RankError | None:
        """The exception rank ``rank`` saved, or ``None``: it saved none (yet), or the file is not one this version
        reads (caught half-written on a full disk, say)."""
        try:
            return RankError.decode(self.error_file(rank).read_bytes())
        except (OSError, RecordError):
            return None

    def write_payload(self, payload: Payload) -> None:
        """Write ``payload.pkl`` (atomically, 0600): what the ranks run."""
        import pickle

        atomic_write_bytes(self.payload_file, pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))

    def write_attach(self, record: AttachRecord) -> None:
        """Write ``attach.pkl`` (atomically, 0600): how another kernel attaches to this detached job."""
        atomic_write_bytes(self.attach_file, record.encode())

    def write_mlflow_run(self, record: MlflowRunRecord) -> None:
        """Write ``mlflow.json`` (atomically, 0600): the job's MLflow run, or that tracking could not start."""
        atomic_write_json(self.mlflow_file, record.encode())

    def read_mlflow_run(self) -> MlflowRunRecord | None:
        """``mlflow.json`` as its typed record, read through the private-read check; ``None`` before the kernel has
        written it.

        Raises:
            PermissionError: it or its folder is not private to this user (:func:`read_private`).
            RecordError: it is not a run record this version reads.
        """
        from sgpu_magic.wire.mlflow import MlflowRunRecord  # a rank reads it on first need only: not loaded at start

        raw = read_json(self.mlflow_file, private=True)
        return None if raw is None else MlflowRunRecord.decode(raw)

    def read_attach(self) -> AttachRecord:
        """``attach.pkl`` as its typed record, read through the private-read check (a pickle is code).

        Raises:
            FileNotFoundError: the run is not a detached job's.
            PermissionError: it or its folder is not private to this user (:func:`read_private`).
            RecordError: it is not an attach record this version reads.
        """
        from sgpu_magic.wire.attach import AttachRecord  # a rank never reads it: not loaded there

        return AttachRecord.decode(read_private(self.attach_file, self.path))

    def read_payload(self) -> Payload:
        """``payload.pkl``, read through the private-read check (a pickle is code: only from a private run
        directory).

        Raises:
            FileNotFoundError: there is none (the job has ended: its payload is deleted then).
            PermissionError: it or its folder is not private to this user (:func:`read_private`).
            RecordError: it is not a payload of this version.
        """
        import pickle

        from sgpu_magic.wire.payload import Payload

        payload = pickle.loads(read_private(self.payload_file, self.path))
        if not isinstance(payload, Payload):
            raise RecordError(
                f"{self.payload_file} is not a payload of this sgpu_magic (a {type(payload).__name__}); was it "
                f"written by another version? Run the job again from this kernel"
            )
        return payload

    def write_session(self, record: SessionRecord) -> None:
        """Write ``session.json`` (atomically, 0600) from ``record``."""
        atomic_write_bytes(self.session_file, record.encode())

    def read_session(self) -> SessionRecord:
        """``session.json`` as its typed record, read through the private-read check.

        Raises:
            FileNotFoundError: the run is not a detached session's (or its ranks were never ready).
            PermissionError: it or its folder is not private to this user (:func:`read_private`).
            RecordError: it is not a session record this version reads.
        """
        from sgpu_magic.wire.session import SessionRecord  # a job's rank never reads it: not loaded there

        return SessionRecord.decode(read_private(self.session_file))

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"


def keeper_dir(root: Path | None = None) -> Path:
    """``<root>/keeper`` (0700, made if needed): the run keeper's socket, start lock and logs.

    Raises:
        PermissionError: the folder (or ``root``) is another user's (:func:`make_private_dir`).
    """
    return make_private_dir((root or default_root()) / "keeper")


def detached_index(root: Path | None = None) -> Path:
    """``<root>/keeper/runs`` (0700): one empty file per detached job, named by its id, made when the run keeper
    took it: what ``%distributed_jobs --all`` and :func:`sgpu_magic.attach` look through (``<root>/runs`` holds
    every job)."""
    return make_private_dir(keeper_dir(root) / "runs")
