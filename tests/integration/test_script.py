"""Scripts and modules run as torchrun runs them: ``run_script`` and ``%distributed_run`` (issue 17).

Real rank processes, the session's real IPython shell, and a real Jupyter kernel (through
jupyter_client) for the cases the issue lists: argparse positional and optional arguments, ``-m`` a
module, ``sys.exit(3)`` (failed, exit code 3), a missing path (refused, nothing started).
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap

import pytest
from IPython.core.error import UsageError

from sgpu_magic import Job, JobState, run_script
from sgpu_magic.errors import RankFailedError, SpecError

from kernel_utils import execute, start_kernel, stop_kernel

PROBE = """\
import argparse, json, os, sys
parser = argparse.ArgumentParser()
parser.add_argument("total_epochs", type=int)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--name", default="run")
parser.add_argument("--out", required=True)
args = parser.parse_args()
import sibling  # a module next to the script, as torchrun finds it (the script's folder is sys.path[0])
seen = {"argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(),
        "args": vars(args), "sibling": sibling.VALUE,
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                               "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")}}
with open(os.path.join(args.out, f"rank_{os.environ['RANK']}.json"), "w") as f:
    json.dump(seen, f)
"""


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """``scripts/probe.py`` (+ ``scripts/sibling.py``), an output folder, and a kernel cwd that is neither."""
    script = write(tmp_path / "scripts" / "probe.py", PROBE)
    write(tmp_path / "scripts" / "sibling.py", "VALUE = 'beside the script'\n")
    out = tmp_path / "out"
    out.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return script, out, work


def seen_by(out, world: int) -> list[dict]:
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(world)]


def test_run_script_gives_each_rank_what_torchrun_gives_it(probe):
    script, out, work = probe
    assert run_script(
        os.path.relpath(script), ["3", "--lr", "0.5", "--out", str(out)], gpus=2, mlflow=False, widgets=False
    ) == [0, 0]
    for rank, seen in enumerate(seen_by(out, 2)):
        assert seen["argv"] == [str(script), "3", "--lr", "0.5", "--out", str(out)]
        assert (seen["name"], seen["file"], seen["path0"], seen["cwd"]) == (
            "__main__",
            str(script),
            str(script.parent),
            str(work),
        )
        assert seen["args"] == {"total_epochs": 3, "lr": 0.5, "name": "run", "out": str(out)}
        assert seen["sibling"] == "beside the script"
        env = seen["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank),
            str(rank),
            "2",
            "2",
        )
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"].isdigit()
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"


def test_the_magic_passes_what_follows_the_script_untouched(ip, probe):
    """Options after the script that the magic also has (``-o``, ``--gpus``) are the script's, as with torchrun."""
    script, out, _ = probe
    write(
        script,
        PROBE.replace(
            'parser.add_argument("--out", required=True)',
            'parser.add_argument("--out", required=True)\nparser.add_argument("-o")\nparser.add_argument("--gpus")',
        ),
    )
    ip.user_ns.pop("job", None)
    value = ip.run_line_magic(
        "distributed_run",
        f"--gpus 2 --no-mlflow --no-widgets -o job {script} 7 --name 'two words' --out {out} -o mine --gpus 5",
    )
    assert value is None
    job = ip.user_ns["job"]
    assert isinstance(job, Job) and job.state is JobState.SUCCEEDED and job.result() == [0, 0]
    assert seen_by(out, 2)[1]["argv"][1:] == [
        "7",
        "--name",
        "two words",
        "--out",
        str(out),
        "-o",
        "mine",
        "--gpus",
        "5",
    ]


def test_a_module_runs_as_python_m_does(ip, tmp_path, monkeypatch):
    """``-m pkg.train``: the module's file as argv[0], the current directory first on sys.path, the package
    imported first; ``-m pkg`` runs ``pkg/__main__.py``."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "pkg" / "__init__.py", "IMPORTED = True\n")
    body = """\
        import json, os, sys
        import pkg
        assert __name__ == "__main__" and pkg.IMPORTED
        with open(os.path.join(sys.argv[1], f"{MARK}_{os.environ['RANK']}.json"), "w") as f:
            json.dump({"argv": sys.argv, "path0": sys.path[0], "spec": __spec__.name}, f)
        """
    train = write(tmp_path / "pkg" / "train.py", body.replace("{MARK}", "train"))
    main = write(tmp_path / "pkg" / "__main__.py", body.replace("{MARK}", "main"))
    out = tmp_path / "out"
    out.mkdir()
    assert run_script("pkg.train", [str(out), "--flag"], module=True, gpus=2, mlflow=False, widgets=False) == [0, 0]
    ip.run_line_magic("distributed_run", f"--gpus 1 --no-mlflow --no-widgets -m pkg {out}")
    for rank in range(2):
        seen = json.loads((out / f"train_{rank}.json").read_text())
        assert seen == {"argv": [str(train), str(out), "--flag"], "path0": str(tmp_path), "spec": "pkg.train"}
    assert json.loads((out / "main_0.json").read_text())["argv"] == [str(main), str(out)]


TRAIN = """\
import torch

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(6):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
"""


def test_a_script_s_optimizer_steps_are_timed_and_profiled_by_the_magic_and_run_script(ip, tmp_path):
    train = write(tmp_path / "train.py", TRAIN)
    ip.user_ns.pop("job", None)
    ip.run_line_magic("distributed_run", f"--gpus 2 --no-mlflow --no-widgets --profile 3 -o job {train}")
    job = ip.user_ns["job"]
    assert [len(t) for t in job.step_times().values()] == [5, 5]
    assert sorted(job.profile_summary()) == [0, 1] and job.profile_summary()[1]["steps"] == 3
    assert run_script(str(train), gpus=1, mlflow=False, widgets=False, profile=2) == [0]
    with pytest.raises(SpecError, match=r"^profile must be a number of steps to profile between 1 and 1000"):
        run_script(str(train), gpus=1, profile=0)


def test_exit_status_is_the_result_and_sys_exit_3_fails_with_code_3(tmp_path):
    ok = write(tmp_path / "ok.py", "import sys\nprint('done')\nsys.exit(0)\n")
    assert run_script(str(ok), gpus=2, mlflow=False, widgets=False) == [0, 0]
    three = write(
        tmp_path / "three.py",
        "import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(3)\nimport time\ntime.sleep(60)\n",
    )
    with pytest.raises(RankFailedError, match=r"^rank 1 failed \(root cause\): SystemExit: 3 \(exit code 3\)") as info:
        run_script(str(three), gpus=2, mlflow=False, widgets=False)
    assert info.value.root_cause.rank == 1 and info.value.root_cause.exitcode == 3


def test_an_argparse_refusal_shows_its_usage_and_exit_code_not_a_traceback(tmp_path):
    """Python and torchrun print no traceback for ``SystemExit``: the error is argparse's own lines and the exit
    code, and ``sys.exit("message")`` prints its message as Python does (exit code 1)."""
    script = write(
        tmp_path / "train.py",
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('save_every', type=int)\np.parse_args()\n",
    )
    with pytest.raises(RankFailedError) as info:
        run_script(str(script), gpus=2, mlflow=False, widgets=False)
    lines = str(info.value).splitlines()
    assert re.fullmatch(r"rank [01] failed \(root cause\): SystemExit: 2 \(exit code 2\)", lines[0]), lines
    assert lines[1:4] == [
        "  the end of its log:",
        "    | usage: train.py [-h] save_every",
        "    | train.py: error: the following arguments are required: save_every",
    ], lines
    assert info.value.root_cause.traceback == ""
    rendered = "\n".join(info.value._render_traceback_())
    assert "Traceback" not in rendered and "argparse.py" not in rendered, rendered

    says = write(tmp_path / "says.py", "import sys\nsys.exit('no data in /nowhere')\n")
    with pytest.raises(RankFailedError, match=r"SystemExit: 1 \(exit code 1\)\n  the end of its log:\n    \| no data"):
        run_script(str(says), gpus=1, mlflow=False, widgets=False)


def test_background_returns_the_job(ip, tmp_path):
    script = write(tmp_path / "bg.py", "import sys\nprint('args', sys.argv[1:])\n")
    job = run_script(str(script), ["a"], gpus=2, mlflow=False, widgets=False, background=True)
    assert isinstance(job, Job) and job.result(timeout_s=120) == [0, 0]
    assert "args ['a']" in job.logs(1)
    job = ip.run_line_magic("distributed_run", f"--gpus 1 --no-mlflow --no-widgets --background {script} b")
    assert isinstance(job, Job) and job.result(timeout_s=120) == [0]


def test_a_tracked_script_job_is_one_run_named_after_the_script(tmp_path, monkeypatch):
    import uuid

    from mlflow import MlflowClient

    name = f"test-script-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", name)
    script = write(
        tmp_path / "train_mlp.py",
        """\
        import os
        import mlflow
        for step in range(50):
            mlflow.log_metric(f"loss_rank{os.environ['RANK']}", 1.0 / (step + 1), step=step)
        """,
    )
    job = run_script(str(script), gpus=2, widgets=False, background=True)
    assert job.result(timeout_s=180) == [0, 0]
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.get_run(job.mlflow_run_id)
    assert run.info.run_name == "train_mlp.py" and run.info.status == "FINISHED"
    assert [len(client.get_metric_history(run.info.run_id, f"loss_rank{r}")) for r in range(2)] == [50, 50]


# ----------------------------------------------------------------------------- refused before launch


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "notes.txt", "these are notes, not python: a -> b\n")
    write(tmp_path / "broken.py", "x = 1\ndef f(:\n    pass\n")
    (tmp_path / "folder").mkdir()
    write(tmp_path / "lib" / "__init__.py", "raise RuntimeError('the package was imported in the kernel')\n")
    write(tmp_path / "lib" / "util.py", "X = 1\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02\xff")
    return tmp_path


REFUSED = [
    (
        "missing.py",
        False,
        FileNotFoundError,
        r"^script 'missing\.py' not found \(looked for .*/missing\.py; the kernel's "
        r"current directory is .*\); give the path of a Python file",
    ),
    (
        "notes.txt",
        False,
        ValueError,
        r"^script 'notes\.txt' is not a Python file \(SyntaxError: .*\); %distributed_run "
        r"and run_script run Python scripts, as torchrun does$",
    ),
    ("blob.bin", False, ValueError, r"^script 'blob\.bin' is not a Python file \((SyntaxError|ValueError): "),
    ("folder", False, ValueError, r"^script 'folder' is a folder without a __main__\.py; give the Python file to run$"),
    (
        "no_such_module",
        True,
        ModuleNotFoundError,
        r"^no module named 'no_such_module' \(searched the kernel's current "
        r"directory .* and sys\.path\)",
    ),
    ("lib.nothing", True, ModuleNotFoundError, r"^no module named 'lib\.nothing'"),
    (
        "lib",
        True,
        ModuleNotFoundError,
        r"^'lib' is a package without a __main__ module, so it cannot be run "
        r"\(python -m lib fails the same way\); name a module inside it$",
    ),
    ("not-a.module", True, ValueError, r"^module 'not-a\.module' is not a dotted module name such as 'mypkg\.train'$"),
]


@pytest.mark.parametrize(
    "target, module, error, message",
    REFUSED,
    ids=["missing", "text", "binary", "folder", "no-module", "no-submodule", "package", "bad-name"],
)
def test_what_cannot_run_is_refused_before_anything_starts(settled, ip, files, target, module, error, message):
    """``run_script`` raises the error itself; ``%distributed_run`` shows it as a UsageError. Nothing starts,
    and a module's parent package is not imported in the kernel to find it."""
    with settled():
        with pytest.raises(error, match=message):
            run_script(target, module=module, gpus=2)
        with pytest.raises(UsageError, match=message):
            ip.run_line_magic("distributed_run", f"--gpus 2 {'-m ' if module else ''}{target}")
    assert "lib" not in sys.modules


def test_a_py_file_that_does_not_compile_is_its_syntax_error(settled, ip, files):
    with settled():
        with pytest.raises(SyntaxError) as info:
            run_script("broken.py", gpus=2)
        assert (info.value.filename, info.value.lineno) == (str(files / "broken.py"), 2)
        with pytest.raises(SyntaxError):
            ip.run_line_magic("distributed_run", "--gpus 2 broken.py")


def test_bad_arguments_and_options_are_refused_naming_them(settled, ip, files):
    write(files / "fine.py", "pass\n")
    with settled():
        with pytest.raises(
            SpecError,
            match=r"^args must be a list of strings \(the script's command-line arguments, "
            r"e\.g\. \['--epochs', '3'\]\), got '--epochs 3'$",
        ):
            run_script("fine.py", "--epochs 3", gpus=2)
        with pytest.raises(
            SpecError,
            match=r"^args must be strings, as on a command line; 3 is of type int \(write "
            r"str\(\.\.\.\) or an f-string\)$",
        ):
            run_script("fine.py", ["--epochs", 3], gpus=2)
        with pytest.raises(
            SpecError,
            match=r"^module must be True or False \(run a module, as python -m, instead of "
            r"a script file\); got 'yes'$",
        ):
            run_script("fine.py", module="yes", gpus=2)
        with pytest.raises(SpecError, match=r"^background must be True or False"):
            run_script("fine.py", background="no", gpus=2)
        with pytest.raises(SpecError, match=r"^stuck_after_s must be a number of seconds > 0, or None for no limit"):
            run_script("fine.py", stuck_after_s=0, gpus=2)
        with pytest.raises(
            ValueError,
            match=r"^give the script to run as a path \(or a module name with "
            r"module=True\); got ''$",
        ):
            run_script("", gpus=2)
        with pytest.raises(
            UsageError,
            match=r"^the following arguments are required: script\.py \| module, args\n"
            r"usage: %distributed_run .*\(%distributed_run\? shows the help\)",
        ):
            ip.run_line_magic("distributed_run", "--gpus 2")
        with pytest.raises(UsageError, match=r"^-o/--output takes a Python variable name such as job"):
            ip.run_line_magic("distributed_run", "--gpus 2 -o 1x fine.py")
        with pytest.raises(UsageError, match=r"^gpus must be between 1 and 1024, got 0$"):
            ip.run_line_magic("distributed_run", "--gpus 0 fine.py")


# ----------------------------------------------------------------------------- the issue's cases, in a real kernel


@pytest.mark.slow
def test_the_issue_cases_in_a_real_kernel(tmp_path):
    """As a notebook user types them: argparse positional + optional arguments, -m a module, sys.exit(3),
    a missing path (refused, nothing started: no process under the kernel and no run directory)."""
    write(
        tmp_path / "train.py",
        """\
        import argparse, os
        p = argparse.ArgumentParser()
        p.add_argument("total_epochs", type=int)
        p.add_argument("save_every", type=int)
        p.add_argument("--batch_size", type=int, default=32)
        a = p.parse_args()
        print(f"rank {os.environ['RANK']}: epochs={a.total_epochs} save_every={a.save_every} batch={a.batch_size}")
        """,
    )
    write(tmp_path / "tools" / "__init__.py", "")
    write(tmp_path / "tools" / "report.py", "import sys\nprint('module argv', sys.argv[1:])\n")
    write(tmp_path / "exit3.py", "import sys\nsys.exit(3)\n")
    home = tmp_path / "home"
    km, kc = start_kernel(
        cwd=tmp_path,
        env={
            "SGPU_MAGIC_HOME": str(home),
            "SGPU_MAGIC_WIDGETS": "0",
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db",
        },
    )
    try:
        out = execute(kc, "%distributed_run --gpus 2 -o job train.py 5 2 --batch_size 8\njob.results", timeout_s=300)
        assert out.error is None, out
        assert "[rank 0] rank 0: epochs=5 save_every=2 batch=8" in out.stdout
        assert "[rank 1] rank 1: epochs=5 save_every=2 batch=8" in out.stdout
        assert out.results == ["[0, 0]"]
        out = execute(kc, "%distributed_run --gpus 2 --no-mlflow -m tools.report --verbose", timeout_s=300)
        assert out.error is None and "[rank 1] module argv ['--verbose']" in out.stdout, out
        out = execute(kc, "%distributed_run --gpus 2 --no-mlflow exit3.py", timeout_s=300)
        assert out.error["ename"] == "RankFailedError", out
        assert "SystemExit: 3 (exit code 3)" in out.error["evalue"]
        runs = sorted(os.listdir(home / "runs"))
        out = execute(
            kc,
            "import psutil\nbefore = len(psutil.Process().children(recursive=True))\n"
            "%distributed_run --gpus 2 missing.py",
        )
        assert "UsageError: script 'missing.py' not found" in out.stderr, out  # IPython shows usage errors on stderr
        out = execute(kc, "print(len(psutil.Process().children(recursive=True)) == before)")
        assert out.stdout.strip() == "True"
        assert sorted(os.listdir(home / "runs")) == runs
    finally:
        stop_kernel(km, kc)
