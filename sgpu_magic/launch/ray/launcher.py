"""The Ray launcher: one actor per rank in a placement group, each running ``python -m sgpu_magic.rank.worker`` on its node;
a supervisor thread in the kernel writes the job's status as the launch host does."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sgpu_magic.errors import SgpuError, SpecError
from sgpu_magic.launch.group import RankGroup, Started
from sgpu_magic.launch.machine import RunMachine
from sgpu_magic.launch.ray.agent import agent_class
from sgpu_magic.launch.ray.cluster import NAMESPACE, PENDING_NOTE_S, ray_module
from sgpu_magic.launch.ray.nodes import Node, NodeFiles, NodeUsage, rank_env_on
from sgpu_magic.launch.ray.warm import WARM, WarmSet, driver_id, give_back, keep_warm_s, shape_of
from sgpu_magic.launch.stacks import REPLY_WAIT_S, CodeMap, RankStack, no_stack
from sgpu_magic.rank.mlflow_guard import RUN_FILE_ENV, run_env
from sgpu_magic.rundir import RunDir, atomic_write_bytes
from sgpu_magic.status import HostStatus, RankUsage
from sgpu_magic.wire import RankError, RunState, StopReason
from sgpu_magic.wire.errors import ObservedFailure, RankOutcome

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

log = logging.getLogger(__name__)

LOG_PULL_S = 0.2
"""How often the supervisor copies new log bytes from the ranks' nodes."""

STOP_WAIT_S = 30.0
"""Seconds a job that restarts or is stopped waits for its agents to stop the ranks still running (SIGKILL, so it is
quick), and again for those ranks' outcomes."""


def _bundle(backend: str, gpu_type: str | None) -> dict[str, float]:
    """One rank's placement-group bundle: a CPU for gloo, a GPU (of ``gpu_type``) for nccl."""
    if backend == "gloo":
        return {"CPU": 1}
    bundle: dict[str, float] = {"GPU": 1}
    if gpu_type:
        bundle[f"accelerator_type:{gpu_type}"] = 0.001
    return bundle


def agent_name(job_id: str, rank: int) -> str:
    """The Ray name of rank ``rank``'s agent in a detached session's job ``job_id`` (in :data:`~sgpu_magic.launch.ray.
    cluster.NAMESPACE`): the session's kernel, which is not the agents' driver, finds them by it."""
    return f"sgpu_magic-{job_id}-rank-{rank}"


class RayLauncher:
    """The :class:`~sgpu_magic.launch.base.Launcher` of jobs on a Ray cluster: ``launch`` starts a supervisor
    thread in this process (the kernel; the run keeper for a detached job) for the run dir, ``cancel`` stops it.

    The run keeper (:class:`sgpu_magic.launch.host.keeper.Keeper`) runs detached jobs' supervisors: it gives each
    job the ranks' base environment its kernel sent (:meth:`launch_with_env`), and the supervisor connects to the
    cluster in its own thread; the keeper keeps its warm set as a kernel does (:mod:`sgpu_magic.launch.keeper_main`).
    """

    def __init__(self, cluster: str, gpu_type: str | None) -> None:
        self.cluster, self.gpu_type = cluster, gpu_type
        self.pid = os.getpid()
        self._jobs: dict[str, _Supervisor] = {}

    def where(self) -> str:
        return "the kernel's Ray driver"

    def preparing(self) -> str | None:
        return None  # a job waiting for the cluster's resources says so itself (its status' "waiting")

    def stacks(self, run_dir: RunDir, status: Callable[[], HostStatus], native: bool) -> dict[int, str]:
        """The running ranks' stacks, each taken by py-spy on its node by the rank's agent (its tracer).

        Raises:
            SgpuError: the job's ranks are not running (not yet, or between attempts), or it has ended (saying
                where the stacks taken when it was stopped are: :func:`sgpu_magic.launch.stacks.live_stacks`)."""
        from sgpu_magic.launch.stacks import live_stacks

        sup = self._running(run_dir)
        if sup is not None:
            taken = sup.take_stacks(range(sup.world), native)
            if taken:
                return {rank: stack.text for rank, stack in taken.items()}
        now = status()
        if not now.final:
            raise SgpuError(
                f"job {run_dir.job_id} has no running ranks yet (state {now.state.value}); take its stacks once it runs"
            )
        return live_stacks(run_dir, status, native)  # raises: it has ended, and where its saved stacks are

    def launch(self, run_dir: RunDir) -> None:
        self.launch_with_env(run_dir, None)

    def launch_with_env(self, run_dir: RunDir, base_env: dict[str, str] | None) -> None:
        """Start the job's supervisor; ``base_env``: the ranks' environment before the job's own (``None``: this
        process's, :func:`sgpu_magic.launch.client.rank_base_env`; the run keeper gives the one the job's kernel
        sent, and the supervisor connects to the cluster first)."""
        sup = _Supervisor(run_dir, self.cluster, self.gpu_type, base_env)
        self._jobs[run_dir.job_id] = sup
        sup.start()

    def running(self) -> list[str]:
        """The ids of the jobs whose supervisor has not finished."""
        return [job_id for job_id, sup in self._jobs.items() if not sup.finished]

    def answer_stacks(self, run_dir: RunDir, token: str, native: bool) -> None:
        """The run keeper's answer to a kernel's stacks request for a detached Ray job (as the launch host's,
        :func:`sgpu_magic.launch.stacks.answer`): each running rank's stack, taken on its node by its agent."""
        from sgpu_magic.launch.stacks import reply_stacks

        sup = self._running(run_dir)
        if sup is None:
            return reply_stacks(run_dir, token, None)
        reply_stacks(run_dir, token, lambda: sup.take_stacks(range(sup.world), native))

    def stop_all(self, reason: StopReason, wait_s: float) -> None:
        """Stop every running job (the run keeper is exiting) and wait up to ``wait_s`` seconds for them to end."""
        deadline = time.monotonic() + wait_s
        for sup in self._jobs.values():
            sup.stop(reason)
        for sup in self._jobs.values():
            sup.join(max(0.0, deadline - time.monotonic()))

    def cancel(self, run_dir: RunDir, reason: StopReason) -> None:
        sup = self._jobs.get(run_dir.job_id)
        if sup is not None:
            sup.stop(reason)

    def alive(self) -> bool:
        return all(s.is_alive() or s.finished for s in self._jobs.values())

    def agents(self, run_dir: RunDir) -> list | None:
        """The rank actors of the job in ``run_dir`` once its ranks run (rank order), else ``None``."""
        sup = self._running(run_dir)
        return sup.actors if sup is not None else None

    def _running(self, run_dir: RunDir) -> _Supervisor | None:
        """The supervisor of the job of ``run_dir`` while its ranks run (started, not finished), else ``None``."""
        sup = self._jobs.get(run_dir.job_id)
        return sup if sup is not None and sup.running.is_set() and not sup.finished else None


class _Supervisor(threading.Thread, RankGroup):
    """One Ray job's ranks, one actor each: a :class:`~sgpu_magic.launch.group.RankGroup` that its thread drives with
    the job's :class:`~sgpu_magic.launch.machine.RunMachine`, as the launch host drives its jobs' ranks."""

    def __init__(self, rd: RunDir, cluster: str, gpu_type: str | None, base_env: dict[str, str] | None = None) -> None:
        super().__init__(name=f"sgpu_magic ray {rd.job_id}", daemon=True)
        self.rd, self.cluster, self.gpu_type = rd, cluster, gpu_type
        self.base_env = base_env
        """The ranks' environment before the job's own; ``None``: this process's (a kernel's job). Given: a detached
        job in the run keeper, which connects to the cluster in this thread."""
        # the kernel wrote launch.json before it handed the run dir over
        self.launch = rd.read_launch()
        self.world = self.launch.world_size
        self.machine = RunMachine(rd, self.launch, self, host_pid=os.getpid(), cluster=cluster, start_method="ray")
        self._mlflow: dict[str, str] | None = None
        self.finished = False
        self.copier = NodeFiles(rd, self.world)
        self.actors: list = []
        self.running = threading.Event()
        """Set once every rank has started (its actor's ``run`` called)."""
        self.pg: PlacementGroup | None = None
        self.pg_name = f"sgpu_magic-{rd.job_id}"
        self.bundle = _bundle(self.launch.backend, gpu_type)
        self.nodes: list[Node] = []
        self.warm_agents = False  # it took the kernel's warm placement group and agents
        self.forked_ranks = 0  # ranks forked from their warm agent's zygote
        self.usage = NodeUsage()
        self.pids: dict[int, int] = {}  # the running attempt's ranks, on their nodes
        self._pending: dict[Any, int] = {}  # {run call: rank} of the attempt's ranks that have not ended
        self._exitcodes: dict[int, int | None] = {}  # the attempt's ranks that have ended
        self._pulled_at = 0.0

    def stop(self, reason: StopReason) -> None:
        self.machine.request_stop(reason)  # read by the supervisor's loop within 0.1 s

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - reported to the kernel as the job's failure
            self.machine.finish(RunState.FAILED, launch_error=f"{type(exc).__name__}: {exc}")
        finally:
            self._release()
            self.finished = True

    def _run(self) -> None:
        if self.base_env is not None:  # in the run keeper: connected by the job's own thread (seconds, the first time)
            from sgpu_magic.launch.ray.cluster import connect

            connect(self.cluster)
        bundle = self.bundle
        warm = None if self._session() else WARM.take(shape_of(self.world, bundle))
        if warm is None or not self._adopt(warm):
            reason = self._reserve(bundle)
            if reason:
                return self.machine.stop(reason)
            self._start_agents()
        self.machine.start_attempt()
        self.running.set()
        while not self.machine.drive():
            pass

    def _reserve(self, bundle: dict[str, float]) -> StopReason | None:
        """The job's placement group, waited for (saying so every ``PENDING_NOTE_S``); why it stopped waiting, if."""
        ray = ray_module()
        from ray.util.placement_group import placement_group

        self.pg = placement_group([dict(bundle) for _ in range(self.world)], strategy="PACK", name=self.pg_name)
        ready = self.pg.ready()
        if not ray.wait([ready], timeout=0.1)[0]:
            WARM.waiting(+1)  # nothing is kept warm while a job waits for the cluster's resources
            try:
                return self._wait_for(ready, bundle)
            finally:
                WARM.waiting(-1)
        return None

    def _wait_for(self, ready: Any, bundle: dict[str, float]) -> StopReason | None:
        ray = ray_module()
        noted = 0.0
        while not ray.wait([ready], timeout=0.1)[0]:
            reason = self.machine.stop_due()
            if reason:
                return reason
            if time.time() - noted > PENDING_NOTE_S:
                noted = time.time()
                unit = "GPU" if "GPU" in bundle else "CPU"
                free, total = ray.available_resources().get(unit, 0), ray.cluster_resources().get(unit, 0)
                self.machine.waiting(
                    f"waiting for {self.world} {unit} bundle(s) on the Ray cluster: {free:g} of {total:g} {unit}s "
                    "free now"
                )
        self.machine.waiting(None)
        return None

    def _session(self) -> bool:
        """Whether the job is a live session's ranks (its run directory has its session folder, made by its
        channel): the agents make the FIFOs, and they are never kept for another job."""
        return self.rd.session_dir.is_dir()

    def _adopt(self, warm: WarmSet) -> bool:
        """Take the kernel's warm placement group and agents (:mod:`~sgpu_magic.launch.ray.warm`) for this job;
        ``False`` (given back) when an agent is gone, e.g. its node was lost."""
        try:
            self.nodes = ray_module().get([a.node.remote() for a in warm.actors], timeout=30)
        except Exception:  # noqa: BLE001 - a dead agent or node: start afresh
            give_back(warm)
            return False
        self.pg, self.actors, self.pg_name = warm.pg, warm.actors, warm.name
        self.warm_agents = True
        self.machine.note(warm_agents=True)
        return True

    def _start_agents(self) -> None:
        """One rank agent per bundle of the job's placement group."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert self.pg is not None  # reserved by _reserve
        gloo = self.launch.backend == "gloo"
        agent = agent_class()
        # a detached session's agents are named, so a kernel (not their driver, the run keeper) finds them
        named = self.launch.detached and self._session()
        self.actors = [
            agent.options(
                num_cpus=int(gloo),
                num_gpus=int(not gloo),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
                **({"name": agent_name(self.rd.job_id, r), "namespace": NAMESPACE} if named else {}),
            ).remote()
            for r in range(self.world)
        ]
        self.nodes = ray_module().get([a.node.remote() for a in self.actors])

    def start_ranks(self, attempt: int) -> Started:
        """Each agent runs its rank of ``attempt`` with torchrun's env."""
        ray = ray_module()
        nodes = self.nodes
        port = None
        if self.warm_agents and not self.launch.port:
            port = ray.get(self.actors[0].open_store.remote(nodes[0][1]))  # rank 0's agent serves the store
        agent_store = port is not None
        port = port or self.launch.port or ray.get(self.actors[0].free_port.remote())
        payload = self.rd.payload_file.read_bytes()
        refs = [
            a.run.remote(r, payload, self._rank_launch(), self._rank_env(r, nodes, port, agent_store, attempt))
            for r, a in enumerate(self.actors)
        ]
        self._pending, self._exitcodes = dict(zip(refs, range(self.world))), {}
        pids = ray.get([a.pid.remote(wait_s=10.0) for a in self.actors])
        self.pids = {r: p for r, p in enumerate(pids) if p is not None}
        notes = {"master_addr": nodes[0][1], "nodes": {str(r): ip for r, (_, ip, _) in enumerate(nodes)}}
        return Started(self.pids, port, notes)

    def poll_ranks(self) -> list[ObservedFailure] | None:
        """Wait up to 50 ms for a rank to end, copying the ranks' logs here every ``LOG_PULL_S``; each rank that has
        ended by then has its outcome recorded. The ranks seen fail (every one by then, as the launch host sees
        them), ``[]`` once every rank has succeeded, else ``None``."""
        ray = ray_module()
        pending = self._pending
        done = ray.wait(list(pending), num_returns=1, timeout=0.05)[0] if pending else []
        if time.monotonic() - self._pulled_at > LOG_PULL_S:
            self._pulled_at = time.monotonic()
            self._pull_logs()
        if done:  # and every other rank that has ended by now
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        seen = [f for f in (self._record_outcome(pending.pop(ref), ref) for ref in done) if f]
        if seen:
            return sorted(seen, key=lambda f: f.rank)
        return None if pending else []

    def sample_usage(self) -> dict[int, RankUsage] | None:
        """Each rank's CPU, memory and GPU figures, taken by its agent on its node about once a second
        (:class:`~sgpu_magic.launch.ray.nodes.NodeUsage`); the hang detector reads the logs and metrics copied here."""
        return self.usage.poll(self.actors)

    def running_pids(self) -> dict[int, int]:
        return {rank: self.pids.get(rank, 0) for rank in sorted(self._pending.values())}

    def stop_ranks(self) -> dict[int, int | None]:
        """Each agent stops its rank if it still runs (SIGKILL); each stopped rank's outcome is taken (its error, a
        peer's broken connection, is the attempt's) and what the ranks wrote up to now is copied here."""
        ray = ray_module()
        try:  # every agent, also one whose rank has ended: stop_rank readies it for the next attempt's run
            ray.get([a.stop_rank.remote() for a in self.actors], timeout=STOP_WAIT_S)
        except Exception:  # noqa: BLE001 - a dead agent: its rank's outcome below says so
            pass
        pending = self._pending
        ended = set(ray.wait(list(pending), num_returns=len(pending), timeout=STOP_WAIT_S)[0]) if pending else set()
        for ref, rank in pending.items():
            if ref not in ended:  # its agent did not stop it in time
                self._exitcodes[rank] = None
                continue
            try:
                out: RankOutcome = ray.get(ref)
            except Exception:  # noqa: BLE001 - its actor died
                self._exitcodes[rank] = -9
                continue
            self._exitcodes[rank] = out.exitcode
            if out.error is not None:  # kept with the attempt's, by the machine's restart
                self.rd.write_error(out.error)
        self._pending = {}
        self._pull_logs()  # the attempt's last lines, before a restart's marker
        return dict(self._exitcodes)

    def take_stacks(self, ranks: Iterable[int], native: bool = False) -> dict[int, RankStack]:
        """The stacks of ``ranks`` that still run, each taken on its node by its agent, all at once."""
        ray = ray_module()
        code = CodeMap.read(self.rd.code_map_file)
        actors = self.actors
        refs = {r: actors[r].stacks.remote(r, code.labels, code.sources, native) for r in ranks}
        taken: dict[int, RankStack] = {}
        for rank, ref in refs.items():
            try:
                stack = ray.get(ref, timeout=REPLY_WAIT_S)
            except Exception as exc:  # noqa: BLE001 - a dead or stuck agent
                stack = no_stack(rank, 0, f"its Ray agent did not answer ({type(exc).__name__})")
            if stack is not None:
                taken[rank] = stack
        return taken

    def _record_outcome(self, rank: int, ref: Any) -> ObservedFailure | None:
        """Write rank ``rank``'s result or error into the run dir; its failure as the launch host records one (with
        its agent's OOM verdict), ``None`` when it succeeded (an agent that ended a rank after its value, at the
        teardown grace, counts as success)."""
        try:
            out: RankOutcome = ray_module().get(ref)
        except Exception as exc:  # noqa: BLE001 - the actor died (node lost, killed)
            died = RankError(rank, type(exc).__name__, f"the rank's Ray actor died: {exc}", time_s=time.time())
            out = RankOutcome(-9, error=died)
        self._exitcodes[rank] = out.exitcode
        if out.warm:  # forked from its warm agent's zygote
            self.forked_ranks += 1
            self.machine.note(forked_ranks=self.forked_ranks)
        if out.result is not None:
            atomic_write_bytes(self.rd.result_file(rank), out.result)
        if out.error is not None:
            self.rd.write_error(out.error)
        if out.profile:  # a profiled rank's trace and figures, from its node
            self.rd.profile_dir.mkdir(mode=0o700, exist_ok=True)
            for name, data in out.profile.items():
                atomic_write_bytes(self.rd.profile_dir / Path(name).name, data)
        if out.teardown:  # it had not exited teardown_grace_s after its outcome: its agent ended it
            self.machine.grace_ended([out.teardown])
        if out.succeeded:
            return None
        return ObservedFailure(rank, out.exitcode, time.time(), out.oom, out.oom_killed)

    def _rank_launch(self) -> dict:
        """The job's launch record as the agents write it on their nodes (JSON: an agent of another sgpu_magic
        version reads it by its schema); a live session's run directory has its session folder (made by its
        channel): the agents make the FIFOs."""
        return self.launch.for_rank_agent(session=self.rd.session_dir.is_dir()).to_json()

    def _mlflow_env(self) -> dict[str, str]:
        """The job's MLflow run as the ranks' environment gives it (the kernel makes it while the actors start; the
        ranks on the nodes cannot read the run directory's ``mlflow.json``, so the supervisor waits for it here,
        once)."""
        if self._mlflow is None:
            run_file = self.launch.env.get(RUN_FILE_ENV)
            self._mlflow = run_env(run_file) if run_file else {}
        return self._mlflow

    def _rank_env(
        self, rank: int, nodes: list[Node], port: int, agent_store: bool = False, attempt: int = 1
    ) -> dict[str, str]:
        """torchrun's contract for ``rank`` on its node (:func:`~sgpu_magic.launch.ray.nodes.rank_env_on`), over the
        ranks' base environment, the job's own and its MLflow run."""
        from sgpu_magic.launch.client import rank_base_env

        base = rank_base_env() if self.base_env is None else self.base_env
        env = {**base, **self.launch.env, **self._mlflow_env()}
        env.pop(RUN_FILE_ENV, None)  # the kernel's run directory is not on the nodes: the run's identity is given
        return rank_env_on(self.launch, env, rank, nodes, port, attempt, agent_store)

    def _pull_logs(self) -> None:
        """Copy what the ranks added to their logs and metrics on their nodes into the run directory here."""
        if self.actors:
            self.copier.pull(self.actors)

    def end_ranks(self) -> dict[int, int | None]:
        """What the ranks wrote up to now is copied here, then their agents are kept warm for the next job of the
        shape (:meth:`_park`) or each cleans its node and is ended; the attempt's exit codes."""
        ray = ray_module()
        self._pull_logs()  # what the ranks wrote up to now, before their actors go
        if self._park():
            return dict(self._exitcodes)
        cleanups = []
        for actor in self.actors:
            try:
                cleanups.append(actor.cleanup.remote())
            except Exception:  # noqa: BLE001 - a dead actor
                pass
        try:
            ray.wait(cleanups, num_returns=len(cleanups), timeout=10)
        except Exception:  # noqa: BLE001
            pass
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001
                pass
        return dict(self._exitcodes)

    def _park(self) -> bool:
        """Keep the job's placement group and agents warm for the next job of its shape (:mod:`~sgpu_magic.launch.
        ray.warm`): each agent stops its rank, clears the job's files and starts its zygote; whether they
        were kept (not for a session's ranks, nor when ``ray_keep_warm_s`` is 0 or an agent did not answer)."""
        try:
            keep_s = keep_warm_s()
        except SpecError:  # the environment's value went bad since the job was planned: keep nothing
            keep_s = 0.0
        if not self.actors or self.pg is None or self._session() or keep_s <= 0:
            return False
        ray = ray_module()
        try:
            ready = ray.get([a.reset.remote(serve_store=r == 0) for r, a in enumerate(self.actors)], timeout=10)
        except Exception:  # noqa: BLE001 - a dead or stuck agent: the job's actors go
            return False
        if not all(ready):
            return False
        warm = WarmSet(shape_of(self.world, self.bundle), self.pg, self.actors, driver_id(), self.pg_name)
        self.pg = None  # the warm set holds it now (WARM gives it back)
        WARM.park(warm, keep_s)
        return True

    def _release(self) -> None:
        if self.pg is not None:
            try:
                ray_module().util.remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
            self.pg = None
