"""Stacks in a real Jupyter kernel: interrupting the broadcast/sleep hang of issue 21 says where each rank was, with
the cell named as the notebook numbers it (``Cell In[3]``)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from sgpu_magic.front.cell import CELL_FILENAME
from sgpu_magic.launch.stacks import CodeMap, take_stacks

from helpers import wait_for
from kernel_utils import collect, execute, start_kernel, stop_kernel

pytestmark = pytest.mark.slow

START_DEADLINE_S = 120.0  # two fresh ranks on a busy 2-core box

BODY = """
import os, time, torch
import torch.distributed as dist
from sgpu_magic import runtime
dist.init_process_group(runtime.backend())
open(os.path.join(piddir, str(runtime.get_global_rank())), "w").write(str(os.getpid()))
t = torch.zeros(1)
if runtime.get_global_rank() == 0:
    dist.broadcast(t, src=1)
while True:
    time.sleep(0.05)
"""
"""The cell after its ``%%distributed`` line: notebook line 9 is rank 0's broadcast, 11 rank 1's sleep."""


def test_interrupting_a_hung_cell_says_where_each_rank_was():
    km, kc = start_kernel()  # In[1]: %load_ext sgpu_magic
    try:
        out = execute(kc, "import tempfile\npiddir = tempfile.mkdtemp()\nprint(piddir)")  # In[2]
        assert out.error is None, out.error
        piddir = out.stdout.strip()
        msg_id = kc.execute("%%distributed --gpus 2 --timeout 600\n" + textwrap.dedent(BODY).lstrip("\n"))  # In[3]

        def pids():  # {rank: pid} once both ranks wrote theirs
            written = {int(p.name): p.read_text() for p in Path(piddir).iterdir()}
            return {r: int(pid) for r, pid in written.items()} if len(written) == 2 and all(written.values()) else None

        ranks = wait_for(pids, START_DEADLINE_S, "both ranks' pids")
        # from outside, as the launch host will: until rank 0 is in its broadcast and rank 1 in its sleep
        code = CodeMap({CELL_FILENAME: "the cell"}, {CELL_FILENAME: "\n" + textwrap.dedent(BODY).lstrip("\n")})

        def in_place():
            where = {r: s.where for r, s in take_stacks(ranks, code).items()}
            return where == {0: "dist.broadcast at the cell line 9", 1: "time.sleep at the cell line 11"}

        wait_for(in_place, 60, "rank 0 in dist.broadcast and rank 1 in time.sleep")
        km.interrupt_kernel()
        error = collect(kc, msg_id, timeout_s=60).error
        assert error is not None and error["ename"] == "JobCancelledError", error
        assert re.fullmatch(
            r"job \S+ was interrupted; every rank was stopped\. Logs: \S+/logs\. Where the ranks still running were: "
            r"rank 0: dist\.broadcast at Cell In\[3\] line 9; rank 1: time\.sleep at Cell In\[3\] line 11 "
            r"\(their stacks: \S+/stacks\)\.",
            error["evalue"],
        ), error["evalue"]
    finally:
        stop_kernel(km, kc)
