"""A new user's first notebook, run headless with the README's own command (issues 17 and 18).

``scripts/run_notebook.py`` executes a small notebook in a real kernel (nbclient) with a new MLflow
store: two tracked jobs, then a ``%%distributed`` cell with an IPython line in it. What the user
reads must be the jobs' output and the one error, nothing else: no warning from the kernel about
TCP, no MLflow INFO lines about creating the store's tables (they go to the kernel's log), the
machine's lack of GPUs said once, and the bad cell's SyntaxError without frames of IPython or
sgpu_magic.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from sgpu_magic.launch.resources import list_gpus

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CELLS = [
    "%load_ext sgpu_magic",
    "import os\nprint('kernel pid', os.getpid())",
    "%%distributed --gpus 2\nprint('first job')",
    "%%distributed --gpus 2\nprint('second job')",
    "%%distributed --gpus 1\nimport os\n!ls\nprint('never runs')",
]


def test_a_first_notebook_in_a_new_store_shows_only_what_the_user_needs(tmp_path, sgpu_home):
    store = tmp_path / "store"
    store.mkdir()
    notebook = tmp_path / "first.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS]), notebook)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store}/mlflow.db"}
    env.pop("MLFLOW_EXPERIMENT_NAME", None)
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run_notebook.py"), str(notebook)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = re.sub(r"\x1b\[[0-9;]*m", "", run.stdout)
    assert run.returncode == 1, (run.stdout, run.stderr)  # the last cell's error, nothing before it
    assert run.stderr == "", run.stderr  # the kernel's "running over TCP without encryption" warning was here
    assert not re.search(r"\bINFO\b|WARNING", out), out
    assert "[rank 0] first job" in out and "[rank 1] second job" in out, out
    assert out.count("no GPU found; running 2 CPU rank(s) with gloo") == (1 if not list_gpus() else 0), out

    kernel_pid = int(re.search(r"^kernel pid (\d+)$", out, re.MULTILINE)[1])
    kernel_log = (sgpu_home / "hosts" / f"kernel-{kernel_pid}.log").read_text()
    assert "INFO mlflow.store.db.utils: Creating initial MLflow database tables" in kernel_log  # where they went

    error = out.split(": %%distributed --gpus 1\n", 1)[1]  # what run_notebook.py printed for the last cell
    assert "line 3 of the cell, '!ls', is IPython syntax" in error and "CellSyntaxError" in error, error
    for internal in ("interactiveshell.py", "run_cell_magic", "magics.py", "Traceback (most recent call last)"):
        assert internal not in error, error
    assert "never runs" not in out
