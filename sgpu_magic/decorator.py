"""The ``@distributed`` decorator, call-compatible with the serverless GPU API.

Example::

    from sgpu_magic import distributed

    @distributed(gpus=2)
    def train(num_epochs: int) -> float:
        ...

    results = train.distributed(num_epochs=3)   # one value per rank, in rank order
    job = train.submit(num_epochs=3)            # returns a Job at once; job.result() later
    train(1)                                    # still a plain local call
"""

from __future__ import annotations

import difflib
import functools
import inspect
from dataclasses import replace
from typing import Any, Callable

from . import capture
from .job import Job, JobSink, submit
from .launcher import get_host
from .leases import LeaseRegistry
from .panel import DEFAULT_MAX_LINES, TextView, make_view
from .resources import check_port_free, plan_devices
from .spec import DEFAULT_TEARDOWN_GRACE_S, DEFAULT_TIMEOUT_S, LaunchSpec, check_max_capture_bytes, make_spec, shown
from .errors import SpecError


def _sinks(spec: LaunchSpec, view: JobSink | None) -> list[JobSink]:
    """Who follows the job: MLflow tracking first (it names the run the view links to), then the view."""
    sinks: list[JobSink] = []
    if spec.mlflow:
        from .tracking import DEFAULT_EXPERIMENT, MlflowTracking

        sinks.append(MlflowTracking(default_experiment=_resolve(_FromConfig("mlflow_experiment", DEFAULT_EXPERIMENT)),
                                    ui=_resolve(_FromConfig("mlflow_ui", False))))
    sinks.append(view or make_view(spec.widgets, _resolve(_FromConfig("max_log_lines", DEFAULT_MAX_LINES))))
    return sinks


def start(spec: LaunchSpec, build_payload: Callable[[Callable[[str], None]], dict], view: TextView | None = None,
          background: bool = False) -> Job:
    """Shared by both front doors: check the machine, capture, warn, then lease GPUs and start the ranks.

    Everything that can be refused is refused before any process starts. A background job is
    followed by its own thread; for a blocking one the caller runs ``job._follow_blocking()``.
    """
    sinks = _sinks(spec, view)
    view = sinks[-1]
    if spec.cluster is not None:  # Ray places the ranks: no local GPUs, no leases, no local port
        from .ray_cluster import RayLauncher, is_connected, plan_on_cluster

        if not is_connected():
            view.note(f"sgpu_magic: connecting to the Ray cluster {spec.cluster} ...")
        plan = plan_on_cluster(spec)
        launcher = RayLauncher(spec.cluster, spec.gpu_type)
        host_factory: Callable = lambda: launcher  # noqa: E731
    else:
        plan = plan_devices(spec)
        if spec.port is not None:
            check_port_free(spec.port)
        host_factory = get_host
    payload = build_payload(view.warn)  # warnings are shown as capture finds them
    payload["display_names"] = _cell_labels(payload.get("sources", {}))
    payload.setdefault("argv", [spec.name])  # the ranks' sys.argv: a script run without arguments
    if plan.note:
        view.note(plan.note)
    registry = LeaseRegistry(_resolve(_FromConfig("lease_dir", "")) or None) if plan.needs_lease else None
    return submit(spec, plan, payload, host_factory, sinks, background=background, registry=registry)


def _cell_labels(filenames) -> dict[str, str]:
    """``{cell file name: "Cell In[3]"}``, as IPython labels cells in its own tracebacks."""
    try:
        from IPython import get_ipython
    except ImportError:
        return {}
    shell = get_ipython()
    compiler = getattr(shell, "compile", None)
    if compiler is None or not hasattr(compiler, "format_code_name"):
        return {}
    labels = {}
    for filename in filenames:
        label = compiler.format_code_name(filename)
        if label:
            labels[filename] = " ".join(label)
    return labels


class DistributedFunction:
    """A function that runs once per rank through :meth:`distributed`; calling it runs it locally.

    Attributes:
        spec: the :class:`~sgpu_magic.spec.LaunchSpec` from the decorator.
        last_job: the :class:`~sgpu_magic.job.Job` of the latest ``.distributed`` call, or ``None``.
    """

    def __init__(self, fn: Callable, spec: LaunchSpec, max_capture_bytes: int) -> None:
        functools.update_wrapper(self, fn)
        self.__sgpu_function__ = fn
        self.spec = spec
        self.max_capture_bytes = max_capture_bytes
        self.last_job: Job | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__sgpu_function__(*args, **kwargs)

    def _payload(self, args: tuple, kwargs: dict, warn: Callable[[str], None] | None = None) -> dict:
        call = f"{self.__sgpu_function__.__name__}.distributed"
        args_bytes, kwargs_bytes = capture.capture_arguments(call, args, kwargs)
        payload = capture.capture_function(self.__sgpu_function__, self.max_capture_bytes, warn)
        payload.update(args=args_bytes, kwargs=kwargs_bytes)
        return payload

    def distributed(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; block until all end.

        Returns:
            list of length ``gpus``: each rank's return value, in global-rank order; tensors
            come back on the CPU.

        Raises:
            CaptureError: an argument cannot be pickled (nothing is started).
            ResourceError: the GPUs asked for are not there (nothing is started).
            RankFailedError: a rank failed; the others were stopped.
            JobTimeoutError: the job ran past ``timeout``.
            JobCancelledError: (a KeyboardInterrupt) the kernel was interrupted; every rank was stopped.
        """
        self.last_job = start(self.spec, lambda warn: self._payload(args, kwargs, warn))
        self.last_job._follow_blocking()
        return self.last_job.result()

    def submit(self, *args: Any, **kwargs: Any) -> Job:
        """Start ``fn(*args, **kwargs)`` on every rank in the background; return its :class:`Job` at once.

        The cell ends and the kernel stays free; the job's panel (or ``[rank N]`` lines) keeps
        updating in the cell that submitted it. Interrupting the kernel does not touch the job:
        ``job.cancel()``, the panel's Stop button, ``%distributed_stop`` or the kernel's end stop it.
        ``job.result()`` waits and returns one value per rank (or raises the job's error).

        Raises (before anything starts):
            CaptureError, ResourceError (also: the GPUs are leased and ``wait=False``), SpecError.
        """
        self.last_job = start(self.spec, lambda warn: self._payload(args, kwargs, warn), background=True)
        return self.last_job

    def __repr__(self) -> str:
        return f"<distributed function {self.__qualname__} gpus={self.spec.gpus}>"


class _FromConfig:
    """Default that follows ``%config DistributedMagics.<trait>`` when the extension is loaded."""

    def __init__(self, trait: str, fallback: Any) -> None:
        self.trait, self.fallback = trait, fallback

    def resolve(self) -> Any:
        try:
            from IPython import get_ipython
        except ImportError:
            return self.fallback
        shell = get_ipython()
        magics = shell.magics_manager.registry.get("DistributedMagics") if shell is not None else None
        return getattr(magics, self.trait) if magics is not None else self.fallback

    def __repr__(self) -> str:
        return repr(self.fallback)


def _resolve(value: Any) -> Any:
    return value.resolve() if isinstance(value, _FromConfig) else value


class _Required:
    """Default of ``gpus``: lets ``@distributed(gpu=2)`` reach the unknown-argument message."""

    def __repr__(self) -> str:
        return "<required>"


_REQUIRED: Any = _Required()


def distributed(gpus: int = _REQUIRED, gpu_type: str | None = None,
                timeout: float | None = _FromConfig("timeout_s", DEFAULT_TIMEOUT_S), *, port: int | None = None,
                widgets: bool | None = _FromConfig("widgets", None),
                max_capture_bytes: int = _FromConfig("max_capture_bytes", capture.DEFAULT_MAX_BYTES),
                mlflow: bool = _FromConfig("mlflow", True), gpu_ids: list[int] | None = None, wait: bool = True,
                max_restarts: int = 0, cluster: str | None = None,
                teardown_grace_s: float = _FromConfig("teardown_grace_s", DEFAULT_TEARDOWN_GRACE_S),
                **unknown: Any) -> Callable[[Callable], DistributedFunction]:
    """Decorate a function so ``fn.distributed(...)`` runs it on ``gpus`` ranks.

    Follows the serverless GPU API's ``@distributed(gpus, gpu_type, remote=False)`` shape.

    Args:
        gpus: number of ranks, one GPU each; on a machine with no GPU, CPU ranks with gloo.
        gpu_type: GPU model to require, e.g. ``"H100"`` (case-insensitive substring of the
            device name); ``None`` (default) takes any. Ignored, with a note, on a machine without GPUs.
        timeout: seconds before every rank is stopped and ``TimeoutError`` raised; default
            10800 (3 h), or ``%config DistributedMagics.timeout_s`` when set; ``None`` for no limit.
        port: MASTER_PORT for the ranks' rendezvous; default picks a free port.
        widgets: the ipywidgets panel (True) or plain ``[rank N]`` text (False); default: the
            panel in a Jupyter kernel (``%config DistributedMagics.widgets``, ``SGPU_MAGIC_WIDGETS``).
        max_capture_bytes: captured globals above this size get a warning (default 100 MiB, or
            ``%config DistributedMagics.max_capture_bytes``).
        mlflow: track each call as one MLflow run (default True, or ``%config DistributedMagics.mlflow``);
            ranks log into it with plain ``mlflow.log_metric(...)``. ``False`` turns tracking off.
        gpu_ids: physical GPU indices (NVML order) to run on, one per rank, e.g. ``[0, 1]``; default
            any free GPUs. GPUs running processes outside sgpu_magic are skipped unless named here.
        wait: when other sgpu_magic jobs (from any kernel sharing the lease directory) hold the
            GPUs, queue for them in arrival order (True, default; the job is ``pending`` meanwhile)
            or raise ``ResourceError`` at once naming the holders (False).
        max_restarts: when a rank fails, stop the others and start all ranks again, up to this many
            times (torchrun's ``--max-restarts``; default 0). Each attempt appends to the same rank logs
            after a ``[sgpu_magic] attempt K of N`` line; ranks read ``TORCHELASTIC_RESTART_COUNT`` (0 on the
            first attempt) and resume from their own checkpoint. The timeout covers all attempts.
        cluster: run on a Ray cluster instead of this machine: ``"auto"`` (a running local cluster, or an
            already initialised Ray), ``"ray://host:10001"`` (Ray client) or ``"host:6379"``; default ``None``.
            The job reserves one placement group of ``gpus`` GPU bundles (CPU bundles when the cluster
            has no GPU) and runs one actor per rank (see :mod:`sgpu_magic.ray_cluster`); needs
            ``pip install "sgpu_magic[ray]"``. Not with ``gpu_ids`` or ``max_restarts``.
        teardown_grace_s: seconds a rank may take to exit after it has returned (or raised): destructors of the
            function's locals, ``atexit`` handlers, stream flushes. A rank still running then is ended (SIGTERM,
            then SIGKILL) and the call still returns the values, with a note naming the rank. Default 10, or
            ``%config DistributedMagics.teardown_grace_s``; >= 0.

    Raises (at decoration time, before anything starts):
        SpecError: invalid ``gpus``, ``gpu_type``, ``timeout``, ``port``, ``widgets``, ``max_capture_bytes``,
            ``mlflow``, ``gpu_ids``, ``wait``, ``max_restarts`` or ``teardown_grace_s`` (``widgets``, ``mlflow``
            and ``wait`` take ``True`` / ``False``, not strings); or a decorated object that cannot run on the ranks (not
            callable, a bound method, a generator or ``async def`` function, a partial or callable instance).
        TypeError: an argument this signature does not have (e.g. ``gpu=2``), naming it and the accepted ones.
    """
    if unknown:
        raise TypeError(_unknown_arguments_message(unknown))
    if gpus is _REQUIRED:
        raise TypeError("@distributed needs gpus, the number of ranks (one GPU each): write @distributed(gpus=N)")
    if callable(gpus):
        raise SpecError("@distributed needs the number of GPUs: write @distributed(gpus=N)")
    timeout, max_capture_bytes, widgets = _resolve(timeout), _resolve(max_capture_bytes), _resolve(widgets)
    mlflow, teardown_grace_s = _resolve(mlflow), _resolve(teardown_grace_s)
    # fail at the decorator line
    spec = make_spec(gpus, gpu_type, timeout, port, widgets=widgets, mlflow=mlflow, gpu_ids=gpu_ids, wait=wait,
                     max_restarts=max_restarts, cluster=cluster, teardown_grace_s=teardown_grace_s)
    max_capture_bytes = check_max_capture_bytes(max_capture_bytes)

    def wrap(fn: Callable) -> DistributedFunction:
        problem = capture.function_problem(fn)
        if problem is not None:
            raise SpecError(f"@distributed(...) decorates a function: {problem}")
        return DistributedFunction(fn, replace(spec, name=getattr(fn, "__qualname__", "function")), max_capture_bytes)

    return wrap


def _unknown_arguments_message(unknown: dict[str, Any]) -> str:
    """``@distributed`` got ``gpu=2``: name it, suggest the near miss, list what is accepted."""
    accepted = [name for name in inspect.signature(distributed).parameters if name != "unknown"]
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, accepted, n=1)
        parts.append(shown(name) + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (f"@distributed got unknown argument(s) {', '.join(parts)}; it takes {', '.join(accepted)} "
            f"(see help(distributed))")
