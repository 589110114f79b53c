"""Faults in live sessions, injected from outside or by the cells: a rank SIGKILLed while the session is idle, and
a rank blocked in a C++ collective that an interrupt cannot reach. Each must end in a clear state, leave no rank
and no GPU lease behind, and let ``restart`` bring a working session."""

from __future__ import annotations

import os
import signal

import pytest

from sgpu_magic import Session
from sgpu_magic.errors import CellInterruptedError, SessionError
from sgpu_magic.launch.leases import LeaseRegistry
from sgpu_magic.session.core import INTERRUPT_GRACE_S

from helpers import wait_for, wait_gone

pytestmark = pytest.mark.slow


@pytest.fixture
def fake_gpus(monkeypatch, tmp_path):
    """Two fake GPUs and a private lease registry, so the session's leases are exercised (ranks run on CPU)."""
    monkeypatch.setenv("SGPU_MAGIC_FAKE_GPUS", "2 x H100")
    monkeypatch.setenv("SGPU_MAGIC_LEASE_DIR", str(tmp_path / "leases"))
    return LeaseRegistry(tmp_path / "leases")


def _holders(registry: LeaseRegistry) -> list[str]:
    return [h["job_id"] for h in registry.snapshot()["holders"]]


def test_a_rank_sigkilled_while_idle_breaks_the_session_and_frees_everything(ip, fake_gpus):
    session = Session(gpus=2, widgets=False, mlflow=False, name="chaos_kill")
    try:
        assert _holders(fake_gpus) == [session.job.job_id]
        session.run_cell("state = 42")
        pids = session.pids
        os.kill(pids[1], signal.SIGKILL)
        assert wait_gone(pids.values()) == []
        wait_for(lambda: session.broken is not None, 30, "the session to notice the dead rank")
        assert "rank 1 died (killed by signal SIGKILL (9))" in session.broken
        wait_for(lambda: _holders(fake_gpus) == [], 30, "the session's leases to be released")
        with pytest.raises(SessionError, match=r"session chaos_kill is broken: rank 1 died \(killed by signal SIGKILL"):
            session.run_cell("state")
        session.restart()
        assert _holders(fake_gpus) == [session.job.job_id]
        assert session.run_cell("'state' in globals()") == [False, False]
    finally:
        session.stop()
    assert wait_gone(session.pids.values()) == []
    wait_for(lambda: _holders(fake_gpus) == [], 30, "the leases to be released after stop")


def test_a_rank_blocked_in_a_collective_is_named_after_the_interrupt_grace(ip, fake_gpus, tmp_path):
    session = Session(gpus=2, widgets=False, mlflow=False, name="chaos_stuck")
    try:
        session.run_cell("import torch, torch.distributed as dist\ndist.init_process_group('gloo')")
        marker = tmp_path / "entered"
        import threading

        errors: list[BaseException] = []

        def stuck() -> None:
            try:  # only rank 0 runs it: its all_reduce waits in gloo's C++ for rank 1, out of Python's reach
                session.run_cell(
                    f"import pathlib\npathlib.Path({str(marker)!r}).touch()\ndist.all_reduce(torch.ones(1))",
                    ranks=[0],
                )
            except BaseException as exc:  # noqa: BLE001 - the test looks at it
                errors.append(exc)

        thread = threading.Thread(target=stuck)
        thread.start()
        wait_for(marker.exists, 60, "rank 0 to enter the collective")
        session.interrupt()
        thread.join(INTERRUPT_GRACE_S + 30)
        assert not thread.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], CellInterruptedError), errors
        assert f"rank(s) 0 did not return within {INTERRUPT_GRACE_S:g} s of the interrupt" in str(errors[0])
        with pytest.raises(SessionError, match=r"session chaos_stuck needs a restart: rank\(s\) 0 did not return"):
            session.run_cell("1")
        old = session.pids
        session.restart()
        assert wait_gone(old.values()) == []
        assert session.run_cell("1") == [1, 1]
    finally:
        session.stop()
    assert wait_gone(session.pids.values()) == []
    wait_for(lambda: _holders(fake_gpus) == [], 30, "the leases to be released after stop")
