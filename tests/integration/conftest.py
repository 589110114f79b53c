"""Fixtures the integration tests share."""

from __future__ import annotations

import contextlib
import os

import psutil
import pytest

from sgpu_magic.launch.client import get_host
from sgpu_magic.testing import wait_for_tracking

from helpers import run_dirs, wait_for


def _pids() -> set[int]:
    """Every PID on the machine (a directory listing: cheap enough to take around each example)."""
    return set(psutil.pids())


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return "(gone)"


def _under(pid: int, roots: tuple[int, ...]) -> bool:
    """Whether process ``pid`` runs under one of ``roots`` (one already gone does not)."""
    try:
        proc = psutil.Process(pid)
        while proc is not None:
            if proc.pid in roots:
                return True
            proc = proc.parent()
    except psutil.Error:
        return False
    return False


_TRACKER = "from multiprocessing.resource_tracker import main"


def _pool_started(host: int) -> bool:
    """Whether the launch host has made its forkserver (a fork of itself: its ready markers exist once it has) and
    started its resource tracker (a fresh interpreter, past its exec)."""
    if not all(path.exists() for path in get_host().ready_markers):
        return False
    return any(_TRACKER in _cmdline(child.pid) for child in psutil.Process(host).children())


@pytest.fixture(scope="module")
def settled(ip, sgpu_home):
    """A check that a block starts no process and creates no run directory.

    Ranks run under the launch host ``%load_ext`` started (its children when cold, its forkserver's when
    warm), so processes are looked for under both the kernel and the host. What the extension starts in
    the background as it loads is waited for first: the host's forkserver and resource tracker (once
    the host has imported torch, seconds on a busy machine) and the kernel's mlflow import.
    """
    kernel, host = os.getpid(), get_host().pid
    if os.environ.get("SGPU_MAGIC_START_METHOD", "forkserver") != "subprocess":
        wait_for(lambda: _pool_started(host), 120.0, "the launch host's forkserver to start")
    wait_for_tracking(120.0)  # the kernel's background import of mlflow

    @contextlib.contextmanager
    def nothing_starts():
        pids, runs = _pids(), run_dirs(sgpu_home)
        yield
        started = [pid for pid in _pids() - pids if _under(pid, (kernel, host))]
        assert started == [], f"processes were started: {[(pid, _cmdline(pid)) for pid in started]}"
        assert run_dirs(sgpu_home) == runs, "a run directory was created"
        assert psutil.pid_exists(host), "the launch host is gone"

    return nothing_starts


@pytest.fixture
def keeper_home(tmp_path, monkeypatch):
    """A sgpu_magic home of the test's own (its run keeper is the test's), whose keeper exits 0.5 s after its last
    run; a keeper a failed test left is killed, so nothing outlives the test."""
    import signal

    from sgpu_magic.launch.keeper import running_keeper

    home = tmp_path / "home"
    monkeypatch.setenv("SGPU_MAGIC_HOME", str(home))
    monkeypatch.setenv("SGPU_MAGIC_KEEPER_LINGER_S", "0.5")
    yield home
    keeper = running_keeper(home)
    if keeper is not None:
        os.kill(keeper.pid, signal.SIGKILL)
