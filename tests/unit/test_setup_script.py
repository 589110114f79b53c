"""``scripts/setup.sh`` says what it does, step by step with times, and shows pip's output only for a step
that fails (issue 18). Run for real on a copy of the script in a temporary folder, with a torch spec that
no index has, so that it stops at the torch step after creating its venv and upgrading pip."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "setup.sh"


def test_setup_prints_one_timed_line_per_step_and_the_log_of_the_step_that_failed(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "setup.sh")
    env = {**os.environ, "SGPU_TORCH_SPEC": "sgpu-no-such-package==0"}
    run = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    lines = (run.stdout + run.stderr).splitlines()
    assert run.returncode == 1, lines
    assert re.fullmatch(r"setup: creating \.venv with python3 \(Python 3\.\d+\.\d+\) \.\.\. done \(\d+ s\)", lines[0])
    assert re.fullmatch(r"setup: upgrading pip \.\.\. done \(\d+ s\)", lines[1]), lines
    assert re.fullmatch(r"setup: installing sgpu-no-such-package 0 \.\.\. FAILED \(exit code 1, \d+ s\)", lines[2])
    assert lines[3] == "setup: .venv/setup-logs/torch.log (pip's 'Location ... is ignored' warnings left out):"
    log = lines[4:]
    assert log and all(line.startswith("    ") for line in log), lines  # the step's log, indented, and nothing after
    assert any("No matching distribution found for sgpu-no-such-package==0" in line for line in log), log
    assert not [line for line in lines if "is ignored: it is neither a file nor a directory" in line]
    assert (tmp_path / ".venv" / "setup-logs" / "pip.log").is_file()  # what pip said, kept
