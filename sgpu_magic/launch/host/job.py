"""One job in the launch host: its ranks on torch elastic (warm forkserver or cold), polled, restarted up to
``max_restarts`` times, ended with the teardown grace, its status written until the final one."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sgpu_magic._compat import elastic
from sgpu_magic.launch.env import rank_env
from sgpu_magic.launch.flight_recorder import flight_recorder_env
from sgpu_magic.launch.forensics import OomWatch
from sgpu_magic.launch.host.cleanup import kill_leftovers, release_lease
from sgpu_magic.launch.host.warm_pool import WarmPool
from sgpu_magic.launch.machine import RunMachine
from sgpu_magic.launch.progress import ProgressWatch
from sgpu_magic.launch.stacks import save_stacks
from sgpu_magic.launch.teardown import TeardownGuard
from sgpu_magic.launch.usage import UsageSampler
from sgpu_magic.rundir import RunDir
from sgpu_magic.spec import DEFAULT_TEARDOWN_GRACE_S
from sgpu_magic.wire import LaunchRecord, RunState, StopReason
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


class HostJob:
    """One job's ranks inside the host over torch elastic: start, poll, stop; what it sees goes to its
    :class:`~sgpu_magic.launch.machine.RunMachine`, which writes the status."""

    def __init__(self, run_dir: RunDir, env: dict, pool: WarmPool | None) -> None:
        self.run_dir = run_dir
        # the kernel wrote launch.json before it handed the run dir over
        self.launch = run_dir.read_launch()
        self.store, self.port = _rendezvous_store(self.launch.port or 0)
        self.machine = RunMachine(
            run_dir,
            self.launch,
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
        self.done = False
        grace_s = self.launch.teardown_grace_s
        self.guard = TeardownGuard(
            run_dir, self.launch.world_size, DEFAULT_TEARDOWN_GRACE_S if grace_s is None else float(grace_s), GRACE_S
        )
        self.ctx: PContext | None = None
        self.pids: dict[int, int] = {}
        self.usage = UsageSampler(self.launch.gpus if self.launch.backend == "nccl" else [])
        self.oom = OomWatch()
        self.progress = ProgressWatch(run_dir, self.launch.world_size, self.launch.stuck_after_s)
        self.warm_by = 0.0
        self._start_when_warm()

    def _start_when_warm(self) -> None:
        """Start the ranks now, or once the warming forkserver is ready when it is expected to be ready before
        cold interpreters would have started (at the latest when they would have: :meth:`WarmPool.wait_s`)."""
        wait = None if self.pool is None else self.pool.wait_s(self.launch.world_size, self.launch.sys_path)
        if wait:
            self.warm_by = time.monotonic() + wait
            return
        self._start_attempt(warm=wait == 0.0)

    def _start_attempt(self, warm: bool | None = None) -> None:
        """Start every rank for the machine's attempt (1-based; ranks see TORCHELASTIC_RESTART_COUNT = attempt - 1).

        ``warm``: fork them from the forkserver; default: if it is ready (else cold while it warms up)."""
        if warm is None:
            warm = self.pool is not None and self.pool.ready(self.launch.sys_path)
        self.ctx = _make_context(self.run_dir, self.launch, self.port, self.env, warm, self.machine.attempt - 1)
        self.oom.watch(range(self.launch.world_size))
        self.ctx.start()
        self.pids = self.ctx.pids()
        self.usage.watch(self.pids)
        self.progress.restart()
        _make_tree_private(self.run_dir.elastic_dir)  # torch elastic made its per-rank folders with the umask
        self.machine.running(self.pids, self.port, start_method="forkserver" if warm else "subprocess")

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
        """Check the ranks once; finish the job when they are done, failed, or past the timeout."""
        if self.machine.timed_out():
            self.stop(StopReason.TIMED_OUT)
            return
        if self.ctx is None:  # waiting for the warming forkserver
            assert self.pool is not None  # only a forkserver that warms is waited for (_start_when_warm)
            if self.pool.ready(self.launch.sys_path) or time.monotonic() >= self.warm_by:
                self.machine.note(waited_for_warm_s=round(time.time() - self.machine.started_s, 2))
                self._start_attempt()
            return
        self.guard.check(self.pids)
        result = self.ctx.wait(0)
        if result is None:
            self._sample()
            return
        failures = self.guard.spare(getattr(self.ctx, "first_failures", None) or result.failures)
        now = time.time()
        seen = [
            ObservedFailure(r, f.exitcode, now, **self.oom.verdict(r, self.pids.get(r), f.exitcode))
            for r, f in sorted(failures.items())
        ]
        if seen and self.machine.failed(seen):
            self._restart()
            return
        self._finish(RunState.FAILED if seen else RunState.SUCCEEDED)

    def _sample(self) -> None:
        """About once a second: the ranks' usage, their memory cgroups, and whether the job is possibly stuck."""
        if not self.usage.sample():
            return
        self.oom.sample(self.pids)
        if self.progress.check(self.pids):
            self.machine.sampled(self.usage.usage, stuck=self.progress.report())
        else:
            self.machine.sampled(self.usage.usage)

    def _restart(self) -> None:
        """torchrun's restart policy: stop every rank, keep this attempt's record, start them all again.

        The failed attempt's error files move to ``errors/attempt_<k>/`` and its results are dropped, so
        the next attempt is judged on its own; the rank logs go on, after a line naming the new attempt.
        """
        assert self.ctx is not None  # an attempt ran
        self.ctx.close(timeout=GRACE_S)  # type: ignore[arg-type] # torch says int; its waits take seconds as floats
        kill_leftovers(set(self.pids.values()), self.launch.job_id)
        self.guard.reset()
        for rank, exc in self.machine.restart(elastic.exitcodes(self.ctx)):
            log.warning(f"sgpu_magic host: could not mark attempt {self.machine.attempt} in rank {rank}'s log ({exc})")
        self.store = None  # a fresh store per attempt, as torchrun's agent makes (stale keys of the last one go)
        self.store, self.port = _rendezvous_store(self.launch.port or 0)
        self._start_attempt()

    @property
    def started_s(self) -> float:
        return self.machine.started_s

    def stop(self, reason: StopReason, stacks: bool = True, launch_error: str | None = None) -> None:
        """Stop every rank (SIGTERM, then SIGKILL after GRACE_S) and end for ``reason``; when the job timed out or
        was cancelled (``stacks``), the stacks of the ranks still running are taken first (:meth:`_save_stacks`).
        ``launch_error``: why the host could not go on with the job (its status says it)."""
        if self.ctx is not None:
            if stacks and reason.takes_stacks:
                self._save_stacks()
            self.ctx.close(timeout=GRACE_S)  # type: ignore[arg-type] # torch says int; its waits take seconds as floats
        self._finish(reason, launch_error)

    def _save_stacks(self) -> None:
        """Take the stacks of the ranks still running into ``stacks/`` and their summary into the status; a
        failure is logged, never raised (the ranks are stopped all the same)."""
        running = {
            r: self.pids[r] for r, code in elastic.exitcodes(self.ctx).items() if code is None and r in self.pids
        }
        if not running:
            return
        try:
            self.machine.stacks_taken(save_stacks(self.run_dir, running))
        except Exception as exc:  # noqa: BLE001 - the stop goes on without them; the host log says why
            log.warning(f"sgpu_magic host: could not take the stacks of job {self.run_dir.job_id}: {exc!r}")

    def _finish(self, end: RunState | StopReason, launch_error: str | None = None) -> None:
        kill_leftovers(set(self.pids.values()), self.launch.job_id)
        self.usage.gpu.close()
        self.machine.grace_ended(self.guard.report())
        exitcodes = elastic.exitcodes(self.ctx) if self.ctx else {}
        self.store = None  # closes the rendezvous listener before the kernel hears the job ended
        # the final status is the last thing written: once the kernel reads it, the run dir and the
        # leases are in their final form (no payload, GPUs free)
        release_lease(self.launch)
        self.machine.finish(end, exitcodes, **({} if launch_error is None else {"launch_error": launch_error}))
        self.done = True
