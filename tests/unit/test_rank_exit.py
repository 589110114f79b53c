"""The rank's exit path (sgpu_magic.rank.exit and the seam it uses, sgpu_magic._compat.torch) in this process: what it does to the interpreter's own registries."""

import gc
import subprocess
import sys
import weakref

import torch.library  # noqa: F401 - the exit path looks for torch.library's finalizers

from sgpu_magic._compat import torch as torch_compat


class _Cycle:
    pass


def test_skipping_torch_library_finalizers_survives_a_collection_that_runs_finalizers():
    """A garbage collection while the finalizer registry is copied ran finalizers that deleted their entries:
    ``RuntimeError: dictionary changed size during iteration`` in ranks that had returned their value
    (MLflow's async logging leaves such cycles behind). Cyclic garbage with finalizers, and a collection on
    nearly every allocation, makes that collection happen during the copy."""
    fired = []
    threshold = gc.get_threshold()
    gc.collect()
    gc.disable()
    try:
        holder = []
        for i in range(2000):
            c = _Cycle()
            c.me = c
            weakref.finalize(c, fired.append, i)
            holder.append(c)
        del c
        gc.collect(0)  # the cycles move to the middle generation, which a collection reaches every 10th time
        del holder  # now they are garbage only a collection frees
        gc.set_threshold(1)
        gc.enable()
        torch_compat.skip_library_finalizers()
    finally:
        gc.set_threshold(*threshold)
        gc.enable()
        gc.collect()
    assert len(fired) == 2000  # the cycles were collected (after the copy), their finalizers ran once


_EXIT_WITH_A_BROKEN_SPEED_UP = """
import atexit
from sgpu_magic._compat import torch as torch_compat
from sgpu_magic.rank import exit as rank_exit

def broken():
    raise RuntimeError("dictionary changed size during iteration")

torch_compat.skip_library_finalizers = broken
atexit.register(print, "atexit handler ran")
rank_exit.exit_like_python()
import os
os._exit(0)
"""


def test_the_exit_path_reports_a_failing_speed_up_and_still_runs_the_atexit_handlers():
    # in a process of its own: the exit path shuts down threading, which this process still needs
    run = subprocess.run(
        [sys.executable, "-c", _EXIT_WITH_A_BROKEN_SPEED_UP], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "atexit handler ran\n"
    assert "RuntimeError: dictionary changed size during iteration" in run.stderr
