"""The launch host's diagnostics: records of ``logging.getLogger(__name__)`` in its modules, written by the one
handler :func:`sgpu_magic.launch.host.process.host_logging` sets up as lines of the host's log file, redacted."""

from __future__ import annotations

import subprocess
import sys

HOST_LIKE = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
os.dup2(fd, 2)  # as the host's _detach does: stderr is the log file
from sgpu_magic.launch.host.process import host_logging
from sgpu_magic.launch.host.cleanup import end_mlflow_run
from sgpu_magic.wire import RunState
from sgpu_magic.rundir import RunDir, atomic_write_json
host_logging()
rd = RunDir.create(__import__("pathlib").Path(sys.argv[2]))
atomic_write_json(rd.mlflow_file, {"run_id": "r1", "tracking_uri": "bogus://user:hunter22@host/db"})
end_mlflow_run(rd, RunState.FAILED)
"""


def test_a_host_diagnostic_is_one_redacted_line_of_the_host_log(tmp_path):
    log = tmp_path / "host.log"
    run = subprocess.run(
        [sys.executable, "-c", HOST_LIKE, str(log), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    lines = log.read_text().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("sgpu_magic host: could not end MLflow run r1 FAILED: "), lines
    assert "bogus://user:***@host/db" in lines[0] and "hunter22" not in lines[0]
