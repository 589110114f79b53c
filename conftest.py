"""Settings for the whole test run, including the notebooks that nbval executes (``notebooks/``).

nbval starts each notebook's kernel before any fixture runs, so the environment the kernels
inherit is set here, at configuration: a private sgpu_magic home and MLflow store for the run,
so executing the notebooks leaves nothing in the repository or in the user's home. Notebook
items are marked ``slow`` (``-m "not slow"`` skips them with the other kernel tests).
"""

from __future__ import annotations

import os
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


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.slow)
