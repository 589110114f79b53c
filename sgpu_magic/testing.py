"""Hooks for tests and benchmarks of code that runs through sgpu_magic (sgpu_magic's own included).

What a test needs beyond the user's API: starting a decorated function's job in a view of its own choosing (a
:class:`~sgpu_magic.ui.text.TextView` writing to its own streams, a panel it then inspects) without following
it, and the pid of the ``%mlflow_ui`` server. The rest is public already: ``job.view`` (what shows a job),
``job.run_dir`` (``RunDir(job.run_dir)`` names every file in it), ``job.status``, ``job.result()``.

Example:
    ```python
    import io
    from sgpu_magic import distributed
    from sgpu_magic.testing import start_job
    from sgpu_magic.ui.text import TextView

    @distributed(gpus=2)
    def hello(name):
        print("hello", name)

    out = io.StringIO()
    job = start_job(hello, ("ranks",), view=TextView(out=out, err=out))
    job.follow()  # a blocking job: the caller follows it, as fn.distributed(...) does
    assert "hello ranks" in out.getvalue()
    ```
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgpu_magic.front.decorator import DistributedFunction
    from sgpu_magic.job.handle import Job
    from sgpu_magic.ui.text import TextView

__all__ = ["mlflow_ui_pid", "start_job", "wait_for_tracking"]


def start_job(
    fn: DistributedFunction,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    view: TextView | None = None,
    background: bool = False,
) -> Job:
    """Start ``fn(*args, **kwargs)`` on ``fn``'s ranks, shown in ``view``; return its :class:`~sgpu_magic.Job`.

    What ``fn.distributed(...)`` (``background=False``) or ``fn.submit(...)`` (``background=True``) start, with
    the same capture, tracking and lease, except that the job is shown in ``view`` (default: the panel or text
    view the configuration picks) and that a blocking job is not followed: call ``job.follow()`` (or
    ``job.wait(timeout_s)``) and then ``job.result()``. ``fn.last_job`` is left alone.

    Args:
        fn: a function decorated with :func:`sgpu_magic.distributed`.
        args: positional arguments for every rank (default: none).
        kwargs: keyword arguments for every rank (default: none).
        view: what shows the job: a ``TextView`` or a ``Panel`` (default ``None``: chosen as for any job).
        background: follow the job on a thread of its own, as ``fn.submit`` does (default ``False``).

    Raises:
        TypeError: ``fn`` is not a decorated function.
        CaptureError, ResourceError, SpecError: as ``fn.distributed`` raises them, before anything starts.
    """
    from sgpu_magic.front.decorator import DistributedFunction, function_payload, start

    if not isinstance(fn, DistributedFunction):
        raise TypeError(
            f"start_job needs a function decorated with @distributed(...), got {type(fn).__name__}; "
            f"decorate it first, e.g. start_job(distributed(gpus=2)(fn))"
        )
    call_kwargs = dict(kwargs or {})
    return start(fn.spec, lambda warn: function_payload(fn, args, call_kwargs, warn), view, background=background)


def mlflow_ui_pid() -> int | None:
    """The pid of this kernel's ``%mlflow_ui`` server's watchdog (the parent of ``mlflow server``), or ``None``
    when none runs."""
    from sgpu_magic.tracking.server import running_ui

    ui = running_ui()
    return None if ui is None else ui.pid


def wait_for_tracking(timeout_s: float | None = 120.0) -> bool:
    """Wait until every MLflow write the kernel has queued so far is done (mlflow's background import, runs made,
    parameterised and ended: :mod:`sgpu_magic.tracking.worker`); whether they were within ``timeout_s`` seconds.
    A benchmark calls it before it times a launch, so the import's CPU is not in the measurement."""
    from sgpu_magic.tracking.worker import worker

    return worker().flush(timeout_s)
