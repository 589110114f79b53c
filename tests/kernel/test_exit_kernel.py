"""How ranks end, in a real Jupyter kernel driven through jupyter_client as a notebook frontend drives it.

- the wedge guard: ranks that return and then block for good in their exit path still end SUCCEEDED
  with their values after the teardown grace (``%config DistributedMagics.teardown_grace_s``), and the
  summary names them; nothing of theirs is left running;
- ``sys.argv`` inside a ``%%distributed`` cell, and ``argparse`` reading its defaults;
- ``;`` at the end of a cell's last line suppresses its value, by IPython's rule;
- a rank that ends through ``sys.exit(0)`` is noted with its line.
"""

from __future__ import annotations

import ast
import re

import pytest

from helpers import wait_gone
from kernel_utils import execute, start_kernel, stop_kernel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kernel():
    km, kc = start_kernel()
    out = execute(kc, "%config DistributedMagics.teardown_grace_s = 1\nfrom sgpu_magic import distributed")
    assert out.error is None, out.error
    yield kc
    stop_kernel(km, kc)


def ok(kc, code: str):
    out = execute(kc, code, timeout_s=300)
    assert out.error is None, (out.error, out.stdout, out.stderr)
    return out


WEDGED_FUNCTION = '''
@distributed(gpus=2, mlflow=False)
def returns_then_wedges():
    """Returns, then blocks for good while its locals are freed: a destructor waits for a lock a thread holds
    (as ~ProcessGroupGloo joins a gloo thread that waits for the GIL); SIGTERM alone does not end it."""
    import os, signal, threading
    signal.signal(signal.SIGTERM, lambda *_: None)
    lock, taken = threading.Lock(), threading.Event()
    def hold():
        lock.acquire(); taken.set(); threading.Event().wait()
    threading.Thread(target=hold, daemon=True).start()
    taken.wait()
    class Reducer:
        def __del__(self):
            lock.acquire()
    reducer = Reducer()
    return {"rank": int(os.environ["RANK"]), "pid": os.getpid()}

values = returns_then_wedges.distributed()
print("values:", values, returns_then_wedges.last_job.state.value)
'''

WEDGED_CELL = """%%distributed --gpus 2 --no-mlflow -o cell_job
import atexit, os, threading
lock, taken = threading.Lock(), threading.Event()
def hold():
    lock.acquire(); taken.set(); threading.Event().wait()
threading.Thread(target=hold, daemon=True).start()
taken.wait()
atexit.register(lock.acquire)  # the exit path needs the lock the thread holds
("cell value", os.getpid())
"""


def test_ranks_that_wedge_after_returning_succeed_with_their_values_after_the_grace(kernel):
    out = ok(kernel, WEDGED_FUNCTION)
    values = ast.literal_eval(re.search(r"^values: (\[.*\]) succeeded$", out.stdout, re.M).group(1))
    assert [v["rank"] for v in values] == [0, 1]
    for rank in (0, 1):
        assert (
            f"sgpu_magic: rank {rank} needed the teardown grace: it returned its value but had not exited 1 s "
            f"later (teardown_grace_s), so sgpu_magic ended it (SIGKILL); its value is kept"
        ) in out.stdout
    assert wait_gone([v["pid"] for v in values]) == []

    out = ok(kernel, WEDGED_CELL)
    (value,) = out.results
    assert ast.literal_eval(value)[0] == "cell value"
    assert "sgpu_magic: rank 1 needed the teardown grace" in out.stdout and "(SIGTERM)" in out.stdout
    assert ast.literal_eval(ok(kernel, "cell_job.state.value").results[0]) == "succeeded"
    pids = ast.literal_eval(ok(kernel, "[v[1] for v in cell_job.results]").results[0])
    assert wait_gone(pids) == []


ARGV_CELL = """%%distributed --gpus 2 --no-mlflow
import argparse, sys
parser = argparse.ArgumentParser(description="pasted from a script")
parser.add_argument("--total-epochs", type=int, default=3)
(sys.argv, parser.parse_args().total_epochs)
"""


def test_sys_argv_in_a_cell_is_the_cells_name_so_parse_args_reads_defaults(kernel):
    assert ok(kernel, ARGV_CELL).results == ["(['%%distributed cell'], 3)"]


@pytest.mark.parametrize(
    "last_line, rank_values",
    [
        ("big;", [None, None]),  # nothing pickled back
        ("big ;  # a comment after the semicolon", [None, None]),
        ("big  # a semicolon in a comment;", ["list", "list"]),
        ("len('a;')", ["int", "int"]),
    ],
)
def test_a_semicolon_at_the_end_of_the_cell_suppresses_its_value_as_ipython_does(kernel, last_line, rank_values):
    out = ok(kernel, f"%%distributed --gpus 2 --no-mlflow -o quiet_job\nbig = list(range(10_000))\n{last_line}")
    assert bool(out.results) is (rank_values[0] is not None)
    types = ok(kernel, "[r if r is None else type(r).__name__ for r in quiet_job.results]").results
    assert ast.literal_eval(types[0]) == rank_values


EXIT_CELL = """%%distributed --gpus 2 --no-mlflow
import os, sys
if os.environ["RANK"] == "0":
    sys.exit(0)
"trained"
"""


def test_a_rank_that_calls_sys_exit_0_in_a_cell_is_noted_with_its_line(kernel):
    out = ok(kernel, EXIT_CELL)
    assert out.results == []  # the cell's value is rank 0's: None
    assert re.search(r"sgpu_magic: rank 0 called sys\.exit\(0\) at Cell In\[\d+\]:4; it returned nothing", out.stdout)
