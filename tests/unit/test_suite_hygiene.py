"""The suite fails when a test leaves something in the repository (the root conftest's session check).

Run for real: a throwaway git repository gets this repository's root ``conftest.py`` and one test
that writes a file into the repository's root; pytest runs there in a subprocess.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("leaves", [True, False], ids=["leaves-a-file", "clean"])
def test_a_run_that_leaves_files_in_the_repository_fails_naming_them(tmp_path, leaves):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    shutil.copy(ROOT / "conftest.py", repo / "conftest.py")
    (repo / ".gitignore").write_text("mlruns/\n")
    where = "mlruns/0/left.log" if leaves else None
    (repo / "tests" / "test_writes.py").write_text(
        "import os\n\ndef test_writes():\n"
        + (
            f"    os.makedirs('mlruns/0', exist_ok=True)\n    open({where!r}, 'w').close()\n"
            if leaves
            else "    pass\n"
        )
    )
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "start"], cwd=repo, check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if leaves:
        assert run.returncode == 1, run.stdout + run.stderr
        assert "the tests left files in the repository (git status --porcelain --ignored)" in run.stdout
        assert "!! mlruns/" in run.stdout  # ignored by git, and still found
    else:
        assert run.returncode == 0, run.stdout + run.stderr
        assert "left files" not in run.stdout


def test_every_test_module_has_a_name_of_its_own():
    """The test folders are not packages (rootdir-relative imports): two ``test_x.py`` in two folders make pytest
    refuse the second one ("import file mismatch") when both are collected, as in CI's whole-suite run."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(ROOT)} and {path.relative_to(ROOT)}")
        seen.setdefault(path.name, path)
    assert not clashes, f"test modules share a name (rename one): {clashes}"


# ----------------------------------------------------------------------------- timed asserts, private reaches

TESTS = ROOT / "tests"
_CLOCKS = {"time.monotonic", "time.perf_counter", "time.time", "monotonic", "perf_counter"}
_PRIVATES_OF_SGPU_OBJECTS = {"_payload", "_sinks", "_rd", "_results", "_status", "_ui", "_host", "_feed"}
"""Privates of sgpu_magic's objects that tests used to reach (sgpu_magic.testing and the public API replace them)."""


def _clock_names(tree: ast.AST) -> set[str]:
    """Names assigned from an expression that reads a clock (``t0 = time.monotonic()``, ``elapsed = ... - t0``)."""
    names: set[str] = set()
    changed = True
    while changed:
        changed = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _reads_clock(node.value, names):
                for target in node.targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name) and name.id not in names:
                            names.add(name.id)
                            changed = True
    return names


def _reads_clock(node: ast.AST, names: set[str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and ast.unparse(sub.func) in _CLOCKS:
            return True
        if isinstance(sub, ast.Name) and sub.id in names:
            return True
    return False


def timed_asserts(source: str, filename: str) -> list[str]:
    """``file:line`` of every ``assert`` that orders (``<``, ``<=``, ``>``, ``>=``) a value read from a clock,
    unless one of its lines says why it is not a speed target (``# timing-ok: ...``)."""
    tree = ast.parse(source, filename)
    names, lines = _clock_names(tree), source.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert) or any(
            "# timing-ok:" in x for x in lines[node.lineno - 1 : node.end_lineno]
        ):
            continue
        for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            ordered = any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in cmp.ops)
            if ordered and _reads_clock(cmp, names):
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node.test)}")
                break
    return found


def test_no_test_asserts_on_wall_clock_time():
    """Speed targets are figures of ``python -m benchmarks.run`` (e.g. ``--only responsive``), never asserts:
    on a loaded machine they fail for reasons that are not bugs."""
    found = [
        hit
        for path in sorted(TESTS.rglob("*.py"))
        for hit in timed_asserts(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert found == [], "timed asserts (move the figure to benchmarks/, keep the behaviour):\n" + "\n".join(found)


def test_the_timed_assert_check_finds_one():
    source = (
        "import time\n"
        "t0 = time.monotonic()\n"
        "elapsed = time.monotonic() - t0\n"
        "assert elapsed < 5.0\n"
        "assert time.perf_counter() - t0 < 2\n"
        "assert elapsed >= 2.0  # timing-ok: a lower bound, not a speed target\n"
        "assert len('abc') < 5\n"
    )
    assert timed_asserts(source, "probe.py") == [
        "probe.py:4: elapsed < 5.0",
        "probe.py:5: time.perf_counter() - t0 < 2",
    ]


def test_tests_and_benchmarks_use_the_public_seam_not_sgpu_magic_privates():
    """``sgpu_magic.testing.start_job`` instead of the decorator's start with the function's private payload
    builder, ``job.view`` instead of the job's private sink list, ``RunDir(job.run_dir)`` instead of its private
    RunDir, ..."""
    reach = re.compile(r"(?<!self)\.(" + "|".join(sorted(_PRIVATES_OF_SGPU_OBJECTS)) + r")\b")
    found = []
    for path in sorted([*TESTS.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in _PRIVATES_OF_SGPU_OBJECTS:
                text = ast.unparse(node)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and reach.search(node.value):
                text = reach.search(node.value).group(0)  # code run in a kernel or a subprocess
            else:
                continue
            if not text.startswith("self."):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert found == [], "use sgpu_magic.testing or the public API:\n" + "\n".join(found)
