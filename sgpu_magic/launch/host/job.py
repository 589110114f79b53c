"""One job in the launch host: its ranks on torch elastic (warm forkserver or cold), a
:class:`~sgpu_magic.launch.group.RankGroup` that its :class:`~sgpu_magic.launch.machine.RunMachine` polls, restarts up
to ``max_restarts`` times, stops and ends with the teardown grace, writing its status until the final one."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sgpu_magic._compat import elastic
from sgpu_magic.launch.env import rank_env
from sgpu_magic.launch.flight_recorder import flight_recorder_env
from sgpu_magic.launch.forensics import OomWatch
from sgpu_magic.launch.group import RankGroup, Started
from sgpu_magic.launch.host.cleanup import kill_leftovers, release_lease
from sgpu_magic.launch.host.warm_pool import WarmPool
from sgpu_magic.launch.machine import RunMachine
from sgpu_magic.launch.stacks import CodeMap, RankStack, take_stacks
from sgpu_magic.launch.teardown import TeardownGuard
from sgpu_magic.launch.usage import UsageSampler
from sgpu_magic.rundir import RunDir
from sgpu_magic.spec import DEFAULT_TEARDOWN_GRACE_S
from sgpu_magic.status import RankUsage
from sgpu_magic.wire import LaunchRecord, StopReason
from sgpu_magic.wire.errors import ObservedFailure

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.api import PContext

log = logging.getLogger(__name__)
"""The host's diagnostics: one line each in its log file (:func:`sgpu_magic.launch.host.process.serve` sets the
handler up), redacted."""

GRACE_S = 3.0


STORE_TIMEOUT_S = 1800.0
"""How long the rendezvous store's own operations may wait (torch's default for a process group: 30 min)."""


def _rendezvous_store(port: int):
    """torchrun's agent store for one job: a c10d ``TCPStore`` served by the host and listening on
    127.0.0.1:``port`` only (``port`` 0 = a free one). Ranks reach it as clients through
    ``TORCHELASTIC_USE_AGENT_STORE``, so no rank opens a listener on every interface as rank 0's
    own store would. One store per attempt, as torchrun's agent makes.

    Returns:
        (store, port): keep ``store`` referenced while the ranks run; dropping it closes the listener.
    Raises:
        OSError: ``port`` is in use.
    """
    from datetime import timedelta

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore: TIME_WAIT is not "in use"
        sock.bind(("127.0.0.1", port))
        sock.listen(1024)
        port = sock.getsockname()[1]
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            None,
            True,
            timedelta(seconds=STORE_TIMEOUT_S),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
            use_libuv=True,
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the listening socket now and closes it when dropped
    return store, port


def _make_context(
    run_dir: RunDir, launch: LaunchRecord, port: int, env: dict[str, str], warm: bool, restart_count: int = 0
) -> PContext:
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, MultiprocessContext, SubprocessContext

    from sgpu_magic.rank import worker

    world = launch.world_size
    env = {**env, **flight_recorder_env(run_dir, launch.backend, env)}
    envs = {r: rank_env(launch, r, port, env, restart_count) for r in range(world)}
    logs = DefaultLogsSpecs(log_dir=str(run_dir.elastic_dir))
    if warm:
        args: dict[int, tuple[Any, ...]] = {r: (str(run_dir.path), envs[r]) for r in range(world)}
        return elastic.context_class(MultiprocessContext, GRACE_S)(
            name=launch.job_id,
            entrypoint=worker.rank_entry,
            args=args,
            envs=envs,
            start_method="forkserver",
            logs_specs=logs,
        )
    args = {r: ("-u", "-m", "sgpu_magic.rank.worker", str(run_dir.path)) for r in range(world)}
    return elastic.context_class(SubprocessContext, GRACE_S)(
        name=launch.job_id, entrypoint=sys.executable, args=args, envs=envs, logs_specs=logs
    )


def _make_tree_private(top: Path) -> None:
    """chmod 0700 every folder under ``top`` (folders only: elastic leaves them empty, ranks log to our files)."""
    for dirpath, _, _ in os.walk(top):
        try:
            os.chmod(dirpath, 0o700)
        except OSError:
            pass


class HostJob(RankGroup):
    """One job's ranks inside the host over torch elastic (a ``PContext`` per attempt): start, poll, stop. Its
    :class:`~sgpu_magic.launch.machine.RunMachine` drives them (:meth:`poll` on every turn of the host's loop) and
    writes the status."""

    def __init__(self, run_dir: RunDir, env: dict, pool: WarmPool | None) -> None:
        self.run_dir = run_dir
        # the kernel wrote launch.json before it handed the run dir over
        self.launch = run_dir.read_launch()
        self.store, self.port = _rendezvous_store(self.launch.port or 0)
        self.machine = RunMachine(
            run_dir,
            self.launch,
            self,
            on_error=lambda exc: log.warning(
                f"sgpu_magic host: cannot write the status of job {run_dir.job_id} ({exc}); retrying"
            ),
            port=self.port,
            host_pid=os.getpid(),
        )
        self.write()
        # this job's environment is its own value (its ranks get exactly it, warm or cold): never the host's
        # os.environ, which every job of the kernel shares
        env = {**env, **self.launch.env}
        self.tracked = self.launch.tracked  # the host imports mlflow once its ranks have started
        self.env, self.pool = env, pool
        grace_s = self.launch.teardown_grace_s
        self.guard = TeardownGuard(
            run_dir, self.launch.world_size, DEFAULT_TEARDOWN_GRACE_S if grace_s is None else float(grace_s), GRACE_S
        )
        self.ctx: PContext | None = None
        self.pids: dict[int, int] = {}
        self.usage = UsageSampler(self.launch.gpus if self.launch.backend == "nccl" else [])
        self.oom = OomWatch()
        self._reaped = True  # no rank has run that could leave processes behind
        self.warm_by = 0.0
        self._warm: bool | None = None  # how the next attempt starts, when chosen (else: warm if the pool is ready)
        self._start_when_warm()

    @property
    def done(self) -> bool:
        return self.machine.finished

    def _start_when_warm(self) -> None:
        """Start the ranks now, or once the warming forkserver is ready when it is expected to be ready before
        cold interpreters would have started (at the latest when they would have: :meth:`WarmPool.wait_s`)."""
        wait = None if self.pool is None else self.pool.wait_s(self.launch.world_size, self.launch.sys_path)
        if wait:
            self.warm_by = time.monotonic() + wait
            return
        self._warm = wait == 0.0
        self.machine.start_attempt()

    def start_ranks(self, attempt: int) -> Started:
        """Start every rank of ``attempt`` from the forkserver if it is ready (or as :meth:`_start_when_warm` chose),
        else cold while it warms up; a fresh rendezvous store for each attempt after the first, as torchrun's agent
        makes (the stale keys of the last one go)."""
        warm, self._warm = self._warm, None
        if warm is None:
            warm = self.pool is not None and self.pool.ready(self.launch.sys_path)
        if attempt > 1:
            self.store = None
            self.store, self.port = _rendezvous_store(self.launch.port or 0)
        self.guard.reset()
        self.ctx = _make_context(self.run_dir, self.launch, self.port, self.env, warm, attempt - 1)
        self.oom.watch(range(self.launch.world_size))
        self._reaped = False
        self.ctx.start()
        self.pids = self.ctx.pids()
        self.usage.watch(self.pids)
        _make_tree_private(self.run_dir.elastic_dir)  # torch elastic made its per-rank folders with the umask
        return Started(self.pids, self.port, {"start_method": "forkserver" if warm else "subprocess"})

    def write(self) -> None:
        """Write status.json; when that fails (a full disk that even the reserve did not cover), keep the
        status and try again on every turn of the host's loop (:meth:`Host.run`) instead of failing."""
        self.machine.write()

    @property
    def unwritten(self) -> bool:
        """The last write of the status failed; the host's loop writes it again."""
        return self.machine.unwritten

    def wake_fds(self) -> list[int]:
        """File descriptors that become readable when a warm rank returns or exits (its return-value
        pipe, its process sentinel), so the host polls at once instead of on its next tick."""
        return elastic.wake_fds(self.ctx) if self.ctx is not None else []

    def poll(self) -> None:
        """One turn of the host's loop for this job: start its ranks once the warming forkserver is ready (a job
        past its timeout meanwhile ends), else the machine's look at them (:meth:`RunMachine.drive`)."""
        if self.ctx is not None:
            self.machine.drive()
            return
        # waiting for the warming forkserver
        reason = self.machine.stop_due()
        if reason is not None:
            self.stop(reason)
            return
        assert self.pool is not None  # only a forkserver that warms is waited for (_start_when_warm)
        if self.pool.ready(self.launch.sys_path) or time.monotonic() >= self.warm_by:
            self.machine.note(waited_for_warm_s=round(time.time() - self.machine.started_s, 2))
            self.machine.start_attempt()

    def poll_ranks(self) -> list[ObservedFailure] | None:
        assert self.ctx is not None  # an attempt runs
        self.guard.check(self.pids)
        result = self.ctx.wait(0)
        if result is None:
            return None
        failures = self.guard.spare(getattr(self.ctx, "first_failures", None) or result.failures)
        now = time.time()
        return [
            ObservedFailure(r, f.exitcode, now, **self.oom.verdict(r, self.pids.get(r), f.exitcode))
            for r, f in sorted(failures.items())
        ]

    def sample_usage(self) -> dict[int, RankUsage] | None:
        """About once a second: the ranks' usage, and their memory cgroups (for an OOM verdict)."""
        if not self.usage.sample():
            return None
        self.oom.sample(self.pids)
        return self.usage.usage

    def running_pids(self) -> dict[int, int]:
        codes = elastic.exitcodes(self.ctx) if self.ctx is not None else {}
        return {r: self.pids[r] for r, code in codes.items() if code is None and r in self.pids}

    def take_stacks(self, ranks: Mapping[int, int]) -> dict[int, RankStack]:
        return take_stacks(dict(ranks), CodeMap.read(self.run_dir.code_map_file))

    def stop_ranks(self) -> dict[int, int | None]:
        """torch elastic's close (SIGTERM, then SIGKILL after ``GRACE_S``), then whatever the ranks left behind."""
        if self.ctx is None:  # waiting for the warming forkserver: no rank started
            return {}
        self.ctx.close(timeout=GRACE_S)  # type: ignore[arg-type] # torch says int; its waits take seconds as floats
        self._reap()
        return elastic.exitcodes(self.ctx)

    def _reap(self) -> None:
        if not self._reaped:
            kill_leftovers(set(self.pids.values()), self.launch.job_id)
            self._reaped = True

    @property
    def started_s(self) -> float:
        return self.machine.started_s

    def stop(self, reason: StopReason, stacks: bool = True, launch_error: str | None = None) -> None:
        """Stop the job for ``reason`` (:meth:`RunMachine.stop`: the stacks first when it timed out or was cancelled
        and ``stacks``); ``launch_error``: why the host could not go on with the job (its status says it)."""
        self.machine.stop(reason, stacks, launch_error)

    def end_ranks(self) -> dict[int, int | None]:
        """Leftovers killed, the GPU sampler closed, the ranks the teardown grace ended noted, the rendezvous
        listener closed and the lease given back: the final status, written next, is the last thing the kernel
        reads, so once it does the run dir and the leases are in their final form (no payload, GPUs free)."""
        self._reap()
        self.usage.gpu.close()
        self.machine.grace_ended(self.guard.report())
        exitcodes = elastic.exitcodes(self.ctx) if self.ctx else {}
        self.store = None  # closes the rendezvous listener before the kernel hears the job ended
        release_lease(self.launch)
        return exitcodes
