"""Execute a notebook and store only the outputs of its ``# NBVAL_CHECK_OUTPUT`` cells (what nbval compares).

Usage: ``.venv/bin/python scripts/store_checked_outputs.py notebooks/02_fsdp.ipynb [...]``. Every other
cell is stored without outputs, so the notebooks stay small and free of machine-specific text (run
ids, paths, timings). Run it after changing a checked cell; ``pytest --nbval-lax notebooks/`` then
compares those cells' outputs with a fresh run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

MARK = "# NBVAL_CHECK_OUTPUT"


def store(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    count = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if cell.source.startswith(MARK):
            count += 1
            cell.execution_count = count
        else:
            cell.outputs, cell.execution_count = [], None
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)
    print(f"{path}: stored the outputs of {count} checked cell(s)")


if __name__ == "__main__":
    os.environ.setdefault("SGPU_MAGIC_WIDGETS", "0")
    for arg in sys.argv[1:]:
        store(Path(arg))
