"""The launch options, listed once (:data:`LAUNCH_OPTIONS`): each option's name, where it is taken (the decorator,
:func:`~sgpu_magic.run_script`, the job magics ``%%distributed`` / ``%distributed_run``, a live
:class:`~sgpu_magic.Session`), its magic flag with its help, and the ``%config DistributedMagics`` trait its default
follows. The job magics' arguments are made from it (:func:`job_options`, IPython's ``magic_arguments``), and a test
checks every front door's signature against it, so an option added to one door and not the others fails there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from IPython.core.magic_arguments import argument

DECORATOR, SCRIPT, MAGIC, SESSION = "decorator", "script", "magic", "session"
JOBS = frozenset({DECORATOR, SCRIPT, MAGIC})
EVERY = JOBS | {SESSION}


@dataclass(frozen=True)
class LaunchOption:
    """One launch option.

    Attributes:
        name: its keyword at the decorator, ``run_script`` and ``Session`` (the serverless GPU API's where it has one).
        doors: the front doors that take it (``"decorator"``, ``"script"``, ``"magic"``, ``"session"``).
        flags: the job magics' flag(s) (``("--gpus",)``; ``("--no-mlflow",)`` turns a default-on switch off);
            ``()``: the magics take it only through its ``%config`` trait, or not at all.
        help: the flag's help line (``%%distributed?``).
        argparse: the flag's other ``argparse`` settings (``type``, ``default``, ``action``, ``metavar`` ...).
        trait: the ``DistributedMagics`` trait its default follows (``%config DistributedMagics.<trait>``), if any.
    """

    name: str
    doors: frozenset[str]
    flags: tuple[str, ...] = ()
    help: str = ""
    argparse: Mapping[str, Any] = field(default_factory=dict)
    trait: str | None = None

    def magic_argument(self):
        """The job magics' ``@argument`` for it."""
        return argument(*self.flags, help=self.help, **self.argparse)


PROFILE = LaunchOption(
    "profile",
    JOBS,
    ("--profile",),
    "Profile STEPS steps (default 5) on every rank with torch.profiler, after one step of wait and one of "
    "warm-up: a table of each rank's time in compute, collectives, data loading and idle, the top 10 ops, and "
    "one merged trace (job.profile_trace()).",
    {"type": int, "nargs": "?", "const": 5, "default": None, "metavar": "STEPS"},
)

LAUNCH_OPTIONS: tuple[LaunchOption, ...] = (
    LaunchOption(
        "gpus",
        EVERY,
        ("--gpus",),
        "Number of ranks, one GPU each (CPU ranks with gloo when the machine has no GPU).",
        {"type": int, "required": True},
    ),
    LaunchOption(
        "gpu_type",
        EVERY,
        ("--gpu-type",),
        "GPU model to require, e.g. H100 (case-insensitive match of the device name).",
        {"default": None},
    ),
    LaunchOption(
        "timeout",
        JOBS,
        ("--timeout",),
        "Seconds before every rank is stopped, or 'none'. Default: DistributedMagics.timeout_s (3 h).",
        {"default": None},
        trait="timeout_s",
    ),
    LaunchOption(
        "port",
        JOBS,
        ("--port",),
        "MASTER_PORT for the rendezvous; default: a free port.",
        {"type": int, "default": None},
    ),
    LaunchOption(
        "widgets",
        EVERY,
        ("--no-widgets",),
        "Plain [rank N] text instead of the widget panel.",
        {"action": "store_true"},
        trait="widgets",
    ),
    LaunchOption(
        "mlflow",
        EVERY,
        ("--no-mlflow",),
        "Do not track this job as an MLflow run.",
        {"action": "store_true"},
        trait="mlflow",
    ),
    LaunchOption(
        "gpu_ids",
        EVERY,
        ("--gpu-ids",),
        "Physical GPU indices to run on, one per rank, e.g. 0,1.",
        {"default": None, "metavar": "I,J"},
    ),
    LaunchOption(
        "background",
        frozenset({SCRIPT, MAGIC}),  # the decorator's is fn.submit(...); a session's cells are its own
        ("--background",),
        "Return the Job at once; the cell ends and the job's output keeps coming here. Interrupting the kernel does "
        "not stop it (%%distributed_stop does).",
        {"action": "store_true"},
    ),
    LaunchOption(
        "wait",
        JOBS,
        ("--no-wait",),
        "Fail at once, naming who holds them, when the GPUs are leased by other jobs (default: wait in the queue).",
        {"action": "store_true"},
    ),
    LaunchOption(
        "cluster",
        EVERY,
        ("--cluster",),
        "Run on a Ray cluster: 'auto', 'ray://host:10001' or 'host:6379' (needs sgpu_magic[ray]); one placement "
        "group of --gpus bundles, one actor per rank.",
        {"default": None, "metavar": "ADDRESS"},
    ),
    LaunchOption(
        "remote",
        JOBS,
        ("--remote",),
        "Run on the kernel's remote cluster (DistributedMagics.remote_cluster, else $SGPU_MAGIC_REMOTE_CLUSTER), as "
        "the serverless GPU API's remote=True.",
        {"action": "store_true"},
    ),
    LaunchOption(
        "max_restarts",
        JOBS,
        ("--max-restarts",),
        "Restart all ranks up to N times after a rank fails (torchrun's --max-restarts; ranks read "
        "TORCHELASTIC_RESTART_COUNT). Default 0.",
        {"type": int, "default": 0, "metavar": "N"},
    ),
    PROFILE,
    LaunchOption(
        "detach",
        EVERY,
        ("--detach",),
        "Run the ranks under your run keeper instead of this kernel's launch host: the job outlives the kernel, and "
        "%%distributed_attach JOB_ID in any of your kernels gives it back (see docs/guide/detached.md).",
        {"action": "store_true"},
    ),
    LaunchOption(
        "output",
        frozenset({MAGIC}),  # the other doors return the handle
        ("-o", "--output"),
        "Store the Job handle (per-rank results, log paths) in this variable.",
        {"default": None, "metavar": "NAME"},
    ),
    LaunchOption("max_capture_bytes", frozenset({DECORATOR}), trait="max_capture_bytes"),
    LaunchOption("teardown_grace_s", JOBS, trait="teardown_grace_s"),
    LaunchOption("stuck_after_s", JOBS, trait="stuck_after_s"),
    LaunchOption("num_accelerators", frozenset({DECORATOR, SCRIPT})),  # databricks.air's names
    LaunchOption("accelerator_type", frozenset({DECORATOR, SCRIPT})),
    LaunchOption("idle_timeout", frozenset({SESSION}), trait="session_idle_timeout_s"),
    LaunchOption("name", frozenset({SESSION})),
    LaunchOption("mlflow_per_cell", frozenset({SESSION}), trait="mlflow_per_cell"),
    LaunchOption("auto_recover", frozenset({SESSION}), trait="session_auto_recover"),
)
"""Every launch option, in the order the job magics' help lists their flags."""

PROFILE_OPTION = PROFILE.magic_argument()
"""``--profile [STEPS]``: of every job magic and of a ``%%distributed --session`` cell."""

JOB_OPTIONS = tuple(option.magic_argument() for option in LAUNCH_OPTIONS if MAGIC in option.doors and option.flags)


def options_of(door: str) -> list[LaunchOption]:
    """The options front door ``door`` takes."""
    return [option for option in LAUNCH_OPTIONS if door in option.doors]


def job_options(magic):
    """The options every job magic takes (%%distributed, %distributed_run), in this order in its help."""
    for option in reversed(JOB_OPTIONS):
        magic = option(magic)
    return magic
