"""Execute a notebook headless in a real kernel, print each cell's text output as it finishes,
and save the executed copy next to it as ``<name>.out.ipynb`` (ignored by git).

Usage: ``.venv/bin/python scripts/run_notebook.py notebooks/01_quickstart.ipynb``. Exits non-zero
when a cell raises.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from traitlets.config import Config


def _print_outputs(cell, cell_index, **_) -> None:
    if cell.cell_type != "code":
        return
    print(f"--- cell {cell_index}: {cell.source.splitlines()[0] if cell.source else ''}", flush=True)
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            print(out.text, end="", flush=True)
        elif out.output_type in ("execute_result", "display_data") and "text/plain" in out.get("data", {}):
            print(out.data["text/plain"], flush=True)
        elif out.output_type == "error":
            print("\n".join(out.traceback), flush=True)


def main(path: str) -> int:
    os.environ.setdefault("SGPU_MAGIC_WIDGETS", "0")  # no widget manager here: plain [rank N] text
    src = Path(path)
    nb = nbformat.read(src, as_version=4)
    # the kernel talks to this process over IPC sockets in a private temporary folder rather than TCP on
    # 127.0.0.1, which it warns about ("Kernel is running over TCP without encryption")
    sockets = tempfile.mkdtemp(prefix="sgpu_magic_kernel_")
    ipc = Config({"KernelManager": {"transport": "ipc", "ip": os.path.join(sockets, "kernel")}})
    client = NotebookClient(
        nb,
        config=ipc,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(src.parent)}},
        on_cell_executed=_print_outputs,
    )
    t0 = time.perf_counter()
    try:
        client.execute()
        code = 0
    except CellExecutionError:
        code = 1
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    out = src.with_suffix(".out.ipynb")
    nbformat.write(nb, out)
    print(f"--- {src}: {'ok' if code == 0 else 'FAILED'} in {time.perf_counter() - t0:.1f} s; executed copy: {out}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "notebooks/01_quickstart.ipynb"))
