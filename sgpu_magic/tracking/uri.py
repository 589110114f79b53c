"""MLflow tracking URIs: absolute store paths, the notebook's path, links to a run's page."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

STORE_LOCK_TIMEOUT_S = 120.0
"""How long a process waits for another one that creates a fresh local store's tables (about 4 s on 2 cores)
before it gives up (its job then runs with tracking off, saying why)."""

_opened: set[str] = set()
_opened_lock = threading.Lock()


def absolute_tracking_uri(uri: str) -> str:
    """``uri`` with a relative local path made absolute (ranks may run elsewhere than the kernel's cwd).

    ``sqlite:///mlflow.db`` -> ``sqlite:////<cwd>/mlflow.db``; ``mlruns`` -> ``/<cwd>/mlruns``;
    ``file:mlruns`` -> ``file:///<cwd>/mlruns``; server and database URIs are returned as they are.
    """
    if uri.startswith("sqlite:///"):
        path, sep, query = uri[len("sqlite:///") :].partition("?")
        if path and not path.startswith("/") and path != ":memory:":
            path = quote(os.path.abspath(unquote(path)))
            return "sqlite:///" + path + sep + query
        return uri
    parts = urlsplit(uri)
    if not parts.scheme:
        return os.path.abspath(uri)
    if parts.scheme == "file" and not parts.netloc and not parts.path.startswith("/"):
        return "file://" + quote(os.path.abspath(unquote(parts.path)))
    return uri


_default_store_dir: str | None = None
"""The folder whose store MLflow's default URI names for this kernel (:func:`pin_default_store`), or ``None``."""


def pin_default_store(folder: str) -> None:
    """Keep MLflow's default store (``sqlite:///mlflow.db`` when nothing sets a URI) in ``folder`` for this kernel:
    the notebook's folder when the extension loads, so a ``%cd`` later does not start a new store there (each job's
    run then went to the ``mlflow.db`` of the cwd of the moment, and the first one paid its creation)."""
    global _default_store_dir
    _default_store_dir = os.path.abspath(folder)


def kernel_tracking_uri(mlflow) -> str:
    """The kernel's tracking URI (``mlflow.get_tracking_uri()``), absolute; when neither ``mlflow.set_tracking_uri``
    nor ``MLFLOW_TRACKING_URI`` sets one, MLflow's default store as named in the folder
    :func:`pin_default_store` pinned (MLflow names it in the current directory)."""
    uri = absolute_tracking_uri(mlflow.get_tracking_uri())
    if _default_store_dir is None or mlflow.is_tracking_uri_set():
        return uri
    here = os.getcwd()
    for scheme in ("sqlite:///", "file://"):
        prefix = scheme + quote(here)
        if uri.startswith(prefix + "/"):
            return scheme + quote(_default_store_dir) + uri[len(prefix) :]
    return uri


def sqlite_dir(uri: str) -> Path | None:
    """The directory of a local sqlite store's database file, else ``None``."""
    if not uri.startswith("sqlite:////"):
        return None
    path = unquote(uri[len("sqlite:///") :].partition("?")[0])
    return Path(path).parent


def notebook_path() -> str | None:
    """The notebook this kernel runs, as Jupyter names it (``JPY_SESSION_NAME``), or ``None``."""
    return os.environ.get("JPY_SESSION_NAME") or None


def http_base(uri: str) -> str | None:
    """``uri`` without credentials and trailing slash when it is an http(s) server, else ``None``."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return None
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def open_client(mlflow: Any, uri: str) -> Any:
    """``mlflow.MlflowClient(uri)``, its store opened. The first one of this process for a local sqlite store is made
    under a file lock that every sgpu_magic process of this user shares (``<home>/locks``), so two of them (two
    kernels, a kernel and the one it attached to) never create a fresh store's tables at once: MLflow's SQL store
    checks for its tables, then creates them, and two processes doing that together both fail (``table ... already
    exists``, or alembic's ``Online migration expected to match one row``), which turned a job's tracking off.

    Raises:
        filelock.Timeout: another process held the lock for :data:`STORE_LOCK_TIMEOUT_S`; what MLflow raises.
    """
    if sqlite_dir(uri) is None or uri in _opened:
        return mlflow.MlflowClient(uri)
    from filelock import FileLock

    from sgpu_magic.rundir import default_root, make_private_dir

    locks = default_root() / "locks"
    make_private_dir(locks)
    name = "mlflow-store-" + hashlib.sha256(uri.encode()).hexdigest()[:16] + ".lock"
    with _opened_lock, FileLock(str(locks / name), timeout=STORE_LOCK_TIMEOUT_S, mode=0o600):
        client = mlflow.MlflowClient(uri)  # MLflow opens the store (and makes a fresh one's tables) here
        _opened.add(uri)
    return client
