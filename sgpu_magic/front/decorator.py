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
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from sgpu_magic import capture
from sgpu_magic.errors import SpecError
from sgpu_magic.front.spec_options import (  # re-exported: used by the magics, run_script and Session
    FromConfig,
    config_default,
    job_spec,
    resolve_config,
)
from sgpu_magic.job.follow import JobSink
from sgpu_magic.job.handle import Job
from sgpu_magic.job.start import start as start_job
from sgpu_magic.spec import (
    DEFAULT_STUCK_AFTER_S,
    DEFAULT_TEARDOWN_GRACE_S,
    DEFAULT_TIMEOUT_S,
    LaunchSpec,
    check_max_capture_bytes,
    shown,
)
from sgpu_magic.ui.panel import make_view
from sgpu_magic.ui.terminal import DEFAULT_MAX_LINES
from sgpu_magic.ui.text import TextView
from sgpu_magic.wire.payload import Cell, Payload


def make_sinks(spec: LaunchSpec, view: JobSink | None, parent_run: JobSink | None = None) -> list[JobSink]:
    """Who follows the job: MLflow tracking first (it names the run the view links to), then the view.
    ``parent_run``: the tracking of the MLflow run to nest the job's run under (a session cell's: the session's)."""
    sinks: list[JobSink] = []
    if spec.mlflow:
        from sgpu_magic.tracking.run import DEFAULT_EXPERIMENT, MlflowTracking

        sinks.append(
            MlflowTracking(
                default_experiment=resolve_config(FromConfig("mlflow_experiment", DEFAULT_EXPERIMENT)),
                ui=resolve_config(FromConfig("mlflow_ui", False)),
                parent=parent_run if isinstance(parent_run, MlflowTracking) else None,
            )
        )
    sinks.append(view or make_view(spec.widgets, resolve_config(FromConfig("max_log_lines", DEFAULT_MAX_LINES))))
    return sinks


def start(
    spec: LaunchSpec,
    build_payload: Callable[[Callable[[str], None]], Payload],
    view: TextView | None = None,
    background: bool = False,
) -> Job:
    """The front doors' start: the job's sinks and lease directory from the configuration, cell labels as
    IPython names them, then :func:`sgpu_magic.job.start.start` (the shared pipeline).

    A background job is followed by its own thread; for a blocking one the caller runs ``job.follow()``.
    """

    def build(warn: Callable[[str], None]) -> Payload:
        payload = build_payload(warn)
        payload.display_names = _cell_labels(payload.sources)
        body = payload.body
        if isinstance(body, Cell) and body.cell_label:  # a %%distributed cell's own frames, as IPython names it
            payload.display_names[body.filename] = body.cell_label
        return payload

    return start_job(
        spec,
        build,
        make_sinks(spec, view),
        background=background,
        lease_dir=resolve_config(FromConfig("lease_dir", "")) or None,
    )


def _cell_labels(filenames: Iterable[str]) -> dict[str, str]:
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


def function_payload(
    fn: DistributedFunction, args: tuple[Any, ...], kwargs: dict[str, Any], warn: Callable[[str], None] | None = None
) -> Payload:
    """The payload of ``fn(*args, **kwargs)`` for its ranks: the function and the notebook values it reads
    (:func:`sgpu_magic.capture.capture_function`), and the pickled arguments; ``warn`` shows capture warnings.

    Raises:
        CaptureError: an argument cannot be pickled.
    """
    call = f"{fn.__sgpu_function__.__name__}.distributed"
    args_bytes, kwargs_bytes = capture.capture_arguments(call, args, kwargs)
    payload = capture.capture_function(fn.__sgpu_function__, fn.max_capture_bytes, warn, ranks=fn.spec.gpus)
    payload.args, payload.kwargs = args_bytes, kwargs_bytes
    return payload


class DistributedFunction:
    """A function that runs once per rank through :meth:`distributed`; calling it runs it locally.

    Attributes:
        spec: the :class:`~sgpu_magic.spec.LaunchSpec` from the decorator.
        last_job: the :class:`~sgpu_magic.job.handle.Job` of the latest ``.distributed`` call, or ``None``.
    """

    def __init__(self, fn: Callable[..., Any], spec: LaunchSpec, max_capture_bytes: int) -> None:
        functools.update_wrapper(self, fn)
        self.__qualname__: str  # fn's, as update_wrapper copies it (with __name__, __doc__, __wrapped__)
        self.__sgpu_function__ = fn
        self.spec = spec
        self.max_capture_bytes = max_capture_bytes
        self.last_job: Job | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__sgpu_function__(*args, **kwargs)

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
        self.last_job = start(self.spec, lambda warn: function_payload(self, args, kwargs, warn))
        self.last_job.follow()
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
        self.last_job = start(self.spec, lambda warn: function_payload(self, args, kwargs, warn), background=True)
        return self.last_job

    def __repr__(self) -> str:
        return f"<distributed function {self.__qualname__} gpus={self.spec.gpus}>"


DistributedFunction.__module__ = "sgpu_magic"  # its public home (type names in messages, pickles by reference)


def distributed(
    gpus: int | None = None,
    gpu_type: str | None = None,
    timeout: float | None = config_default("timeout_s", DEFAULT_TIMEOUT_S),
    *,
    port: int | None = None,
    widgets: bool | None = config_default("widgets", None),
    max_capture_bytes: int = config_default("max_capture_bytes", capture.DEFAULT_MAX_BYTES),
    mlflow: bool = config_default("mlflow", True),
    gpu_ids: list[int] | None = None,
    wait: bool = True,
    max_restarts: int = 0,
    cluster: str | None = None,
    teardown_grace_s: float = config_default("teardown_grace_s", DEFAULT_TEARDOWN_GRACE_S),
    stuck_after_s: float | None = config_default("stuck_after_s", DEFAULT_STUCK_AFTER_S),
    remote: bool = False,
    num_accelerators: int | None = None,
    accelerator_type: str | None = None,
    profile: int | None = None,
    detach: bool = False,
    **unknown: Any,
) -> Callable[[Callable[..., Any]], DistributedFunction]:
    """Decorate a function so ``fn.distributed(...)`` runs it on ``gpus`` ranks.

    Call-compatible with both generations of the Databricks serverless GPU API's decorator (their public
    docs: ``from serverless_gpu import distributed`` with ``@distributed(gpus=8, gpu_type='A10',
    remote=True)``, and the current ``from databricks.air import distributed`` with
    ``@distributed(num_accelerators=8, accelerator_type="GPU_8xH100")`` or ``@distributed()`` for every GPU
    of the node). A notebook written for either runs here after changing that import line; the
    options from ``timeout`` to ``cluster`` are sgpu_magic's own. Sources: the API's docs pages
    docs.databricks.com/aws/en/machine-learning/ai-runtime/distributed-training and
    .../ai-runtime/connecting/distributed-training, and pypi.org/project/databricks-sdk-air.

    Args:
        gpus: number of ranks, one GPU each; on a machine with no GPU, CPU ranks with gloo. Default: every
            GPU of this machine (of ``gpu_type`` when given), or 1 CPU rank where there is none.
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
            ranks log into it with plain ``mlflow.log_metric(...)``, asynchronously by default (MLflow's own
            async logging, flushed before each rank ends). ``False`` turns tracking off.
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
            has no GPU) and runs one actor per rank (see :mod:`sgpu_magic.launch.ray.cluster`); needs
            ``pip install "sgpu_magic[ray]"``. Not with ``gpu_ids``.
        teardown_grace_s: seconds a rank may take to exit after it has returned (or raised): destructors of the
            function's locals, ``atexit`` handlers, stream flushes. A rank still running then is ended (SIGTERM,
            then SIGKILL) and the call still returns the values, with a note naming the rank. Default 10, or
            ``%config DistributedMagics.teardown_grace_s``; >= 0.
        stuck_after_s: seconds without a log line or a metric point from any rank, while every rank runs, after
            which the job is reported possibly stuck, with each rank's stack (``job.status.stuck``, a line and the
            panel); it goes on running. Default 300, or ``%config DistributedMagics.stuck_after_s``; ``None``: never.
        remote: the serverless GPU API's switch. ``False`` (default): this machine. ``True``: the kernel's
            remote cluster, ``%config DistributedMagics.remote_cluster = "ray://head:10001"`` (else
            ``$SGPU_MAGIC_REMOTE_CLUSTER``), through the same Ray path as ``cluster=``.
        num_accelerators: the current API's (``databricks.air``) name for ``gpus``.
        accelerator_type: the current API's hardware name, ``"GPU_<n>x<model>"`` (``"GPU_8xH100"``,
            ``"GPU_1xA10"``): ``<model>`` is the ``gpu_type``, and ``<n>`` the number of ranks unless
            ``gpus`` / ``num_accelerators`` gives fewer.
        profile: profile this many steps on every rank with ``torch.profiler`` (steps as ``runtime.step()`` or
            the optimizer mark them; after one step of wait and one of warm-up); the call then shows each rank's
            time in compute, collectives, data loading and idle, and the top 10 ops, and ``fn.last_job.
            profile_trace()`` gives one merged Chrome/Perfetto trace (also an MLflow artifact). Default ``None``:
            no profiling. See ``docs/guide/performance.md``.
        detach: run the ranks under the user's run keeper instead of the kernel's launch host: the job outlives the
            kernel (a kill, a restart), and ``sgpu_magic.attach(job_id)`` / ``%distributed_attach`` in any kernel of
            the same user gives its handle back with every line so far. Default ``False``: no rank outlives the
            kernel. With ``cluster`` / ``remote=True`` the keeper supervises the Ray job (it is the Ray driver that
            owns the job's actors, so they outlive the kernel too). See ``docs/guide/detached.md``.

    Raises (at decoration time, before anything starts):
        SpecError: invalid ``gpus``, ``gpu_type``, ``timeout``, ``port``, ``widgets``, ``max_capture_bytes``,
            ``mlflow``, ``gpu_ids``, ``wait``, ``max_restarts``, ``teardown_grace_s``, ``stuck_after_s``, ``remote``,
            ``num_accelerators``, ``accelerator_type``, ``profile`` or ``detach`` (``widgets``, ``mlflow``, ``wait``,
            ``remote`` and ``detach`` take ``True`` / ``False``, not strings); an old and
            a new name that disagree (``gpus=4, num_accelerators=8``); ``remote=True`` with no remote cluster
            configured; or a decorated object that cannot run on the ranks (not callable, a bound method, a
            generator or ``async def`` function, a partial or callable instance).
        TypeError: an argument this signature does not have (e.g. ``gpu=2``), naming it and the accepted ones.
    """
    if unknown:
        raise TypeError(_unknown_arguments_message(unknown))
    if callable(gpus):
        raise SpecError("@distributed needs the number of GPUs: write @distributed(gpus=N)")
    timeout, max_capture_bytes, widgets = (
        resolve_config(timeout),
        resolve_config(max_capture_bytes),
        resolve_config(widgets),
    )
    # fail at the decorator line
    spec = job_spec(
        "function",
        gpus,
        gpu_type,
        timeout,
        port=port,
        widgets=widgets,
        mlflow=resolve_config(mlflow),
        gpu_ids=gpu_ids,
        wait=wait,
        max_restarts=max_restarts,
        cluster=cluster,
        teardown_grace_s=resolve_config(teardown_grace_s),
        stuck_after_s=resolve_config(stuck_after_s),
        remote=remote,
        num_accelerators=num_accelerators,
        accelerator_type=accelerator_type,
        profile=profile,
        detach=detach,
    )
    max_capture_bytes = check_max_capture_bytes(max_capture_bytes)

    def wrap(fn: Callable[..., Any]) -> DistributedFunction:
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
    return (
        f"@distributed got unknown argument(s) {', '.join(parts)}; it takes {', '.join(accepted)} "
        f"(see help(distributed))"
    )
