"""The kernel-side :class:`Job` handle: state, log following, results, cancel.

A job is followed through its RunDir: the host's ``status.json``, each rank's log file
(read by byte offset) and the ranks' result and error files.
"""

from __future__ import annotations

import codecs
import enum
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .errors import JobCancelledError, JobTimeoutError, LauncherError, RankFailedError, RankFailure, SgpuError
from .launcher import LaunchHost
from .resources import DevicePlan
from .rundir import RunDir, atomic_write_bytes, atomic_write_json, read_json
from .spec import LaunchSpec

POLL_INTERVAL_S = 0.05
CANCEL_WAIT_S = 15.0


class JobState(enum.Enum):
    """Life cycle of a job. Final states: SUCCEEDED, FAILED, CANCELLED, TIMED_OUT."""

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def final(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.TIMED_OUT)


def _to_state(status: dict) -> JobState:
    """The host writes JobState values, plus ``interrupted`` (a cancel caused by a kernel interrupt)."""
    raw = status.get("state", "pending")
    return JobState.CANCELLED if raw == "interrupted" else JobState(raw)


class LogFollower:
    """Follows one rank's log file by byte offset and returns the new text (UTF-8 decoded incrementally)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def read(self, final: bool = False) -> str:
        """Text written since the last call; with ``final`` also a trailing incomplete character."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        self.offset += len(chunk)
        return self._decoder.decode(chunk, final=final)


class JobSink:
    """Receives one job's events; subclass and override what you need.

    The panel, the text view and MLflow tracking are sinks. Events come from the thread that
    follows the job (the waiting thread for a blocking call); ``prepare`` runs before the
    ranks start.
    """

    def prepare(self, job_id: str, spec: LaunchSpec, plan: DevicePlan) -> dict:
        """Before launch: return ``{"env": {...}}`` for the ranks and other launch.json entries."""
        return {}

    def started(self, job: "Job") -> None:
        """The job was handed to the launch host."""

    def output(self, rank: int, text: str) -> None:
        """New text from rank ``rank``'s log (stdout and stderr in order; may end mid-line)."""

    def state_changed(self, job: "Job", state: "JobState") -> None:
        """The job moved to ``state``."""

    def tick(self, job: "Job") -> None:
        """Called on every poll of the job (about 20 times a second): flush what is buffered."""

    def finished(self, job: "Job") -> None:
        """The job reached a final state; every line of its logs was delivered before this."""

    def launch_failed(self, job_id: str, error: BaseException) -> None:
        """The launch failed after ``prepare`` (no ``started`` or ``finished`` follows): release what
        ``prepare`` set up."""


class Job:
    """A running or finished distributed job (future-like).

    Attributes:
        job_id: unique id, also the run directory's name.
        spec: the :class:`~sgpu_magic.spec.LaunchSpec` it was started with.
        plan: where its ranks run (:class:`~sgpu_magic.resources.DevicePlan`).
        run_dir: path of its run directory (logs stay there after the job).
        mlflow_run_id: the job's MLflow run, or ``None`` when it is not tracked.
        run_url: a link to that run's page (tracking server or ``%mlflow_ui``), or ``None``.
    """

    def __init__(self, run_dir: RunDir, spec: LaunchSpec, plan: DevicePlan, host: LaunchHost,
                 sinks: list[JobSink] = ()) -> None:
        self._rd = run_dir
        self.spec = spec
        self.plan = plan
        self._host = host
        self._sinks = list(sinks)
        self._last_state: JobState | None = None
        self._followers = [LogFollower(run_dir.log_file(r)) for r in range(plan.world_size)]
        self._results: list[Any] | None = None
        self._error: BaseException | None = None
        self._final_status: dict | None = None
        self.submitted_s = time.time()
        self.mlflow_run_id: str | None = None
        self.run_url: str | None = None

    job_id = property(lambda self: self._rd.job_id)
    run_dir = property(lambda self: self._rd.path)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def rank_exitcodes(self) -> dict[int, int | None]:
        """Exit code of each rank once the job ended (negative: killed by that signal); ``{}`` before."""
        return {int(k): v for k, v in (self._status().get("exitcodes") or {}).items()}

    @property
    def elapsed_s(self) -> float | None:
        """Seconds from the ranks' start to the job's end (or to now while it runs); ``None`` before start."""
        status = self._status()
        if "started_s" not in status:
            return None
        return status.get("ended_s", time.time()) - status["started_s"]

    @property
    def log_paths(self) -> list[Path]:
        """One log file per rank, in rank order."""
        return [self._rd.log_file(r) for r in range(self.world_size)]

    def logs(self, rank: int) -> str:
        """Everything rank ``rank`` wrote to stdout and stderr so far."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is not in this job (world_size={self.world_size})")
        path = self._rd.log_file(rank)
        return path.read_text(errors="replace") if path.exists() else ""

    def _status(self) -> dict:
        return self._final_status or read_json(self._rd.status_file) or {"state": "pending"}

    @property
    def state(self) -> JobState:
        """The current :class:`JobState`."""
        return _to_state(self._status())

    def done(self) -> bool:
        return self.state.final

    def _emit(self, event: str, *args: Any) -> None:
        for sink in self._sinks:
            getattr(sink, event)(*args)

    def _pump(self, final: bool = False) -> None:
        for rank, follower in enumerate(self._followers):
            text = follower.read(final)
            if text:
                self._emit("output", rank, text)

    def _poll_once(self) -> bool:
        if self._final_status is not None:
            return True
        self._pump()
        status = read_json(self._rd.status_file) or {}
        state = _to_state(status)
        if state.final:
            self._pump(final=True)
            self._final_status = status
        if state is not self._last_state:
            self._last_state = state
            self._emit("state_changed", self, state)
        if state.final:
            self._emit("finished", self)
            return True
        self._emit("tick", self)
        if not self._host.alive():
            message = (f"the launch host died while job {self.job_id} ran; see {self._host.log_path} "
                       f"and the rank logs in {self._rd.path / 'logs'}")
            self._pump(final=True)
            self._final_status = {**status, "state": "failed", "host_lost": message, "ended_s": time.time()}
            self._last_state = JobState.FAILED
            self._emit("state_changed", self, JobState.FAILED)
            self._emit("finished", self)
            raise LauncherError(message)
        return False

    def wait(self, timeout_s: float | None = None) -> JobState:
        """Block until the job ends (or ``timeout_s`` seconds pass); stream its logs meanwhile.

        Interrupting (KeyboardInterrupt) cancels the job, waits for its ranks to stop, and raises
        :class:`~sgpu_magic.errors.JobCancelledError` (a KeyboardInterrupt) naming the job and its logs.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while not self._poll_once():
                if deadline is not None and time.monotonic() > deadline:
                    break
                time.sleep(POLL_INTERVAL_S)
        except KeyboardInterrupt:
            self.cancel(_reason="interrupted")
            raise JobCancelledError(f"job {self.job_id} was interrupted; every rank was stopped. "
                                    f"Logs: {self._rd.path / 'logs'}") from None
        return self.state

    def request_cancel(self, _reason: str = "cancelled") -> None:
        """Ask the launch host to stop every rank, without waiting. Safe from any thread (a Stop button)."""
        if self._final_status is None:
            try:
                self._host.cancel(self._rd, _reason)
            except LauncherError:
                pass

    def cancel(self, _reason: str = "cancelled") -> None:
        """Stop every rank (SIGTERM, then SIGKILL) and wait until they are gone; state becomes CANCELLED."""
        if self.done():
            return
        self.request_cancel(_reason)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while not self._poll_once() and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)

    def exception(self) -> BaseException | None:
        """Wait for the job; return its error (``None`` on success)."""
        self.wait()
        if self._error is None and self.state is not JobState.SUCCEEDED:
            self._error = self._build_error()
        return self._error

    def result(self) -> list[Any]:
        """Wait for the job; return one value per rank, in rank order (tensors on CPU).

        Raises:
            RankFailedError: a rank failed; shows the root-cause rank's traceback and log path.
            JobTimeoutError: the job ran past its timeout.
            JobCancelledError: (a KeyboardInterrupt) the job was interrupted or cancelled.
        """
        error = self.exception()
        if error is not None:
            raise error
        if self._results is None:
            self._results = [self._load_result(r) for r in range(self.world_size)]
        return self._results

    @property
    def results(self) -> list[Any] | None:
        """Per-rank values once the job succeeded, else ``None``."""
        if self.state is JobState.SUCCEEDED:
            return self.result()
        return None

    def _load_result(self, rank: int) -> Any:
        path = self._rd.result_file(rank)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise SgpuError(f"rank {rank} exited 0 but left no result; see {self._rd.log_file(rank)}") from None
        try:
            return pickle.loads(data)
        except Exception as exc:
            raise SgpuError(f"the result of rank {rank} cannot be unpickled in the kernel "
                            f"({type(exc).__name__}: {exc}); return plain Python, numpy or torch values") from exc

    def _build_error(self) -> BaseException:
        status = self._status()
        state = self.state
        if state is JobState.TIMED_OUT:
            return JobTimeoutError(f"job {self.job_id} ran longer than its timeout of {self.spec.timeout_s:g} s; "
                                   f"every rank was stopped. Logs: {self._rd.path / 'logs'}")
        if state is JobState.CANCELLED:
            how = "interrupted" if status.get("state") == "interrupted" else "cancelled"
            return JobCancelledError(f"job {self.job_id} was {how}; every rank was stopped. "
                                     f"Logs: {self._rd.path / 'logs'}")
        if status.get("host_lost"):
            return LauncherError(status["host_lost"])
        if status.get("launch_error"):
            return LauncherError(f"job {self.job_id} could not start: {status['launch_error']}")
        return failure_from_status(self._rd, status, self.world_size)

    def __repr__(self) -> str:
        return f"<Job {self.job_id} {self.state.value} world_size={self.world_size} run_dir={str(self.run_dir)!r}>"


def failure_from_status(rd: RunDir, status: dict, world_size: int) -> RankFailedError:
    """Build the :class:`RankFailedError` for a failed job: the earliest failure is the root cause."""
    exitcodes = {int(k): v for k, v in (status.get("exitcodes") or {}).items()}
    observed = {f["rank"]: f for f in status.get("failures", [])}
    failures = []
    for rank in range(world_size):
        err = read_json(rd.error_file(rank))
        if rank not in observed and err is None:
            continue
        seen = observed.get(rank, {})
        failures.append(RankFailure(
            rank=rank, exitcode=seen.get("exitcode", exitcodes.get(rank)),
            exc_type=err and err["exc_type"], message=(err or {}).get("message", ""),
            traceback=(err or {}).get("traceback", ""), log_path=str(rd.log_file(rank)),
            time_s=err["time_s"] if err else seen.get("time_s", float("inf"))))
    if not failures:
        failures.append(RankFailure(rank=0, exitcode=exitcodes.get(0), log_path=str(rd.log_file(0))))
    failures.sort(key=lambda f: (f.time_s, f.rank))
    failed = {f.rank for f in failures}
    stopped = [r for r in range(world_size) if r not in failed and not rd.result_file(r).exists()]
    return RankFailedError(failures[0], failures[1:], stopped, str(rd.path))


def submit(spec: LaunchSpec, plan: DevicePlan, payload: dict, get_host: Callable[[], LaunchHost],
           sinks: list[JobSink] = (), root: Path | None = None) -> Job:
    """Write the payload into a new RunDir and hand it to the launch host; return the :class:`Job` at once.

    ``get_host`` returns the kernel's launch host; if the host turns out to be gone, a fresh
    one is asked once more, so a dead host never fails a launch.
    """
    rd = RunDir.create(root)
    atomic_write_bytes(rd.payload_file, pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
    launch = {"job_id": rd.job_id, "name": spec.name, "world_size": plan.world_size, "backend": plan.backend,
              "cuda_visible_devices": plan.cuda_visible_devices, "timeout_s": spec.timeout_s, "port": spec.port,
              "cwd": os.getcwd(), "sys_path": list(sys.path), "env": {}}
    prepared: list[JobSink] = []
    try:
        for sink in sinks:
            extra = sink.prepare(rd.job_id, spec, plan)
            prepared.append(sink)
            launch["env"].update(extra.pop("env", {}))
            launch.update(extra)
        atomic_write_json(rd.launch_file, launch)
        for rank in range(plan.world_size):
            rd.log_file(rank).touch(mode=0o600)
        host = get_host()
        try:
            host.launch(rd)
        except LauncherError:
            host = get_host()
            host.launch(rd)
    except BaseException as exc:
        for sink in prepared:
            sink.launch_failed(rd.job_id, exc)
        raise
    job = Job(rd, spec, plan, host, sinks)
    job._emit("started", job)
    return job
