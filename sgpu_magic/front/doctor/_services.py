"""The doctor's rows about what jobs talk to: MLflow, the widget frontend and Jupyter, Ray, DeepSpeed's ops."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urlsplit

from sgpu_magic._util.redact import redact
from sgpu_magic.front.doctor._machine import Facts, unwritable
from sgpu_magic.front.doctor._rows import Check, DoctorConfig, error, ok, warning

REMOTE_CLUSTER_ENV = "SGPU_MAGIC_REMOTE_CLUSTER"
SQLITE_HEADER = b"SQLite format 3\x00"
MLFLOW_REMEDY_TAIL = "(--no-mlflow / mlflow=False runs a job untracked on purpose)"


def version_of(distribution: str) -> str | None:
    """The installed version of ``distribution`` (its package metadata), or ``None``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (import refused)
        return False


# ----------------------------------------------------------------------------- MLflow


def _sqlite_store(uri: str, shown: str) -> Check:
    path = Path(unquote(uri[len("sqlite:///") :].partition("?")[0]))
    if not path.exists():
        why = unwritable(path.parent)
        if why is not None:
            return error(
                "mlflow",
                f"{shown}: the database cannot be created: {why}",
                f"set MLFLOW_TRACKING_URI (or mlflow.set_tracking_uri) to a place you can write {MLFLOW_REMEDY_TAIL}",
            )
        return ok("mlflow", f"{shown}: made with the first tracked job (its tables take about 4 s)")
    remedy = (
        f"point MLFLOW_TRACKING_URI (or mlflow.set_tracking_uri) at a new sqlite:/// file, or move that one "
        f"away {MLFLOW_REMEDY_TAIL}"
    )
    try:
        with open(path, "rb") as f:
            header = f.read(len(SQLITE_HEADER))
    except OSError as exc:
        return error("mlflow", f"{shown}: {path} cannot be read ({exc.strerror})", remedy)
    if header and header != SQLITE_HEADER:
        return error("mlflow", f"{shown}: {path} is not an SQLite database", remedy)
    if not os.access(path, os.W_OK):
        return error("mlflow", f"{shown}: {path} is not writable by you", remedy)
    return ok("mlflow", f"{shown}: SQLite store, {path.stat().st_size / 2**20:.1f} MiB")


def _file_store(uri: str, shown: str) -> Check:
    parts = urlsplit(uri)
    path = Path(unquote(parts.path) if parts.scheme == "file" else uri)
    why = unwritable(path)
    if why is not None:
        return error(
            "mlflow",
            f"{shown}: the file store cannot be written: {why}",
            f"set MLFLOW_TRACKING_URI (or mlflow.set_tracking_uri) to a place you can write {MLFLOW_REMEDY_TAIL}",
        )
    return ok("mlflow", f"{shown}: file store" + ("" if path.exists() else ", made with the first tracked job"))


def _server(uri: str, shown: str, timeout_s: float) -> Check:
    parts = urlsplit(uri)
    base = f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}{parts.path.rstrip('/')}"
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=timeout_s) as reply:
            code = reply.status
    except urllib.error.HTTPError as exc:
        code = exc.code
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return error(
            "mlflow",
            f"{shown}: the tracking server does not answer within {timeout_s:g} s ({reason}): jobs would run untracked",
            f"start it (e.g. mlflow server --host 127.0.0.1 --port {parts.port or 5000}), or set "
            f"MLFLOW_TRACKING_URI (or mlflow.set_tracking_uri) to a server that runs {MLFLOW_REMEDY_TAIL}",
        )
    took = f"{(time.monotonic() - started) * 1000:.0f} ms"
    if code in (401, 403):
        return warning(
            "mlflow",
            f"{shown}: the server answers but refuses access (HTTP {code})",
            "give credentials: MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD",
        )
    if code != 200:
        return warning(
            "mlflow",
            f"{shown}: answers HTTP {code} at /health: is it an MLflow tracking server?",
            "check the tracking URI",
        )
    return ok("mlflow", f"{shown}: the tracking server answers ({took})")


def mlflow_rows(config: DoctorConfig, facts: Facts) -> list[Check]:
    if not config.mlflow:
        return [ok("mlflow", "off (DistributedMagics.mlflow = False): jobs are not tracked")]
    try:
        import mlflow
    except ImportError as exc:
        return [warning("mlflow", f"cannot be imported ({exc}): jobs run untracked", "pip install mlflow")]
    from sgpu_magic.tracking.uri import kernel_tracking_uri

    uri = kernel_tracking_uri(mlflow)
    shown = f"mlflow {mlflow.__version__}, tracking URI {redact(uri)}"
    scheme = urlsplit(uri).scheme
    if uri.startswith("sqlite:///"):
        return [_sqlite_store(uri, shown)]
    if scheme in ("", "file"):
        return [_file_store(uri, shown)]
    if scheme in ("http", "https"):
        return [_server(uri, shown, config.timeout_s)]
    return [ok("mlflow", f"{shown} (a {scheme} store: not checked)")]


# ----------------------------------------------------------------------------- widgets and Jupyter

FRONTEND_PACKAGES = ("ipywidgets", "jupyterlab_widgets", "widgetsnbextension", "jupyterlab", "notebook", "ipykernel")
EXTENSIONS = {"jupyterlab_widgets": "JupyterLab, Notebook 7", "widgetsnbextension": "classic Notebook"}


def _extension_requirements(requires: list[str]) -> dict[str, str]:
    """ipywidgets' own pins of its frontend extensions (``jupyterlab_widgets~=3.0.17`` ...), by name."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    wanted = {canonicalize_name(name): name for name in EXTENSIONS}
    out = {}
    for text in requires:
        req = Requirement(text)
        if req.marker is None and canonicalize_name(req.name) in wanted:
            out[wanted[canonicalize_name(req.name)]] = str(req.specifier)
    return out


def widgets_row(versions: dict[str, str | None], requires: list[str]) -> Check:
    """Whether ipywidgets' frontend extensions match it, so the panel renders.

    ``versions``: installed version per name of :data:`FRONTEND_PACKAGES` (``None``: not installed);
    ``requires``: ipywidgets' requirements (``importlib.metadata.requires("ipywidgets")``).
    """
    from packaging.specifiers import SpecifierSet

    widgets = versions.get("ipywidgets")
    if widgets is None:
        return warning(
            "widgets", "ipywidgets is not installed: jobs show plain [rank N] text, no panel", "pip install ipywidgets"
        )
    found = []
    for name, spec in _extension_requirements(requires).items():
        have = versions.get(name)
        if have is None or not SpecifierSet(spec).contains(have, prereleases=True):
            what = "is not installed" if have is None else f"is {have}"
            return error(
                "widgets",
                f"ipywidgets {widgets} needs {name}{spec} (its {EXTENSIONS[name]} extension), "
                f"but {name} {what}: the panel will not render ('Error displaying widget')",
                f"pip install '{name}{spec}' in the environment the Jupyter server runs in",
            )
        found.append(f"{name} {have} ({EXTENSIONS[name]})")
    return ok("widgets", f"ipywidgets {widgets} with {', '.join(found) or 'its extensions'}")


def _at_least(version: str | None, minimum: tuple[int, ...]) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return version is not None and Version(version).release[: len(minimum)] >= minimum
    except InvalidVersion:
        return False


def jupyter_row(versions: dict[str, str | None]) -> Check:
    """JupyterLab / Notebook / ipykernel here, and whether Stop works while a blocking cell runs (subshells)."""
    lab, notebook, kernel = versions.get("jupyterlab"), versions.get("notebook"), versions.get("ipykernel")
    details = ", ".join(
        f"{label} {versions.get(name) or 'not installed'}"
        for label, name in (("JupyterLab", "jupyterlab"), ("Notebook", "notebook"), ("ipykernel", "ipykernel"))
    )
    if kernel is None:
        return warning("jupyter", f"{details}: this environment cannot run a Jupyter kernel", "pip install ipykernel")
    old = [
        f"{label} {have}"
        for label, have, minimum in (
            ("ipykernel", kernel, (7,)),
            ("JupyterLab", lab, (4, 4)),
            ("Notebook", notebook, (7, 4)),
        )
        if have is not None and not _at_least(have, minimum)
    ]
    if old:
        return warning(
            "jupyter",
            f"{details}: with {' and '.join(old)} the panel's Stop button waits until a "
            f"blocking cell ends (no kernel subshells)",
            "use the notebook's Interrupt button meanwhile (it cancels the job too), or upgrade: pip "
            "install 'ipykernel>=7' 'jupyterlab>=4.4' (Notebook: 'notebook>=7.4')",
        )
    if lab is None and notebook is None:
        details += " (the Jupyter server may run in another environment)"
    return ok("jupyter", details)


def _view_row(config: DoctorConfig) -> Check:
    """The panel or the text view, and what decided it (as :func:`sgpu_magic.ui.panel.use_widgets` decides)."""
    from sgpu_magic.ui.panel import use_widgets

    env = os.environ.get("SGPU_MAGIC_WIDGETS", "").strip()
    if config.widgets is not None:
        why = f"DistributedMagics.widgets = {config.widgets}"
    elif env:
        why = f"SGPU_MAGIC_WIDGETS={env}"
    else:
        why = "a Jupyter kernel" if use_widgets(None) else "not a Jupyter kernel"
    view = "the ipywidgets panel" if use_widgets(config.widgets) else "plain [rank N] text and a summary line"
    return ok("view", f"{view} ({why})")


def frontend_rows(config: DoctorConfig, facts: Facts) -> list[Check]:
    versions = {name: version_of(name) for name in FRONTEND_PACKAGES}
    requires = (importlib.metadata.requires("ipywidgets") or []) if versions["ipywidgets"] else []
    return [widgets_row(versions, requires), jupyter_row(versions), _view_row(config)]


# ----------------------------------------------------------------------------- Ray


def _ray_address(config: DoctorConfig) -> tuple[str | None, str]:
    if config.cluster:
        return config.cluster, "--cluster"
    if config.remote_cluster:
        return config.remote_cluster, "DistributedMagics.remote_cluster"
    if os.environ.get(REMOTE_CLUSTER_ENV, "").strip():
        return os.environ[REMOTE_CLUSTER_ENV].strip(), REMOTE_CLUSTER_ENV
    return None, ""


def _auto_address() -> str | None:
    """What Ray's ``address="auto"`` finds on this machine: ``RAY_ADDRESS``, else the address file of the latest
    ``ray start`` (``<RAY_TMPDIR or TMPDIR or /tmp>/ray/ray_current_cluster``), else ``None``."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    tmp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    try:
        return (Path(tmp) / "ray" / "ray_current_cluster").read_text().split()[0]
    except (OSError, IndexError):
        return None


def _reachable(address: str, timeout_s: float) -> str | None:
    """Why nothing accepts a TCP connection at ``[ray://]host:port``, or ``None`` when something does."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except (OSError, ValueError) as exc:
        return str(exc) or type(exc).__name__


def ray_rows(config: DoctorConfig, facts: Facts) -> list[Check]:
    from sgpu_magic.launch import held_warm
    from sgpu_magic.launch.ray import cluster

    address, source = _ray_address(config)
    version = version_of("ray") if _importable("ray") else None
    installed = f"Ray {version} installed" if version else "Ray not installed (pip install 'sgpu_magic[ray]' for it)"
    if cluster.is_connected():  # whatever is configured: what this kernel's jobs use, and what it holds there
        held = "; ".join(held_warm()) or "nothing kept warm on it"
        named = cluster.connected_to() or address or "initialised in the notebook"
        return [ok("ray", f"this kernel is connected to the Ray cluster {named!r}; Ray {version}; {held}")]
    if address is None:
        return [ok("ray", f"no cluster configured: jobs run on this machine; {installed}")]
    if version is None:
        return [
            error(
                "ray",
                f"{source} names the Ray cluster {address!r}, but Ray is not installed",
                "pip install 'sgpu_magic[ray]' (or pip install ray), the same version as the cluster's",
            )
        ]
    target = _auto_address() if address == "auto" else address
    if target is None:
        return [
            error(
                "ray",
                f"{source} is 'auto', but no Ray cluster was started on this machine (no RAY_ADDRESS, "
                f"no ray_current_cluster file)",
                "start one (ray start --head), or give its address, e.g. ray://head:10001",
            )
        ]
    why = _reachable(target, config.timeout_s)
    if why is not None:
        return [
            error(
                "ray",
                f"{source} names the Ray cluster {address!r}, but nothing answers at {target} within "
                f"{config.timeout_s:g} s ({why})",
                "start the cluster (ray start --head), or fix the address: ray://host:10001 (Ray client), "
                "host:6379 (its GCS) or auto",
            )
        ]
    return [ok("ray", f"{source}: {address!r} answers at {target}; Ray {version}")]


# ----------------------------------------------------------------------------- DeepSpeed


def _extensions_dir() -> Path:
    """Where torch's JIT extension builder (which DeepSpeed's ops use) caches builds: ``$TORCH_EXTENSIONS_DIR``,
    else ``<torch's default build root>/py<ver>_<cpu|cuXY>`` (torch.utils.cpp_extension's rule)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{accelerator}"


def _built_ops(directory: Path) -> list[str]:
    try:
        return sorted(d.name for d in directory.iterdir() if d.is_dir() and any(d.glob("*.so")))
    except OSError:
        return []


def _toolchain_row(version: str) -> Check:
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX") or "c++"
    found = shutil.which(compiler)
    if found is None:
        return warning(
            "deepspeed",
            f"{version}, but no C++ compiler ({compiler} not found): DeepSpeed cannot build "
            f"its JIT ops (on CPU, the communication op deepspeed.init_distributed needs; "
            f"DeepSpeedCPUAdam)",
            "install one (apt-get install g++), or set CXX to a compiler",
        )
    if not is_ninja_available():
        return warning(
            "deepspeed",
            f"{version}, compiler {found}, but no ninja on PATH: torch's extension builder "
            f"needs it for DeepSpeed's JIT ops",
            "pip install ninja",
        )
    return ok("deepspeed", f"{version}, C++ compiler {found}, ninja: its JIT ops can build")


def deepspeed_rows(config: DoctorConfig, facts: Facts) -> list[Check]:
    version = version_of("deepspeed")
    if version is None:
        return [ok("deepspeed", "not installed (optional: pip install 'sgpu_magic[deepspeed]')")]
    if not _importable("torch"):
        return [ok("deepspeed", f"{version} (not checked further without torch)")]
    directory = _extensions_dir()
    ops = _built_ops(directory)
    why = unwritable(directory)
    if why is not None:
        cache = warning(
            "torch extensions",
            f"the JIT op cache {directory} cannot be written: {why}",
            "set TORCH_EXTENSIONS_DIR to a directory you can write",
        )
    elif ops:
        cache = ok("torch extensions", f"{directory}: {len(ops)} op(s) built ({', '.join(ops)})")
    else:
        cache = ok(
            "torch extensions",
            f"{directory}: none built yet; DeepSpeed's first start compiles a C++ op "
            f"(about 60 s on 2 cores) and caches it here",
        )
    return [_toolchain_row(version), cache]
