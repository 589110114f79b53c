"""Entry point of one rank: ``python -m sgpu_magic.rank.worker <run_dir>``.

Started by the launch host through torch.distributed.elastic with torchrun's environment
contract (RANK, LOCAL_RANK, WORLD_SIZE, ...). It sends its stdout and stderr (file
descriptors 1 and 2, so native code and child processes too) to its log file, applies the
kernel's cwd and sys.path, loads the payload, runs it, and writes its result or its error
into the RunDir atomically, before anything the user's code made is destroyed; then it ends as a
Python program ends (see :mod:`sgpu_magic.rank.exit`). It imports nothing from IPython or ipywidgets.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import sys
import threading
import time

from sgpu_magic._util.metrics import WRITER as METRICS
from sgpu_magic._util.proc import allow_tracing_by, die_with_parent
from sgpu_magic.rank import exit as rank_exit
from sgpu_magic.rank.mlflow_guard import guard_job_run
from sgpu_magic.rank.payload import build_namespace, dump_result, redirect_output, run_payload, write_error
from sgpu_magic.rundir import RunDir, atomic_write_bytes
from sgpu_magic.wire import LaunchRecord, RankError
from sgpu_magic.wire.errors import RankExit
from sgpu_magic.wire.payload import Payload, SessionRanks


def _die_with_parent(expected_parent: int | None) -> None:
    """Exit when the parent (the launch host, or its forkserver) dies (PR_SET_PDEATHSIG), even by SIGKILL.

    Also lead a session of its own, so that what this rank starts can be found and stopped with it, and let the
    launch host's py-spy read this rank's stack under Yama's ``ptrace_scope`` 1 (``job.stacks()``, on a timeout).
    """
    die_with_parent(signal.SIGKILL, expected_parent, signal.SIGKILL + 128)  # as if the signal had come
    host = os.environ.get("SGPU_MAGIC_HOST_PID", "")
    if host.isdigit():
        allow_tracing_by(int(host))
    try:
        os.setsid()
    except PermissionError:
        pass  # already a session leader (started by the host with start_new_session)


def _match_threads_to_env() -> None:
    """In a warm (forkserver) rank torch is already imported, so OMP_NUM_THREADS must be applied by hand."""
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _apply_kernel_context(launch: LaunchRecord) -> None:
    try:
        os.chdir(launch.cwd)
    except OSError as exc:
        print(f"sgpu_magic: could not enter the kernel's cwd {launch.cwd!r}: {exc}", file=sys.stderr)
    sys.path[:] = list(launch.sys_path)


def teardown(ns: dict) -> None:
    """Drop user objects, then destroy the process group (avoids DDP's teardown deadlock, pytorch#56297);
    when the user code destroyed the group itself, do nothing.

    The rank's process ends with ``os._exit`` (no interpreter finalization), so destroying the
    group only matters while the process still waits for its peers to finish: it closes the
    group's connections, and a peer still blocked in a collective fails fast instead of
    waiting for the collective's timeout. It runs in a thread (tens of ms for gloo), so the
    rank reports done at once; the process exits when every rank has.
    """
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            # Nothing to order: leave the user's objects alone. Dropping a DDP model after its process
            # group was destroyed (user code that calls destroy_process_group first) can block for good
            # in the reducer's destructor; the process ends with os._exit, which runs no destructor.
            return
    except Exception:  # noqa: BLE001 - teardown must not turn success into failure
        return
    ns.clear()
    gc.collect()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass

    threading.Thread(target=destroy, name="sgpu_magic teardown", daemon=True).start()


def _system_exit(run_dir: RunDir, rank: int, exc: SystemExit, payload: Payload) -> int:
    """A rank that raised ``SystemExit``: non-zero fails it, as under torchrun; zero returns nothing, noted where.

    As Python ends a program on ``SystemExit``, no traceback is printed or recorded (``sys.exit("message")`` prints
    the message on stderr and exits 1): the rank's last lines (argparse's usage and error) tell what happened."""
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if code:
        if not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr, flush=True)
        run_dir.write_error(RankError(rank=rank, exc_type="SystemExit", message=str(code), time_s=time.time()))
        return code
    run_dir.write_exit(rank, RankExit(rank_exit.raise_site(exc, payload.display_names), payload.kind))
    atomic_write_bytes(run_dir.result_file(rank), dump_result(None, rank))
    return 0


def _run_and_record(run_dir: RunDir, rank: int, payload: Payload, ns: dict, held: list) -> int:
    """Run the payload and write its outcome (value or error); the exit code. ``held`` keeps the function's frame."""
    body = payload.body
    try:
        if isinstance(body, SessionRanks):  # a live session's rank: cells until the session stops
            from sgpu_magic.rank.session import serve

            serve(run_dir, ns, body.detached, body.idle_timeout_s)
            value = None
        else:
            value = run_payload(payload, ns, held, run_dir)
        atomic_write_bytes(run_dir.result_file(rank), dump_result(value, rank))
        return 0
    except SystemExit as exc:
        return _system_exit(run_dir, rank, exc, payload)
    except BaseException as exc:  # noqa: BLE001 - every rank failure is recorded
        write_error(run_dir, rank, exc, payload.display_names)
        return 1


def _execute(run_dir: RunDir, rank: int) -> int:
    """Load the payload, run it, write its outcome, then free what it made (the teardown the host bounds)."""
    payload = run_dir.read_payload()
    METRICS.use(run_dir.metrics_file(rank))
    guard_job_run()  # before the payload's globals import mlflow: the kernel owns the run's status
    rank_exit.keep_process_groups()  # before they import torch.distributed (cold) or any group exists (warm)
    sys.argv = list(payload.argv or sys.argv[:1])  # [cell or function name]: parse_args() reads defaults
    ns = build_namespace(payload)
    held: list = []
    try:
        return _run_and_record(run_dir, rank, payload, ns, held)
    finally:
        held.clear()  # the function's locals go now: its outcome is written
        teardown(ns)


def _run_rank(run_dir: RunDir, expected_parent: int | None) -> int:
    rank = int(os.environ["RANK"])
    redirect_output(run_dir.log_file(rank))
    _die_with_parent(expected_parent)
    code = 1
    try:
        _apply_kernel_context(run_dir.read_launch())  # missing or unreadable: caught below
        code = _execute(run_dir, rank)
    except BaseException as exc:  # noqa: BLE001 - payload could not even be loaded
        write_error(run_dir, rank, exc)
    finally:
        rank_exit.exit_like_python()  # threads, atexit handlers, flushes: inside the host's teardown grace
    return code


def main(argv: list[str]) -> None:
    """Cold start: a fresh interpreter started by the host; ends with ``os._exit``."""
    os._exit(_run_rank(RunDir(argv[1]), int(os.environ["SGPU_MAGIC_HOST_PID"])))


def rank_entry(run_dir: str, env: dict[str, str]) -> None:
    """Warm start: called in a process forked from the host's forkserver (torch already imported).

    torch elastic's wrapper has applied the rank's variables; ``env`` replaces the whole
    environment, so it is the kernel's as of this launch. Returns on success (elastic's
    multiprocessing contract); a failure exits with the rank's code.
    """
    os.environ.clear()
    os.environ.update(env)
    _match_threads_to_env()
    # the forkserver left its own start method as this process's default; a rank's DataLoader
    # workers must get the platform's default, as in a fresh interpreter (fork on Linux <= 3.13)
    multiprocessing.set_start_method(None, force=True)
    code = _run_rank(RunDir(run_dir), None)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main(sys.argv)
