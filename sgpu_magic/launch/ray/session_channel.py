"""The kernel's end of a session whose ranks run on a Ray cluster: the same requests as
:class:`~sgpu_magic.session.channel.SessionChannel`, relayed through each rank's actor (the Ray backend's side of
a session: :func:`sgpu_magic.launch.session_channel_for` picks it, so ``session`` imports no backend).

Each rank's FIFOs live on its node, held by its actor (:class:`~sgpu_magic.launch.ray.agent.SessionPipe`). The
kernel sends a command with one actor call (a cell's payload travels with it into a node-side run directory of the
cell), and keeps one pending ``session_recv`` call per rank, which returns the rank's next frame; the session's
reader thread waits on them (:meth:`RaySessionChannel.read_ready`). While a cell runs its ranks' logs are copied
from their nodes as a Ray job's are; when a rank's reply ends the cell, its result, error and metrics files are
written into the cell's run directory here before the reply is handed on, so the cell's Job finds them as for a
local session.
"""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from sgpu_magic.launch.ray.cluster import ray_module
from sgpu_magic.launch.ray.launcher import LOG_PULL_S
from sgpu_magic.rundir import RunDir, atomic_write_bytes, make_private_dir, read_private
from sgpu_magic.wire.session import Frame, RunCell, SessionCommand, with_run_dir


class _SessionJob(Protocol):
    """What the channel needs of the session's job (:class:`sgpu_magic.job.handle.Job`): its launcher, which knows
    the rank actors (``RayLauncher.agents``), and its status (a detached session's agents, which the run keeper
    drives, are found by name once its ranks run)."""

    @property
    def launcher(self) -> Any: ...
    @property
    def status(self) -> Any: ...


RECV_WAIT_S = 2.0
"""How long one ``session_recv`` call waits on a rank's node for a frame before it is asked again."""

CALL_TIMEOUT_S = 30.0
"""How long a send, a log read or an interrupt may take on the cluster before the channel counts it as failed."""


class RaySessionChannel:
    """A Ray session's channel (see the module docstring). ``job``: the session's job, set once it is submitted
    (its launcher knows the rank actors)."""

    def __init__(self, run_dir: RunDir, world_size: int, cluster: str | None = None) -> None:
        self.run_dir, self.world_size, self.cluster = run_dir, world_size, cluster
        self.job: _SessionJob | None = None
        self._agents: list | None = None
        self._recv: dict[Any, int] = {}
        self._cells: dict[int, list] = {}  # rank -> [the cell's RunDir here, log offset]
        self._lock = threading.Lock()
        self._found_lock = threading.Lock()
        self._token = secrets.token_hex(8)
        """This channel's: a detached session's agents give their frames only to the last kernel that sent or asked."""
        self._closed = False
        self._pulled = 0.0

    def make(self) -> None:
        """Mark the run directory as a session's: the rank actors make the FIFOs on their nodes."""
        make_private_dir(self.run_dir.session_dir)

    def attach(self, job: _SessionJob) -> None:
        """The session's job is submitted: its launcher will know the rank actors once they run."""
        self.job = job

    def reopen(self) -> None:
        """A detached session another kernel started (:meth:`sgpu_magic.session.core.SessionCore.adopt`): connect
        to its cluster (``cluster``); its rank agents are found by name once :meth:`attach` names the job.

        Raises:
            OSError: the cluster cannot be reached (the message names it).
        """
        from sgpu_magic.errors import ResourceError
        from sgpu_magic.launch.ray.cluster import connect

        try:
            connect(self.cluster or "auto")
        except ResourceError as exc:
            raise OSError(str(exc)) from None

    def _named(self, job: _SessionJob) -> list | None:
        """A detached session's rank agents, by name, once its status says its ranks run (``None`` before)."""
        from sgpu_magic.launch.ray.cluster import NAMESPACE
        from sgpu_magic.launch.ray.launcher import agent_name

        if not job.status.pids:
            return None
        ray = ray_module()
        try:
            return [
                ray.get_actor(agent_name(self.run_dir.job_id, r), namespace=NAMESPACE) for r in range(self.world_size)
            ]
        except ValueError:  # not (or no longer) there
            return None

    def _actors(self) -> list | None:
        """The rank actors once they run; the first caller that finds them (the reader thread, or a send) asks each
        for its first frame, once: two pending receives on one rank's FIFO would split its frames between them."""
        if self._agents is None and self.job is not None and not self._closed:
            with self._found_lock:
                if self._agents is None:
                    agents = getattr(self.job.launcher, "agents", None)
                    found = agents(self.run_dir) if agents is not None else self._named(self.job)
                    if found is not None:
                        self._agents = list(found)
                        for rank in range(self.world_size):
                            self._ask(rank)
        return self._agents

    def _ask(self, rank: int) -> None:
        assert self._agents is not None
        self._recv[self._agents[rank].session_recv.remote(RECV_WAIT_S, self._token)] = rank

    def send(self, ranks: tuple[int, ...], cmd: SessionCommand, seq: int = 0) -> None:
        """Send ``cmd`` (of request ``seq``) to each of ``ranks`` (a cell's payload with it) and wait until each actor
        has it.

        Raises:
            OSError: the ranks are not running (yet, or any more), or an actor failed.
        """
        agents = self._actors()
        if agents is None:
            raise OSError(f"the session's ranks on the Ray cluster are not running ({self.run_dir})")
        payload = None
        if isinstance(cmd, RunCell):
            cell = RunDir(cmd.run_dir)
            payload = read_private(cell.payload_file, cell.path)
            cmd = with_run_dir(cmd, cell.job_id)  # the actor makes the cell's folder on its node
            with self._lock:
                self._cells.update({r: [cell, 0] for r in ranks})
        ray = ray_module()
        try:
            ray.get(
                [agents[r].session_send.remote(cmd, seq, payload, self._token) for r in ranks], timeout=CALL_TIMEOUT_S
            )
        except Exception as exc:  # noqa: BLE001 - Ray's errors: an actor died, a timeout
            raise OSError(f"sending to the session's ranks failed ({type(exc).__name__}: {exc})") from None

    def interrupt(self, rank: int, pid: int) -> None:
        """SIGINT to ``rank``'s process on its node (through its actor)."""
        if self._agents is not None:
            self._agents[rank].session_interrupt.remote()

    releases = False
    """``Session.recover()`` does not reach the connections of ranks on a Ray cluster's nodes (it says to restart)."""

    def release(self, peers: dict[int, int]) -> None:
        """Nothing on a Ray cluster (see :attr:`releases`)."""

    def read_ready(self, timeout_s: float) -> list[tuple[int, Frame, bytes | None]]:
        """Wait up to ``timeout_s`` for frames from the ranks; each as ``(rank, reply, pickled value or None)``."""
        if self._actors() is None or not self._recv:
            time.sleep(timeout_s)
            return []
        ray = ray_module()
        ready, _ = ray.wait(list(self._recv), num_returns=1, timeout=timeout_s)
        if ready:
            rest = [ref for ref in self._recv if ref not in ready]
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0] if rest else []
        if time.monotonic() - self._pulled > LOG_PULL_S:
            self._pull_logs()
        out = []
        for ref in ready:
            rank = self._recv.pop(ref)
            try:
                got = ray.get(ref)
            except Exception:  # noqa: BLE001 - the actor is gone: the session's job ends, which breaks the session
                continue
            if got in ("gone", "stale") or self._closed:
                continue  # the rank exited (its job's end says why), or another kernel attached and reads it
            self._ask(rank)
            if got is not None:
                reply, value, files = got
                if files:
                    self._end_cell(rank, files)
                out.append((rank, reply, value))
        return out

    def _end_cell(self, rank: int, files: dict[str, bytes]) -> None:
        """Bring the rest of ``rank``'s cell log, then its result, error and metrics files, into the cell's run
        directory here (before its reply is handed on and the cell's final status is written)."""
        with self._lock:
            entry = self._cells.pop(rank, None)
        if entry is None:
            return
        self._pull_log(rank, entry)
        cell: RunDir = entry[0]
        for name, data in files.items():
            path = cell.path / name
            if ".." in Path(name).parts or path.is_symlink():
                continue
            make_private_dir(path.parent)
            atomic_write_bytes(path, data)

    def _pull_logs(self) -> None:
        self._pulled = time.monotonic()
        with self._lock:
            entries = list(self._cells.items())
        for rank, entry in entries:
            self._pull_log(rank, entry)

    def _pull_log(self, rank: int, entry: list) -> None:
        if self._agents is None:
            return
        cell: RunDir = entry[0]
        try:
            chunk = ray_module().get(
                self._agents[rank].read_log.remote(rank, entry[1], cell.job_id), timeout=CALL_TIMEOUT_S
            )
        except Exception:  # noqa: BLE001 - a dead actor has no more log to give
            return
        if chunk:
            with open(cell.log_file(rank), "ab") as f:
                f.write(chunk)
            entry[1] += len(chunk)

    def close(self) -> None:
        """Forget the actors (their job's end removes them); later reads return nothing."""
        self._closed = True
        self._agents = None
        self._recv.clear()
