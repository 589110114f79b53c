"""Drive a real Jupyter kernel through jupyter_client, as a notebook frontend does.

Every benchmark runs its code in such kernels: the timing taken inside the kernel around
the call (cells print a ``__BENCH__ {json}`` line) plus the wall time the driver sees from
sending the execute request to the kernel going idle again.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import queue
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from jupyter_client.manager import KernelManager

MARKER = "__BENCH__"


class CellError(RuntimeError):
    """A benchmark cell raised in the kernel."""


class CellTimeout(RuntimeError):
    """A cell did not finish in time (a hang); the kernel and everything it started were killed."""


@dataclass
class Cell:
    """What one executed cell produced, as the driver saw it."""

    wall_s: float = 0.0
    stdout_chunks: list[str] = field(default_factory=list)
    stderr: str = ""
    error: dict | None = None
    data: dict = field(default_factory=dict)
    msg_counts: collections.Counter = field(default_factory=collections.Counter)
    first_stderr_match_s: float | None = None

    @property
    def stdout(self) -> str:
        return "".join(self.stdout_chunks)


def kernel_env(home: Path, **extra: str) -> dict[str, str]:
    """The kernel's environment: ours, plus a private sgpu_magic home, plain-text views and (unless ours names
    one) an MLflow store in that home by default; a kernel runs in the repository, where MLflow's default store
    (``sqlite:///mlflow.db`` in the working directory) would be left behind."""
    env = dict(os.environ)
    env["SGPU_MAGIC_HOME"] = str(home)
    env["SGPU_MAGIC_WIDGETS"] = "0"
    env.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")
    env.pop("JPY_PARENT_PID", None)
    env.update(extra)
    return env


class Kernel:
    """One IPython kernel started with ``jupyter_client``; its own output goes to a log file."""

    _ids = itertools.count()

    def __init__(
        self, name: str, env: dict[str, str], cwd: Path, log_dir: Path, ready_timeout_s: float = 120.0
    ) -> None:
        self.name = f"{name}-{next(self._ids)}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(log_dir / f"kernel-{self.name}.log", "wb")  # noqa: SIM115 - closed when the kernel stops
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env, cwd=str(cwd), stdout=self._log, stderr=self._log)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=ready_timeout_s)
        self.closed = False

    @property
    def pid(self) -> int | None:
        try:
            return self.km.provisioner.process.pid
        except AttributeError:
            return None

    def run(
        self,
        code: str,
        timeout_s: float = 600.0,
        stderr_match: str | None = None,
        keep_stdout: bool = True,
        count_substring: str | None = None,
    ) -> Cell:
        """Execute ``code``; wait until the kernel is idle again.

        ``stderr_match``: note when a stderr stream containing it first arrives; ``keep_stdout=False``
        keeps only the marker lines (for floods); ``count_substring`` counts its occurrences in stdout.

        Raises:
            CellError: the cell raised (message: the exception and the tail of its output).
            CellTimeout: the cell ran past ``timeout_s``; the kernel was killed.
        """
        cell = Cell()
        t0 = time.perf_counter()
        msg_id = self.kc.execute(code, store_history=True)
        deadline = t0 + timeout_s
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                self.kill()
                raise CellTimeout(f"cell did not finish within {timeout_s:.0f} s in kernel {self.name}")
            try:
                msg = self.kc.get_iopub_msg(timeout=min(remaining, 5.0))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            cell.msg_counts[kind] += 1
            if kind == "stream":
                if content["name"] == "stdout":
                    text = content["text"]
                    if count_substring:
                        cell.msg_counts["substring"] += text.count(count_substring)
                    if MARKER in text:
                        for line in text.splitlines():
                            if line.startswith(MARKER):
                                cell.data.update(json.loads(line[len(MARKER) :]))
                    if keep_stdout:
                        cell.stdout_chunks.append(text)
                    else:
                        cell.msg_counts["stdout_lines"] += text.count("\n")
                else:
                    cell.stderr += content["text"]
                    if stderr_match and cell.first_stderr_match_s is None and stderr_match in content["text"]:
                        cell.first_stderr_match_s = time.perf_counter() - t0
            elif kind == "error":
                cell.error = content
            elif kind == "status" and content["execution_state"] == "idle":
                cell.wall_s = time.perf_counter() - t0
                break
        self._drain_shell(msg_id)
        if cell.error is not None:
            tail = (cell.stdout[-1500:] + cell.stderr[-1500:]).strip()
            raise CellError(
                f"{cell.error['ename']}: {cell.error['evalue']}" + (f"\n--- output tail ---\n{tail}" if tail else "")
            )
        return cell

    def _drain_shell(self, msg_id: str) -> None:
        end = time.monotonic() + 5.0
        while time.monotonic() < end:
            try:
                reply = self.kc.get_shell_msg(timeout=1.0)
            except queue.Empty:
                return
            if reply["parent_header"].get("msg_id") == msg_id:
                return

    def kill(self) -> None:
        """SIGKILL the kernel and every process under it (a hung fork, a launcher)."""
        if self.closed:
            return
        pid = self.pid
        procs = []
        if pid is not None:
            try:
                parent = psutil.Process(pid)
                procs = parent.children(recursive=True) + [parent]
            except psutil.NoSuchProcess:
                pass
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=5)
        self._close()

    def shutdown(self) -> None:
        """Shut the kernel down as a frontend does (its launch host and ranks follow it)."""
        if self.closed:
            return
        try:
            self.km.shutdown_kernel(now=False)
        except Exception:  # noqa: BLE001 - fall back to killing it
            self.kill()
            return
        self._close()

    def _close(self) -> None:
        self.closed = True
        try:
            self.kc.stop_channels()
        except Exception:  # noqa: BLE001
            pass
        try:
            self.km.cleanup_resources()
        except Exception:  # noqa: BLE001
            pass
        self._log.close()
