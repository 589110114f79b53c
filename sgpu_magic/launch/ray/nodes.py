"""What a Ray job's supervisor does per node: torchrun's environment for a rank on its node (:func:`rank_env_on`), the
copy of the ranks' logs and metrics from their nodes into the job's run directory here (:class:`NodeFiles`) and the
ranks' usage as their agents sample it (:class:`NodeUsage`)."""

from __future__ import annotations

import time
from typing import Any

from sgpu_magic.launch.env import cpu_framework_env, torchrun_env
from sgpu_magic.launch.ray.cluster import ray_module
from sgpu_magic.launch.usage import SAMPLE_INTERVAL_S
from sgpu_magic.rundir import RunDir
from sgpu_magic.status import RankUsage
from sgpu_magic.wire import LaunchRecord

Node = tuple[str, str, list[str]]
"""Where a rank's actor runs: (Ray node id, the node's IP, the GPU ids Ray gave the actor there)."""

USAGE_ASK_GIVE_UP_S = 5.0
"""Seconds the Ray supervisor waits for an agent's usage figures before it asks every agent again (a busy or lost
node's agent; its rank's last figures stay)."""

PULL_WAIT_S = 10.0
"""Seconds a copy waits for one agent's answer (a dead or busy agent's rank has no more to give this time)."""


def rank_env_on(
    launch: LaunchRecord,
    env: dict[str, str],
    rank: int,
    nodes: list[Node],
    port: int,
    attempt: int,
    agent_store: bool = False,
) -> dict[str, str]:
    """``env`` with torchrun's contract for ``rank`` (:func:`~sgpu_magic.launch.env.torchrun_env`): ``nodes[r]`` is
    where rank ``r``'s actor runs; nodes are numbered by their first rank (``GROUP_RANK``), ``MASTER_ADDR`` is rank
    0's node, ``attempt`` (from 1) sets ``TORCHELASTIC_RESTART_COUNT``; ``agent_store``: rank 0's agent serves the
    rendezvous store at ``port`` (else rank 0 does). As torchrun on one node, every local rank sees its node's job
    GPUs (``CUDA_VISIBLE_DEVICES`` in local-rank order) and takes ``cuda:LOCAL_RANK``."""
    order = list(dict.fromkeys(node for node, _, _ in nodes))  # by their first rank
    node_id = nodes[rank][0]
    local = [r for r, (n, _, _) in enumerate(nodes) if n == node_id]
    env = dict(env)
    env.update(
        torchrun_env(
            launch.job_id,
            rank,
            launch.world_size,
            local.index(rank),
            len(local),
            order.index(node_id),
            len(order),
            nodes[0][1],
            port,
            restart_count=attempt - 1,
            max_restarts=launch.max_restarts,
            agent_store=agent_store,
        )
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(cpu_framework_env(launch.backend, env))
    gpus = [g for r in local for g in nodes[r][2]]
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


class NodeFiles:
    """The ranks' logs and metrics, copied from their nodes (each rank's agent reads its own from an offset) into
    the job's run directory here, so the panel, ``job.logs``, ``job.metrics()``, the hang detector and MLflow read
    them as a local job's."""

    def __init__(self, rd: RunDir, world_size: int) -> None:
        self.rd = rd
        self.offsets = [0] * world_size
        self.metric_offsets = [(0, 0)] * world_size  # (metrics file, name table) of each rank, copied so far

    def pull(self, actors: list) -> None:
        """Copy what each rank added since the last pull: its log, then its metrics."""
        ray = ray_module()
        refs = [a.read_log.remote(r, self.offsets[r]) for r, a in enumerate(actors)]
        for rank, ref in enumerate(refs):
            try:
                chunk = ray.get(ref, timeout=PULL_WAIT_S)
            except Exception:  # noqa: BLE001 - a dead actor has no more log to give
                continue
            if chunk:
                with open(self.rd.log_file(rank), "ab") as f:
                    f.write(chunk)
                self.offsets[rank] += len(chunk)
        self._pull_metrics(actors)

    def _pull_metrics(self, actors: list) -> None:
        """Each rank's new metric points and names (the names first, so the kernel's reader knows every record it
        reads)."""
        from sgpu_magic._util.metrics import append, names_file

        ray = ray_module()
        refs = [a.read_metrics.remote(r, *self.metric_offsets[r]) for r, a in enumerate(actors)]
        for rank, ref in enumerate(refs):
            try:
                records, names = ray.get(ref, timeout=PULL_WAIT_S)
            except Exception:  # noqa: BLE001 - a dead actor has no more points to give
                continue
            path = self.rd.metrics_file(rank)
            if names:
                append(names_file(path), names)
            if records:
                append(path, records)
            offset, names_offset = self.metric_offsets[rank]
            self.metric_offsets[rank] = (offset + len(records), names_offset + len(names))


class NodeUsage:
    """Each rank's CPU, memory and GPU figures, asked of its agent (``RankAgent.usage``, sampled on its node) about
    once a second without blocking the supervisor's loop: what has come is taken on a later :meth:`poll`; an agent
    that has not answered within :data:`USAGE_ASK_GIVE_UP_S` is asked again (its rank's last figures stay)."""

    def __init__(self) -> None:
        self.asked: dict[Any, int] = {}  # {usage call: rank} asked of the agents and not answered yet
        self.asked_at = 0.0
        self.usage: dict[int, RankUsage] = {}  # each rank's last figures

    def poll(self, actors: list) -> dict[int, RankUsage] | None:
        """Take the answers that have come and ask again when it is time; every rank's figures once each agent asked
        has answered, else ``None`` (nothing new to write)."""
        ray, now, answered = ray_module(), time.monotonic(), None
        if self.asked:
            ready, _ = ray.wait(list(self.asked), num_returns=len(self.asked), timeout=0)
            for ref in ready:
                rank = self.asked.pop(ref)
                try:
                    figures = ray.get(ref)
                except Exception:  # noqa: BLE001 - a dead agent: its rank's end says why; its last figures stay
                    figures = None
                if figures:
                    self.usage[rank] = RankUsage.from_dict(figures)
            if ready and not self.asked:
                answered = dict(self.usage)
            if self.asked and now - self.asked_at < USAGE_ASK_GIVE_UP_S:
                return answered
        if now - self.asked_at >= SAMPLE_INTERVAL_S:
            self.asked_at = now
            self.asked = {agent.usage.remote(): rank for rank, agent in enumerate(actors)}
        return answered
