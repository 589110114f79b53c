"""The ``%%distributed`` cell magic and the line magics around it (their help: :mod:`sgpu_magic.front.magic_help`)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Float, Int, Unicode, observe

from sgpu_magic import capture
from sgpu_magic._util.redact import redact
from sgpu_magic.errors import SgpuError, SpecError
from sgpu_magic.front import script
from sgpu_magic.front.cell import (
    CELL_FILENAME,
    as_usage_error,
    cell_label,
    check_output_name,
    checked_source,
    ends_quiet,
    parse_gpu_ids,
    parse_line,
    parse_timeout,
    show_cell_syntax_errors_alone,
)
from sgpu_magic.front.decorator import start
from sgpu_magic.front.job_table import JobTable, find_job, latest_running, listed_jobs
from sgpu_magic.front.magic_help import magic_help
from sgpu_magic.front.options import job_options
from sgpu_magic.front.session_magics import RANKS_OPTION, SESSION_OPTION, is_session_cell, run_session_cell
from sgpu_magic.front.spec_options import job_spec
from sgpu_magic.launch import held_warm
from sgpu_magic.launch.ray.warm import set_keep_warm_s
from sgpu_magic.spec import DEFAULT_STUCK_AFTER_S, DEFAULT_TEARDOWN_GRACE_S, DEFAULT_TIMEOUT_S, LaunchSpec
from sgpu_magic.wire.payload import Payload


@magics_class
class DistributedMagics(Magics):
    """Run a cell on N ranks. Defaults can be set with ``%config DistributedMagics.<name> = ...``."""

    def __init__(self, shell=None, **kwargs) -> None:
        super().__init__(shell=shell, **kwargs)
        if shell is not None:
            show_cell_syntax_errors_alone(shell)

    timeout_s = Float(
        DEFAULT_TIMEOUT_S,
        allow_none=True,
        help="Default job timeout in seconds when --timeout is not given; None = no limit.",
    ).tag(config=True)
    max_capture_bytes = Int(
        capture.DEFAULT_MAX_BYTES,
        min=0,
        help="Captured globals larger than this many bytes get a warning before launch.",
    ).tag(config=True)
    max_log_lines = Int(
        2000, help="Lines each rank's log view in the panel keeps; earlier ones stay in the log file."
    ).tag(config=True)
    widgets = Bool(
        None,
        allow_none=True,
        help="Show the ipywidgets panel (True), plain [rank N] text (False), or decide (None: the panel "
        "in a Jupyter kernel, unless SGPU_MAGIC_WIDGETS=0).",
    ).tag(config=True)
    mlflow = Bool(
        True, help="Track each job as one MLflow run (--no-mlflow / mlflow=False turn it off for one job)."
    ).tag(config=True)
    mlflow_per_cell = Bool(
        False,
        help="A live session is one MLflow run; True also gives each of its cells a child run (with the cell's "
        "params and logs; made and ended off the cell's path). --mlflow-per-cell turns it on for one session.",
    ).tag(config=True)
    mlflow_ui = Bool(
        False,
        help="Start the local MLflow UI server (as %mlflow_ui does) with the first tracked job, so run links work.",
    ).tag(config=True)
    lease_dir = Unicode(
        "",
        help="Directory of the GPU lease registry shared by the kernels that must not share "
        "GPUs (default: $SGPU_MAGIC_LEASE_DIR, else <sgpu_magic home>/leases).",
    ).tag(config=True)
    mlflow_experiment = Unicode(
        "sgpu_magic",
        help="MLflow experiment for jobs when neither mlflow.set_experiment, "
        "MLFLOW_EXPERIMENT_NAME/ID nor a notebook name gives one.",
    ).tag(config=True)
    teardown_grace_s = Float(
        DEFAULT_TEARDOWN_GRACE_S,
        min=0.0,
        help="Seconds a rank may take to exit (destructors, "
        "atexit handlers) after its value or error is written; a rank still running then is "
        "ended and the job keeps its outcome, noting which rank needed it.",
    ).tag(config=True)

    stuck_after_s = Float(
        DEFAULT_STUCK_AFTER_S,
        allow_none=True,
        help="Seconds without a log line or metric point from any rank, while every rank runs, after which a job "
        "shows 'possibly stuck' with each rank's stack; None = never.",
    ).tag(config=True)

    session_idle_timeout_s = Float(
        None,
        allow_none=True,
        help="Stop a live session (and release its GPUs) after this many seconds without a cell; None = never. "
        "%distributed_session start --idle-timeout S / Session(idle_timeout=S) set it for one session.",
    ).tag(config=True)

    session_auto_recover = Bool(
        True,
        help="When ranks of a live session's cell do not return from its interrupt and each waits in a "
        "torch.distributed call (a collective that a peer never entered), release them and make the process group "
        "again at once, keeping every rank's state (as %distributed_session recover does); False: say so and wait "
        "for recover or restart. Session(auto_recover=...) sets it for one session.",
    ).tag(config=True)

    remote_cluster = Unicode(
        "",
        help="The cluster remote=True / --remote runs on, e.g. 'ray://head:10001' (a Ray "
        "address, as cluster=); default: $SGPU_MAGIC_REMOTE_CLUSTER.",
    ).tag(config=True)

    ray_keep_warm_s = Float(
        None,
        allow_none=True,
        min=0.0,
        help="Seconds the placement group and rank agents of the last Ray job are kept, with no job, for the next "
        "job of the same shape (which then forks its ranks on the nodes in well under a second instead of starting "
        "them afresh); they hold the cluster's resources meanwhile. 0 keeps nothing; sgpu_magic.release() gives "
        "them back at once. None: $SGPU_MAGIC_RAY_KEEP_WARM_S, else 180.",
    ).tag(config=True)

    @observe("ray_keep_warm_s")
    def _keep_warm_changed(self, change) -> None:
        set_keep_warm_s(change["new"])

    def _job_spec(self, args, name: str) -> LaunchSpec:
        """The job's spec from the options both magics share; a bad one is a UsageError naming it."""
        with as_usage_error(SpecError):
            return job_spec(
                name,
                args.gpus,
                args.gpu_type,
                parse_timeout(args.timeout, self.timeout_s),
                port=args.port,
                widgets=False if args.no_widgets else self.widgets,
                mlflow=self.mlflow and not args.no_mlflow,
                gpu_ids=parse_gpu_ids(args.gpu_ids),
                wait=not args.no_wait,
                max_restarts=args.max_restarts,
                cluster=args.cluster,
                teardown_grace_s=self.teardown_grace_s,
                stuck_after_s=self.stuck_after_s,
                remote=args.remote,
                profile=args.profile,
                detach=args.detach,
            )

    @magic_arguments(name="%distributed")  # a cell magic: the usage line reads %%distributed
    @job_options
    @SESSION_OPTION
    @RANKS_OPTION
    @magic_help(
        "%%distributed",
        examples="""
        %%distributed --gpus 2
        import torch, torch.distributed as dist
        from sgpu_magic import runtime
        dist.init_process_group(runtime.backend())      # "nccl" with CUDA, else "gloo"
        t = torch.ones(1, device=runtime.device())
        dist.all_reduce(t)
        t.item()                                        # the cell's value (rank 0's): 2.0

        %%distributed --gpus 8 --gpu-type H100 --timeout 3600 -o job
        train(epochs=3)                                 # job.results: one value per rank; job.logs(0)

        %%distributed --gpus 2 --background -o job
        train(epochs=30)                                # returns at once: job.state, job.result() later

        %%distributed --session                         # on the live session's ranks (%distributed_session start)
        loss = train_some(steps=100)                    # the ranks keep model, optimizer, process group
        loss
        """,
    )
    @cell_magic
    def distributed(self, line: str, cell: str):
        """Run the cell on N ranks; its last expression's value on rank 0 is the cell's output (a ``;`` at the
        end of the last line suppresses it, as in IPython, and no value is sent back).

        The names the cell reads from the notebook are captured: functions, classes and
        values by value, modules by reference. Each rank gets torchrun's environment
        (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), one GPU each, or
        CPU with gloo on a machine without GPUs. Output streams live into the cell (a panel
        with one tab per rank in Jupyter, [rank N] lines elsewhere); a failed rank raises
        its traceback here, every rank is stopped, and the logs stay on disk. Ranks run plain
        Python: a cell with IPython syntax (%magic, !shell, ? help) or a top-level return is
        refused with a SyntaxError before anything starts.
        """
        if is_session_cell(line):
            return run_session_cell(self.shell, line, cell)
        args = parse_line(self.distributed.parser, line, "%%distributed")
        check_output_name(args.output)
        spec = self._job_spec(args, "%%distributed cell")
        shell = self.shell
        assert shell is not None  # a magic runs in the shell it is registered with
        label = cell_label(shell)
        source = checked_source(cell, shell.transform_cell(cell), label)  # stops bad cells before anything starts

        def payload(warn) -> Payload:
            return capture.capture_cell(
                source,
                shell.user_ns,
                self.max_capture_bytes,
                warn,
                ranks=spec.gpus,
                filename=CELL_FILENAME,
                quiet=ends_quiet(source),
                cell_label=label,  # as Out[N]: its frames in tracebacks and stacks
            )

        job = start(spec, payload, background=args.background)
        if args.output:
            shell.user_ns[args.output] = job
        if args.background:
            return job
        job.follow()
        return job.result()[0]

    @magic_arguments(name="distributed_run")
    @job_options
    @argument(
        "-m",
        "--module",
        action="store_true",
        help="Run a module as `python -m` does (sys.path[0] is the current directory) instead of a script file.",
    )
    @argument(
        "script",
        metavar="script.py | module",
        help="The script file (or with -m, the module) each rank runs "
        "as torchrun does: __name__ == '__main__', sys.argv = [script, *args], its folder first on sys.path.",
    )
    @argument("args", nargs=argparse.REMAINDER, help="Arguments for the script, passed on untouched.")
    @magic_help(
        "%distributed_run",
        examples="""
        %distributed_run --gpus 2 train.py --epochs 3 data/     # each rank: sys.argv = ['/abs/path/train.py', '--epochs', '3', 'data/']
        %distributed_run --gpus 2 -m mypkg.train --lr 0.1       # as python -m mypkg.train --lr 0.1
        %distributed_run --gpus 8 --background -o job train.py  # returns at once; job.result() later
        """,
    )
    @line_magic
    def distributed_run(self, line: str):
        """Run a script (or ``-m module``) on every rank as torchrun does: ``%distributed_run --gpus 2 train.py 3``.

        Every %%distributed option works here; what follows the script or module goes to it untouched.
        A rank's result is the script's exit status (0); sys.exit(n) with n != 0 fails the rank with
        code n. A missing file, a file that is not Python or an unknown module is refused before
        anything starts. Returns nothing (the Job with -o NAME, or with --background).
        """
        args = parse_line(self.distributed_run.parser, line, "%distributed_run")
        check_output_name(args.output)
        spec = self._job_spec(args, "script")
        with as_usage_error(FileNotFoundError, ValueError, ModuleNotFoundError):
            target = script.resolve(args.script, module=args.module)
        job = start(replace(spec, name=target.name), lambda warn: target.payload(args.args), background=args.background)
        if args.output:
            assert self.shell is not None  # a magic runs in the shell it is registered with
            self.shell.user_ns[args.output] = job
        if args.background:
            return job
        job.follow()
        job.result()
        return None

    @magic_arguments(name="distributed_jobs")
    @argument(
        "--all",
        action="store_true",
        help="Your detached runs on this machine, from any kernel: running, and ended in the last day.",
    )
    @argument("--stop", default=None, metavar="JOB_ID", help="Stop your detached run JOB_ID (or a unique part of it).")
    @magic_help(
        "%distributed_jobs",
        examples="""
        %distributed_jobs
        job                     state      world size  GPUs  elapsed  MLflow run
        20261201-101500-a1b2c3  succeeded  2           cpu   3.2 s    3f1c0e...

        %distributed_jobs --all                   # detached runs (--detach) of every kernel of yours
        %distributed_jobs --stop a1b2c3
        """,
    )
    @line_magic
    def distributed_jobs(self, line: str):
        """Show this kernel's jobs: id, state, world size, GPUs, elapsed time and MLflow run; with --all, your
        detached runs on this machine (started with detach=True / --detach by any of your kernels, running or
        ended in the last day); with --stop JOB_ID, stop one of them.

        The MLflow run id links to its page whenever a server shows it (a tracking server, or
        %mlflow_ui). A line below the table says what the kernel keeps warm on a Ray cluster between jobs
        (DistributedMagics.ray_keep_warm_s; sgpu_magic.release() gives it back).
        """
        from sgpu_magic.front.detached import DetachedTable, detached_runs, stop_detached

        args = parse_line(self.distributed_jobs.parser, line, "%distributed_jobs")
        if args.stop is not None:
            if args.all:
                raise UsageError("give --all (to list) or --stop JOB_ID (to stop one), not both")
            with as_usage_error(SgpuError):
                print(stop_detached(args.stop))
            return None
        if args.all:
            return DetachedTable(detached_runs())
        return JobTable(listed_jobs(), held_warm())

    @magic_arguments(name="distributed_attach")
    @argument(
        "job_id", nargs="?", default=None, help="The detached run's id (or a unique part of it), as --all lists it."
    )
    @argument("--last", action="store_true", help="The latest detached run you started (from any kernel).")
    @argument("--no-widgets", action="store_true", help="Plain [rank N] text instead of the widget panel.")
    @argument("-o", "--output", default=None, metavar="NAME", help="Store the Job handle in this variable.")
    @magic_help(
        "%distributed_attach",
        examples="""
        %distributed_attach --last -o job         # the panel again, every line from the first; job.result() waits
        %distributed_attach 20261201-101500-a1b2c3
        """,
    )
    @line_magic
    def distributed_attach(self, line: str):
        """Attach to a detached run (detach=True / --detach) from any of your kernels, also after the kernel that
        started it died or restarted: shows its panel rebuilt from the run directory (every rank's lines so far,
        metrics, state, MLflow link), then follows it live, and returns its Job (job.result(), job.cancel(),
        job.stacks(), job.metrics())."""
        from sgpu_magic.front.detached import attach

        args = parse_line(self.distributed_attach.parser, line, "%distributed_attach")
        if args.last == (args.job_id is not None):
            raise UsageError(
                "give a detached run's id (see %distributed_jobs --all) or --last, e.g. %distributed_attach --last"
            )
        check_output_name(args.output)
        with as_usage_error(SgpuError):
            job = attach(args.job_id, widgets=False if args.no_widgets else None)
        if args.output:
            assert self.shell is not None  # a magic runs in the shell it is registered with
            self.shell.user_ns[args.output] = job
        return job

    @magic_arguments(name="distributed_stop")
    @argument("job_id", nargs="?", default=None, help="Job id (or a unique part of it), as %%distributed_jobs shows.")
    @argument("--all", action="store_true", help="Stop every job of this kernel that has not ended.")
    @magic_help(
        "%distributed_stop",
        examples="""
        %distributed_stop a1b2c3          # any unique part of the id %distributed_jobs shows
        %distributed_stop --all
        """,
    )
    @line_magic
    def distributed_stop(self, line: str) -> None:
        """Cancel a job of this kernel (every rank stopped, state cancelled), or all of them with --all."""
        args = parse_argstring(self.distributed_stop, line)
        if args.all == (args.job_id is not None):
            raise UsageError("give one job id (see %distributed_jobs) or --all, e.g. %distributed_stop --all")
        if args.all:
            chosen = [job for job in listed_jobs() if not job.done()]
        else:
            chosen = [find_job(args.job_id)]
        for job in chosen:
            if job.done():
                print(f"job {job.job_id} already ended: {job.state.label}")
                continue
            job.cancel()
            print(f"job {job.job_id}: {job.state.label}")
        if not chosen:
            print("no running job to stop")

    @magic_arguments(name="distributed_stacks")
    @argument(
        "job_id", nargs="?", default=None, help="Job id (or a unique part of it); default: the latest running job."
    )
    @argument("--native", action="store_true", help="Also show C/C++ frames (py-spy --native), e.g. where gloo waits.")
    @magic_help(
        "%distributed_stacks",
        examples="""
        %distributed_stacks               # rank 0 (pid 4242): dist.broadcast at Cell In[4] line 7, then its frames
        %distributed_stacks a1b2c3 --native
        """,
    )
    @line_magic
    def distributed_stacks(self, line: str) -> None:
        """Print the Python stack of every running rank of a job, taken from outside by py-spy (about 0.1 s).

        Each rank's first line says where it is; notebook frames read as the notebook shows them (Cell In[4]
        line 7, then the line). A job that timed out or was cancelled while ranks ran keeps the stacks taken
        just before they were stopped in <run dir>/stacks/, and its error says where each rank was.
        """
        args = parse_argstring(self.distributed_stacks, line)
        job = find_job(args.job_id) if args.job_id else latest_running("%distributed_stacks")
        for text in job.stacks(native=args.native).values():
            print(text)

    @magic_arguments(name="distributed_doctor")
    @argument("--port", type=int, default=None, help="Also check that this pinned MASTER_PORT is free.")
    @argument(
        "--cluster", default=None, metavar="ADDRESS", help="Check this Ray cluster (default: the configured one)."
    )
    @magic_help(
        "%distributed_doctor",
        examples="""
        %distributed_doctor
        %distributed_doctor --port 29500 --cluster ray://head:10001
        """,
    )
    @line_magic
    def distributed_doctor(self, line: str):
        """Check what a job of this kernel will use and what is wrong: one row per check (Python, torch, GPUs and
        their holders, leases, ports, launch host, MLflow, widgets, Ray, DeepSpeed), each ok / warning / error
        with the remedy. ``python -m sgpu_magic doctor`` runs the same checks outside a kernel."""
        from sgpu_magic.front.doctor import DoctorConfig, diagnose

        args = parse_argstring(self.distributed_doctor, line)
        return diagnose(DoctorConfig.from_magics(self, port=args.port, cluster=args.cluster))

    @magic_arguments(name="mlflow_ui")
    @argument("--port", type=int, default=None, help="Port on 127.0.0.1; default: a free port.")
    @argument("--stop", action="store_true", help="Stop the server.")
    @magic_help(
        "%mlflow_ui",
        examples="""
        %mlflow_ui                        # MLflow UI for sqlite:////home/me/proj/mlflow.db: http://127.0.0.1:40123
        %mlflow_ui --port 5000
        %mlflow_ui --stop
        """,
    )
    @line_magic("mlflow_ui")  # type: ignore[arg-type] # IPython's annotations of line_magic("name") do not fit a method
    def start_mlflow_ui(self, line: str) -> None:
        """Start a local MLflow UI server for the kernel's tracking URI and print its URL.

        It listens on 127.0.0.1, serves the store the jobs' runs go to, and stops when the kernel
        ends. From then on each job's run link points at it. ``%config DistributedMagics.mlflow_ui = True``
        starts it with the first tracked job instead.
        """
        from sgpu_magic.tracking import server

        args = parse_argstring(self.start_mlflow_ui, line)
        if args.stop:
            print("MLflow UI stopped" if server.stop_ui() else "no MLflow UI was running")
            return
        ui = server.start_ui(port=args.port)
        print(f"MLflow UI for {redact(ui.backend_uri)}: {ui.url}")
