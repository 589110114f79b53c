"""Run a script file or a module on every rank, as torchrun does: ``run_script`` and ``%distributed_run``.

Each rank runs the target the way ``torchrun [options] script.py args...`` (or ``torchrun
--module module args...``) would: ``__name__ == "__main__"``, ``sys.argv`` is the script's path
followed by its arguments, the script's folder first on ``sys.path`` (for a module: the current
directory, as ``python -m`` puts it), the kernel's current directory, torchrun's environment
contract (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...). The file is run with
:func:`runpy.run_path`, the module with :func:`runpy.run_module`. Nothing is captured from the
notebook: a script gets what it imports.

A rank's result is the script's exit status: ``0`` when it ends normally or through
``sys.exit(0)``; ``sys.exit(n)`` with ``n != 0`` fails the rank with exit code ``n``, as under torchrun.

Example::

    from sgpu_magic import run_script

    run_script("train.py", ["--epochs", "3"], gpus=2)      # blocks; [0, 0]: each rank's exit status
    job = run_script("mypkg.train", ["--lr", "1e-3"], module=True, gpus=2, background=True)
    job.result()                                            # [0, 0]

In a notebook: ``%distributed_run --gpus 2 train.py --epochs 3`` / ``%distributed_run --gpus 2 -m mypkg.train``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from sgpu_magic.errors import SpecError
from sgpu_magic.front.decorator import start
from sgpu_magic.front.spec_options import config_default, job_spec, resolve_config
from sgpu_magic.job.handle import Job
from sgpu_magic.spec import DEFAULT_STUCK_AFTER_S, DEFAULT_TEARDOWN_GRACE_S, DEFAULT_TIMEOUT_S, check_switch, shown
from sgpu_magic.wire.payload import Payload, Script

__all__ = ["run_script", "resolve", "ScriptTarget"]


@dataclass(frozen=True)
class ScriptTarget:
    """What every rank runs: a script file (``path``, absolute) or a module (``module``), checked in the kernel.

    Attributes:
        path: the script's absolute path, or for a module the file it resolved to (``None`` for a namespace
            package's ``__main__`` that could not be located).
        module: the dotted module name for ``-m``, else ``None``.
    """

    path: str | None
    module: str | None = None

    @property
    def name(self) -> str:
        """The job's name (MLflow run, panel): the script's file name, or ``-m module``."""
        return f"-m {self.module}" if self.module else os.path.basename(self.path or "script")

    def payload(self, args: Sequence[str]) -> Payload:
        """The payload for the ranks: ``sys.argv`` is ``[script, *args]`` (for a module, its file, as
        ``python -m`` sets it)."""
        argv0 = self.path if self.path is not None else self.module
        return Payload(Script(self.path, self.module), argv=[str(argv0), *args])


def _check_args(args: object) -> list[str]:
    if isinstance(args, (str, bytes)) or not isinstance(args, (list, tuple)):
        raise SpecError(
            f"args must be a list of strings (the script's command-line arguments, e.g. ['--epochs', '3']), "
            f"got {shown(args)}"
        )
    bad = [a for a in args if not isinstance(a, str)]
    if bad:
        raise SpecError(
            f"args must be strings, as on a command line; {shown(bad[0])} is of type {type(bad[0]).__name__} "
            f"(write str(...) or an f-string)"
        )
    return list(args)


def _resolve_file(text: str) -> ScriptTarget:
    """An existing Python file (or a folder / zip with ``__main__.py``, as ``python path`` runs)."""
    path = os.path.abspath(os.path.expanduser(text))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"script {text!r} not found (looked for {path}; the kernel's current directory is "
            f"{os.getcwd()}); give the path of a Python file, or -m / module=True for a module"
        )
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "__main__.py")):
            raise ValueError(f"script {text!r} is a folder without a __main__.py; give the Python file to run")
        return ScriptTarget(path)
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        raise FileNotFoundError(f"script {text!r} cannot be read ({exc.strerror})") from None
    _check_python(text, path, source)
    return ScriptTarget(path)


def _check_python(text: str, path: str, source: bytes) -> None:
    """A script that Python cannot compile is refused here, before any rank starts (its SyntaxError is kept
    for ``.py`` files; other files are named as not Python)."""
    if source[:4] == b"PK\x03\x04":  # a zip application, as `python app.zip` / runpy.run_path run it
        return
    try:
        compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:  # ValueError: NUL bytes
        if path.endswith((".py", ".pyw")) and isinstance(exc, SyntaxError):
            raise
        raise ValueError(
            f"script {text!r} is not a Python file ({type(exc).__name__}: {exc}); %distributed_run and "
            f"run_script run Python scripts, as torchrun does"
        ) from None


def _find_module(name: str) -> importlib.machinery.ModuleSpec | None:
    """Where ``name`` would be found by ``python -m`` in the kernel's current directory, without importing
    anything (a parent package's ``__init__`` is not run)."""
    top, *rest = name.split(".")
    spec = importlib.machinery.PathFinder.find_spec(top, [os.getcwd()])
    if spec is None:
        loaded = sys.modules.get(top)
        spec = getattr(loaded, "__spec__", None) if loaded is not None else importlib.util.find_spec(top)
    for part in rest:
        if spec is None or not spec.submodule_search_locations:
            return None
        spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return spec


def _resolve_module(name: str) -> ScriptTarget:
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"module {name!r} is not a dotted module name such as 'mypkg.train'")
    spec = _find_module(name)
    if spec is None:
        raise ModuleNotFoundError(
            f"no module named {name!r} (searched the kernel's current directory {os.getcwd()} "
            f"and sys.path); check the name, or give a script path without -m / module=True"
        )
    if spec.submodule_search_locations is not None:  # a package: python -m runs its __main__
        main = importlib.machinery.PathFinder.find_spec("__main__", list(spec.submodule_search_locations))
        if main is None:
            raise ModuleNotFoundError(
                f"{name!r} is a package without a __main__ module, so it cannot be run "
                f"(python -m {name} fails the same way); name a module inside it"
            )
        return ScriptTarget(main.origin, name)
    return ScriptTarget(spec.origin if spec.has_location else None, name)


def resolve(script: str, module: bool = False) -> ScriptTarget:
    """Check ``script`` (a path, or a module name when ``module``) in the kernel, before anything starts.

    Raises:
        FileNotFoundError: the script does not exist (the message names the path looked for).
        ValueError: it is not a Python file, or a folder without ``__main__.py``; or a bad module name.
        SyntaxError: a ``.py`` file that does not compile (with its file and line).
        ModuleNotFoundError: the module is not found, or is a package without ``__main__``.
    """
    if not isinstance(script, str) or not script.strip():
        raise ValueError(f"give the script to run as a path (or a module name with module=True); got {shown(script)}")
    return _resolve_module(script.strip()) if module else _resolve_file(script)


def run_script(
    path_or_module: str,
    args: Sequence[str] = (),
    *,
    module: bool = False,
    gpus: int | None = None,
    gpu_type: str | None = None,
    timeout: float | None = config_default("timeout_s", DEFAULT_TIMEOUT_S),
    port: int | None = None,
    widgets: bool | None = config_default("widgets", None),
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
    background: bool = False,
) -> Any:
    """Run a script (or with ``module=True`` a module) on every rank, as ``torchrun`` does.

    The job options ``gpus``, ``gpu_type``, ``timeout``, ``port``, ``widgets``, ``mlflow``, ``gpu_ids``, ``wait``,
    ``max_restarts``, ``cluster``, ``teardown_grace_s``, ``stuck_after_s``, ``remote``, ``num_accelerators``,
    ``accelerator_type``,
    ``profile`` (the script's ``optimizer.step()`` calls, or its ``runtime.step()`` marks, are its steps) and
    ``detach`` are as for :func:`~sgpu_magic.distributed` (same defaults, same ``%config DistributedMagics``
    traits).

    Args:
        path_or_module: the script's path (relative to the kernel's current directory), or a dotted module
            name with ``module=True`` (``torchrun --module``, ``python -m``).
        args: the script's command-line arguments, strings, passed on untouched: ``sys.argv[1:]`` in every rank.
        module: run ``path_or_module`` as a module (default False).
        background: return the :class:`~sgpu_magic.Job` at once (as ``fn.submit(...)`` and
            ``%distributed_run --background``); ``job.result()`` then waits for the per-rank list.

    Returns:
        list of length ``gpus``: each rank's exit status (``0``), in rank order; or the Job with ``background=True``.

    Raises:
        FileNotFoundError, ValueError, SyntaxError, ModuleNotFoundError: the script or module cannot be run
            (see :func:`resolve`); nothing was started.
        SpecError: a bad option or ``args`` (nothing was started).
        RankFailedError: a rank failed (``sys.exit(3)``: exit code 3); the others were stopped.
        JobTimeoutError, JobCancelledError: as for ``fn.distributed``.
    """
    args = _check_args(args)
    module = check_switch("module", module, "run a module, as python -m, instead of a script file")
    background = check_switch("background", background, "return the Job at once, or wait for the results")
    spec = job_spec(
        "script",
        gpus,
        gpu_type,
        resolve_config(timeout),
        port=port,
        widgets=resolve_config(widgets),
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
    target = resolve(path_or_module, module=module)
    job: Job = start(replace(spec, name=target.name), lambda warn: target.payload(args), background=background)
    if background:
        return job
    job.follow()
    return job.result()
