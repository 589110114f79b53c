"""The ``%%distributed`` cell magic."""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Float, Int, Unicode

from . import capture
from .decorator import start
from .errors import SpecError
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
    mlflow_experiment = Unicode("sgpu_magic", help="MLflow experiment for jobs when neither mlflow.set_experiment, "
                                "MLFLOW_EXPERIMENT_NAME/ID nor a notebook name gives one.").tag(config=True)

    @magic_arguments()
    @argument("--gpus", type=int, required=True, help="Number of ranks, one GPU each (CPU ranks with gloo when the machine has no GPU).")
    @argument("--gpu-type", default=None, help="GPU model to require, e.g. H100 (case-insensitive match of the device name).")
    @argument("--timeout", default=None, help="Seconds before every rank is stopped, or 'none'. Default: DistributedMagics.timeout_s (3 h).")
    @argument("--port", type=int, default=None, help="MASTER_PORT for the rendezvous; default: a free port.")
    @argument("--no-widgets", action="store_true", help="Plain [rank N] text instead of the widget panel.")
    @argument("--no-mlflow", action="store_true", help="Do not track this job as an MLflow run.")
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
                             mlflow=self.mlflow and not args.no_mlflow)
        except SpecError as exc:
            raise UsageError(str(exc)) from None
        source = _aligned_source(cell, self.shell.transform_cell(cell))
        filename = CELL_FILENAME

        def payload() -> dict:
            part = capture.capture_cell(source, self.shell.user_ns, self.max_capture_bytes)
            part["filename"] = filename
            return part

        compile(source, filename, "exec")  # a SyntaxError stops here, before anything starts
        job = start(spec, payload)
        if args.output:
            self.shell.user_ns[args.output] = job
        return job.result()[0]

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
