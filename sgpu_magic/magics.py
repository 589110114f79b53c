"""The ``%%distributed`` cell magic."""

from __future__ import annotations

import html

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Float, Int, Unicode

from . import capture
from .decorator import start
from .errors import SpecError
from .job import Job, jobs
from .spec import DEFAULT_TIMEOUT_S, make_spec


def _parse_timeout(text: str | None, default: float | None) -> float | None:
    if text is None:
        return default
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise UsageError(f"--timeout takes a number of seconds > 0, or 'none' for no limit; got {text!r}")
    return value


def _parse_gpu_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise UsageError(f"--gpu-ids takes GPU indices separated by commas, e.g. --gpu-ids 0,1; got {text!r}") from None


class JobTable:
    """``%distributed_jobs`` output: an HTML table in Jupyter, aligned text elsewhere."""

    COLUMNS = ("job", "state", "world size", "GPUs", "elapsed", "MLflow run")

    def __init__(self, jobs: list[Job]) -> None:
        self.rows = []
        for job in jobs:
            elapsed = job.elapsed_s
            self.rows.append((job.job_id, job.state.value, str(job.world_size),
                              ",".join(map(str, job.gpus)) or "cpu" if not job.plan.needs_lease or job.gpus else "-",
                              "-" if elapsed is None else f"{elapsed:.1f} s", job.run_url or "-"))

    def __repr__(self) -> str:
        if not self.rows:
            return "no sgpu_magic jobs in this kernel yet"
        widths = [max(len(c), *(len(r[i]) for r in self.rows)) for i, c in enumerate(self.COLUMNS)]
        lines = [self.COLUMNS, *self.rows]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines)

    def _repr_html_(self) -> str:
        if not self.rows:
            return "<i>no sgpu_magic jobs in this kernel yet</i>"
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.COLUMNS)
        body = ""
        for row in self.rows:
            *cells, url = row
            link = f'<a href="{html.escape(url)}" target="_blank">run</a>' if url != "-" else "-"
            body += "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + f"<td>{link}</td></tr>"
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


CELL_FILENAME = "<%%distributed cell>"
"""File name of the cell's code in rank tracebacks; line numbers are those of the notebook cell."""


def _aligned_source(cell: str, transformed: str) -> str:
    """Pad ``transformed`` so its line numbers match the notebook cell, whose line 1 is ``%%distributed``.

    IPython's transforms drop the cell's leading blank lines; they are put back here.
    """
    lines = cell.splitlines()
    leading = next((i for i, line in enumerate(lines) if line.strip()), len(lines))
    return "\n" * (1 + leading) + transformed


@magics_class
class DistributedMagics(Magics):
    """Run a cell on N ranks. Defaults can be set with ``%config DistributedMagics.<name> = ...``."""

    timeout_s = Float(DEFAULT_TIMEOUT_S, allow_none=True,
                      help="Default job timeout in seconds when --timeout is not given; None = no limit.").tag(config=True)
    max_capture_bytes = Int(capture.DEFAULT_MAX_BYTES,
                            help="Captured globals larger than this many bytes get a warning before launch.").tag(config=True)
    max_log_lines = Int(2000, help="Lines each rank's log view in the panel keeps; earlier ones stay in the "
                                   "log file.").tag(config=True)
    widgets = Bool(None, allow_none=True,
                   help="Show the ipywidgets panel (True), plain [rank N] text (False), or decide (None: the panel "
                        "in a Jupyter kernel, unless SGPU_MAGIC_WIDGETS=0).").tag(config=True)
    mlflow = Bool(True, help="Track each job as one MLflow run (--no-mlflow / mlflow=False turn it off for one job)."
                  ).tag(config=True)
    mlflow_ui = Bool(False, help="Start the local MLflow UI server (as %mlflow_ui does) with the first tracked job, "
                                 "so run links work.").tag(config=True)
    lease_dir = Unicode("", help="Directory of the GPU lease registry shared by the kernels that must not share "
                        "GPUs (default: $SGPU_MAGIC_LEASE_DIR, else <sgpu_magic home>/leases).").tag(config=True)
    mlflow_experiment = Unicode("sgpu_magic", help="MLflow experiment for jobs when neither mlflow.set_experiment, "
                                "MLFLOW_EXPERIMENT_NAME/ID nor a notebook name gives one.").tag(config=True)

    @magic_arguments()
    @argument("--gpus", type=int, required=True, help="Number of ranks, one GPU each (CPU ranks with gloo when the machine has no GPU).")
    @argument("--gpu-type", default=None, help="GPU model to require, e.g. H100 (case-insensitive match of the device name).")
    @argument("--timeout", default=None, help="Seconds before every rank is stopped, or 'none'. Default: DistributedMagics.timeout_s (3 h).")
    @argument("--port", type=int, default=None, help="MASTER_PORT for the rendezvous; default: a free port.")
    @argument("--no-widgets", action="store_true", help="Plain [rank N] text instead of the widget panel.")
    @argument("--no-mlflow", action="store_true", help="Do not track this job as an MLflow run.")
    @argument("--gpu-ids", default=None, metavar="I,J", help="Physical GPU indices to run on, one per rank, e.g. 0,1.")
    @argument("--background", action="store_true", help="Return the Job at once; the cell ends and the job's "
              "output keeps coming here. Interrupting the kernel does not stop it (%%distributed_stop does).")
    @argument("--no-wait", action="store_true", help="Fail at once, naming who holds them, when the GPUs are "
              "leased by other jobs (default: wait in the queue).")
    @argument("--max-restarts", type=int, default=0, metavar="N", help="Restart all ranks up to N times after a "
              "rank fails (torchrun's --max-restarts; ranks read TORCHELASTIC_RESTART_COUNT). Default 0.")
    @argument("-o", "--output", default=None, metavar="NAME", help="Store the Job handle (per-rank results, log paths) in this variable.")
    @cell_magic
    def distributed(self, line: str, cell: str):
        """Run the cell on every rank; its last expression's value on rank 0 is the output.

        The names the cell reads from the notebook are captured: functions, classes and
        values by value, modules by reference. Each rank gets torchrun's environment
        (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...). Output streams
        live, prefixed [rank N]; a failed rank raises its traceback here.
        """
        args = parse_argstring(self.distributed, line)
        try:
            spec = make_spec(args.gpus, args.gpu_type, _parse_timeout(args.timeout, self.timeout_s), args.port,
                             name="%%distributed cell", widgets=False if args.no_widgets else self.widgets,
                             mlflow=self.mlflow and not args.no_mlflow, gpu_ids=_parse_gpu_ids(args.gpu_ids),
                             wait=not args.no_wait, max_restarts=args.max_restarts)
        except SpecError as exc:
            raise UsageError(str(exc)) from None
        source = _aligned_source(cell, self.shell.transform_cell(cell))
        filename = CELL_FILENAME

        def payload(warn) -> dict:
            part = capture.capture_cell(source, self.shell.user_ns, self.max_capture_bytes, warn)
            part["filename"] = filename
            return part

        compile(source, filename, "exec")  # a SyntaxError stops here, before anything starts
        job = start(spec, payload, background=args.background)
        if args.output:
            self.shell.user_ns[args.output] = job
        if args.background:
            return job
        job._follow_blocking()
        return job.result()[0]

    @line_magic
    def distributed_jobs(self, line: str) -> "JobTable":
        """Show this kernel's jobs: id, state, world size, GPUs, elapsed time, MLflow run link."""
        if line.strip():
            raise UsageError(f"%distributed_jobs takes no arguments, got {line.strip()!r}")
        return JobTable(jobs())

    @magic_arguments(name="distributed_stop")
    @argument("job_id", nargs="?", default=None, help="Job id (or a unique part of it), as %%distributed_jobs shows.")
    @argument("--all", action="store_true", help="Stop every job of this kernel that has not ended.")
    @line_magic
    def distributed_stop(self, line: str) -> None:
        """Cancel a job of this kernel (every rank stopped, state cancelled), or all of them with --all."""
        args = parse_argstring(self.distributed_stop, line)
        if args.all == (args.job_id is not None):
            raise UsageError("give one job id (see %distributed_jobs) or --all, e.g. %distributed_stop --all")
        if args.all:
            chosen = [job for job in jobs() if not job.done()]
        else:
            chosen = [job for job in jobs() if args.job_id in job.job_id]
            if len(chosen) != 1:
                known = ", ".join(job.job_id for job in jobs()) or "none yet"
                what = "matches no job" if not chosen else f"matches {len(chosen)} jobs"
                raise UsageError(f"{args.job_id!r} {what} of this kernel (jobs: {known}); give more of the id")
        for job in chosen:
            if job.done():
                print(f"job {job.job_id} already ended: {job.state.value}")
                continue
            job.cancel()
            print(f"job {job.job_id}: {job.state.value}")
        if not chosen:
            print("no running job to stop")

    @magic_arguments(name="mlflow_ui")
    @argument("--port", type=int, default=None, help="Port on 127.0.0.1; default: a free port.")
    @argument("--stop", action="store_true", help="Stop the server.")
    @line_magic("mlflow_ui")
    def start_mlflow_ui(self, line: str) -> None:
        """Start a local MLflow UI server for the kernel's tracking URI and print its URL.

        It listens on 127.0.0.1, serves the store the jobs' runs go to, and stops when the kernel
        ends. From then on each job's run link points at it. ``%config DistributedMagics.mlflow_ui = True``
        starts it with the first tracked job instead.
        """
        from . import tracking

        args = parse_argstring(self.start_mlflow_ui, line)
        if args.stop:
            print("MLflow UI stopped" if tracking.stop_ui() else "no MLflow UI was running")
            return
        ui = tracking.start_ui(port=args.port)
        print(f"MLflow UI for {ui.backend_uri}: {ui.url}")
