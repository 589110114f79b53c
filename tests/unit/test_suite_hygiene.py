"""The suite fails when a test leaves something in the repository (the root conftest's session check).

Run for real: a throwaway git repository gets this repository's root ``conftest.py`` and one test
that writes a file into the repository's root; pytest runs there in a subprocess.
"""

from __future__ import annotations

import os
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
