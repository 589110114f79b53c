"""Detached jobs in real Jupyter kernels (jupyter_client): a ``%%distributed --detach`` job printing a line every
0.4 s survives its kernel's SIGKILL and a ``restart_kernel()`` of the kernel that attached to it; a new kernel
attaches with ``%distributed_attach`` and sees every line from the first (none lost, none doubled) and the result.
A job started without ``--detach`` still never outlives its kernel (tests/kernel/test_kernel.py, C12)."""

from __future__ import annotations

import re

import pytest

from helpers import wait_for, wait_gone
from kernel_utils import execute, start_kernel, stop_kernel

pytestmark = pytest.mark.slow

START_DEADLINE_S = 120.0  # a fresh keeper importing torch, then two ranks, on a busy 2-core box
LINES = 60  # 24 s: still running after the second kernel's restart

CELL = f"""%%distributed --gpus 2 --detach --background --no-widgets -o job
import time
for i in range({LINES}):
    print("line", i, flush=True)
    time.sleep(0.4)
"done"
"""


def rank_lines(text: str, rank: int) -> list[str]:
    return re.findall(rf"^\[rank {rank}\] (line \d+)$", text, re.MULTILINE)


def test_a_detached_job_survives_a_kernel_sigkill_and_a_restart_and_a_new_kernel_gets_every_line_and_the_result(
    tmp_path,
):
    env = {"SGPU_MAGIC_HOME": str(tmp_path / "home"), "SGPU_MAGIC_KEEPER_LINGER_S": "0.5"}
    km, kc = start_kernel(cwd=tmp_path, env=env)
    try:
        out = execute(kc, CELL)
        assert out.error is None, out.error
        out = execute(kc, "print(job.job_id)")
        assert out.error is None, out.error
        job_id = out.stdout.strip()
        log = tmp_path / "home" / "runs" / job_id / "logs" / "rank_1.log"
        wait_for(lambda: log.exists() and "line 2" in log.read_text(), START_DEADLINE_S, "rank 1's third line")
        out = execute(kc, "print(job.launcher.pid)")  # handed over, since its ranks print
        assert out.error is None, out.error
        keeper_pid = int(out.stdout)
        km.shutdown_kernel(now=True)  # SIGKILL: nothing runs in the kernel
    finally:
        stop_kernel(km, kc)
    assert "line 3" in log.read_text() or wait_for(lambda: "line 3" in log.read_text(), 30, "a line after the kill")

    km, kc = start_kernel(cwd=tmp_path, env=env)
    try:
        out = execute(
            kc, "%distributed_attach --last --no-widgets -o job\nprint(f'{job.job_id} {job.state.value}\\n', end='')"
        )
        assert out.error is None, out.error
        assert f"{job_id} running" in out.stdout
        km.restart_kernel(now=False)  # graceful: the kernel's exit code runs, and leaves the detached job alone
        kc.wait_for_ready(timeout=90)
        assert execute(kc, "%load_ext sgpu_magic").error is None
        out = execute(
            kc,
            f"%distributed_attach {job_id[-6:]} --no-widgets -o job\nprint(f'state {{job.state.value}}\\n', end='')\nprint(job.result())",
        )
        assert out.error is None, out.error
        assert "state running\n" in out.stdout, out.stdout  # it outlived the restart too
    finally:
        stop_kernel(km, kc)
    assert "['done', 'done']" in out.stdout
    for rank in (0, 1):  # every line once: those printed before each attach, and after
        assert rank_lines(out.stdout, rank) == [f"line {i}" for i in range(LINES)], out.stdout
    assert f"job {job_id} (attached) succeeded" in out.stdout
    assert wait_gone([keeper_pid], 30) == []  # the keeper exits once it holds no run


TRAIN = """%%distributed --session
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    loss = model(torch.ones(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

WEIGHTS = "%distributed_pull model --rank 0 -o pulled\nprint(pulled.weight.tolist(), pulled.bias.tolist())"


def test_a_detached_session_with_a_trained_model_survives_a_kernel_sigkill_and_a_new_kernel_pulls_the_same_weights(
    tmp_path,
):
    env = {"SGPU_MAGIC_HOME": str(tmp_path / "home"), "SGPU_MAGIC_KEEPER_LINGER_S": "0.5"}
    km, kc = start_kernel(cwd=tmp_path, env=env)
    try:
        for code in ("%distributed_session start --gpus 2 --detach --no-mlflow --no-widgets -o sess", TRAIN):
            out = execute(kc, code)
            assert out.error is None, out.error
        out = execute(kc, WEIGHTS)
        assert out.error is None, out.error
        trained = out.stdout.strip()
        out = execute(kc, "print(sess.job.job_id, *sess.pids.values(), sess.job.launcher.pid)")
        job_id, *pids = out.stdout.split()
        km.shutdown_kernel(now=True)  # SIGKILL
    finally:
        stop_kernel(km, kc)

    km, kc = start_kernel(cwd=tmp_path, env=env)
    try:
        out = execute(kc, "%distributed_attach --last -o sess\nprint(type(sess).__name__, sess.job.job_id)")
        assert out.error is None, out.error
        assert f"Session {job_id}" in out.stdout
        out = execute(kc, WEIGHTS)
        assert out.error is None, out.error
        assert out.stdout.strip() == trained  # the weights the dead kernel's session trained
        out = execute(kc, "%distributed_session stop")
        assert out.error is None, out.error
    finally:
        stop_kernel(km, kc)
    assert wait_gone([int(p) for p in pids], 30) == []  # its ranks and the keeper
