"""``%mlflow_ui``: the MLflow UI server for a store (``mlflow ui``), watched by :mod:`sgpu_magic.tracking.watchdog` so that it
ends with the kernel."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from sgpu_magic._util.redact import redact
from sgpu_magic.errors import SgpuError
from sgpu_magic.rundir import default_root, make_private_dir
from sgpu_magic.tracking.uri import http_base, kernel_tracking_uri, sqlite_dir

UI_READY_TIMEOUT_S = 120.0


class MlflowUIError(SgpuError):
    """The local MLflow UI server could not be started."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowUI:
    """A local ``mlflow server`` for one tracking URI on 127.0.0.1, which dies with the kernel.

    Attributes:
        backend_uri: the tracking URI it serves.
        url: ``http://127.0.0.1:<port>``.
        log_path: the server's output.
    """

    def __init__(self, backend_uri: str, port: int | None = None) -> None:
        self.backend_uri = backend_uri
        if port:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    raise MlflowUIError(
                        f"port {port} on 127.0.0.1 is in use; pick another with --port, or leave it out for a free one"
                    ) from None
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        folder = make_private_dir(default_root() / "mlflow-ui")
        self.log_path = folder / f"server-{os.getpid()}-{self.port}.log"
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            backend_uri,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        # no job runner (2 processes instead of 15); no usage telemetry, whose flush held up the server's exit ~4 s
        env = {"MLFLOW_DISABLE_TELEMETRY": "true", **os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        # the watchdog (python -m sgpu_magic.tracking.watchdog) runs in the store's folder: sgpu_magic must import there
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parents[2])] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        cwd = sqlite_dir(backend_uri) or folder
        with os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "sgpu_magic.tracking.watchdog", str(os.getpid()), *cmd],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                cwd=str(cwd),
            )
        self.pid = self._proc.pid
        """The watchdog's pid; the server runs in its process group (``os.killpg(pid, ...)``)."""

    def alive(self) -> bool:
        return self._proc.poll() is None

    def answers(self) -> bool:
        """Whether the server answers ``/health``."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = UI_READY_TIMEOUT_S) -> None:
        """Block until the server answers; raise :class:`MlflowUIError` if it exits or takes too long."""
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            if not self.alive():
                raise MlflowUIError(
                    f"the MLflow UI server exited with code {self._proc.returncode}; "
                    f"see {self.log_path}:\n{_tail(self.log_path)}"
                )
            if time.monotonic() > deadline:
                raise MlflowUIError(
                    f"the MLflow UI server did not answer on {self.url} within {timeout_s:g} s; see {self.log_path}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop the server (its watchdog stops the whole group) and wait until it is gone."""
        try:
            assert self._proc.stdin is not None  # stdin=PIPE
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass
            self._proc.wait()


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


_ui: MlflowUI | None = None


_ui_lock = threading.Lock()


def start_ui(
    tracking_uri: str | None = None, port: int | None = None, wait: bool = True, timeout_s: float = UI_READY_TIMEOUT_S
) -> MlflowUI:
    """Start (or reuse) the local MLflow UI server for ``tracking_uri`` (default: the kernel's) on ``port``
    of 127.0.0.1 (default: a free one).

    One server per kernel: asking for another URI or port stops the previous one. With ``wait``,
    return once it answers (about 10 s for a fresh server).

    Raises:
        MlflowUIError: the URI is already a server, the port is in use, or the server exited or did
            not answer within ``timeout_s``.
    """
    global _ui
    if tracking_uri is None:
        import mlflow

        tracking_uri = kernel_tracking_uri(mlflow)
    if http_base(tracking_uri) is not None:
        raise MlflowUIError(f"the tracking URI {redact(tracking_uri)} is already an MLflow server; open it directly")
    with _ui_lock:
        ui = _ui
        if ui is None or not ui.alive() or ui.backend_uri != tracking_uri or (port and ui.port != port):
            if ui is not None:
                ui.stop()
            ui = _ui = MlflowUI(tracking_uri, port)
    if wait:
        try:
            ui.wait_ready(timeout_s)
        except MlflowUIError:
            with _ui_lock:
                if _ui is ui:
                    _ui = None
            ui.stop()
            raise
    return ui


def stop_ui() -> bool:
    """Stop the local MLflow UI server; ``False`` if none ran."""
    global _ui
    with _ui_lock:
        ui, _ui = _ui, None
    if ui is None:
        return False
    ui.stop()
    return True


def running_ui() -> MlflowUI | None:
    """The ``%mlflow_ui`` server this kernel started, if it still runs, else ``None``."""
    ui = _ui
    return ui if ui is not None and ui.alive() else None


def ui_base_url(tracking_uri: str) -> str | None:
    """The ``%mlflow_ui`` server's URL if one runs for ``tracking_uri``, else ``None``."""
    ui = _ui
    return ui.url if ui is not None and ui.alive() and ui.backend_uri == tracking_uri else None


def run_link(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page: on the tracking server for an http(s) URI, else on the ``%mlflow_ui`` server if
    one runs for this URI, else ``None``."""
    base = http_base(tracking_uri) or ui_base_url(tracking_uri)
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}" if base else None
