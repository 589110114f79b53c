"""The Ray actor of one rank (:class:`RankAgent`): it runs the rank as a child process on its node, in a private
run directory there, and serves that rank's files to the kernel.

For a live session's rank it is also the kernel's end of the rank's channel (:class:`SessionPipe`): the rank's
command and reply FIFOs live on the rank's node, and the kernel relays frames through the actor's methods
(``session_send``, ``session_recv``, ``session_interrupt``), so the rank runs the same cell loop
(:mod:`sgpu_magic.rank.session`) as on this machine.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from sgpu_magic._util.frames import read_frame, write_frame
from sgpu_magic._util.fs import site_packages_fingerprint
from sgpu_magic.launch.forensics import OomWatch
from sgpu_magic.launch.ray.cluster import ray_module
from sgpu_magic.launch.usage import UsageSampler
from sgpu_magic.rundir import (
    RunDir,
    atomic_write_bytes,
    make_private_dir,
    make_private_fifo,
    open_private_fifo,
)
from sgpu_magic.wire import LaunchRecord
from sgpu_magic.wire.errors import RankOutcome
from sgpu_magic.wire.session import Frame, Reply, RunCell, SessionCommand, decode_frame, encode_command, with_run_dir

if TYPE_CHECKING:
    import subprocess

AGENT_CONCURRENCY = 8
"""Calls one agent serves at once: the rank's ``run`` (the rank's whole life), a session's pending
``session_recv``, and the kernel's log reads, sends and interrupts beside them."""

ZYGOTE_WAIT_S = 30.0
"""Seconds a rank waits for its agent's zygote to finish preloading torch before it starts cold instead: the zygote
is ahead of a cold start (which imports torch from scratch, beside it, on the same cores), so waiting is quicker
(a 4-rank job right after the last one on a 2-core machine: cold beside the preloading zygotes 15.8 s)."""

CELL_FILES = ("results", "errors", "metrics", "profile")
"""The folders of a session cell's node-side run directory that go back to the kernel when the cell ends (its log
is read as it grows, by ``read_log``); ``profile`` is a profiled cell's (:mod:`sgpu_magic.rank.profile`)."""


class SessionPipe:
    """A session rank's two FIFOs on its node, held open (read-write) by the rank's agent, and the node-side run
    directory of the cell the rank runs now."""

    def __init__(self, rd: RunDir, rank: int) -> None:
        self.rank, self.cells = rank, rd.path / "cells"
        make_private_dir(rd.session_dir)
        fds = []
        for path in (rd.session_command(rank), rd.session_reply(rank)):
            make_private_fifo(path)
            fds.append(open_private_fifo(path, os.O_RDWR))
        self.commands, self.replies = fds
        self.cell: RunDir | None = None
        self.reader: str | None = None
        """The token of the kernel's channel that reads the replies now (the last one that sent or asked)."""
        self._read_lock = threading.Lock()

    def take(self, token: str | None) -> None:
        """The channel ``token`` (a kernel that attached to a detached session) reads the replies from now on."""
        if token is not None:
            with self._read_lock:
                self.reader = token

    def cell_dir(self, cell_id: str) -> RunDir:
        return RunDir(self.cells / "runs" / cell_id)

    def send(self, cmd: SessionCommand, seq: int, payload: bytes | None) -> None:
        """Write ``cmd`` (of request ``seq``) to the rank; a cell's ``payload`` first goes into a fresh node-side run
        directory (the kernel's :class:`~sgpu_magic.wire.session.RunCell` names the cell's id)."""
        if isinstance(cmd, RunCell) and payload is not None:
            import shutil

            if self.cell is not None:
                shutil.rmtree(self.cell.path, ignore_errors=True)  # the previous cell's files went to the kernel
            self.cell = RunDir.create(self.cells, job_id=cmd.run_dir, lean=True)
            atomic_write_bytes(self.cell.payload_file, payload)
            self.cell.log_file(self.rank).touch(mode=0o600)
            cmd = with_run_dir(cmd, str(self.cell.path))
        write_frame(self.commands, encode_command(cmd, seq))

    def recv(
        self, timeout_s: float, token: str | None = None
    ) -> tuple[Frame, bytes | None, dict[str, bytes]] | str | None:
        """The rank's next frame (a reply, or a debugger's frame) as ``(reply, value, files)``, or ``None`` after
        ``timeout_s``. ``files``: the cell's result, error and metrics files (paths relative to its run
        directory) with the reply that ends a cell. ``token``: the asking channel's; ``"stale"`` when another
        channel has taken the replies since (:meth:`take`), so that a receive a dead kernel left running on this
        actor cannot take the frame a kernel that attached is waiting for."""
        ready, _, _ = select.select([self.replies], [], [], timeout_s)
        if not ready:
            return None
        with self._read_lock:
            if token is not None and self.reader != token:  # the receive of a kernel gone: leave it to the new one
                return "stale"
            return self._read()

    def _read(self) -> tuple[Frame, bytes | None, dict[str, bytes]] | None:
        frame = read_frame(self.replies)
        if frame is None:
            return None
        reply = decode_frame(frame)
        value = bytes(read_frame(self.replies) or b"") if reply.has_value else None
        files: dict[str, bytes] = {}
        if self.cell is not None and isinstance(reply, Reply) and reply.pid is None:
            files = _cell_files(self.cell)
        return reply, value, files


def _cell_files(rd: RunDir) -> dict[str, bytes]:
    out = {}
    for sub in CELL_FILES:
        for path in sorted((rd.path / sub).rglob("*")):
            if path.is_file():
                out[str(path.relative_to(rd.path))] = path.read_bytes()
    return out


def agent_class():
    """The Ray actor class of a rank (Ray is imported here, in the kernel, only when a job names a cluster)."""
    return ray_module().remote(max_concurrency=AGENT_CONCURRENCY)(RankAgent)


class RankAgent:
    """One rank's agent on its node: runs the rank as a child process and serves its files (and, for a live
    session's rank, its channel).

    A fresh agent starts its first rank as a fresh interpreter. Once its job has ended and the kernel keeps it warm
    (:mod:`sgpu_magic.launch.ray.warm`), :meth:`reset` clears the job's files and starts a zygote that preloads
    torch (:mod:`~sgpu_magic.launch.ray.zygote`); the next job's rank is forked from it when it is ready, else
    started cold."""

    def __init__(self) -> None:
        import tempfile

        self.root = Path(tempfile.mkdtemp(prefix="sgpu-ray-rank-"))  # 0700
        self.dir = self.root / "job"
        self.proc: subprocess.Popen[bytes] | _ForkedRank | None = None
        self.session: SessionPipe | None = None
        self.zygote: _Zygote | None = None
        self.jobs = 0
        self.sys_path: list[str] = []  # the last job's (its packages are what the zygote preloads)
        self.store: Any = None  # the rendezvous store it serves for the job (rank 0's agent of a warm set)
        self._torch_loaded: Any = None  # a thread importing torch.distributed for the store
        import threading

        self._started = threading.Event()  # set once run() has started its rank (pid() waits for it)
        self._usage: tuple[str, UsageSampler] | None = None  # (the job whose rank it samples, its sampler)
        self._oom = OomWatch()  # the memory cgroups its rank ran in, for the OOM verdict of a SIGKILL
        self._rank = 0  # the rank run() runs (or ran last)

    def node(self) -> tuple[str, str, list[str]]:
        """(node id, node IP, the GPU ids Ray gave this actor)."""
        ray = ray_module()
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def free_port(self) -> int:
        from sgpu_magic.launch.resources import free_port

        return free_port()

    def warm(self) -> bool:
        """Whether this agent's zygote has preloaded torch (the next rank is forked from it)."""
        return self.zygote is not None and self.zygote.ready.is_set() and self.zygote.alive()

    def run(self, rank: int, payload: bytes, launch: dict, env: dict) -> RankOutcome:
        """Run the rank to its end: how it ended (:class:`~sgpu_magic.wire.errors.RankOutcome`: its exit code, value,
        error, teardown entry, a profiled job's files, whether the agent's zygote forked it).
        ``launch``: the job's :class:`~sgpu_magic.wire.LaunchRecord` as JSON (its ``session``: a live session's
        rank, whose FIFOs are made here first)."""
        import subprocess
        import sys

        from sgpu_magic.launch.teardown import wait_with_grace
        from sgpu_magic.spec import DEFAULT_TEARDOWN_GRACE_S

        self.jobs += 1
        record = LaunchRecord.from_json(launch)
        self.sys_path = list(record.sys_path)
        self.dir = self.root / record.job_id  # the job's own: an earlier job's rank may linger
        rd = RunDir(self.dir)
        for folder in (rd.path, rd.logs_dir, rd.results_dir, rd.errors_dir):
            folder.mkdir(mode=0o700, exist_ok=True)
        atomic_write_bytes(rd.payload_file, payload)
        rd.write_launch(record)
        for last in (rd.result_file(rank), rd.error_file(rank), rd.exit_file(rank)):  # a restarted job's last try's
            last.unlink(missing_ok=True)
        rd.log_file(rank).touch(mode=0o600)  # a restarted job's log goes on
        if record.session:
            self.session = SessionPipe(rd, rank)
        env = {**env, "SGPU_MAGIC_HOST_PID": str(os.getpid())}
        proc: subprocess.Popen[bytes] | _ForkedRank | None = None
        self._oom = OomWatch()
        self._oom.watch([rank])  # the cgroup its rank starts in: this agent's
        packages = site_packages_fingerprint(self.sys_path)
        if self.zygote is not None and self.zygote.packages != packages:  # a %pip install since it preloaded
            self.zygote.stop()
            self.zygote = None
        warm = self.zygote is not None and self.zygote.wait_ready(ZYGOTE_WAIT_S)
        if warm:
            assert self.zygote is not None  # wait_ready() says it is there
            try:
                proc = self.zygote.fork(rd, env)
            except OSError:  # it died since: this rank starts cold
                warm = False
        if proc is None:
            proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "sgpu_magic.rank.worker", str(rd.path)],
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.proc, self._rank = proc, rank
        self._started.set()
        grace_s = record.teardown_grace_s
        code, ended = wait_with_grace(
            cast("subprocess.Popen[bytes]", proc),  # a _ForkedRank waits as a Popen does
            rd,
            rank,
            DEFAULT_TEARDOWN_GRACE_S if grace_s is None else grace_s,
            3.0,
        )
        result = rd.result_file(rank).read_bytes() if rd.result_file(rank).exists() else None
        profile = (
            {p.name: p.read_bytes() for p in sorted(rd.profile_dir.glob("rank_*"))} if rd.profile_dir.is_dir() else {}
        )
        oom = self._oom.verdict(rank, proc.pid, code)  # on its node, as the launch host judges its own ranks
        return RankOutcome(code, result, rd.read_error(rank), ended, profile, warm, **oom)

    def stop_rank(self) -> None:
        """Stop the rank (its whole session, SIGKILL) if it still runs and wait for it; its files stay (a job that
        restarts stops every rank this way, and its agents' ``run`` calls return)."""
        self._started.clear()  # the next run() starts the next one
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()

    def stacks(self, rank: int, labels: dict[str, str], sources: dict[str, str], native: bool) -> Any:
        """The rank's stack, taken by py-spy on this node (:func:`sgpu_magic.launch.stacks.take_stacks`; the rank
        names this agent its tracer, so Yama's ``ptrace_scope`` 1 lets the agent's py-spy read it), read with the
        notebook's names for its code (``labels``, ``sources``: the job's
        :class:`~sgpu_magic.launch.stacks.CodeMap`); a :class:`~sgpu_magic.launch.stacks.RankStack`, or ``None``
        when the rank is not running."""
        from sgpu_magic.launch.stacks import CodeMap, take_stacks

        proc = self.proc
        if proc is None or proc.poll() is not None:
            return None
        return take_stacks({rank: proc.pid}, CodeMap(labels, sources), native)[rank]

    def cleanup(self, keep_agent: bool = False) -> None:
        """Stop the rank (its whole session) if it still runs, and remove this node's copy of its files (with
        ``keep_agent``, only the job's: the agent is kept for another job)."""
        import shutil

        if not keep_agent and self.zygote is not None:
            self.zygote.stop()
        self.stop_rank()
        shutil.rmtree(self.dir if keep_agent else self.root, ignore_errors=True)

    def open_store(self, host: str) -> int | None:
        """Serve a fresh rendezvous store (``torch.distributed.TCPStore``) for the next job on ``host`` and a port
        the OS picks, as torchrun's agent does (ranks connect with ``TORCHELASTIC_USE_AGENT_STORE``); its port,
        or ``None`` while torch is not imported here yet (the job's rank 0 then serves it). Ranks forked together
        would otherwise race rank 0's store: the others' first connects fail and back off for 0.5 s or more."""
        loaded = self._torch_loaded
        if loaded is None or loaded.is_alive():
            return None
        import torch.distributed as dist

        self.close_store()
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return int(self.store.port)

    def close_store(self) -> None:
        self.store = None  # a TCPStore server stops with its last reference

    def reset(self, serve_store: bool = False) -> bool:
        """Make the agent ready for another job: :meth:`cleanup`, then start its zygote if it has none
        (:mod:`sgpu_magic.launch.ray.zygote`; it preloads in the background, :meth:`warm` says when it is done).
        With ``serve_store`` (rank 0's agent) it also imports torch, in the background, to serve the next job's
        rendezvous store (:meth:`open_store`). Whether the agent can serve another job (not a live session's: its
        FIFOs are its session's)."""
        if self.session is not None:
            self.cleanup()
            return False
        self.cleanup(keep_agent=True)
        self.proc = None
        self.close_store()
        if self.zygote is None or not self.zygote.alive():
            self.zygote = _Zygote(site_packages_fingerprint(self.sys_path))
        if serve_store and self._torch_loaded is None:
            import threading

            self._torch_loaded = threading.Thread(target=__import__, args=("torch.distributed",), daemon=True)
            self._torch_loaded.start()
        return True

    def pid(self, wait_s: float = 0.0) -> int | None:
        """The process id of the rank that :meth:`run` started, waiting up to ``wait_s`` seconds for it to start
        (calls to a threaded actor may run out of order); ``None`` when none has."""
        self._started.wait(wait_s)
        return None if self.proc is None or not self._started.is_set() else self.proc.pid

    def usage(self) -> dict | None:
        """The CPU, memory and (with NVML) GPU figures of the rank this agent runs, sampled now over the time since
        the last call, as ``status.json``'s ``usage`` holds a rank's (:mod:`sgpu_magic.launch.usage`); a restarted
        rank's peaks include the attempts before. ``None`` before its rank runs, or once it has ended."""
        proc = self.proc
        if proc is None or not self._started.is_set() or proc.poll() is not None:
            return None
        rank, job = self._rank, self.dir.name
        if self._usage is None or self._usage[0] != job:  # a warm agent's next job: its peaks start afresh
            gpus = [int(g) for g in ray_module().get_gpu_ids()]
            self._usage = (job, UsageSampler(gpus))
        sampler = self._usage[1]
        if sampler.watched.get(rank) != proc.pid:  # its first sample, or a restarted attempt's rank
            sampler.watch({rank: proc.pid})
        sampler.sample(force=True)
        self._oom.sample({rank: proc.pid})
        figures = sampler.usage.get(rank)
        return None if figures is None else figures.as_dict()

    def read_log(self, rank: int, offset: int, cell: str = "") -> bytes:
        """Up to 8 MiB of rank ``rank``'s log from byte ``offset``: the job's, or the session cell ``cell``'s."""
        rd = self.session.cell_dir(cell) if cell and self.session is not None else RunDir(self.dir)
        try:
            with open(rd.log_file(rank), "rb") as f:
                f.seek(offset)
                return f.read(8 << 20)
        except FileNotFoundError:
            return b""

    def read_metrics(self, rank: int, offset: int, names_offset: int) -> tuple[bytes, bytes]:
        """What rank ``rank`` of the job appended to its metrics file from byte ``offset`` (whole records, up to 8 MiB)
        and to its name table from ``names_offset`` (whole lines). The table is read after the records, so it names
        every record returned (:mod:`sgpu_magic._util.metrics`)."""
        from sgpu_magic._util.metrics import names_file, read_new

        path = RunDir(self.dir).metrics_file(rank)
        records = read_new(path, offset)
        return records, read_new(names_file(path), names_offset)

    def session_send(
        self, cmd: SessionCommand, seq: int, payload: bytes | None = None, token: str | None = None
    ) -> None:
        """Relay a session command to the rank (see :meth:`SessionPipe.send`); the channel ``token`` reads the replies
        from now on (:meth:`SessionPipe.take`)."""
        pipe = self._pipe()
        pipe.take(token)
        pipe.send(cmd, seq, payload)

    def session_recv(
        self, timeout_s: float, token: str | None = None
    ) -> tuple[Frame, bytes | None, dict[str, bytes]] | str | None:
        """The rank's next frame (see :meth:`SessionPipe.recv`); ``"gone"`` once the rank has exited, ``"stale"`` once
        another channel than ``token``'s reads the replies (the last one that sent or asked does)."""
        if self.proc is not None and self.proc.poll() is not None:
            return "gone"
        if self.session is None:  # run() has not made the FIFOs yet
            import time

            time.sleep(min(timeout_s, 0.05))
            return None
        self.session.take(token)  # a kernel that asks reads from now on: a receive left by one gone gives it up
        return self.session.recv(timeout_s, token)

    def session_interrupt(self) -> None:
        """SIGINT to the rank: ``KeyboardInterrupt`` in the cell it runs (ignored between cells)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)

    def _pipe(self) -> SessionPipe:
        if self.session is None:
            raise RuntimeError("this rank is not a live session's rank, or it has not started yet")
        return self.session


class _Zygote:
    """The agent's end of its zygote (:mod:`sgpu_magic.launch.ray.zygote`): a child that has imported torch and forks
    ranks on request. A reader thread takes its replies: ``ready`` once preloaded, each rank's pid as it starts and
    its exit code as it ends."""

    def __init__(self, packages: tuple) -> None:
        import subprocess
        import sys
        import threading

        self.packages = packages
        """The site-packages fingerprint it was started with (:func:`~sgpu_magic._util.fs.site_packages_fingerprint`)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "sgpu_magic.launch.ray.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "SGPU_MAGIC_HOST_PID": str(os.getpid())},
            start_new_session=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None  # PIPE
        self.ready = threading.Event()
        self._lock = threading.Lock()  # one request at a time: its "started" reply is the next one
        self._started: list[int] = []
        self._started_cv = threading.Condition()
        self._ranks: dict[int, _ForkedRank] = {}
        self._exited: dict[int, int] = {}
        threading.Thread(target=self._read, name="sgpu_magic zygote replies", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            try:
                frame = read_frame(fd)
            except (OSError, EOFError):
                frame = None
            if frame is None:  # the zygote is gone: ranks not heard of ended with it
                self.ready.clear()
                with self._started_cv:
                    for orphan in self._ranks.values():
                        orphan.ended(-signal.SIGKILL)
                    self._started.append(-1)
                    self._started_cv.notify_all()
                return
            reply = pickle.loads(frame)
            if reply[0] == "ready":
                self.ready.set()
            elif reply[0] == "started":
                with self._started_cv:
                    self._started.append(reply[1])
                    self._started_cv.notify_all()
            elif reply[0] == "exited":
                with self._started_cv:
                    rank = self._ranks.pop(reply[1], None)
                    if rank is None:  # it ended before fork() took its pid: fork() gives it its code
                        self._exited[reply[1]] = reply[2]
                if rank is not None:
                    rank.ended(reply[2])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the zygote to have preloaded; whether it has and still runs."""
        import time

        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.05):
            if not self.alive() or time.monotonic() > deadline:
                return False
        return self.alive()

    def fork(self, rd: RunDir, env: dict[str, str]) -> _ForkedRank:
        """Fork a rank of the job in ``rd`` with ``env`` (its whole environment).

        Raises:
            OSError: the zygote is gone (the caller starts the rank cold)."""
        assert self.proc.stdin is not None
        with self._lock:
            write_frame(self.proc.stdin.fileno(), pickle.dumps((str(rd.path), env)))
            with self._started_cv:
                while not self._started:
                    self._started_cv.wait()
                pid = self._started.pop(0)
                if pid < 0:
                    raise OSError("the agent's zygote ended")
                rank = _ForkedRank(pid)
                if pid in self._exited:
                    rank.ended(self._exited.pop(pid))
                else:
                    self._ranks[pid] = rank
        return rank

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()


class _ForkedRank:
    """A rank forked by the agent's zygote, waited for as a ``subprocess.Popen`` is (``wait``, ``poll``, ``pid``;
    exit code ``-N`` for signal ``N``)."""

    def __init__(self, pid: int) -> None:
        import threading

        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired("rank", timeout or 0.0)
        assert self.returncode is not None  # set before the event
        return self.returncode
