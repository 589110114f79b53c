"""A real Jupyter server on 127.0.0.1 — JupyterLab, then Notebook 7 — and Debian's chromium driven by Playwright,
for tests/browser.

Each test module runs once per frontend (the ``jupyter`` fixture is parametrized; one server and one browser at a
time). Everything is made per server in a temporary directory: its root (a copy of the quickstart notebook), its
Jupyter config/data/runtime folders, sgpu_magic's home, the MLflow store, and an IPython profile that turns on
``DistributedMagics.mlflow_ui`` (so the panel's MLflow link points at a local server that the test can ask about
the run). Screenshots go to the session's temporary directory, or to ``$SGPU_MAGIC_SCREENSHOTS`` when set
(``tests/browser/screenshots/`` is ignored by git, for refreshing ``docs/panel.png``). Without chromium,
Playwright or a frontend's package the tests are skipped, saying what is missing.
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
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("SGPU_MAGIC_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
"""Flags for a sandboxed root run on a machine with no outside network (no background connections)."""
SERVER_START_TIMEOUT_S = 120


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.browser)
            item.add_marker(pytest.mark.slow)


@dataclass(frozen=True)
class Frontend:
    """How one Jupyter frontend's server is started and where it opens a notebook.

    Attributes:
        name: the test id (``jupyterlab``, ``notebook7``).
        module: the server's ``python -m`` module (also what must be importable).
        args: its own options, beyond the ``ServerApp`` ones every frontend shares.
        screenshot_prefix: put before each screenshot's name (JupyterLab's keep the names ``docs/`` uses).
    """

    name: str
    module: str
    args: tuple[str, ...]
    screenshot_prefix: str

    def notebook_path(self, name: str) -> str:
        """The page of notebook ``name``: JupyterLab's in a workspace of its own (``reset`` there: nothing restored
        from an earlier page); Notebook 7's ``/notebooks/<name>``."""
        if self.name == "jupyterlab":
            return f"lab/workspaces/{Path(name).stem}/tree/{name}"
        return f"notebooks/{name}"


FRONTENDS = {
    "jupyterlab": Frontend(
        "jupyterlab",
        "jupyterlab",
        (
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
        ),
        "",
    ),
    "notebook7": Frontend("notebook7", "notebook", (), "notebook7-"),
}


def _missing(frontend: Frontend) -> str | None:
    if not Path(CHROMIUM).exists():
        return (
            f"Debian's chromium is not installed ({CHROMIUM} is missing): scripts/setup.sh installs it with "
            f"'apt-get install chromium' when run as root; install it, or set SGPU_MAGIC_CHROMIUM"
        )
    try:
        import playwright  # noqa: F401

        __import__(frontend.module)
    except ImportError as exc:
        return f"{exc.name} is not installed: pip install -e '.[browser]' (scripts/setup.sh does)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterServer:
    """A Jupyter server of one frontend: ``url(path)`` with the token, ``notebook_url(name)``, ``root`` (its files),
    ``env`` (its kernels' env), ``frontend``."""

    def __init__(self, base: Path, frontend: Frontend) -> None:
        self.base = base
        self.frontend = frontend
        self.root = base / "root"
        self.root.mkdir()
        shutil.copy(REPO / "notebooks" / "01_quickstart.ipynb", self.root / "01_quickstart.ipynb")
        self.home = base / "sgpu_home"
        ipython_dir = base / "ipython"
        (ipython_dir / "profile_default").mkdir(parents=True)
        # what a user writes to have every tracked job's link work on a local store
        (ipython_dir / "profile_default" / "ipython_config.py").write_text("c.DistributedMagics.mlflow_ui = True\n")
        # JupyterLab's own settings (Notebook 7 shares them): no "notified about Jupyter news?" prompt (no network)
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
            "PYTHONPATH": os.pathsep.join(
                [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
            ),
        }
        self.env.pop("SGPU_MAGIC_WIDGETS", None)  # the panel, as a user of the frontend gets it
        self.log_path = base / f"{frontend.module}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open for the server's life
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                frontend.module,
                "--no-browser",
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={self.port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.root}",
                "--ServerApp.terminals_enabled=False",
                *frontend.args,
            ]
            + (["--allow-root"] if os.geteuid() == 0 else []),  # CI and this machine run as root
            cwd=self.root,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_ready()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}?token={self.token}"

    def notebook_url(self, name: str) -> str:
        return self.url(self.frontend.notebook_path(name)) + ("&reset" if self.frontend.name == "jupyterlab" else "")

    def api(self, path: str):
        with urllib.request.urlopen(self.url(f"api/{path}"), timeout=10) as response:
            return json.loads(response.read())

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.frontend.module} exited with {self.proc.returncode}: {self.log_path.read_text()[-3000:]}"
                )
            try:
                self.api("status")
                return
            except OSError:  # not listening yet: wait a moment on the process (returns at once if it exits)
                try:
                    self.proc.wait(timeout=0.25)
                except subprocess.TimeoutExpired:
                    pass
        raise RuntimeError(
            f"{self.frontend.module} did not answer within {SERVER_START_TIMEOUT_S} s: "
            f"{self.log_path.read_text()[-3000:]}"
        )

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
        assert not alive, f"processes started by the {self.frontend.module} server outlived it by 30 s: {alive}"


# module scope, one frontend after the other: the server, its kernels and the browser are gone before the next
# frontend's (and the next test module's) tests, which check that nothing they started is left running
@pytest.fixture(scope="module", params=list(FRONTENDS))
def jupyter(request, tmp_path_factory):
    frontend = FRONTENDS[request.param]
    missing = _missing(frontend)
    if missing:
        pytest.skip(missing)
    server = JupyterServer(tmp_path_factory.mktemp(frontend.name), frontend)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(jupyter):
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
