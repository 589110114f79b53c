"""The layout's contracts: docs/architecture.md's layer table is the import-linter contract of pyproject.toml,
every package of sgpu_magic is in it, the contracts hold (lint-imports), and a rank imports no front door."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "sgpu_magic"


def _contract_layers() -> list[set[str]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return [set(re.split(r"\s*[|:]\s*", layer.strip())) for layer in layers["layers"]]


def _doc_rows() -> dict[str, set[str]]:
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text.split("<!-- layers:start -->")[1].split("<!-- layers:end -->")[0]
    rows = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = set(re.findall(r"`([\w.]+)`", cells[1]))
    return rows


def test_the_documented_layers_are_the_import_linter_contract():
    rows = _doc_rows()
    layers = _contract_layers()
    documented = [rows[str(n)] for n in range(len(layers) - 1, -1, -1)]
    assert documented == layers, "docs/architecture.md's layer table and pyproject's layers contract differ"


def test_every_package_and_module_of_sgpu_magic_has_a_layer():
    listed = set().union(*_doc_rows().values())
    entries = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
    }
    assert entries - {"__init__", "__main__"} - listed == set(), "modules missing from docs/architecture.md"
    assert listed - entries == set(), "docs/architecture.md names modules that do not exist"


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    done = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_a_rank_imports_no_front_door_nor_kernel_side_library():
    code = (
        "import sys, sgpu_magic.rank.worker\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('sgpu_magic', 'IPython', 'ipywidgets', 'ipykernel', 'mlflow', 'psutil', 'filelock', 'traitlets')))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = ast.literal_eval(done.stdout)
    assert loaded == [
        "sgpu_magic",
        "sgpu_magic._util",
        "sgpu_magic._util.fs",
        "sgpu_magic._util.imports",
        "sgpu_magic._util.metrics",
        "sgpu_magic._util.proc",
        "sgpu_magic.errors",
        "sgpu_magic.rank",
        "sgpu_magic.rank.exit",
        "sgpu_magic.rank.mlflow_guard",
        "sgpu_magic.rank.worker",
        "sgpu_magic.rundir",
    ]


def test_every_public_import_path_stays_and_import_sgpu_magic_is_lazy():
    code = (
        "import sys, sgpu_magic\n"
        "lazy = sorted(m for m in sys.modules if m.startswith('sgpu_magic'))\n"
        "from sgpu_magic import (distributed, DistributedFunction, run_script, Job, JobState, runtime,\n"
        "    load_ipython_extension, SgpuError, SpecError, ResourceError, CaptureError, LauncherError,\n"
        "    RankFailedError, JobTimeoutError, JobCancelledError, UnpicklableGlobalError, CheckpointError)\n"
        "from sgpu_magic.errors import CellSyntaxError, RankFailure\n"
        "from sgpu_magic.runtime import get_global_rank, get_local_rank, get_world_size\n"
        "from sgpu_magic.data import VolumeDataset, DataLoader\n"
        "from sgpu_magic.checkpoint import VolumeWriter, VolumeReader, is_complete\n"
        "assert sgpu_magic.__version__ and set(sgpu_magic.__all__) <= set(dir(sgpu_magic))\n"
        "assert DistributedFunction.__module__ == 'sgpu_magic' and sgpu_magic.Job is Job\n"
        "print(lazy)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ast.literal_eval(done.stdout) == ["sgpu_magic"]
