"""The GPU lease registry: exclusive leases across processes, arrival order, reclaim of dead holders."""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from sgpu_magic.errors import JobCancelledError, ResourceError
from sgpu_magic.launch.leases import LeaseRegistry
from sgpu_magic.launch.resources import fake_gpus

GPUS = fake_gpus("8 x H100")

WORKER = textwrap.dedent("""
    import os, random, sys
    from sgpu_magic.launch.leases import LeaseRegistry
    from sgpu_magic.launch.resources import fake_gpus

    lease_dir, held_dir, seed, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    registry, gpus = LeaseRegistry(lease_dir), fake_gpus("8 x H100")
    for i in range(rounds):
        count = rng.randint(1, 5)
        lease = registry.acquire(f"w{seed}-{i}", count, gpus)
        assert len(lease.gpus) == count
        markers = []
        for gpu in lease.gpus:  # exclusive create: fails if another holder has this GPU right now
            path = os.path.join(held_dir, gpu.uuid)
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            markers.append(path)
        for _ in range(rng.randint(0, 3000)):  # hold the GPUs a little while
            pass
        for path in markers:
            os.unlink(path)
        lease.release()
    print("ok", rounds)
""")


def test_concurrent_acquire_and_release_never_hand_a_gpu_to_two_holders(tmp_path):
    """Randomized: 4 processes x 25 leases of 1-5 of 8 GPUs, waiting in the queue for each."""
    held = tmp_path / "held"
    held.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tmp_path / "leases"), str(held), str(seed), "25"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(4)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.strip() == "ok 25"
    assert LeaseRegistry(tmp_path / "leases").snapshot() == {"holders": [], "queue": []}
    assert list(held.iterdir()) == []


def test_no_wait_refusal_names_the_holder(tmp_path):
    registry = LeaseRegistry(tmp_path)
    first = registry.acquire("job-a", 6, GPUS)
    assert [g.index for g in first.gpus] == [0, 1, 2, 3, 4, 5]
    with pytest.raises(
        ResourceError,
        match=rf"job job-b cannot start now: waiting for 6 GPU\(s\): 2 of 8 free; "
        rf"GPUs 0,1,2,3,4,5 held by job job-a \(kernel pid {os.getpid()}, user "
        rf"\S+\) since \d\d:\d\d:\d\d\. Leave out --no-wait",
    ):
        registry.acquire("job-b", 6, GPUS, wait=False)
    assert registry.snapshot()["queue"] == []  # a refused job leaves no ticket
    first.release()
    first.release()  # idempotent
    assert len(registry.acquire("job-b", 8, GPUS, wait=False).gpus) == 8


def test_waiting_jobs_start_in_arrival_order(tmp_path):
    registry = LeaseRegistry(tmp_path)
    holder = registry.acquire("job-a", 6, GPUS)
    lease, why = registry.try_acquire("job-b", 6, GPUS)  # queues
    assert lease is None and "2 of 8 free" in why
    lease, why = registry.try_acquire("job-c", 1, GPUS)  # 2 free, but job-b came first
    assert lease is None and why.endswith("1 job(s) queued ahead (job-b)")
    holder.release()
    lease_c, _ = registry.try_acquire("job-c", 1, GPUS)
    assert lease_c is None
    lease_b, _ = registry.try_acquire("job-b", 6, GPUS)
    assert [g.index for g in lease_b.gpus] == [0, 1, 2, 3, 4, 5]
    lease_c, _ = registry.try_acquire("job-c", 1, GPUS)
    assert [g.index for g in lease_c.gpus] == [6]


def test_explicit_gpu_ids_wait_for_exactly_those(tmp_path):
    registry = LeaseRegistry(tmp_path)
    registry.acquire("job-a", 1, [GPUS[3]], explicit=True)
    lease, why = registry.try_acquire("job-b", 2, [GPUS[2], GPUS[3]], explicit=True)
    assert lease is None and why.startswith("waiting for GPUs 2,3: 1 of 2 free; GPUs 3 held by job job-a")


def test_a_dead_holders_lease_is_reclaimed_by_the_next_job(tmp_path):
    code = (
        "import sys\nfrom sgpu_magic.launch.leases import LeaseRegistry\nfrom sgpu_magic.launch.resources import fake_gpus\n"
        "LeaseRegistry(sys.argv[1]).acquire('doomed', 8, fake_gpus('8 x H100'))\nprint('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "held\n"
    registry = LeaseRegistry(tmp_path)
    assert registry.try_acquire("next", 1, GPUS, enqueue=False)[0] is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lease, _ = registry.try_acquire("next", 8, GPUS)
    assert lease is not None and registry.snapshot()["holders"][0]["job_id"] == "next"


def test_cancel_while_waiting_leaves_the_queue(tmp_path):
    registry = LeaseRegistry(tmp_path)
    registry.acquire("job-a", 8, GPUS)
    cancelled = threading.Event()
    reasons = []
    cancelled.set()
    with pytest.raises(JobCancelledError, match="job job-b was cancelled while it waited for GPUs"):
        registry.acquire("job-b", 1, GPUS, cancelled=cancelled, on_wait=reasons.append)
    assert reasons and reasons[0].startswith("waiting for 1 GPU(s): 0 of 8 free")
    assert registry.snapshot()["queue"] == []


def test_busy_gpus_are_skipped_with_the_reason(tmp_path):
    registry = LeaseRegistry(tmp_path)
    lease, _ = registry.try_acquire(
        "job-a", 2, GPUS[:3], skip=lambda free: {GPUS[0].uuid: "pid 7 (python) holding 3.0 GiB"}
    )
    assert [g.index for g in lease.gpus] == [1, 2]
    lease, why = registry.try_acquire(
        "job-b", 1, GPUS[:1], skip=lambda free: {GPUS[0].uuid: "pid 7 (python) holding 3.0 GiB"}, enqueue=False
    )
    assert (
        lease is None
        and why == "waiting for 1 GPU(s): 0 of 1 free; GPU 0 busy outside sgpu_magic: pid 7 (python) holding 3.0 GiB"
    )


def test_unwritable_lease_dir_is_refused_with_the_remedy(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ResourceError, match=r"cannot create the GPU lease directory .*; set SGPU_MAGIC_LEASE_DIR"):
        LeaseRegistry(blocker / "leases")


def test_corrupt_registry_is_reported(tmp_path):
    (tmp_path / "registry.json").write_text("{not json")
    with pytest.raises(ResourceError, match=r"the GPU lease registry .*registry.json cannot be read"):
        LeaseRegistry(tmp_path).snapshot()
