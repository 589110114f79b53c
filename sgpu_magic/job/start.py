"""The shared start pipeline of every front door: check the machine, capture, warn, lease GPUs, start the ranks.

Everything that can be refused is refused before any process starts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, cast

from sgpu_magic.job.follow import JobSink, MemoryFeed, view_of
from sgpu_magic.job.handle import Job
from sgpu_magic.launch import launcher_for
from sgpu_magic.launch.base import Launcher
from sgpu_magic.launch.leases import LeaseRegistry
from sgpu_magic.launch.resources import DevicePlan
from sgpu_magic.launch.stacks import CodeMap
from sgpu_magic.rundir import RunDir
from sgpu_magic.spec import LaunchSpec
from sgpu_magic.wire.payload import Payload


class _View(Protocol):
    """What start needs of the job's view (the last sink: ``ui.text.TextView`` or the panel): notes and warnings."""

    def note(self, text: str) -> None: ...
    def warn(self, text: str) -> None: ...


def start(
    spec: LaunchSpec,
    build_payload: Callable[[Callable[[str], None]], Payload],
    sinks: list[JobSink],
    background: bool = False,
    lease_dir: str | None = None,
    before_launch: Callable[[RunDir], None] | None = None,
) -> Job:
    """Plan the devices (locally, or on the Ray cluster ``spec.cluster``: :func:`sgpu_magic.launch.launcher_for`), build the payload (its warnings go to
    the last sink, the view, as capture finds them), say the plan's note, then lease GPUs (in ``lease_dir``,
    default :func:`sgpu_magic.launch.leases.default_lease_dir`) and hand the job to its launcher.

    Raises :class:`~sgpu_magic.errors.SpecError` / :class:`~sgpu_magic.errors.ResourceError` before any process
    starts. A background job is followed by its own thread; for a blocking one the caller runs ``job.follow()``.
    ``before_launch(run_dir)`` runs once the run directory holds the payload, before the job is handed over (a
    session makes its channel there).
    """
    view = cast(_View, view_of(sinks))  # the panel or the text view (front.decorator._sinks)
    plan, host_factory = launcher_for(spec, view.note)
    payload = build_payload(view.warn)  # warnings are shown as capture finds them
    if payload.argv is None:
        payload.argv = [spec.name]  # the ranks' sys.argv: a cell or function, for its parse_args() defaults
    if spec.profile_steps is not None:
        payload.profile_steps = spec.profile_steps  # each rank's torch.profiler (rank/profile.py)
    _say_note(view, plan, spec)
    registry = LeaseRegistry(lease_dir) if plan.needs_lease else None
    return submit(
        spec, plan, payload, host_factory, sinks, background=background, registry=registry, before_launch=before_launch
    )


_NO_GPU_SAID = threading.Event()
"""Set once this kernel has said that the machine has no GPU; later jobs say it in their panel header."""


def _say_note(view: _View, plan: DevicePlan, spec: LaunchSpec) -> None:
    """The plan's note for the user; ``no GPU found; running N CPU rank(s) with gloo`` once per kernel
    (again for a job whose ``gpu_type`` it ignores)."""
    if not plan.note:
        return
    if plan.no_gpu and not spec.gpu_type:
        if _NO_GPU_SAID.is_set():
            return
        _NO_GPU_SAID.set()
    view.note(plan.note)


def submit(
    spec: LaunchSpec,
    plan: DevicePlan,
    payload: Payload,
    get_host: Callable[[], Launcher],
    sinks: Sequence[JobSink] = (),
    root: Path | None = None,
    background: bool = False,
    registry: LeaseRegistry | None = None,
    before_launch: Callable[[RunDir], None] | None = None,
    ranks: Sequence[int] | None = None,
    lean: bool = False,
    listed: bool = True,
    reserve_of: Path | None = None,
    feed: MemoryFeed | None = None,
) -> Job:
    """Write the payload into a new RunDir, lease GPUs, and hand it to the launch host.

    The first try for the GPUs happens in the calling thread, so ``wait=False`` refusals raise
    here. A background job is then launched and followed by a daemon thread (its launch errors
    are the job's error); for a blocking one the launch happens here and the caller runs
    :meth:`Job.follow` (which waits in the GPU queue if needed; an interrupt cancels
    the job).

    ``get_host`` returns the kernel's launch host; if the host turns out to be gone, a fresh
    one is asked once more, so a dead host never fails a launch. ``before_launch``: see :func:`start`;
    ``ranks``: the ranks that run it (a session cell on some of the session's ranks), default all; ``lean``: a
    session cell's run directory, ``reserve_of`` the session's (see :meth:`RunDir.create`); ``listed``:
    whether the job is one of the kernel's jobs (:func:`~sgpu_magic.job.registry.jobs`; a session's cell is not: its
    session lists it);
    ``feed``: where the job's status comes from when its launcher keeps it in this process (a session cell), else
    its ``status.json`` (no ``launch.json`` is written for such a job: its ranks run already).
    """
    rd = RunDir.create(root, lean=lean, reserve_of=reserve_of)
    rd.write_payload(payload)
    CodeMap.from_payload(payload).write(rd.code_map_file)  # stacks read frames as the notebook names them
    if before_launch is not None:
        before_launch(rd)
    if plan.needs_lease and registry is None:
        registry = LeaseRegistry()
    job = Job(rd, spec, plan, get_host, sinks, registry, ranks, listed, feed=feed)
    job.start(background)
    return job
