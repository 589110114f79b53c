"""Every function of ``sgpu_magic._compat`` against the installed libraries, for real.

Each test is named after the function it runs, so an upgrade of torch, MLflow, ipykernel or Python that drops a
private sgpu_magic relies on fails here under that name (see docs/architecture.md, "Other libraries' privates").
The error paths take the private away with ``monkeypatch`` (what such an upgrade would do) and pin the message.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing.forkserver
import operator
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest

from sgpu_magic._compat import CompatError, elastic, forkserver, ipykernel, stdlib
from sgpu_magic._compat import mlflow as mlflow_compat

from helpers import wait_for


def _run(code: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (for what changes a process for good: exit paths, c10d, MLflow's globals)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout_s
    )


# ----------------------------------------------------------------------------- torch elastic


def _elastic_context(kind: str, tmp_path, **kwargs):
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, MultiprocessContext, SubprocessContext

    base = MultiprocessContext if kind == "multiprocess" else SubprocessContext
    logs = DefaultLogsSpecs(log_dir=str(tmp_path / "elastic"))
    return elastic.context_class(base, 3.0)(name="compat", logs_specs=logs, **kwargs)


@pytest.mark.slow
def test_context_class_starts_warm_ranks_through_wrap_no_wait(tmp_path):
    """A rank started through ``wrap_no_wait`` exits as soon as its value is in the queue: nobody has read it yet
    (elastic's own wrapper would wait for the parent's read). ``exitcodes`` and ``wake_fds`` see it."""
    import torch.distributed.elastic.multiprocessing.api as api

    original = api._wrap
    ctx = _elastic_context(
        "multiprocess", tmp_path, entrypoint=operator.add, args={0: (1, 2)}, envs={0: {}}, start_method="spawn"
    )
    ctx.start()
    try:
        assert api._wrap is original  # swapped back once the processes started
        assert len(elastic.wake_fds(ctx)) == 2  # the process sentinel, the return-value pipe
        wait_for(lambda: elastic.exitcodes(ctx) == {0: 0}, 60, "the rank to exit before its value was read")
        result = ctx.wait(30)
        assert result is not None and result.return_values == {0: 3} and not result.failures
    finally:
        ctx.close()


def test_context_class_remembers_the_ranks_that_failed_before_close(tmp_path):
    """``first_failures``: the rank that failed, not the one elastic's poll then stopped with ``close()``."""
    ctx = _elastic_context(
        "subprocess",
        tmp_path,
        entrypoint=sys.executable,
        args={0: ("-c", "raise SystemExit(3)"), 1: ("-c", "import signal; signal.pause()")},
        envs={0: {}, 1: {}},
    )
    ctx.start()
    try:
        result = wait_for(lambda: ctx.wait(0), 60, "rank 0 to fail")
        assert set(result.failures) == {0, 1}  # rank 1 was stopped
        assert set(ctx.first_failures) == {0} and ctx.first_failures[0].exitcode == 3
        assert elastic.exitcodes(ctx)[0] == 3 and elastic.exitcodes(ctx)[1] is not None
        assert elastic.wake_fds(ctx) == []  # no return-value pipes in a SubprocessContext
    finally:
        ctx.close()


def test_wrap_no_wait_without_elastics_wrapper_says_which_private_is_gone(monkeypatch):
    import torch.distributed.elastic.multiprocessing.api as api

    monkeypatch.delattr(api, "_wrap")
    with pytest.raises(
        CompatError,
        match=r"torch \S+ has no torch\.distributed\.elastic\.multiprocessing\.api\._wrap, which sgpu_magic needs "
        r"\(checked against torch 2\.13\.0\): a warm rank cannot start; install a torch version sgpu_magic was "
        r"checked against, or report this at the sgpu_magic issue tracker",
    ):
        elastic.wrap_no_wait(0)


# ----------------------------------------------------------------------------- torch


def test_keep_groups_of_keeps_the_groups_destroy_process_group_drops(tmp_path):
    run = _run(f"""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        from sgpu_magic._compat.torch import keep_groups_of

        kept = []
        keep_groups_of(c10d, kept)
        keep_groups_of(c10d, kept)  # idempotent: wrapped once
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        group = dist.group.WORLD
        dist.destroy_process_group()
        print(kept[0] is group, all(g is group for g in kept), c10d._update_default_pg.__wrapped__.__name__)
    """)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "True", "_update_default_pg"]


def test_skip_library_finalizers_leaves_out_torchs_and_only_those():
    run = _run("""
        import tempfile, weakref, torch.library
        from sgpu_magic._compat.torch import skip_library_finalizers

        lib = torch.library.Library("sgpu_compat_test", "DEF")
        other = weakref.finalize(tempfile, print, "other finalizer ran")
        print(skip_library_finalizers() >= 1, other.atexit)
    """)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["True True", "other finalizer ran"]


def test_skip_library_finalizers_without_torch_library_does_nothing():
    run = _run("from sgpu_magic._compat.torch import skip_library_finalizers; print(skip_library_finalizers())")
    assert run.returncode == 0, run.stderr
    assert run.stdout == "0\n"


# ----------------------------------------------------------------------------- multiprocessing's forkserver


def test_forkserver_pid_and_stop_forkserver():
    run = _run("""
        import multiprocessing.forkserver, os
        from sgpu_magic._compat.forkserver import forkserver_pid, stop_forkserver

        print(forkserver_pid())
        multiprocessing.forkserver.ensure_running()
        pid = forkserver_pid()
        print(pid == multiprocessing.forkserver._forkserver._forkserver_pid, os.path.exists(f"/proc/{pid}"))
        stop_forkserver()
        print(forkserver_pid(), os.path.exists(f"/proc/{pid}"))
    """)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["None", "True True", "None False"]


def test_stop_forkserver_without_the_private_says_what_fails(monkeypatch):
    monkeypatch.delattr(multiprocessing.forkserver.ForkServer, "_stop")
    with pytest.raises(
        CompatError,
        match=r"python 3\.\d+\.\d+ has no multiprocessing\.forkserver\._forkserver\._stop, which sgpu_magic needs "
        r"\(checked against python 3\.10\.13-3\.13\.0\): the warm forkserver cannot be restarted after the "
        r"packages changed; install a python version",
    ):
        forkserver.stop_forkserver()


def test_fork_forkserver_starts_a_fork_of_this_process_that_serves_and_stops():
    run = _run("""
        import multiprocessing, multiprocessing.forkserver, os
        from sgpu_magic._compat.forkserver import fork_forkserver, forkserver_pid, stop_forkserver

        pid = fork_forkserver(lambda: None)
        with open(f"/proc/{pid}/cmdline", "rb") as mine, open("/proc/self/cmdline", "rb") as its:
            print(pid == forkserver_pid(), mine.read() == its.read())  # a fork: this process's argv, not `-c main()`
        print(fork_forkserver(lambda: None))  # one is running: nothing done
        multiprocessing.forkserver.ensure_running()  # sees it alive
        print(forkserver_pid() == pid)
        child = multiprocessing.get_context("forkserver").Process(target=os._exit, args=(7,))
        child.start()
        child.join()
        print(child.exitcode)
        stop_forkserver()
        print(forkserver_pid(), os.path.exists(f"/proc/{pid}"))
    """)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["True True", "None", "True", "7", "None False"]


def test_fork_forkserver_of_another_shape_is_none(monkeypatch):
    def main(listener_fd, alive_r, preload, main_path=None, sys_path=None, *, authkey_r=None):  # CPython 3.14's
        raise AssertionError("not to be called")

    monkeypatch.setattr(multiprocessing.forkserver, "main", main)
    before = forkserver.forkserver_pid()
    assert forkserver.fork_forkserver(lambda: None) is None
    assert forkserver.forkserver_pid() == before  # nothing started: the caller falls back to ensure_running()


def test_forkserver_pid_without_the_private_is_none(monkeypatch):
    monkeypatch.delattr(multiprocessing.forkserver._forkserver, "_forkserver_pid")
    assert forkserver.forkserver_pid() is None


# ----------------------------------------------------------------------------- ipykernel


def test_forget_reply_route_sends_the_next_message_where_the_frontend_chose():
    from ipykernel.comm.comm import BaseComm  # what ipykernel's comm.create_comm makes for a widget

    comm = BaseComm(target_name="sgpu_compat_test")  # no kernel here: nothing is published
    with comm._reply_subshell_lock:
        comm._reply_subshell_id = "main shell"  # what publishing from a running cell records
    assert comm._reply_subshell_for(None, "frontend's subshell") == "main shell"
    assert ipykernel.forget_reply_route(comm) is True
    assert comm._reply_subshell_for(None, "frontend's subshell") == "frontend's subshell"
    assert ipykernel.forget_reply_route(comm) is False  # nothing left to drop
    assert ipykernel.forget_reply_route(None) is False  # a widget without a comm


# ----------------------------------------------------------------------------- MLflow

_MLFLOW_CHECKS = """
import json, sys
from sgpu_magic._compat import mlflow as compat

out = {"store_before_import": compat.tracking_store_built()}
import mlflow
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

uri = sys.argv[1]
out["store_before_use"] = compat.tracking_store_built()
out["experiment_before"] = compat.active_experiment_id()
mlflow.set_tracking_uri(uri)
experiment = mlflow.set_experiment("compat-seam")
out["store_after_use"] = compat.tracking_store_built()
out["experiment_after"] = compat.active_experiment_id() == experiment.experiment_id
client = mlflow.MlflowClient(uri)
run = client.create_run(experiment.experiment_id)
monitor = SystemMetricsMonitor(run.info.run_id, tracking_uri=uri)
monitor.start()
compat.stop_system_metrics(monitor)  # at once: the monitor's own first sample is 10 s away
out["system_metrics"] = sorted(client.get_run(run.info.run_id).data.metrics)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def mlflow_checks(tmp_path_factory):
    """The MLflow functions in one fresh interpreter (``set_experiment`` changes the process's environment)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    run = subprocess.run([sys.executable, "-c", _MLFLOW_CHECKS, uri], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.slow
def test_active_experiment_id_is_the_one_set_experiment_chose(mlflow_checks):
    assert mlflow_checks["experiment_before"] is None and mlflow_checks["experiment_after"] is True


@pytest.mark.slow
def test_tracking_store_built_only_once_a_store_is(mlflow_checks):
    assert mlflow_checks["store_before_import"] is False and mlflow_checks["store_before_use"] is False
    assert mlflow_checks["store_after_use"] is True


@pytest.mark.slow
def test_stop_system_metrics_logs_a_last_sample(mlflow_checks):
    assert "system/cpu_utilization_percentage" in mlflow_checks["system_metrics"], mlflow_checks


def test_stop_system_metrics_of_a_monitor_without_the_sampling_methods_only_finishes_it():
    finished = []

    class Finishing:  # a monitor of an MLflow whose sampling methods moved (the fallback the docstring states)
        def finish(self):
            finished.append(True)

    mlflow_compat.stop_system_metrics(Finishing())
    assert finished == [True]


# ----------------------------------------------------------------------------- CPython


def test_shut_down_threading_waits_for_non_daemon_threads_and_run_atexit_handlers_runs_them():
    run = _run("""
        import atexit, os, threading
        from sgpu_magic._compat.stdlib import run_atexit_handlers, shut_down_threading

        go = threading.Event()
        threading.Thread(target=lambda: (go.wait(), print("thread ended", flush=True))).start()
        threading.Thread(target=go.set, daemon=True).start()
        print("shut down:", shut_down_threading(), flush=True)
        atexit.register(print, "atexit handler ran", flush=True)
        atexit.register(lambda: 1 / 0)
        print("ran:", run_atexit_handlers(), flush=True)
        os._exit(0)  # the handlers ran once, here
    """)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["thread ended", "shut down: True", "atexit handler ran", "ran: True"]
    assert "Exception ignored in atexit callback" in run.stderr and "ZeroDivisionError" in run.stderr


def test_shut_down_threading_outside_the_main_thread_does_nothing():
    answers = []
    worker = threading.Thread(target=lambda: answers.append(stdlib.shut_down_threading()))
    worker.start()
    worker.join()
    assert answers == [False]


def test_import_mlflow_holds_another_threads_mlflow_import_until_it_is_done():
    """The thread importing mlflow through the seam is inside mlflow's import when another thread runs ``from
    mlflow.entities import Run``: that one waits (without the gate it got a partially initialised module)."""
    run = _run("""
        import sys, threading
        from sgpu_magic._compat.imports import import_mlflow

        errors = []
        def other():
            while "mlflow" not in sys.modules:  # once the first thread is inside mlflow's import
                pass
            try:
                from mlflow.entities import Run
                from mlflow.tracking import MlflowClient
            except Exception as exc:
                errors.append(repr(exc))
        thread = threading.Thread(target=other)
        thread.start()
        mlflow, entities = import_mlflow("mlflow.entities")
        thread.join()
        print(errors, entities.Run.__name__, import_mlflow("mlflow.entities")[1] is entities)
    """)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[] Run True"


def test_inside_import_and_ready_tell_a_module_being_imported(tmp_path, monkeypatch):
    """Read from the module's own code while it is imported: inside an import, and not yet ready; ready after."""
    from sgpu_magic._compat import imports

    (tmp_path / "sgpu_probe_module.py").write_text(
        "import sys\n"
        "from sgpu_magic._compat import imports\n"
        "SEEN = (imports._inside_import(sys._getframe()), imports._ready(__name__))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sgpu_probe_module", raising=False)
    module = importlib.import_module("sgpu_probe_module")
    assert module.SEEN == (True, False)
    assert (imports._inside_import(sys._getframe()), imports._ready("sgpu_probe_module")) == (False, True)
    assert imports._ready("sgpu_no_such_module") is False


def test_compat_error_names_an_unknown_version():
    from sgpu_magic._compat import missing, version_of

    assert version_of("no-such-distribution-sgpu") == "(unknown)"
    assert version_of("psutil") == psutil.__version__
    assert str(missing("no-such-distribution-sgpu", "x._y", "1.0", "z fails")).startswith(
        "no-such-distribution-sgpu (unknown) has no x._y, which sgpu_magic needs (checked against "
        "no-such-distribution-sgpu 1.0): z fails; install"
    )
