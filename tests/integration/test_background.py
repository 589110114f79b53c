"""Background jobs in the shared IPython shell: fn.submit, --background, the Job handle,
%distributed_jobs, %distributed_stop, and GPU leases with a fake inventory."""

import pytest

from helpers import wait_for

WAITER = """
from sgpu_magic import distributed

@distributed(gpus=2, timeout=120)
def wait_for_go(go, tag):
    import os, time
    print(f"{tag} started on rank {os.environ['RANK']}", flush=True)
    while not os.path.exists(go):
        time.sleep(0.02)
    print(f"{tag} done on rank {os.environ['RANK']}", flush=True)
    return int(os.environ["RANK"]) * 10
"""


@pytest.fixture
def go(tmp_path, ip):
    """A path the waiting ranks poll for; create it to let them finish."""
    path = tmp_path / "go"
    ip.user_ns["go"] = str(path)
    return path


def test_submit_returns_at_once_and_the_job_finishes_in_the_background(ip, run_cell, go):
    run_cell(WAITER)
    result, out, err = run_cell("job = wait_for_go.submit(go, 'bg')\njob")
    assert result.error_in_exec is None, err
    job = ip.user_ns["job"]
    assert repr(result.result).startswith(f"<Job {job.job_id} ") and job.background
    assert not job.done()
    wait_for(lambda: all("bg started" in job.logs(r) for r in range(2)), 60, "the job to get there")
    wait_for(lambda: job.state.value == "running", 60, "the job to be running")
    assert job.wait(timeout_s=0.05).value == "running"  # waiting with a timeout returns, the job goes on
    with pytest.raises(TimeoutError, match=rf"job {job.job_id} is still running after 0.05 s"):
        job.result(timeout_s=0.05)
    go.touch()
    assert job.result(timeout_s=60) == [0, 10]
    assert job.state.value == "succeeded" and job.exception() is None and job.gpus == []
    assert "bg done on rank 1" in job.logs(1)


def test_two_background_jobs_of_one_kernel_run_at_once(ip, run_cell, go):
    run_cell(WAITER)
    result, _, err = run_cell("a = wait_for_go.submit(go, 'a')\nb = wait_for_go.submit(go, 'b')")
    assert result.error_in_exec is None, err
    a, b = ip.user_ns["a"], ip.user_ns["b"]
    # both run at once: each has printed while the other has not ended (neither can end before go exists)
    wait_for(lambda: "a started" in a.logs(0) and "b started" in b.logs(0), 60, "both jobs to print")
    assert not a.done() and not b.done()
    wait_for(lambda: a.state.value == b.state.value == "running", 60, "both jobs to be running")
    go.touch()
    assert a.result(timeout_s=60) == b.result(timeout_s=60) == [0, 10]


def test_cancel_stops_a_background_job_and_its_error_says_so(ip, run_cell, go):
    run_cell(WAITER)
    run_cell("job = wait_for_go.submit(go, 'c')")
    job = ip.user_ns["job"]
    wait_for(lambda: "c started" in job.logs(1), 60, "the job to get there")
    job.cancel()
    assert job.state.value == "cancelled"
    assert job.rank_exitcodes and all(code != 0 for code in job.rank_exitcodes.values())
    from sgpu_magic.errors import JobCancelledError

    with pytest.raises(JobCancelledError, match=rf"job {job.job_id} was cancelled; every rank was stopped"):
        job.result()


def test_a_failing_background_job_says_job_result_raises_its_traceback(ip, run_cell, capsys):
    run_cell(
        "from sgpu_magic import distributed\n"
        "@distributed(gpus=1, timeout=120, widgets=False, mlflow=False)\n"
        "def breaks():\n    raise ValueError('bad input')\n"
        "bg_fail = breaks.submit()"
    )
    job = ip.user_ns["bg_fail"]
    job.wait(120)
    out, err = capsys.readouterr()
    assert (
        "[rank 0] [sgpu_magic] rank 0 raised ValueError; job.result() raises the error with the root cause's "
        "traceback (every rank's is in its log file)\n" in out
    ), out
    assert "Traceback" not in out
    with pytest.raises(Exception, match=r"^rank 0 failed \(root cause\): ValueError: bad input"):
        job.result()


def test_a_job_is_a_future_for_wait_as_completed_callbacks_and_asyncio(ip, run_cell, go):
    """Jobs compose with concurrent.futures and asyncio: a failed job counts as one that raised, callbacks get the
    job once it ended (one added after the end runs at once), and a cancelled job says so."""
    import asyncio
    import concurrent.futures

    from sgpu_magic.errors import JobCancelledError, RankFailedError

    run_cell(WAITER)
    run_cell(
        "@distributed(gpus=1, timeout=120)\n"
        "def breaks():\n    raise ValueError('bad input')\n"
        "ok = wait_for_go.submit(go, 'f')\nbad = breaks.submit()\nstopped = wait_for_go.submit(go, 's')"
    )
    ok, bad, stopped = (ip.user_ns[name] for name in ("ok", "bad", "stopped"))
    ended = []
    ok.add_done_callback(ended.append)
    done, not_done = concurrent.futures.wait([ok, bad], timeout=120, return_when=concurrent.futures.FIRST_EXCEPTION)
    assert done == {bad} and not_done == {ok} and ok.running() and ended == []
    assert isinstance(bad.exception(timeout=0), RankFailedError) and not bad.cancelled()
    with pytest.raises(RankFailedError, match=r"^rank 0 failed \(root cause\): ValueError: bad input"):
        bad.result(timeout=0)
    wait_for(lambda: "s started" in stopped.logs(0), 60, "the job to be cancelled to run")
    assert stopped.cancel() is True and stopped.cancelled() and stopped.cancel() is False
    assert isinstance(stopped.exception(), JobCancelledError)
    go.touch()
    assert set(concurrent.futures.as_completed([ok, bad, stopped], timeout=120)) == {ok, bad, stopped}
    assert ended == [ok] and not ok.running()
    late = []
    ok.add_done_callback(late.append)
    assert late == [ok]

    async def awaited():
        return await asyncio.wrap_future(ok)

    assert asyncio.run(awaited()) == ok.result(timeout=0) == [0, 10]


def test_background_magic_and_the_jobs_table_and_stop(ip, run_cell, go):
    result, out, err = run_cell(
        "%%distributed --gpus 2 --background -o bgjob\n"
        "import os, time\nprint('magic started', flush=True)\n"
        "while not os.path.exists(go):\n    time.sleep(0.02)\n"
    )
    assert result.error_in_exec is None, err
    job = ip.user_ns["bgjob"]
    assert result.result is job
    wait_for(lambda: "magic started" in job.logs(0) and job.state.value == "running", 60, "the job to run")
    result, out, err = run_cell("%distributed_jobs")
    table = repr(result.result)
    header, *rows = table.splitlines()
    assert header.split() == ["job", "state", "world", "size", "GPUs", "elapsed", "MLflow", "run", "what"]
    row = next(r for r in rows if r.startswith(job.job_id))
    assert row.split()[1:4] == ["running", "2", "cpu"]
    assert row.endswith("%%distributed cell")  # what it runs
    assert job.mlflow_run_id and row.split()[-3] == job.mlflow_run_id  # the run id, even with no page to link
    html = result.result._repr_html_()
    assert f"<td>{job.job_id}</td><td>running</td>" in html and f"<td>{job.mlflow_run_id}</td>" in html
    result, out, err = run_cell(f"%distributed_stop {job.job_id[-6:]}")
    assert result.error_in_exec is None, err
    assert out.strip().endswith(f"job {job.job_id}: cancelled")
    _, out, _ = run_cell(f"%distributed_stop {job.job_id}")
    assert f"job {job.job_id} already ended: cancelled" in out


def test_stop_all_cancels_every_running_job(ip, run_cell, go):
    run_cell(WAITER)
    run_cell("s1 = wait_for_go.submit(go, 's1')\ns2 = wait_for_go.submit(go, 's2')")
    s1, s2 = ip.user_ns["s1"], ip.user_ns["s2"]
    result, out, err = run_cell("%distributed_stop --all")
    assert result.error_in_exec is None, err
    assert f"job {s1.job_id}: cancelled" in out and f"job {s2.job_id}: cancelled" in out
    assert s1.state.value == s2.state.value == "cancelled"


@pytest.mark.parametrize(
    "line, message",
    [
        ("%distributed_stop", r"give one job id \(see %distributed_jobs\) or --all"),
        ("%distributed_stop nosuchjob", r"'nosuchjob' matches no job of this kernel \(jobs: .*\); give more of the id"),
        (
            "%distributed_jobs now",
            r"^unrecognized arguments: now\nusage: %distributed_jobs \[--all\] \[--stop JOB_ID\]",
        ),
        (
            "%%distributed --gpus 2 --gpu-ids zero\npass",
            r"--gpu-ids takes GPU indices separated by commas, e.g. "
            r"--gpu-ids 0,1; got 'zero'",
        ),
    ],
)
def test_job_magics_refuse_bad_input(run_cell, line, message):
    import re

    result, _, err = run_cell(line)
    assert type(result.error_in_exec).__name__ == "UsageError"
    assert re.search(message, str(result.error_in_exec))


@pytest.fixture
def fake_gpus(monkeypatch, tmp_path):
    """An 8 x H100 fake inventory and a private lease directory."""
    monkeypatch.setenv("SGPU_MAGIC_FAKE_GPUS", "8 x H100")
    monkeypatch.setenv("SGPU_MAGIC_LEASE_DIR", str(tmp_path / "leases"))
    from sgpu_magic.launch.leases import LeaseRegistry

    return LeaseRegistry(tmp_path / "leases")


def test_leased_fake_gpus_reach_the_ranks_and_are_released(ip, run_cell, fake_gpus):
    result, out, err = run_cell(
        "%%distributed --gpus 3 -o leased\nimport os\nos.environ['SGPU_MAGIC_GPUS'], os.environ['CUDA_VISIBLE_DEVICES']"
    )
    assert result.error_in_exec is None, err
    assert result.result == ("0,1,2", "")
    assert ip.user_ns["leased"].gpus == [0, 1, 2]
    assert "fake GPU inventory (SGPU_MAGIC_FAKE_GPUS); the job leases 3 of them" in out
    assert fake_gpus.snapshot()["holders"] == []


def test_no_wait_fails_naming_the_holder_and_a_queued_job_starts_when_gpus_free(
    ip, run_cell, go, fake_gpus, monkeypatch
):
    import os

    from sgpu_magic.job import registry
    from sgpu_magic.job.handle import jobs

    run_cell("%%distributed --gpus 1\npass")  # at least one ended job: the list is full of ended jobs below
    # the list as full as it can be (as after 100 jobs): a refused job must not push an ended one out
    monkeypatch.setattr(registry, "MAX_ENDED_JOBS", len([j for j in jobs() if j.ended]))
    holder = fake_gpus.acquire("other-job", 7, fake_gpus_list())
    before = jobs()
    result, out, err = run_cell("%%distributed --gpus 2 --no-wait\npass")
    assert jobs() == before  # a refused job never started: %distributed_jobs does not list it
    error = str(result.error_in_exec)
    assert type(result.error_in_exec).__name__ == "ResourceError"
    assert (
        "cannot start now: waiting for 2 GPU(s): 1 of 8 free; GPUs 0,1,2,3,4,5,6 held by job other-job "
        f"(kernel pid {os.getpid()}"
        in error
        and "Leave out --no-wait / wait=False to queue" in error
    )
    run_cell(WAITER)
    run_cell("queued = wait_for_go.submit(go, 'q')")
    job = ip.user_ns["queued"]
    assert job.state.value == "pending" and "held by job other-job" in job.pending_reason
    _, out, _ = run_cell("%distributed_jobs")
    holder.release()
    wait_for(lambda: job.state.value == "running", 60, "the job to get there")
    assert job.gpus == [0, 1] and job.waited_s > 0 and job.pending_reason == ""
    go.touch()
    assert job.result(timeout_s=60) == [0, 10]
    assert fake_gpus.snapshot() == {"holders": [], "queue": []}


def test_cancelling_a_pending_job_removes_it_from_the_queue(ip, run_cell, go, fake_gpus):
    holder = fake_gpus.acquire("other-job", 8, fake_gpus_list())
    run_cell(WAITER)
    run_cell("pending = wait_for_go.submit(go, 'p')")
    job = ip.user_ns["pending"]
    assert job.state.value == "pending"
    wait_for(lambda: [w["job_id"] for w in fake_gpus.snapshot()["queue"]] == [job.job_id], 30, "the job to get there")
    from sgpu_magic.errors import SgpuError

    with pytest.raises(
        SgpuError, match=rf"^job {job.job_id} has not started yet \(state pending\); show it once it runs$"
    ):
        job.show()
    job.cancel()
    assert job.state.value == "cancelled" and fake_gpus.snapshot()["queue"] == []
    from sgpu_magic.errors import JobCancelledError

    with pytest.raises(JobCancelledError, match=rf"job {job.job_id} was cancelled before it started \(no rank ran\)"):
        job.result()
    holder.release()


def fake_gpus_list():
    from sgpu_magic.launch.resources import fake_gpus

    return fake_gpus("8 x H100")
