"""The :class:`Launcher` protocol: what starts a job's ranks, as the Job handle sees it.

Three launchers implement it: the kernel's client of its local launch host
(:class:`sgpu_magic.launch.client.LaunchHost`), of the user's run keeper for detached jobs
(:class:`sgpu_magic.launch.keeper.RunKeeper`) and the Ray backend
(:class:`sgpu_magic.launch.ray.launcher.RayLauncher`). Each takes a prepared run directory
(``launch.json``, ``payload.pkl``, the rank log files) and report only through it: the job's
``status.json`` (written until its final state) and each rank's log, result and error files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from sgpu_magic.rundir import RunDir
from sgpu_magic.status import HostStatus
from sgpu_magic.wire import StopReason


@runtime_checkable
class Launcher(Protocol):
    """Starts, stops and outlives the ranks of the jobs handed to it."""

    pid: int
    """The process the job's GPU lease is tied to while the ranks run (the launch host; the kernel for Ray)."""

    def launch(self, run_dir: RunDir) -> None:
        """Start the job of ``run_dir``; returns once it is handed over (the ranks start asynchronously).

        Raises:
            LauncherError: the launcher is gone (a fresh one is asked once more).
        """

    def cancel(self, run_dir: RunDir, reason: StopReason) -> None:
        """Stop every rank of the job (SIGTERM, then SIGKILL); it ends in ``reason``'s final state, with ``reason``
        as its stop reason."""

    def alive(self) -> bool:
        """Whether the launcher still runs (a job whose launcher died fails, naming :meth:`where`)."""

    def where(self) -> str:
        """Where the launcher's own diagnostics are, for error messages (a log file's path)."""

    def preparing(self) -> str | None:
        """What the launcher is still getting ready before it can start ranks (said to the user when a launch has
        waited for it a second), or ``None`` when nothing holds a launch up."""

    def stacks(self, run_dir: RunDir, status: Callable[[], HostStatus], native: bool) -> dict[int, str]:
        """Each running rank's stack of the job of ``run_dir`` (:meth:`sgpu_magic.job.handle.Job.stacks`), taken by
        py-spy where the launcher may trace the ranks; ``status`` gives the job's status now.

        Raises:
            SgpuError: the job has ended or its ranks have not started (:func:`sgpu_magic.launch.stacks.live_stacks`).
        """
