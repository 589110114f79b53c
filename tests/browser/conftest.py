"""A real JupyterLab on 127.0.0.1 and Debian's chromium driven by Playwright, for tests/browser.

Everything here is made per test session in a temporary directory: the server's root (a copy of the
quickstart notebook), its Jupyter config/data/runtime folders, sgpu_magic's home, the MLflow store, and an
IPython profile that turns on ``DistributedMagics.mlflow_ui`` (so the panel's MLflow link points at a
local server that the test can ask about the run). Screenshots go to the session's temporary directory,
or to ``$SGPU_MAGIC_SCREENSHOTS`` when set (``tests/browser/screenshots/`` is ignored by git, for
refreshing ``docs/panel.png``). Without chromium or Playwright the tests are skipped, saying what is
missing.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("SGPU_MAGIC_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]
"""Flags for a sandboxed root run on a machine with no outside network (no background connections)."""
SERVER_START_TIMEOUT_S = 120


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.browser)
            item.add_marker(pytest.mark.slow)


def _missing() -> str | None:
    if not Path(CHROMIUM).exists():
        return (f"Debian's chromium is not installed ({CHROMIUM} is missing): scripts/setup.sh installs it with "
                f"'apt-get install chromium' when run as root; install it, or set SGPU_MAGIC_CHROMIUM")
    try:
        import playwright  # noqa: F401
        import jupyterlab  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed: pip install -e '.[browser]' (scripts/setup.sh does)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab server: ``url(path)`` with the token, ``root`` (its files), ``env`` (its kernels' env)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.root = base / "root"
        self.root.mkdir()
        shutil.copy(REPO / "notebooks" / "01_quickstart.ipynb", self.root / "01_quickstart.ipynb")
        self.home = base / "sgpu_home"
        ipython_dir = base / "ipython"
        (ipython_dir / "profile_default").mkdir(parents=True)
        # what a user writes to have every tracked job's link work on a local store
        (ipython_dir / "profile_default" / "ipython_config.py").write_text(
            "c.DistributedMagics.mlflow_ui = True\n")
        # JupyterLab's own settings: no "notified about Jupyter news?" prompt (the machine has no network)
        notification = base / "lab_settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
        notification.parent.mkdir(parents=True, exist_ok=True)
        notification.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
        self.token = secrets.token_hex(16)
        self.port = _free_port()
        self.env = {
            **os.environ,
            "SGPU_MAGIC_HOME": str(self.home),
            "MLFLOW_TRACKING_URI": f"sqlite:///{base / 'mlflow.db'}",
            "IPYTHONDIR": str(ipython_dir),
            "JUPYTER_CONFIG_DIR": str(base / "jupyter_config"),
            "JUPYTER_RUNTIME_DIR": str(base / "jupyter_runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(base / "lab_settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(base / "lab_workspaces"),
            "PYTHONPATH": os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
        }
        self.env.pop("SGPU_MAGIC_WIDGETS", None)  # the panel, as a JupyterLab user gets it
        self.log_path = base / "jupyterlab.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open for the server's life
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
             "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
             "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False"]
            + (["--allow-root"] if os.geteuid() == 0 else []),  # CI and this machine run as root
            cwd=self.root, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}?token={self.token}"

    def api(self, path: str):
        with urllib.request.urlopen(self.url(f"api/{path}"), timeout=10) as response:
            return json.loads(response.read())

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
            try:
                self.api("status")
                return
            except OSError:  # not listening yet: wait a moment on the process (returns at once if it exits)
                try:
                    self.proc.wait(timeout=0.25)
                except subprocess.TimeoutExpired:
                    pass
        raise RuntimeError(f"JupyterLab did not answer within {SERVER_START_TIMEOUT_S} s: "
                           f"{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        """Stop the server (it shuts its kernels down) and wait until everything it started is gone:
        the kernels, their launch hosts, ranks and MLflow UI servers (each goes when its kernel does)."""
        try:
            started = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            started = []
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, alive = psutil.wait_procs(started, timeout=30)
        for proc in alive:  # not expected: named in the failure below, then killed
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        self._log.close()
        assert not alive, f"processes started by JupyterLab outlived it by 30 s: {alive}"


# module scope: the server, its kernels and the browser are gone before the next test module, whose
# tests check that nothing they started is left running
@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    missing = _missing()
    if missing:
        pytest.skip(missing)
    server = Lab(tmp_path_factory.mktemp("lab"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory) -> Path:
    """Where the scenarios' screenshots go: ``$SGPU_MAGIC_SCREENSHOTS``, else a temporary folder (tests
    write nothing into the repository)."""
    chosen = os.environ.get("SGPU_MAGIC_SCREENSHOTS")
    if not chosen:
        return tmp_path_factory.mktemp("screenshots")
    path = Path(chosen).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def page(browser, request, screenshots):
    """A fresh browser page; on failure its screenshot is kept beside the others."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(60_000)
    try:
        yield page
    finally:
        if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
            page.screenshot(path=str(screenshots / f"{request.node.name}-FAILED.png"))
        context.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
