"""Warm launches: ranks fork from the launch host's forkserver (torch preloaded) and stay correct."""

from __future__ import annotations

import json
import os
import re

import pytest

from sgpu_magic import distributed
from sgpu_magic.launch.client import get_host
from sgpu_magic.rundir import host_warm_marker

from helpers import wait_for


@distributed(gpus=2)
def probe(name):
    import sys

    return os.getcwd(), os.environ.get(name), sys.path[:], os.getppid(), "torch" in sys.modules


def wait_warm(timeout_s: float = 120.0, launch_first: bool = True) -> None:
    """Poll until the host's forkserver has finished preloading (its marker file exists).

    A launch first, since the launch is what restarts the forkserver when sys.path's packages changed.
    """
    if launch_first:
        probe.distributed("X")
    marker = host_warm_marker(get_host().log_path)
    wait_for(marker.exists, timeout_s, f"the forkserver to finish preloading ({marker})")


def start_method(fn) -> str:
    return json.loads((fn.last_job.run_dir / "status.json").read_text())["start_method"]


@pytest.mark.slow  # ~20 s: the warm forkserver is started again
def test_warm_ranks_see_the_kernels_current_cwd_env_and_sys_path(tmp_path, monkeypatch):
    wait_warm()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SGPU_TEST_VALUE", "one")
    monkeypatch.syspath_prepend(str(tmp_path / "extra"))
    (cwd, value, path, _, torch_loaded), _ = probe.distributed("SGPU_TEST_VALUE")
    assert start_method(probe) == "forkserver" and torch_loaded
    assert (cwd, value) == (str(tmp_path), "one") and str(tmp_path / "extra") in path
    monkeypatch.delenv("SGPU_TEST_VALUE")
    (_, value, _, _, _), _ = probe.distributed("SGPU_TEST_VALUE")
    assert value is None  # a variable removed in the kernel is gone in the next launch


def test_local_module_edited_between_launches_is_imported_fresh(tmp_path, monkeypatch):
    wait_warm()
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "sgpu_local_mod.py"

    @distributed(gpus=1)
    def read_value():
        import sgpu_local_mod

        return sgpu_local_mod.VALUE

    module.write_text("VALUE = 1\n")
    assert read_value.distributed() == [1]
    module.write_text("VALUE = 2\n")
    assert read_value.distributed() == [2]


@pytest.mark.slow  # ~20 s: the warm forkserver is started again
def test_a_package_change_restarts_the_warm_state(tmp_path, monkeypatch):
    """A site-packages folder that changes (as %pip install changes it) makes the next ranks use a new forkserver."""
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    wait_warm()  # a new site-packages entry on sys.path: the pool restarts
    probe.distributed("X")
    assert start_method(probe) == "forkserver"
    before = probe.distributed("X")[0][3]
    (site / "newpkg-1.0.dist-info").mkdir()  # what an install does to site-packages
    parent = probe.distributed("X")[0][3]
    # cold while the new forkserver preloads, or forked from the new one if the launch waited for it
    assert start_method(probe) == "subprocess" or parent != before
    wait_warm(launch_first=False)
    after = probe.distributed("X")[0][3]
    assert start_method(probe) == "forkserver" and after != before


def test_a_killed_rank_does_not_poison_the_next_warm_launch():
    wait_warm()

    @distributed(gpus=2)
    def killed():
        import signal

        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return 0

    from sgpu_magic.errors import RankFailedError

    with pytest.raises(
        RankFailedError,
        match=r"rank 1 failed \(root cause\): exited without a Python exception "
        r"\(killed by signal SIGKILL \(9\)\)",
    ):
        killed.distributed()
    assert probe.distributed("X")[1][4] is True
    assert start_method(probe) == "forkserver"


def test_a_warm_rank_imports_no_torch_module_of_its_own():
    """Everything torch that a warm rank needs before the user's code runs (elastic's per-rank wrapper
    included) comes preloaded from the forkserver: a module imported after the fork would cost the
    rank its import time at every launch (elastic's multiprocessing package was ~25 ms of CPU per rank).

    Preloaded objects sit in gc's permanent generation (frozen right before the forkserver was forked), so the
    modules that ``gc.get_objects()`` sees in a rank are the ones it imported itself; and the host's own serving
    modules (imported after the fork) are not in a rank at all. A fresh host first: its forkserver is a fork of the
    host (an earlier test may have left one restarted as a fresh interpreter, which preloads for itself)."""
    from sgpu_magic.launch.client import shutdown_host

    shutdown_host()
    wait_warm()

    @distributed(gpus=2)
    def own_modules():
        import gc
        import sys
        import types

        unfrozen = sorted(m.__name__ for m in gc.get_objects() if isinstance(m, types.ModuleType))
        return unfrozen, sorted(name for name in sys.modules if name.startswith("sgpu_magic.launch"))

    results = own_modules.distributed()
    assert start_method(own_modules) == "forkserver"
    for unfrozen, launch_modules in results:
        assert not [n for n in unfrozen if n.split(".")[0] in ("torch", "sgpu_magic")], unfrozen
        # what forks the forkserver (the host's entry and its pool), nothing the host serves with
        assert launch_modules == [
            "sgpu_magic.launch",
            "sgpu_magic.launch.host",
            "sgpu_magic.launch.host.boot",
            "sgpu_magic.launch.host.warm_pool",
        ], launch_modules


def test_cold_start_method_can_be_forced(monkeypatch):
    """SGPU_MAGIC_START_METHOD=subprocess makes a new host start every rank as a fresh interpreter."""
    from sgpu_magic.launch.client import shutdown_host

    shutdown_host()
    monkeypatch.setenv("SGPU_MAGIC_START_METHOD", "subprocess")
    try:
        (_, _, _, _, torch_loaded), _ = probe.distributed("X")
        assert start_method(probe) == "subprocess" and not torch_loaded
    finally:
        shutdown_host()


@distributed(gpus=1, max_restarts=1, mlflow=False, widgets=False, timeout=120)
def env_after_a_restart(go: str):
    """Fails its first attempt once ``go`` exists (the test makes it after another job started), then says what its
    environment holds."""
    import os
    import time

    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.02)
        raise ValueError("the first attempt fails")
    return os.environ.get("SGPU_TEST_JOB"), "SGPU_TEST_ONLY_B" in os.environ


@distributed(gpus=1, mlflow=False, widgets=False, timeout=120)
def env_now():
    import os

    return os.environ.get("SGPU_TEST_JOB"), "SGPU_TEST_ONLY_B" in os.environ


@pytest.mark.parametrize("method", ["forkserver", "subprocess"])
def test_concurrent_jobs_keep_their_own_environment_when_one_restarts(method, monkeypatch, tmp_path):
    """Two background jobs of one kernel launched with different environments: the one that restarts after the
    other started gets its own environment again, on both start paths (forked warm ranks, fresh interpreters)
    (issue 32: the host rewrote its own os.environ per job, and cold ranks inherited the last job's)."""
    from sgpu_magic.launch.client import shutdown_host

    if method == "subprocess":
        shutdown_host()
        monkeypatch.setenv("SGPU_MAGIC_START_METHOD", "subprocess")
    else:
        wait_warm()
    go = tmp_path / "go"
    try:
        monkeypatch.setenv("SGPU_TEST_JOB", "a")
        a = env_after_a_restart.submit(str(go))
        wait_for(lambda: a.state.value == "running", 60, "job a to run")
        monkeypatch.setenv("SGPU_TEST_JOB", "b")
        monkeypatch.setenv("SGPU_TEST_ONLY_B", "1")
        b = env_now.submit()
        assert b.result(timeout_s=60) == [("b", True)]
        go.touch()
        assert a.result(timeout_s=60) == [("a", False)]
        assert a.attempt == 2 and start_method(env_after_a_restart) == method == start_method(env_now)
    finally:
        go.touch()
        if method == "subprocess":
            shutdown_host()


def test_the_forkserver_is_a_fork_of_the_host_that_imported_torch_once():
    """The host imports torch (and the rest warm ranks need) once, then forks its forkserver from itself: no second
    interpreter imports torch in the seconds before the first launch. A warm rank's parent is that fork (the host's
    child, with the host's own argv), and host, forkserver and rank run at the priority they were given (nice 0)."""
    import psutil

    @distributed(gpus=1, mlflow=False, widgets=False)
    def my_parent():
        return os.nice(0), os.getppid()

    wait_warm()
    ((rank_nice, parent),) = my_parent.distributed()
    assert start_method(my_parent) == "forkserver" and rank_nice == 0
    host, forkserver = psutil.Process(get_host().pid), psutil.Process(parent)
    assert forkserver.ppid() == host.pid and forkserver.cmdline() == host.cmdline()
    assert host.nice() == 0 and forkserver.nice() == 0
    assert re.search(r"^imported torch in [0-9.]+ s$", get_host().log_path.read_text(), re.M)
    assert all(path.exists() for path in get_host().ready_markers)  # what the kernel's mlflow import waits for


def test_a_launch_held_up_by_a_starting_host_says_so_and_its_summary_gives_the_wait(capsys):
    """The first launch of a kernel waits while its new launch host imports torch: after a second it says so, and
    the summary gives the user's wait beside the ranks' own time. The host is held stopped (SIGSTOP) right after
    its handshake, before it has imported anything, so the launch waits however fast the machine is."""
    import signal

    from sgpu_magic.launch.client import shutdown_host

    shutdown_host()
    host = get_host()  # answered "ready <pid>": it imports torch from now on
    os.kill(host.pid, signal.SIGSTOP)
    seen = []
    try:
        job = probe.submit("X")

        def said():
            seen.append(capsys.readouterr().out)
            return "starting the launch host" in "".join(seen)

        wait_for(said, 60, "the note that the launch waits for the launch host")
    finally:
        os.kill(host.pid, signal.SIGCONT)
    job.wait(timeout_s=120)
    seen.append(capsys.readouterr().out)
    out = "".join(seen)
    assert (
        "sgpu_magic: starting the launch host (the first launch of this kernel waits while it imports torch) ...\n"
        in out
    )
    wall, ranks = map(float, re.search(r"succeeded in ([\d.]+) s \(([\d.]+) s in the ranks\) on ", out).groups())
    assert wall >= ranks + 1.0, out
