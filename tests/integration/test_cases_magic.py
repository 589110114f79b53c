"""Public-report cases through the ``%%distributed`` cell magic in a real IPython shell.

See /work/shared/cases/public-reports.md. Every job starts 2 real CPU ranks (gloo); logs
are checked both in the stored per-rank log (``-o job`` then ``job.logs(r)``) and in the
text streamed to the cell's stdout (``[rank N] ...``).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import textwrap

import pytest
from IPython.core.error import UsageError

from sgpu_magic.errors import RankFailedError
from sgpu_magic.front.magics import DistributedMagics

from helpers import C01_CELL1, children, kids, run_dirs, wait_gone

# --- helpers -------------------------------------------------------------------------------


def cell(run_cell, code: str):
    """Run a cell that must succeed; return (ExecutionResult, stdout, stderr)."""
    result, out, err = run_cell(textwrap.dedent(code).lstrip("\n"))
    assert result.error_before_exec is None, (result.error_before_exec, out, err)
    assert result.error_in_exec is None, (result.error_in_exec, out, err)
    return result, out, err


def run_cell_merged(ip, code: str):
    """Run a cell with stdout and stderr going to one stream, so their relative order is kept."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        result = ip.run_cell(textwrap.dedent(code).lstrip("\n"))
    return result, buf.getvalue()


def streamed(out: str, rank: int) -> list[str]:
    """The lines rank ``rank`` streamed to the cell's stdout, without their ``[rank N] `` prefix."""
    prefix = f"[rank {rank}] "
    return [line[len(prefix) :] for line in out.splitlines() if line.startswith(prefix)]


# --- C01 cell 3 ----------------------------------------------------------------------------


def test_c01_cell_magic_ships_notebook_helper_class_and_global(ip, run_cell):
    cell(run_cell, C01_CELL1)
    _, out, err = cell(
        run_cell,
        """
        %%distributed --gpus 2 -o job_c01
        import os
        print("value", Box(helper(16 + int(os.environ["RANK"]))).v)
        """,
    )
    job = ip.user_ns["job_c01"]
    assert job.state.value == "succeeded"
    assert "value 40.0" in job.logs(0).splitlines()
    assert "value 41.23105625617661" in job.logs(1).splitlines()
    assert "value 41.23105625617661" not in job.logs(0) and "value 40.0" not in job.logs(1)
    assert "value 40.0" in streamed(out, 0)
    assert "value 41.23105625617661" in streamed(out, 1)
    assert "Can't get attribute" not in out + err


# --- C05 cell 2 ----------------------------------------------------------------------------


def test_c05_unpicklable_global_warned_before_launch_then_fails_once_with_explanation(ip, run_cell, sgpu_home):
    cell(
        run_cell,
        """
        import threading
        stats_lock = threading.Lock()
        stats = {"steps": 0}
        """,
    )
    kids_before = kids()
    result, text = run_cell_merged(
        ip,
        """
        %%distributed --gpus 2 -o job_c05
        with stats_lock:
            stats["steps"] += 1
        print(stats)
        """,
    )

    # the warning, before any rank output
    warning = re.search(
        r"sgpu_magic warning: global 'stats_lock' \(_thread\.lock\) cannot be pickled "
        r"\(TypeError: cannot pickle '_thread\.lock' object\), so it is not sent to the ranks\. "
        r"Create it inside the cell or function that runs on the ranks instead\.",
        text,
    )
    assert warning, text
    assert "[rank" not in text[: warning.start()]
    assert text.count("sgpu_magic warning:") == 1  # stats (a dict) is sent without a warning

    # the job ran, and the first use of stats_lock failed with the same explanation
    err = result.error_in_exec
    assert isinstance(err, RankFailedError), text
    with pytest.raises(
        RankFailedError,
        match=r"failed \(root cause\): UnpicklableGlobalError: global 'stats_lock' \(_thread\.lock\) was not sent "
        r"to the ranks: it cannot be pickled \(TypeError: cannot pickle '_thread\.lock' object; see the warning "
        r"before the launch\)",
    ):
        result.raise_error()
    rc = err.root_cause
    assert rc.exc_type == "UnpicklableGlobalError"
    assert "with stats_lock:" in rc.traceback  # the user's line, from the notebook cell
    # the remedy is said once, in the warning (the error points at it instead of repeating it)
    everything = text + "\n".join(err._render_traceback_())
    assert everything.count("Create it inside the cell or function that runs on the ranks instead") == 1, everything

    # rendered once: one rank's traceback, not one per rank
    rendered = "\n".join(err._render_traceback_())
    assert rendered.count("Traceback (most recent call last)") == 1
    assert len(re.findall(r"--- traceback from rank \d \(root cause\) ---", rendered)) == 1
    assert rendered.count("with stats_lock:") == 1
    shown_by_ipython = "\n".join(line for line in text.splitlines() if not line.startswith("[rank "))
    assert shown_by_ipython.count("Traceback (most recent call last)") == 1
    assert "--- traceback from rank" in shown_by_ipython

    # nothing it started is left running
    job = ip.user_ns["job_c05"]
    assert job.state.value == "failed"
    pids = [int(p) for p in json.loads((job.run_dir / "status.json").read_text())["pids"].values()]
    assert len(pids) == 2 and wait_gone(pids) == []
    assert kids() == kids_before


def test_c05_cell_output_shows_the_traceback_once(ip, run_cell):
    cell(
        run_cell,
        """
        import threading
        stats_lock = threading.Lock()
        stats = {"steps": 0}
        """,
    )
    result, text = run_cell_merged(
        ip,
        """
        %%distributed --gpus 2
        with stats_lock:
            stats["steps"] += 1
        print(stats)
        """,
    )
    assert isinstance(result.error_in_exec, RankFailedError)
    assert text.count("Traceback (most recent call last)") == 1, text
    # the failing rank's line says where its traceback is (issue 18: it said "only in its log file")
    assert re.search(
        r"^\[rank \d\] \[sgpu_magic\] rank \d raised UnpicklableGlobalError; the error below shows the "
        r"root cause's traceback \(every rank's is in its log file\)$",
        text,
        re.MULTILINE,
    ), text


# --- C09 -----------------------------------------------------------------------------------

C09_CELL = """
%%distributed --gpus 2 -o job_c09
import os
open(os.path.join(piddir, str(os.getpid())), "w").close()
import torch, torch.distributed as dist
if not dist.is_initialized():
    dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
for step in range(5):
    if rank == 1 and step == 2:
        raise ValueError("bad batch at step 2 on rank 1")
    dist.all_reduce(t)
    print("step", step, float(t[0]))
"""


def test_c09_rank_crash_mid_training_stops_the_job_and_keeps_logs(ip, run_cell, piddir):
    result, out, _ = run_cell(C09_CELL.lstrip("\n"))
    with pytest.raises(
        RankFailedError, match=r"^rank 1 failed \(root cause\): ValueError: bad batch at step 2 on rank 1"
    ):
        result.raise_error()
    err = result.error_in_exec
    assert err.root_cause.rank == 1 and err.root_cause.exc_type == "ValueError"
    assert err.root_cause.message == "bad batch at step 2 on rank 1"
    assert 'raise ValueError("bad batch at step 2 on rank 1")' in err.root_cause.traceback
    assert "ValueError: bad batch at step 2 on rank 1" in err.root_cause.traceback
    # rank 0 is reported as stopped because of rank 1, or as a secondary failure after it, never as the cause
    assert 0 in err.stopped_ranks or [f.rank for f in err.others] == [0]
    assert re.search(r"rank 0 stopped (by sgpu_magic )?because rank 1 failed", str(err))
    rendered = "\n".join(err._render_traceback_())
    assert "--- traceback from rank 1 (root cause) ---" in rendered
    assert rendered.count("Traceback (most recent call last)") == 1

    job = ip.user_ns["job_c09"]
    for r in (0, 1):
        log = job.logs(r).splitlines()
        assert "step 0 2.0" in log and "step 1 4.0" in log
        assert "step 0 2.0" in streamed(out, r) and "step 1 4.0" in streamed(out, r)
    assert "ValueError: bad batch at step 2 on rank 1" in job.logs(1)

    pids = sorted(int(p.name) for p in piddir.iterdir())
    assert len(pids) == 2
    assert wait_gone(pids) == []
    assert children() == []

    # with the raise removed, the same cell runs to the end on both ranks
    fixed = C09_CELL.replace('        raise ValueError("bad batch at step 2 on rank 1")\n', "        pass\n")
    assert fixed != C09_CELL
    _, out, _ = cell(run_cell, fixed)
    job = ip.user_ns["job_c09"]
    for r in (0, 1):
        assert job.logs(r).splitlines()[-1] == "step 4 32.0"
        assert streamed(out, r)[-1] == "step 4 32.0"


# --- C16 -----------------------------------------------------------------------------------


def test_c16_everything_a_rank_writes_lands_in_its_own_log(ip, run_cell):
    _, out, _ = cell(
        run_cell,
        """
        %%distributed --gpus 2 -o job_c16
        import os, sys, logging
        r = os.environ["RANK"]
        sys.stderr.write(f"py-stderr rank={r}\\n")
        logging.basicConfig(level=logging.INFO)
        logging.getLogger("case").info(f"logging rank={r}")
        os.write(1, f"fd1 rank={r}\\n".encode())          # bypasses sys.stdout, as native code does
        os.write(2, f"fd2 rank={r}\\n".encode())
        os.system(f"echo shell rank={r}")                 # a child process of the rank
        print(f"final unflushed rank={r}", end="")        # no newline, no flush, the rank then exits
        """,
    )
    job = ip.user_ns["job_c16"]
    for r in (0, 1):
        log = job.logs(r)
        lines = log.splitlines()
        for marker in ("py-stderr", "fd1", "fd2", "shell", "final unflushed"):
            assert f"{marker} rank={r}" in lines, (r, marker, log)
        assert any(re.fullmatch(rf"INFO:case:logging rank={r}", line) for line in lines), log
        assert f"rank={1 - r}" not in log  # nothing from the other rank
        seen = streamed(out, r)
        for marker in ("py-stderr", "fd1", "fd2", "shell", "final unflushed"):
            assert f"{marker} rank={r}" in seen
        assert f"rank={1 - r}" not in "\n".join(seen)


# --- C17 -----------------------------------------------------------------------------------


def test_c17_progress_bars_stay_readable(ip, run_cell):
    pytest.importorskip("tqdm")
    _, out, _ = cell(
        run_cell,
        """
        %%distributed --gpus 2 -o job_c17
        import os, time
        from tqdm import tqdm
        for _ in tqdm(range(200), desc=f"rank{os.environ['RANK']}", mininterval=0):
            time.sleep(0.01)
        print("done", os.environ["RANK"])
        """,
    )
    job = ip.user_ns["job_c17"]
    for r in (0, 1):
        log = job.logs(r)
        # the stored log keeps the final bar state and the done line
        assert re.search(rf"rank{r}: 100%\|[^\r\n]*\| 200/200", log), log[-500:]
        assert log.splitlines()[-1] == f"done {r}"
        assert f"rank{1 - r}:" not in log  # one rank's bar never shows in the other's log
        # the streamed text folds the carriage-return updates: a few lines, not 200
        seen = streamed(out, r)
        bar_lines = [line for line in seen if line.startswith(f"rank{r}:")]
        assert 1 <= len(bar_lines) <= 5, bar_lines[:10]
        assert re.match(rf"rank{r}: 100%\|.*\| 200/200", bar_lines[-1])
        assert "\r" not in "".join(seen)
        assert seen[-1] == f"done {r}"
        assert not any(line.startswith(f"rank{1 - r}:") for line in seen)
    assert len([line for line in out.splitlines() if line.startswith("[rank 0] rank0:")]) <= 5


# --- C19 -----------------------------------------------------------------------------------


def test_c19_bursts_of_output_are_neither_interleaved_split_nor_dropped(ip, run_cell):
    _, out, _ = cell(
        run_cell,
        """
        %%distributed --gpus 2 -o job_c19
        import os, sys
        r = os.environ["RANK"]
        for i in range(2000):
            sys.stdout.write(f"r{r}-line{i:04d}-" + "x" * 100 + "\\n")
        """,
    )
    job = ip.user_ns["job_c19"]
    for r in (0, 1):
        expected = [f"r{r}-line{i:04d}-" + "x" * 100 for i in range(2000)]
        assert all(len(line) == 112 for line in expected)
        assert job.logs(r) == "".join(line + "\n" for line in expected)
        assert job.log_paths[r].read_text() == job.logs(r)
        assert streamed(out, r) == expected


# --- the cell's value ----------------------------------------------------------------------


def test_last_expression_of_the_cell_is_its_result_from_rank_0(ip, run_cell):
    result, out, _ = cell(
        run_cell,
        """
        %%distributed --gpus 2 -o job_value
        import os
        r = int(os.environ["RANK"])
        {"rank": r, "value": r + 100}
        """,
    )
    assert result.result == {"rank": 0, "value": 100}
    assert ip.user_ns["job_value"].results == [{"rank": 0, "value": 100}, {"rank": 1, "value": 101}]
    assert ip.user_ns["_"] == {"rank": 0, "value": 100}


# --- help ----------------------------------------------------------------------------------


def test_magic_help_lists_every_option(ip, capsys):
    doc = DistributedMagics.distributed.__doc__
    capsys.readouterr()
    ip.run_line_magic("pinfo", "%%distributed")
    shown = capsys.readouterr().out
    for text in (doc, shown):
        for option in (
            "--gpus GPUS",
            "--gpu-type GPU_TYPE",
            "--timeout TIMEOUT",
            "--port PORT",
            "-o NAME, --output NAME",
        ):
            assert option in text, option
        assert "Run the cell on N ranks" in text
        assert "'none'" in text


def test_magic_help_has_one_usage_examples_and_the_other_magics(ip, capsys):
    """Issue 18: ``%%distributed?`` showed ``%distributed --gpus GPUS ...`` (no such line magic), no example and
    no word of the other magics; its usage is now the one the UsageError repeats."""
    capsys.readouterr()
    ip.run_line_magic("pinfo", "%%distributed")
    shown = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    usages = re.findall(r"^ *%+distributed\b.*--gpus GPUS.*$", shown, re.MULTILINE)
    assert len(usages) == 1 and usages[0].split()[0] == "%%distributed", usages
    usage = " ".join(shown.split("::", 1)[1].split("\n\n")[1].split())  # the block after the first "::"
    assert usage.startswith("%%distributed --gpus GPUS [--gpu-type GPU_TYPE]")
    assert usage.endswith("[-o NAME] [--session [NAME]] [--ranks I,J]")
    examples = shown.split("Examples\n--------\n", 1)[1].split("See also\n--------\n", 1)
    assert examples[0].count("  %%distributed --gpus ") >= 3  # examples to copy, each a cell as typed
    for magic in ("%distributed_jobs : ", "%distributed_stop : ", "%mlflow_ui : ", "%config DistributedMagics : "):
        assert magic in examples[1], magic
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("distributed", "--gpus 2 --bogus 3", "1")
    assert str(info.value).splitlines()[1] == f"usage: {usage} (%%distributed? shows the help)"
    for line_magic, other in (
        ("distributed_jobs", "%%distributed : "),
        ("distributed_stop", "%distributed_jobs : "),
        ("mlflow_ui", "%distributed_stop : "),
    ):
        ip.run_line_magic("pinfo", f"%{line_magic}")
        text = capsys.readouterr().out
        assert "Examples\n--------" in re.sub(r"\x1b\[[0-9;]*m", "", text) and other in text, line_magic
        assert f"%{line_magic} : " not in text  # not its own See also


# --- bad input: refused before anything starts ---------------------------------------------


@pytest.mark.parametrize(
    "line, message",
    [
        ("--gpus abc", r"argument --gpus: invalid int value: 'abc'"),
        ("--gpus 0", r"gpus must be between 1 and 1024, got 0"),
        ("--gpus 2 --timeout -1", r"--timeout takes a number of seconds > 0, or 'none' for no limit; got '-1'"),
        ("--gpus 2 --timeout soon", r"--timeout takes a number of seconds > 0, or 'none' for no limit; got 'soon'"),
        ("--gpus 2 --port 70000", r"port must be an int between 1 and 65535"),
        ("--gpus 2 --bogus 3", r"unrecognized arguments: --bogus 3"),
        ("", r"the following arguments are required: --gpus"),
    ],
    ids=["gpus-abc", "gpus-0", "timeout-negative", "timeout-word", "port-range", "unknown-flag", "no-gpus"],
)
def test_bad_magic_options_raise_usage_error_before_anything_starts(ip, run_cell, sgpu_home, line, message):
    kids_before, runs_before = kids(), run_dirs(sgpu_home)
    result, out, _ = run_cell(f"%%distributed {line}".rstrip() + "\nprint('should not run')\n")
    with pytest.raises(UsageError, match=message):
        result.raise_error()
    assert kids() == kids_before
    assert run_dirs(sgpu_home) == runs_before
    assert "[rank" not in out


def test_syntax_error_cell_is_refused_before_anything_starts(ip, run_cell, sgpu_home):
    kids_before, runs_before = kids(), run_dirs(sgpu_home)
    result, out, _ = run_cell("%%distributed --gpus 2\nprint('fine')\nx = (\n")
    with pytest.raises(SyntaxError, match=r"'\(' was never closed") as info:
        result.raise_error()
    assert re.fullmatch(r"Cell In\[\d+\]", info.value.filename), info.value.filename  # as IPython names cells
    assert info.value.lineno == 3  # line 3 of the notebook cell (line 1 is %%distributed)
    assert kids() == kids_before
    assert run_dirs(sgpu_home) == runs_before
    assert "[rank" not in out


def test_config_defaults_are_shared_by_the_decorator(ip):
    from sgpu_magic import distributed

    ip.run_line_magic("config", "DistributedMagics.timeout_s = 1234.0")
    try:
        assert distributed(gpus=1)(len).spec.timeout_s == 1234.0
        assert distributed(gpus=1, timeout=None)(len).spec.timeout_s is None
    finally:
        ip.run_line_magic("config", "DistributedMagics.timeout_s = 10800.0")
    assert distributed(gpus=1)(len).spec.timeout_s == 10800.0


def test_bare_decorator_is_refused_with_the_remedy():
    from sgpu_magic import distributed
    from sgpu_magic.errors import SpecError

    with pytest.raises(SpecError, match=r"@distributed needs the number of GPUs: write @distributed\(gpus=N\)"):

        @distributed
        def f():
            pass


def test_rank_traceback_line_numbers_match_the_notebook_cell_with_leading_blank_lines(ip, run_cell):
    result, _, _ = run_cell("%%distributed --gpus 1\n\n\n\nx = 1\n1 / 0\n")
    err = result.error_in_exec
    assert isinstance(err, RankFailedError)
    assert re.search(r'File "Cell In\[\d+\]", line 6, in <module>', err.root_cause.traceback), err.root_cause.traceback


def test_a_rank_that_returns_before_its_peers_collective_is_named_in_the_error(ip):
    """Rank 1 returns while rank 0 waits in a barrier: rank 0 fails with gloo's 'Connection closed by peer', and
    the error names rank 1 as the one that left (it exited 0, so nothing else would name it)."""
    result, text = run_cell_merged(
        ip,
        '%%distributed --gpus 2 --no-mlflow\nimport os, torch.distributed as dist\ndist.init_process_group("gloo")\n'
        'if os.environ["RANK"] == "0":\n    dist.barrier()\n',
    )
    err = result.error_in_exec
    assert isinstance(err, RankFailedError), text
    assert err.root_cause.rank == 0 and "by peer" in err.root_cause.message
    assert (
        "  hint: rank 1 returned while the others still ran: a rank that leaves before the collectives its peers "
        "still call (a barrier, an all-reduce) makes them fail like this; check that every rank runs the same "
        "collectives" in str(err)
    )
