"""The launch host's OOM witnesses (memory cgroup counts, the kernel log) and its hang detector, on real processes."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sgpu_magic.launch.forensics import OomWatch, kernel_log_kill, memory_cgroup_file, oom_kills
from sgpu_magic.launch.progress import ProgressWatch
from sgpu_magic.rundir import RunDir
from sgpu_magic.status import StuckReport

from helpers import wait_for

HINT = (
    "but it is the usual cause of a SIGKILL: look for 'Killed process' in `dmesg` or `journalctl -k`, and compare "
    "the rank's peak RSS with the memory limit (`cat /sys/fs/cgroup/memory.max`, or memory.limit_in_bytes under "
    "cgroup v1)"
)

HOG = """
import os, sys
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
print("in", flush=True)
sys.stdin.readline()
hog = bytearray(1 << 30)
"""


@pytest.fixture
def limited_cgroup():
    """A child of this process's memory cgroup limited to 128 MiB (skipped where none can be made)."""
    here = memory_cgroup_file("self")
    if here is None:
        pytest.skip("no memory cgroup to read here")
    child = here.parent / f"sgpu_oom_{secrets.token_hex(3)}"
    limit = "memory.limit_in_bytes" if here.name == "memory.oom_control" else "memory.max"
    try:
        child.mkdir()
        (child / limit).write_text(str(128 << 20))
    except OSError as exc:
        pytest.skip(f"cannot make a memory-limited cgroup here ({exc})")
    yield child
    child.rmdir()


def test_an_oom_kill_in_a_ranks_cgroup_is_counted_and_logged(limited_cgroup):
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG, str(limited_cgroup)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert hog.stdout.readline() == "in\n"  # it is in the cgroup now
    watch = OomWatch()
    watch.sample({0: hog.pid})
    counter = memory_cgroup_file(hog.pid)
    assert counter is not None and counter.parent == limited_cgroup and oom_kills(counter) == 0
    hog.stdin.write("go\n")
    hog.stdin.flush()
    assert hog.wait(60) == -signal.SIGKILL
    verdict = watch.verdict(0, None, -signal.SIGKILL)  # no pid: the cgroup's count alone
    assert verdict == {
        "oom_killed": True,
        "oom": f"the kernel's OOM killer fired in its memory cgroup while it ran (oom_kill in {counter} went from "
        f"0 to 1)",
    }
    logged = kernel_log_kill(hog.pid)
    if logged is not None:  # readable here (CAP_SYSLOG)
        assert f"Killed process {hog.pid} " in logged
        assert watch.verdict(0, hog.pid, -9) == {
            "oom_killed": True,
            "oom": f"the kernel's OOM killer ended it (kernel log: {logged!r})",
        }


def test_a_sigkill_with_no_witness_gets_the_hint_and_other_ends_get_nothing():
    watch = OomWatch()
    assert watch.verdict(0, None, -signal.SIGKILL) == {
        "oom_killed": None,
        "oom": f"nothing here shows the OOM killer, {HINT}",
    }
    watch.watch(range(2))  # the cgroup the ranks start in (this process's)
    if watch.cgroups:
        assert watch.verdict(1, None, -9)["oom"] == (
            f"nothing here shows the OOM killer (its memory cgroup's oom_kill count did not change), {HINT}"
        )
    assert watch.verdict(0, None, -signal.SIGSEGV) == {} and watch.verdict(0, None, 1) == {}


def test_an_ended_process_has_no_cgroup():
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert memory_cgroup_file(int(done.stdout)) is None
    assert oom_kills(Path("/nonexistent/memory.events")) is None


def test_a_quiet_job_is_reported_stuck_until_a_file_grows(tmp_path):
    rd = RunDir.create(tmp_path)
    for rank in range(2):
        rd.log_file(rank).touch()
    watch = ProgressWatch(rd, 2, 0.2)
    watch.restart()
    assert watch.report() is None
    wait_for(lambda: watch.check({}), 10, "the job to count as stuck")
    report = watch.report()
    assert report is not None and report.stuck_after_s == 0.2 and report.stacks == {}
    assert StuckReport.from_dict(report.to_json()) == report  # as status.json holds it
    with open(rd.log_file(1), "a") as log:
        log.write("progress\n")
    assert watch.check({}) is True and watch.report() is None  # changed: the report goes
    assert ProgressWatch(rd, 2, None).check({}) is False  # stuck_after_s None: never


def test_gpu_figures_are_a_no_op_without_nvml_and_round_trip_through_the_status():
    import os

    from sgpu_magic.launch.gpu import GpuSampler
    from sgpu_magic.status import RankUsage

    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("NVML answers here: tests/integration/test_gpu.py covers the GPU figures")
    except Exception:  # noqa: BLE001 - no driver: the case under test
        pass
    sampler = GpuSampler([0])
    assert not sampler.active and sampler.sample({0: os.getpid()}) == {}
    sampler.close()
    plain = RankUsage(12.5, 100, 200, 1.0)
    assert plain.as_dict() == {"cpu_percent": 12.5, "rss_bytes": 100, "peak_rss_bytes": 200, "time_s": 1.0}
    assert RankUsage.from_dict(plain.as_dict()) == plain
    gpu = RankUsage(
        1.0,
        1,
        2,
        3.0,
        gpu_percent=50.0,
        gpu_memory_bytes=5,
        gpu_memory_total_bytes=9,
        gpu_power_w=80.5,
        peak_gpu_memory_bytes=6,
    )
    assert RankUsage.from_dict(gpu.as_dict()) == gpu
