"""The rank's import hook (:func:`sgpu_magic._util.imports.after_import`), in fresh interpreters: several guards
waiting for the same module each run once it is imported (a cold rank's torch.distributed has three: process
groups kept, collectives timed, and so on), and none makes the import recurse."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
from sgpu_magic._util.imports import AfterImport, after_import
seen = []
def first(module): seen.append(("first", module.__name__))
def second(module): seen.append(("second", module.__name__))
after_import("xml.dom.minidom", first)
after_import("xml.dom.minidom", second)
after_import("xml.dom.minidom", first)  # already waiting: not added twice
assert sum(isinstance(f, AfterImport) for f in sys.meta_path) == 1
import xml.dom.minidom
after_import("xml.dom.minidom", second)  # imported already: at once
print(seen)
"""


def test_two_hooks_on_one_module_each_run_once_and_a_late_one_at_once():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "[('first', 'xml.dom.minidom'), ('second', 'xml.dom.minidom'), ('second', 'xml.dom.minidom')]"
    )


def test_a_cold_rank_s_hooks_on_torch_distributed_import_it_without_recursion():
    """What a cold rank does before its code imports torch (found by a Ray job: each rank a fresh interpreter)."""
    code = (
        "from sgpu_magic.rank import exit as rank_exit, steps\n"
        "rank_exit.keep_process_groups()\n"
        "steps.begin()\n"
        "import torch, torch.distributed as dist\n"
        "print(getattr(dist.all_reduce, '__sgpu_timed__', False), getattr(torch.autograd.backward, '__sgpu_timed__', False))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True True"
