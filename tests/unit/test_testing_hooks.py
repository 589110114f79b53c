"""sgpu_magic.testing: the hooks tests and benchmarks use instead of sgpu_magic's privates (their jobs run in
tests/integration/test_panel.py, test_restarts.py, test_launcher.py and test_tracking.py)."""

from __future__ import annotations

import pytest

from sgpu_magic.testing import mlflow_ui_pid, start_job


def test_start_job_refuses_a_function_that_is_not_decorated():
    def plain():
        return 1

    with pytest.raises(
        TypeError,
        match=r"start_job needs a function decorated with @distributed\(\.\.\.\), got function; decorate it first, "
        r"e\.g\. start_job\(distributed\(gpus=2\)\(fn\)\)",
    ):
        start_job(plain)  # type: ignore[arg-type]


def test_mlflow_ui_pid_is_none_without_a_server():
    assert mlflow_ui_pid() is None
