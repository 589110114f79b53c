"""The one seam to other libraries' private internals (layer 0).

sgpu_magic leans on a few private names of torch elastic, torch.distributed, multiprocessing's forkserver,
ipykernel, MLflow and CPython. Each use is a small named function here, one module per library
(:mod:`~sgpu_magic._compat.elastic`, :mod:`~sgpu_magic._compat.torch`, :mod:`~sgpu_magic._compat.forkserver`,
:mod:`~sgpu_magic._compat.ipykernel`, :mod:`~sgpu_magic._compat.mlflow`, :mod:`~sgpu_magic._compat.stdlib`, :mod:`~sgpu_magic._compat.imports`),
whose docstring names the private it uses, the versions it was checked against, and what happens when the
private is missing: a fallback (the feature it speeds up or tidies is skipped) or :class:`CompatError`.

Nothing outside this package touches such a name (``tests/unit/test_architecture.py`` reads the source), and
``tests/unit/test_compat_seam.py`` runs every function here against the installed libraries, so an upgrade that
drops a private fails a test named after the function that needs it.

Importing a module of this package imports nothing of its library: a function is given the library's objects,
or finds the library in :data:`sys.modules` (it reaches only into what its caller has loaded), so a rank that
imports the seam loads neither torch nor MLflow.
"""

from __future__ import annotations

from sgpu_magic.errors import SgpuError


class CompatError(SgpuError, RuntimeError):
    """An installed library lacks a private internal sgpu_magic needs and has no fallback for."""


def version_of(distribution: str) -> str:
    """The installed version of ``distribution`` (``"python"``: the interpreter's), or ``"(unknown)"``."""
    import importlib.metadata  # here: a rank imports this package, and needs no metadata until a private is gone
    import platform

    if distribution == "python":
        return platform.python_version()
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(unknown)"


def missing(distribution: str, name: str, checked: str, consequence: str) -> CompatError:
    """The error for a private ``name`` of ``distribution`` that is gone: what was checked, what fails, the remedy.

    Example:
        ``raise missing("python", "multiprocessing.forkserver._forkserver._stop", "3.10-3.13", "...")``
    """
    return CompatError(
        f"{distribution} {version_of(distribution)} has no {name}, which sgpu_magic needs "
        f"(checked against {distribution} {checked}): {consequence}; install a {distribution} version "
        f"sgpu_magic was checked against, or report this at the sgpu_magic issue tracker"
    )
