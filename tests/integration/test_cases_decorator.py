"""Public-report cases through the ``@distributed`` decorator (see /work/shared/cases/public-reports.md).

The notebook side is the session's real IPython shell: functions, helpers and classes are
defined by running cells in it, so they live in the notebook's ``__main__`` exactly as in a
kernel. Calls whose exception the test pins are made from the test itself on the decorated
function taken from the shell's namespace. Every job starts 2 real CPU ranks (gloo).
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import textwrap

import psutil
import pytest

from sgpu_magic.errors import CaptureError, JobTimeoutError, RankFailedError, ResourceError

from helpers import C01_CELL1, children, kids, run_dirs, wait_gone

# --- helpers -------------------------------------------------------------------------------


def cell(run_cell, code: str):
    """Run a notebook cell that must succeed; return (value of its last expression, stdout, stderr)."""
    result, out, err = run_cell(textwrap.dedent(code))
    assert result.error_before_exec is None, (result.error_before_exec, out, err)
    assert result.error_in_exec is None, (result.error_in_exec, out, err)
    return result.result, out, err


def read_pids(piddir) -> list[int]:
    return sorted(int(p.name) for p in piddir.iterdir())


def rank_pids(job, piddir) -> list[int]:
    """PIDs of a job's ranks: those the ranks recorded themselves, and those the host reported in status.json.

    A rank stopped early may be killed before its code records anything, so both sources are used.
    """
    status = json.loads((job.run_dir / "status.json").read_text())
    assert len(status["pids"]) == job.world_size
    return sorted(set(read_pids(piddir)) | {int(p) for p in status["pids"].values()})


# --- C01 -----------------------------------------------------------------------------------


def test_c01_notebook_function_helper_class_and_global_reach_the_ranks(ip, run_cell):
    cell(run_cell, C01_CELL1)
    value, out, err = cell(
        run_cell,
        """
        from sgpu_magic import distributed
        @distributed(gpus=2)
        def work(base):
            import os
            r = int(os.environ["RANK"])
            return Box(helper(base + r)).v
        res = work.distributed(16)
        res
        """,
    )
    assert value == [40.0, 41.23105625617661]
    assert "Can't get attribute" not in out + err
    # they really are notebook (__main__) objects, shipped by value
    assert ip.user_ns["helper"].__module__ == "__main__" and ip.user_ns["Box"].__module__ == "__main__"


# --- C03 -----------------------------------------------------------------------------------


def test_c03_ranks_are_fresh_interpreters_not_forks_of_the_kernel(ip, run_cell):
    import sys

    try:
        cell(
            run_cell,
            """
            import sys, torch
            a = torch.randn(512, 512); float((a @ a).sum())   # torch's intra-op thread pool in the kernel
            sys.sgpu_case_kernel_only = True                   # exists only in the kernel process
            if torch.cuda.is_available():
                torch.zeros(1, device="cuda")
            """,
        )
        value, out, err = cell(
            run_cell,
            """
            from sgpu_magic import distributed
            @distributed(gpus=2)
            def probe():
                import sys, torch
                x = torch.randn(256, 256)
                cuda_ok = (torch.zeros(1, device="cuda").device.type == "cuda") if torch.cuda.is_available() else True
                return (hasattr(sys, "sgpu_case_kernel_only"), bool((x @ x.T).trace() > 0), cuda_ok)
            probe.distributed()
            """,
        )
        assert value == [(False, True, True), (False, True, True)]
        assert "re-initialize CUDA" not in out + err
    finally:
        if hasattr(sys, "sgpu_case_kernel_only"):
            del sys.sgpu_case_kernel_only


# --- C04 -----------------------------------------------------------------------------------


def test_c04_lambdas_closures_nested_functions_incl_rank_dataloader_workers(ip, run_cell):
    value, out, err = cell(
        run_cell,
        """
        from sgpu_magic import distributed
        import torch
        def make_collate(scale):
            norm = lambda t: t * scale          # closure over a local
            def collate(batch):                 # nested function
                return norm(torch.stack(batch))
            return collate

        @distributed(gpus=2)
        def run(collate, workers, key=lambda r: r * 100):
            import os, torch
            from torch.utils.data import DataLoader
            r = int(os.environ["RANK"])
            data = [torch.tensor([float(r)]), torch.tensor([1.0])]
            dl = DataLoader(data, batch_size=2, collate_fn=collate, num_workers=workers)
            return key(r) + float(next(iter(dl)).sum())

        c04 = (run.distributed(make_collate(2.0), 0), run.distributed(make_collate(2.0), 2))
        c04
        """,
    )
    assert value == ([2.0, 104.0], [2.0, 104.0])
    assert "Can't pickle local object" not in out + err
    assert "PicklingError" not in out + err


# --- C05 (cell 3) --------------------------------------------------------------------------


def test_c05_unpicklable_argument_refused_before_launch_naming_argument_0(ip, run_cell, sgpu_home):
    cell(
        run_cell,
        """
        import threading
        stats_lock = threading.Lock()
        from sgpu_magic import distributed
        @distributed(gpus=2)
        def g(lock):
            return 1
        """,
    )
    kids_before, runs_before = kids(), run_dirs(sgpu_home)
    with pytest.raises(
        CaptureError, match=r"argument 0 of g\.distributed is a _thread\.lock\b.*cannot be sent to the ranks"
    ) as info:
        ip.user_ns["g"].distributed(ip.user_ns["stats_lock"])
    assert "Nothing was started" in str(info.value)
    # nothing was started: no child process, no job handed to the launch host
    assert kids() == kids_before
    assert run_dirs(sgpu_home) == runs_before
    assert ip.user_ns["g"].last_job is None


# --- C06 -----------------------------------------------------------------------------------


def test_c06_generator_argument_refused_clearly_and_not_consumed(ip, run_cell, sgpu_home):
    cell(
        run_cell,
        """
        from sgpu_magic import distributed
        batches = (i * i for i in range(10))

        @distributed(gpus=2)
        def consume(it):
            return sum(it)
        """,
    )
    runs_before = run_dirs(sgpu_home)
    with pytest.raises(
        CaptureError,
        match=r"argument 0 of consume\.distributed is a generator\b.*"
        r"cannot be sent to the ranks.*pass a list.*build the generator inside the function",
    ):
        ip.user_ns["consume"].distributed(ip.user_ns["batches"])
    assert run_dirs(sgpu_home) == runs_before  # raised before any rank started
    assert next(ip.user_ns["batches"]) == 0  # the failed attempt did not consume the generator
    assert ip.user_ns["consume"].distributed(list(range(10))) == [45, 45]


# --- C08 -----------------------------------------------------------------------------------


def test_c08_rank_that_never_reaches_rendezvous_does_not_leave_the_other_waiting(ip, run_cell, piddir):
    cell(
        run_cell,
        """
        from sgpu_magic import distributed
        @distributed(gpus=2)
        def lonely():
            import os
            open(os.path.join(piddir, str(os.getpid())), "w").close()
            import torch.distributed as dist
            if os.environ["RANK"] == "1":
                os._exit(3)                 # rank 1 disappears before any collective
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            dist.barrier()
            return "unreachable"
        """,
    )
    with pytest.raises(
        RankFailedError,
        match=r"rank 1 failed \(root cause\): exited without a Python exception "
        r"\(exit code 3\)",
    ) as info:
        ip.user_ns["lonely"].distributed()
    err = info.value
    assert err.root_cause.rank == 1 and err.root_cause.exitcode == 3
    assert err.stopped_ranks == [0]
    assert re.search(r"rank 0 stopped by sgpu_magic because rank 1 failed", str(err))
    pids = rank_pids(ip.user_ns["lonely"].last_job, piddir)
    assert len(pids) == 2
    assert wait_gone(pids) == []
    # the port was released: the next job rendezvouses and runs normally
    value, _, _ = cell(
        run_cell,
        """
        @distributed(gpus=2)
        def after_lonely():
            import torch, torch.distributed as dist
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            t = torch.ones(1)
            dist.all_reduce(t)
            return float(t)
        after_lonely.distributed()
        """,
    )
    assert value == [2.0, 2.0]


# --- C13 -----------------------------------------------------------------------------------


def test_c13_normal_finish_leaves_no_process_pipe_or_socket(ip, run_cell):
    cell(
        run_cell,
        """
        from sgpu_magic import distributed
        @distributed(gpus=2)
        def quick():
            import os, torch, torch.distributed as dist
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            return os.getpid(), float(t)
        """,
    )
    quick = ip.user_ns["quick"]
    me = psutil.Process()
    fds0 = me.num_fds()
    all_pids = []
    for _ in range(5):
        out = quick.distributed()
        all_pids += [pid for pid, _ in out]
    assert [v for _, v in out] == [3.0, 3.0]
    assert len(set(all_pids)) == 10  # fresh ranks every run
    assert wait_gone(all_pids) == []
    assert children() == []
    assert abs(me.num_fds() - fds0) <= 3


# --- C15 -----------------------------------------------------------------------------------


@pytest.fixture
def blocker_29500():
    """A stale listener on the default port 29500: it accepts but never replies."""
    blocker = socket.socket()
    try:
        blocker.bind(("0.0.0.0", 29500))
    except OSError as exc:
        blocker.close()
        pytest.skip(
            f"C15 needs to hold port 29500 itself, but it cannot be bound here ({errno.errorcode.get(exc.errno, exc)}: "
            f"{exc.strerror}); another process is using it"
        )
    blocker.listen()
    yield blocker
    blocker.close()


def test_c15_busy_default_port_avoided_and_pinned_busy_port_fails_fast(ip, run_cell, sgpu_home, blocker_29500):
    value, _, _ = cell(
        run_cell,
        """
        from sgpu_magic import distributed
        @distributed(gpus=2)
        def where():
            import os
            return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        a = where.distributed(); b = where.distributed()
        (a[0] == a[1], b[0] == b[1], a[0][1] != 29500, b[0][1] != 29500)
        """,
    )
    assert value == (True, True, True, True)

    # pinning the busy port: through the decorator...
    cell(
        run_cell,
        """
        @distributed(gpus=2, port=29500)
        def pinned():
            return "should not start"
        """,
    )
    runs_before, kids_before = run_dirs(sgpu_home), kids()
    with pytest.raises(ResourceError, match=r"port 29500 is in use"):
        ip.user_ns["pinned"].distributed()
    assert run_dirs(sgpu_home) == runs_before and kids() == kids_before
    assert ip.user_ns["pinned"].last_job is None

    # ...and through the cell magic (C15 cell 3)
    result, out, err = run_cell('%%distributed --gpus 2 --port 29500\nprint("should not start")\n')
    assert isinstance(result.error_in_exec, ResourceError)
    assert re.search(r"port 29500 is in use", str(result.error_in_exec))
    assert "[rank" not in out  # no rank ran
    assert run_dirs(sgpu_home) == runs_before and kids() == kids_before


# --- C23 and tensors -----------------------------------------------------------------------


def test_c23_per_rank_return_values_in_rank_order_with_none_kept(ip, run_cell):
    import torch

    value, _, _ = cell(
        run_cell,
        """
        from sgpu_magic import distributed
        @distributed(gpus=2)
        def evaluate(offset):
            import torch, torch.distributed as dist
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            r = dist.get_rank()
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            acc = torch.tensor([0.5 + 0.25 * r], device=dev) + offset
            if r == 1:
                return None
            return {"rank": r, "acc": acc, "world": dist.get_world_size()}
        res = evaluate.distributed(0.125)
        res
        """,
    )
    assert isinstance(value, list) and len(value) == 2
    first, second = value
    assert second is None
    assert set(first) == {"rank", "acc", "world"}
    assert first["rank"] == 0 and first["world"] == 2
    assert first["acc"].device.type == "cpu"
    assert torch.equal(first["acc"], torch.tensor([0.6250]))


def test_tensors_returned_from_ranks_come_back_on_cpu_and_usable(ip, run_cell):
    import torch

    value, _, _ = cell(
        run_cell,
        """
        from sgpu_magic import distributed
        @distributed(gpus=2)
        def tensors():
            import os, torch
            r = int(os.environ["RANK"])
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            return {"t": torch.arange(3, device=dev) + r, "nested": [torch.full((2,), float(r), device=dev)]}
        tensors.distributed()
        """,
    )
    assert [v["t"].device.type for v in value] == ["cpu", "cpu"]
    assert [v["nested"][0].device.type for v in value] == ["cpu", "cpu"]
    assert torch.equal(value[0]["t"] + value[1]["t"], torch.tensor([1, 3, 5]))
    assert torch.equal(value[1]["nested"][0], torch.tensor([1.0, 1.0]))


# --- C25 -----------------------------------------------------------------------------------


def test_c25_repeated_failed_launches_do_not_pile_up_processes(ip, run_cell, piddir):
    cell(
        run_cell,
        """
        from sgpu_magic import distributed
        @distributed(gpus=2)
        def flaky(attempt):
            import os
            open(os.path.join(piddir, str(os.getpid())), "w").close()
            import torch.distributed as dist
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            if dist.get_rank() == 0:
                raise RuntimeError(f"attempt {attempt} failed")
            dist.barrier()                 # rank 1 waits for rank 0, which has gone
        """,
    )
    flaky = ip.user_ns["flaky"]
    me = psutil.Process()
    errors, fds = [], []
    for attempt in range(3):
        with pytest.raises(
            RankFailedError, match=rf"rank 0 failed \(root cause\): RuntimeError: attempt {attempt} failed"
        ) as info:
            flaky.distributed(attempt)
        assert info.value.root_cause.rank == 0 and info.value.root_cause.exc_type == "RuntimeError"
        assert 'raise RuntimeError(f"attempt {attempt} failed")' in info.value.root_cause.traceback
        errors.append(str(info.value))
        fds.append(me.num_fds())
    assert [f"attempt {i} failed" in e for i, e in enumerate(errors)] == [True, True, True]
    pids = read_pids(piddir)
    assert len(pids) == 6
    assert wait_gone(pids) == []
    assert children() == []
    assert max(fds) - min(fds) <= 3


# --- timeout -------------------------------------------------------------------------------


def test_timeout_stops_every_rank_and_raises_timeout_error(ip, run_cell, piddir, capsys):
    cell(
        run_cell,
        """
        from sgpu_magic import distributed
        @distributed(gpus=2, timeout=2)
        def sleepy():
            import os, time
            open(os.path.join(piddir, str(os.getpid())), "w").close()
            time.sleep(600)
        """,
    )
    sleepy = ip.user_ns["sleepy"]
    capsys.readouterr()
    with pytest.raises(TimeoutError, match=r"ran longer than its timeout of 2 s; every rank was stopped") as info:
        sleepy.distributed()
    assert isinstance(info.value, JobTimeoutError)
    job = sleepy.last_job
    # states in words wherever people read them (issue 18: "job ... timed_out in 3.0 s")
    summary = re.search(
        rf"^sgpu_magic: job {job.job_id} timed out in (\d+\.\d) s on 2 x cpu", capsys.readouterr().out, re.M
    )
    assert summary and float(summary.group(1)) >= 2.0  # timing-ok: not stopped before its timeout (a lower bound)
    assert repr(job).startswith(f"<Job {job.job_id} timed out world_size=2")
    pids = rank_pids(sleepy.last_job, piddir)
    assert len(pids) == 2
    assert wait_gone(pids) == []
    assert children() == []


# --- plain local call ----------------------------------------------------------------------


def test_plain_call_still_runs_locally_in_the_kernel(ip, run_cell, sgpu_home):
    runs_before = run_dirs(sgpu_home)
    value, _, _ = cell(
        run_cell,
        """
        import os
        from sgpu_magic import distributed
        @distributed(gpus=2)
        def local_add(a, b=1):
            return os.getpid(), os.environ.get("RANK"), a + b
        local_add(2, b=5)
        """,
    )
    assert value == (os.getpid(), os.environ.get("RANK"), 7)
    assert run_dirs(sgpu_home) == runs_before  # no job was started
    assert ip.user_ns["local_add"].last_job is None


# --- issue 18: the same error on every rank ------------------------------------------------


def test_eight_ranks_failing_the_same_way_are_reported_in_a_few_lines_in_rank_order(ip, run_cell):
    """Every rank of 8 raises the same AttributeError: the root cause, then one line per kind of what the
    other ranks did (failed the same way on their own, or stopped by sgpu_magic), ranks folded and sorted."""
    cell(
        run_cell,
        """
        from sgpu_magic import distributed
        @distributed(gpus=8, mlflow=False)
        def same_bug():
            model = None
            return model.weight
        """,
    )
    with pytest.raises(
        RankFailedError,
        match=r"^rank \d failed \(root cause\): AttributeError: 'NoneType' object "
        r"has no attribute 'weight' \(exit code 1\)\n",
    ) as info:
        ip.user_ns["same_bug"].distributed()
    err = info.value
    root = err.root_cause.rank
    what = re.escape("AttributeError: 'NoneType' object has no attribute 'weight'")
    kinds = [
        rf"failed with the same {what}( \(exit code 1\)| \(ranks? [\d, -]+ then stopped by sgpu_magic\))",
        rf"stopped by sgpu_magic because rank {root} failed",
    ]
    lines = str(err).splitlines()[1:-1]  # between the root cause and its log path
    assert 1 <= len(lines) <= 3, lines  # one line per kind, not one per rank
    seen = []
    for line in lines:
        match = re.fullmatch(r"  ranks? ([\d, -]+) (.*)", line)
        assert match and any(re.fullmatch(kind, match[2]) for kind in kinds), line
        ranks = []
        for part in match[1].split(", "):
            first, _, last = part.partition("-")
            ranks += range(int(first), int(last or first) + 1)
        assert ranks == sorted(ranks) and (len(ranks) > 1) == line.startswith("  ranks "), line
        seen.append(ranks)
    assert [r[0] for r in seen] == sorted(r[0] for r in seen)  # the lines in rank order
    assert sorted(r for ranks in seen for r in ranks) == [r for r in range(8) if r != root]  # each rank once
