"""The options every job magic takes (``%%distributed``, ``%distributed_run``), as IPython's ``magic_arguments``
declare them: one list, so the two magics and their help agree."""

from __future__ import annotations

from IPython.core.magic_arguments import argument

PROFILE_OPTION = argument(
    "--profile",
    type=int,
    nargs="?",
    const=5,
    default=None,
    metavar="STEPS",
    help="Profile STEPS steps (default 5) on every rank with torch.profiler, after one step of wait and one of "
    "warm-up: a table of each rank's time in compute, collectives, data loading and idle, the top 10 ops, and "
    "one merged trace (job.profile_trace()).",
)
"""``--profile [STEPS]``: of every job magic and of a ``%%distributed --session`` cell."""

JOB_OPTIONS = (
    argument(
        "--gpus",
        type=int,
        required=True,
        help="Number of ranks, one GPU each (CPU ranks with gloo when the machine has no GPU).",
    ),
    argument(
        "--gpu-type", default=None, help="GPU model to require, e.g. H100 (case-insensitive match of the device name)."
    ),
    argument(
        "--timeout",
        default=None,
        help="Seconds before every rank is stopped, or 'none'. Default: DistributedMagics.timeout_s (3 h).",
    ),
    argument("--port", type=int, default=None, help="MASTER_PORT for the rendezvous; default: a free port."),
    argument("--no-widgets", action="store_true", help="Plain [rank N] text instead of the widget panel."),
    argument("--no-mlflow", action="store_true", help="Do not track this job as an MLflow run."),
    argument("--gpu-ids", default=None, metavar="I,J", help="Physical GPU indices to run on, one per rank, e.g. 0,1."),
    argument(
        "--background",
        action="store_true",
        help="Return the Job at once; the cell ends and the job's "
        "output keeps coming here. Interrupting the kernel does not stop it (%%distributed_stop does).",
    ),
    argument(
        "--no-wait",
        action="store_true",
        help="Fail at once, naming who holds them, when the GPUs are "
        "leased by other jobs (default: wait in the queue).",
    ),
    argument(
        "--cluster",
        default=None,
        metavar="ADDRESS",
        help="Run on a Ray cluster: 'auto', 'ray://host:10001' "
        "or 'host:6379' (needs sgpu_magic[ray]); one placement group of --gpus bundles, one actor per rank.",
    ),
    argument(
        "--remote",
        action="store_true",
        help="Run on the kernel's remote cluster (DistributedMagics."
        "remote_cluster, else $SGPU_MAGIC_REMOTE_CLUSTER), as the serverless GPU API's remote=True.",
    ),
    argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="Restart all ranks up to N times after a "
        "rank fails (torchrun's --max-restarts; ranks read TORCHELASTIC_RESTART_COUNT). Default 0.",
    ),
    PROFILE_OPTION,
    argument(
        "--detach",
        action="store_true",
        help="Run the ranks under your run keeper instead of this kernel's launch host: the job outlives the "
        "kernel, and %%distributed_attach JOB_ID in any of your kernels gives it back (see docs/guide/detached.md).",
    ),
    argument(
        "-o",
        "--output",
        default=None,
        metavar="NAME",
        help="Store the Job handle (per-rank results, log paths) in this variable.",
    ),
)


def job_options(magic):
    """The options every job magic takes (%%distributed, %distributed_run), in this order in its help."""
    for option in reversed(JOB_OPTIONS):
        magic = option(magic)
    return magic
