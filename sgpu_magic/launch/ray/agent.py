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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sgpu_magic._util.frames import read_frame, write_frame
from sgpu_magic.launch.ray.cluster import ray_module
from sgpu_magic.rundir import (
    RunDir,
    atomic_write_bytes,
    atomic_write_json,
    make_private_dir,
    make_private_fifo,
    open_private_fifo,
    read_json,
)

if TYPE_CHECKING:
    import subprocess

AGENT_CONCURRENCY = 8
"""Calls one agent serves at once: the rank's ``run`` (the rank's whole life), a session's pending
``session_recv``, and the kernel's log reads, sends and interrupts beside them."""

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

    def cell_dir(self, cell_id: str) -> RunDir:
        return RunDir(self.cells / "runs" / cell_id)

    def send(self, message: dict[str, Any], payload: bytes | None) -> None:
        """Write ``message`` to the rank; a cell's ``payload`` first goes into a fresh node-side run directory."""
        if payload is not None:
            import shutil

            if self.cell is not None:
                shutil.rmtree(self.cell.path, ignore_errors=True)  # the previous cell's files went to the kernel
            self.cell = RunDir.create(self.cells, job_id=message["run_dir"], lean=True)
            atomic_write_bytes(self.cell.payload_file, payload)
            self.cell.log_file(self.rank).touch(mode=0o600)
            message = {**message, "run_dir": str(self.cell.path)}
        write_frame(self.commands, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self, timeout_s: float) -> tuple[dict[str, Any], bytes | None, dict[str, bytes]] | None:
        """The rank's next frame (a reply, or a debugger's frame) as ``(reply, value, files)``, or ``None`` after
        ``timeout_s``. ``files``: the cell's result, error and metrics files (paths relative to its run
        directory) with the reply that ends a cell."""
        ready, _, _ = select.select([self.replies], [], [], timeout_s)
        if not ready:
            return None
        frame = read_frame(self.replies)
        if frame is None:
            return None
        reply = pickle.loads(frame)
        value = bytes(read_frame(self.replies) or b"") if reply.get("has_value") else None
        files: dict[str, bytes] = {}
        if self.cell is not None and "stream" not in reply and reply.get("op") != "ready":
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
    session's rank, its channel)."""

    def __init__(self) -> None:
        import tempfile

        self.dir = Path(tempfile.mkdtemp(prefix="sgpu-ray-rank-"))  # 0700
        self.proc: subprocess.Popen[bytes] | None = None
        self.session: SessionPipe | None = None

    def node(self) -> tuple[str, str, list[str]]:
        """(node id, node IP, the GPU ids Ray gave this actor)."""
        ray = ray_module()
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def free_port(self) -> int:
        from sgpu_magic.launch.resources import free_port

        return free_port()

    def run(self, rank: int, payload: bytes, launch: dict, env: dict) -> dict:
        """Run the rank to its end: ``{"exitcode", "result", "error", "teardown", "profile"}`` (``profile``: a
        profiled job's files of this rank, ``{name: bytes}``). ``launch["session"]``: a live session's rank, whose
        FIFOs are made here first."""
        import subprocess
        import sys

        from sgpu_magic.launch.teardown import wait_with_grace
        from sgpu_magic.spec import DEFAULT_TEARDOWN_GRACE_S

        rd = RunDir(self.dir)
        for folder in (rd.logs_dir, rd.results_dir, rd.errors_dir):
            folder.mkdir(mode=0o700, exist_ok=True)
        atomic_write_bytes(rd.payload_file, payload)
        atomic_write_json(rd.launch_file, launch)
        rd.log_file(rank).touch(mode=0o600)
        if launch.get("session"):
            self.session = SessionPipe(rd, rank)
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "sgpu_magic.rank.worker", str(rd.path)],
            env={**env, "SGPU_MAGIC_HOST_PID": str(os.getpid())},
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        grace_s = launch.get("teardown_grace_s")
        code, ended = wait_with_grace(
            self.proc, rd, rank, DEFAULT_TEARDOWN_GRACE_S if grace_s is None else grace_s, 3.0
        )
        result = rd.result_file(rank).read_bytes() if rd.result_file(rank).exists() else None
        profile = (
            {p.name: p.read_bytes() for p in sorted(rd.profile_dir.glob("rank_*"))} if rd.profile_dir.is_dir() else {}
        )
        return {
            "exitcode": code,
            "result": result,
            "error": read_json(rd.error_file(rank)),
            "teardown": ended,
            "profile": profile,
        }

    def cleanup(self) -> None:
        """Stop the rank (its whole session) if it still runs, and remove this node's copy of its files."""
        import shutil

        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

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

    def session_send(self, message: dict[str, Any], payload: bytes | None = None) -> None:
        """Relay a session command to the rank (see :meth:`SessionPipe.send`)."""
        self._pipe().send(message, payload)

    def session_recv(self, timeout_s: float) -> tuple[dict[str, Any], bytes | None, dict[str, bytes]] | str | None:
        """The rank's next frame (see :meth:`SessionPipe.recv`); ``"gone"`` once the rank has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            return "gone"
        if self.session is None:  # run() has not made the FIFOs yet
            import time

            time.sleep(min(timeout_s, 0.05))
            return None
        return self.session.recv(timeout_s)

    def session_interrupt(self) -> None:
        """SIGINT to the rank: ``KeyboardInterrupt`` in the cell it runs (ignored between cells)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)

    def _pipe(self) -> SessionPipe:
        if self.session is None:
            raise RuntimeError("this rank is not a live session's rank, or it has not started yet")
        return self.session
