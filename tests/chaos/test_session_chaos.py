"""Faults in live sessions, injected from outside or by the cells: every kind of the session chaos suite once
through a real kernel (tests/chaos/sessions.py; its long version's table is in RELIABILITY.md), and, in this
process, a rank SIGKILLed while the session is idle, a rank blocked in a C++ collective that an interrupt cannot
reach (released by recover, with its state), and one blocked outside any collective (not). Each must end in a
clear state, leave no rank and no GPU lease behind, and let ``restart`` bring a working session."""

from __future__ import annotations

import os
import re
import signal

import pytest

from sgpu_magic import Session
from sgpu_magic.errors import CellInterruptedError, SessionError
from sgpu_magic.launch.leases import LeaseRegistry
from sgpu_magic.session.core import INTERRUPT_GRACE_S

from helpers import wait_for, wait_gone

pytestmark = pytest.mark.slow


def test_every_session_fault_kind_ends_cleanly_with_the_survivors_state_kept(tmp_path):
    from sessions import SESSION_FAULTS, run_session_suite, session_table

    lines: list[str] = []
    outcomes = run_session_suite(None, seed=1, flood_bytes=1 << 20, flood_cells=10, workdir=tmp_path, log=lines.append)
    print("\n".join(lines))
    print(session_table(outcomes))
    assert {o.fault for o in outcomes} >= set(SESSION_FAULTS) - {"disk_full"}, lines
    failed = {o.fault: o.problems for o in outcomes if not o.ok}
    assert not failed, failed


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


def _interrupted(session: Session, code: str, marker, ranks: list[int]) -> BaseException:
    """Run ``code`` on ``ranks`` from a thread; once it touched ``marker``, interrupt; what the cell raised."""
    import threading

    errors: list[BaseException] = []

    def run() -> None:
        try:
            session.run_cell(code, ranks=ranks)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(marker.exists, 60, "the cell to start")
    session.interrupt()
    thread.join(INTERRUPT_GRACE_S + 60)
    assert not thread.is_alive() and len(errors) == 1, errors
    return errors[0]


def test_a_rank_blocked_in_a_collective_is_released_with_its_state(ip, fake_gpus, tmp_path):
    """Only rank 0 runs the cell: its all_reduce waits in gloo's C++ for rank 1, out of Python's reach; after the
    interrupt's grace the session releases it by itself (auto_recover), both ranks keep their state."""
    session = Session(gpus=2, widgets=False, mlflow=False, name="chaos_stuck")
    try:
        session.run_cell("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\nkept = [1, 2]")
        marker = tmp_path / "entered"
        code = f"import pathlib\npathlib.Path({str(marker)!r}).touch()\ndist.all_reduce(torch.ones(1))"
        error = _interrupted(session, code, marker, [0])
        assert isinstance(error, CellInterruptedError), error
        assert "was interrupted; session chaos_stuck recovered in" in str(error)
        assert "rank 0 (in dist.all_reduce at session chaos_stuck cell 2 line 3) returned" in str(error)
        assert session.state.value == "idle" and _holders(fake_gpus) == [session.job.job_id]
        assert session.run_cell("t = torch.ones(1) * len(kept)\ndist.all_reduce(t)\nt.item()") == [4.0, 4.0]
    finally:
        session.stop()
    assert wait_gone(session.pids.values()) == []
    wait_for(lambda: _holders(fake_gpus) == [], 30, "the leases to be released after stop")


def test_a_rank_blocked_outside_torch_distributed_is_not_recovered_and_restart_still_works(ip, fake_gpus, tmp_path):
    """A rank that ignores the interrupt outside any collective (SIGINT blocked, then a long sleep): no automatic
    recover (not known safe); recover() releases nothing it waits on and says so, naming where it is; the session
    stays broken; restart brings fresh ranks."""
    session = Session(gpus=2, widgets=False, mlflow=False, name="chaos_native")
    try:
        marker = tmp_path / "entered"
        code = (
            f"import pathlib, signal, time\nsignal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGINT}})\n"
            f"pathlib.Path({str(marker)!r}).touch()\ntime.sleep(3600)"
        )
        error = _interrupted(session, code, marker, [0])
        assert isinstance(error, CellInterruptedError), error
        assert re.search(
            r"session chaos_native is broken: rank\(s\) 0 did not return within 5 s of the interrupt \(blocked "
            r"outside Python: rank 0: time\.sleep at session chaos_native cell 1 line 4\); run %distributed_session "
            r"recover",
            str(error),
        ), error
        with pytest.raises(SessionError) as raised:
            session.recover(timeout_s=2)
        assert str(raised.value) == (
            "session chaos_native could not be recovered: rank(s) 0 did not return within 2 s of their connections "
            "to the other ranks being closed (blocked outside torch.distributed: rank 0: time.sleep at session "
            "chaos_native cell 1 line 4); run %distributed_session restart (or sess.restart()) for fresh ranks "
            "(their state is lost)"
        )
        assert session.state.value == "broken"
        with pytest.raises(SessionError, match=r"session chaos_native could not be recovered"):
            session.run_cell("1")
        old = session.pids
        session.restart()
        assert wait_gone(old.values()) == []
        assert session.run_cell("1") == [1, 1]
    finally:
        session.stop()
    assert wait_gone(session.pids.values()) == []
    wait_for(lambda: _holders(fake_gpus) == [], 30, "the leases to be released after stop")
