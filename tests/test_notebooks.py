"""The example notebooks beyond the quickstart (which test_kernel.py checks), executed headless in a real kernel."""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def execute(name: str):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    assert all(not c.outputs for c in nb.cells if c.cell_type == "code"), "the notebook is stored with outputs"
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def cell_text(nb, needle: str) -> tuple[str, str]:
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and needle in c.source]
    stream = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
    result = "".join(o.data.get("text/plain", "") for o in cell.outputs if o.output_type == "execute_result")
    return stream, result


@pytest.mark.slow
def test_data_checkpoint_notebook_streams_once_and_resumes():
    nb = execute("05_data_checkpoint.ipynb")
    stream, result = cell_text(nb, "first = train.distributed(")
    assert "files fetched: 64 | most requests for one file: 1" in stream
    assert ast.literal_eval(result) == [[1, 2], [1, 2]]
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank}: epoch 2 read 32 files" in stream
    stream, result = cell_text(nb, "second = train.distributed(")
    assert "[rank 0] rank 0: resumed from epoch-2" in stream and "[rank 1] rank 1: resumed from epoch-2" in stream
    assert "most requests for one file: 1" in stream  # the second job read only the cache
    assert ast.literal_eval(result) == [[3, 4], [3, 4]]
    stream, _ = cell_text(nb, "model = nn.Linear(10, 1)")
    assert "(small)" in stream
