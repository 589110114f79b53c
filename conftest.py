"""Settings for the whole test run, including the notebooks that nbval executes (``notebooks/``).

nbval starts each notebook's kernel before any fixture runs, so the environment the kernels
inherit is set here, at configuration: a private sgpu_magic home and MLflow store for the run,
so executing the notebooks leaves nothing in the repository or in the user's home. Notebook
items are marked ``slow`` (``-m "not slow"`` skips them with the other kernel tests).

A run that leaves anything new in the repository fails (tests write only under temporary
folders): ``git status --porcelain --ignored`` is taken before and after, Python's and pytest's
caches aside.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest


def pytest_ignore_collect(collection_path, config):
    """The Ray notebook runs where Ray is installed (``pip install "sgpu_magic[ray]"``, as scripts/setup.sh does)."""
    if collection_path.name == "07_ray_cluster.ipynb":
        import importlib.util

        return importlib.util.find_spec("ray") is None or None
    return None


def pytest_configure(config) -> None:
    if "SGPU_MAGIC_HOME" not in os.environ:
        home = tempfile.mkdtemp(prefix="sgpu_magic_pytest_")
        os.environ["SGPU_MAGIC_HOME"] = home
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{home}/mlflow.db")
    # hypothesis keeps a cache of constants (and its example database) in ./.hypothesis unless told otherwise
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", tempfile.mkdtemp(prefix="sgpu_magic_hypothesis_"))
    config.stash[_REPO_STATUS] = repo_status(config.rootpath)


_REPO_STATUS = pytest.StashKey[set]()
_CACHES = ("__pycache__/", ".pytest_cache/")
"""Python's and pytest's own caches, the only things a test run may add to the repository."""


def repo_status(root) -> set[str] | None:
    """The lines of ``git status --porcelain --ignored`` in ``root`` (Python's and pytest's caches left
    out), or ``None`` outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--ignored"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {line for line in out.splitlines() if not line.endswith(_CACHES)}


def pytest_sessionfinish(session, exitstatus) -> None:
    """Fail the run when it left anything new in the repository: tests write only under temporary folders."""
    before = session.config.stash.get(_REPO_STATUS, None)
    after = repo_status(session.config.rootpath) if before is not None else None
    if after is None or not after - before:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_sep("=", "the tests left files in the repository (git status --porcelain --ignored)", red=True)
        for line in sorted(after - before):
            reporter.write_line(line, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.slow)
