"""Shared fixtures: one private sgpu_magic home per test session, one real IPython shell."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# tests/unit, tests/integration, tests/kernel, tests/browser and tests/chaos share helpers.py and kernel_utils.py
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session", autouse=True)
def sgpu_home(tmp_path_factory):
    """Run dirs, host logs and the MLflow store of the whole session go to a private temporary directory."""
    home = tmp_path_factory.mktemp("sgpu_home")
    old = os.environ.get("SGPU_MAGIC_HOME")
    os.environ["SGPU_MAGIC_HOME"] = str(home)
    # the MLflow runs of the session's jobs (tracking is on by default) go to a store in the same place
    old_uri = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri = f"sqlite:///{home}/mlflow.db"
    # The store is made before any test's kernel opens it: MLflow makes a fresh store's tables in several
    # transactions (seconds of CPU), so a kernel a test SIGKILLs meanwhile would leave it half made, and every later
    # opener of it would fail (``duplicate column name``). Made in a child, so this process imports no mlflow.
    made = subprocess.run(
        [sys.executable, "-c", "import mlflow, sys; mlflow.MlflowClient(sys.argv[1]).search_experiments()", uri],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert made.returncode == 0, f"the session's MLflow store could not be made:\n{made.stderr}"
    # kernels started by tests inherit this: plain [rank N] text, which the tests read (the panel has its own tests)
    os.environ.setdefault("SGPU_MAGIC_WIDGETS", "0")
    yield home
    from sgpu_magic.launch.client import shutdown_host

    shutdown_host()
    if old is None:
        os.environ.pop("SGPU_MAGIC_HOME", None)
    else:
        os.environ["SGPU_MAGIC_HOME"] = old
    if old_uri is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = old_uri


@pytest.fixture(scope="session")
def ip(sgpu_home):
    """A real IPython shell with ``%load_ext sgpu_magic`` done (shared: it is warm)."""
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "sgpu_magic")
    return shell


@pytest.fixture
def run_cell(ip, capsys):
    """Run a cell in the shared shell; return (ExecutionResult, stdout, stderr)."""

    def run(code: str):
        capsys.readouterr()
        result = ip.run_cell(code)
        out, err = capsys.readouterr()
        return result, out, err

    return run


@pytest.fixture
def piddir(ip, tmp_path):
    """A fresh directory, also bound to the notebook global ``piddir``, where ranks record their PIDs."""
    d = tmp_path / "pids"
    d.mkdir()
    ip.user_ns["piddir"] = str(d)
    return d
