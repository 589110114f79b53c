"""The layout's contracts: docs/architecture.md's layer table is the import-linter contract of pyproject.toml,
every package of sgpu_magic is in it, the contracts hold (lint-imports), and a rank imports no front door."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from helpers import package_findings

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "sgpu_magic"


def _contract_layers() -> list[set[str]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return [set(re.split(r"\s*[|:]\s*", layer.strip())) for layer in layers["layers"]]


def _doc_rows() -> dict[str, set[str]]:
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text.split("<!-- layers:start -->")[1].split("<!-- layers:end -->")[0]
    rows = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = set(re.findall(r"`([\w.]+)`", cells[1]))
    return rows


def test_the_documented_layers_are_the_import_linter_contract():
    rows = _doc_rows()
    layers = _contract_layers()
    documented = [rows[str(n)] for n in range(len(layers) - 1, -1, -1)]
    assert documented == layers, "docs/architecture.md's layer table and pyproject's layers contract differ"


def test_every_package_and_module_of_sgpu_magic_has_a_layer():
    listed = set().union(*_doc_rows().values())
    entries = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
    }
    assert entries - {"__init__", "__main__"} - listed == set(), "modules missing from docs/architecture.md"
    assert listed - entries == set(), "docs/architecture.md names modules that do not exist"


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    done = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_a_rank_imports_no_front_door_nor_kernel_side_library():
    code = (
        "import sys, sgpu_magic.rank.worker\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('sgpu_magic', 'IPython', 'ipywidgets', 'ipykernel', 'mlflow', 'psutil', 'filelock', 'traitlets')))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = ast.literal_eval(done.stdout)
    assert loaded == [
        "sgpu_magic",
        "sgpu_magic._compat",
        "sgpu_magic._compat.imports",
        "sgpu_magic._compat.mlflow",
        "sgpu_magic._compat.stdlib",
        "sgpu_magic._compat.torch",
        "sgpu_magic._util",
        "sgpu_magic._util.fs",
        "sgpu_magic._util.imports",
        "sgpu_magic._util.metrics",
        "sgpu_magic._util.mlflow_run",
        "sgpu_magic._util.proc",
        "sgpu_magic.errors",
        "sgpu_magic.rank",
        "sgpu_magic.rank.exit",
        "sgpu_magic.rank.mlflow_guard",
        "sgpu_magic.rank.payload",
        "sgpu_magic.rank.profile",
        "sgpu_magic.rank.steps",
        "sgpu_magic.rank.worker",
        "sgpu_magic.rundir",
        "sgpu_magic.wire",
        "sgpu_magic.wire.errors",
        "sgpu_magic.wire.launch",
        "sgpu_magic.wire.payload",
        "sgpu_magic.wire.state",
    ]


def test_every_public_import_path_stays_and_import_sgpu_magic_is_lazy():
    code = (
        "import sys, sgpu_magic\n"
        "lazy = sorted(m for m in sys.modules if m.startswith('sgpu_magic'))\n"
        "from sgpu_magic import (distributed, DistributedFunction, run_script, Job, JobState, runtime,\n"
        "    load_ipython_extension, SgpuError, SpecError, ResourceError, CaptureError, LauncherError,\n"
        "    RankFailedError, JobTimeoutError, JobCancelledError, UnpicklableGlobalError, CheckpointError)\n"
        "from sgpu_magic.errors import CellSyntaxError, RankFailure\n"
        "from sgpu_magic.runtime import get_global_rank, get_local_rank, get_world_size\n"
        "from sgpu_magic.data import VolumeDataset, DataLoader\n"
        "from sgpu_magic.checkpoint import VolumeWriter, VolumeReader, is_complete\n"
        "assert sgpu_magic.__version__ and set(sgpu_magic.__all__) <= set(dir(sgpu_magic))\n"
        "assert DistributedFunction.__module__ == 'sgpu_magic' and sgpu_magic.Job is Job\n"
        "print(lazy)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ast.literal_eval(done.stdout) == ["sgpu_magic"]


# ----------------------------------------------------------------------------- other libraries' privates

_PUBLIC_BY_DOCS = {
    ("os", "_exit"),  # documented in the Python reference
    ("sys", "_getframe"),  # documented in the Python reference (a CPython detail, used as documented)
}
"""``module._name`` accesses that the owner documents as public API."""

_PROTOCOL_HOOKS = re.compile(r"_(repr_\w+|render_traceback|ipython_\w+)_$")
"""IPython's display and traceback hooks (``_repr_html_``, ``_render_traceback_``): public by IPython's docs."""

_OWN_PRIVATES = {
    ("launch/leases.py", "self.registry._update"),  # sgpu_magic's own LeaseRegistry
}
"""Accesses to sgpu_magic's own privates across objects (not another library's)."""

_MODULE_NAMES = {"torch._dynamo"}
"""Private modules named only to preload them (the forkserver skips a preload that fails to import)."""

_KNOWN = {
    "_wrap", "_pc", "_ret_vals", "_failures", "_worker_finished_event",  # torch elastic's, on self in its subclass
    "_reply_subshell_id", "_reply_subshell_lock", "_active_experiment_id", "_forkserver_pid",
    "collect_metrics", "aggregate_metrics", "publish_metrics", "mlflow_logger",  # MLflow's monitor, undocumented
}  # fmt: skip
"""Other libraries' internals the seam uses, found wherever they appear (also on ``self``, and without ``_``)."""

_PRIVATE = re.compile(r"^_[a-z]\w*$")
_PRIVATE_PATH = re.compile(r"^[A-Za-z]\w*(\.\w+)*\._[a-z]\w*(\.\w+)*$")


def _docstring_nodes(tree: ast.Module) -> set[int]:
    nodes = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                nodes.add(id(body[0].value))
    return nodes


def _private_use(node: ast.AST, docstrings: set[int]) -> str | None:
    """The text of ``node`` if it reaches another library's private name, else ``None``."""
    if isinstance(node, ast.Attribute) and node.attr in _KNOWN:
        return f"{ast.unparse(node.value)}.{node.attr}"
    if isinstance(node, ast.Constant) and node.value in _KNOWN:
        return repr(node.value)
    if isinstance(node, ast.Attribute) and _PRIVATE.match(node.attr) and not _PROTOCOL_HOOKS.match(node.attr):
        owner = ast.unparse(node.value)
        if owner not in ("self", "cls") and (owner, node.attr) not in _PUBLIC_BY_DOCS:
            return f"{owner}.{node.attr}"
    if isinstance(node, ast.Call) and node.args:
        func = ast.unparse(node.func)
        if func in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1:
            owner, name = ast.unparse(node.args[0]), node.args[1]
        elif re.fullmatch(r"(vars\(.*\)|.*\.__dict__)\.(pop|get|setdefault)", func):
            owner, name = func, node.args[0]
        else:
            return None
        if isinstance(name, ast.Constant) and _PRIVATE.match(str(name.value)) and owner not in ("self", "cls"):
            return ast.unparse(node)  # getattr(obj, "_x"), vars(obj).pop("_x")
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
        path = node.value
        if _PRIVATE_PATH.match(path) and path not in _MODULE_NAMES and not path.startswith("sgpu_magic."):
            return repr(path)  # sys.modules.get("mlflow.tracking._tracking_service.utils")
    return None


def _private_uses(path: Path, rel: str) -> list[str]:
    """``file:line: expression`` for every use of another library's private name in one module."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = _docstring_nodes(tree)
    found: dict[int, str] = {}  # one per line: the outermost use (ast.walk goes from the outside in)
    for node in ast.walk(tree):
        text = _private_use(node, docstrings)
        line = getattr(node, "lineno", 0)
        if text is not None and (rel, text) not in _OWN_PRIVATES and line not in found:
            found[line] = f"sgpu_magic/{rel}:{line}: {text}"
    return [found[line] for line in sorted(found)]


def test_only_the_compat_seam_touches_other_libraries_privates():
    """Every private internal of another library (``api._wrap``, ``getattr(comm, "_reply_subshell_lock")``,
    ``sys.modules.get("mlflow.tracking._tracking_service.utils")``) is used through ``sgpu_magic/_compat``."""
    found = package_findings(_private_uses, skip=lambda rel: "_compat" in rel.split("/"))
    assert found == [], "another library's private outside sgpu_magic/_compat (add a function there):\n" + "\n".join(
        found
    )


def test_the_private_check_finds_each_kind_of_use(tmp_path):
    """The check above is not vacuous: each way of reaching a private is found, and the allowed ones are not."""
    module = tmp_path / "probe.py"
    module.write_text(
        '"""Docstring naming api._wrap and mlflow.tracking._x is fine."""\n'
        "import os, sys\n"
        "api._wrap = None\n"
        "getattr(fluent, '_active_experiment_id', None)\n"
        "vars(comm).pop('_reply_subshell_id', None)\n"
        "sys.modules.get('mlflow.tracking._tracking_service.utils')\n"
        "super()._start()\n"
        "self._mine = os._exit\n"
        "err._render_traceback_()\n"
        "getattr(self, '_own', None)\n"
        "hasattr(self, '_worker_finished_event')\n"
        "monitor.collect_metrics()\n"
        "__import__('torch._dynamo')\n"
    )
    found = [use.split(": ", 1)[1] for use in _private_uses(module, "probe.py")]
    assert sorted(found) == [
        "'_worker_finished_event'",
        "'mlflow.tracking._tracking_service.utils'",
        "api._wrap",
        "getattr(fluent, '_active_experiment_id', None)",
        "monitor.collect_metrics",
        "super()._start",
        "vars(comm).pop('_reply_subshell_id', None)",
    ], found


def _import_cycles() -> list[list[str]]:
    """The sets of sgpu_magic modules that import each other in a ring, at run time: every import the code makes,
    lazy ones inside functions included, ``if TYPE_CHECKING:`` ones not, and an import of a module's own parent
    package not (Python has imported that package already when the module runs)."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("sgpu_magic", cache_dir=None, exclude_type_checking_imports=True)
    edges = {
        module: {
            other
            for other in graph.find_modules_directly_imported_by(module)
            if not module.startswith(other + ".")  # its parent package: imported before it
        }
        for module in graph.modules
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in edges[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            ring = []
            while True:
                other = stack.pop()
                ring.append(other)
                if other == module:
                    break
            if len(ring) > 1:
                cycles.append(sorted(ring))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycle_at_run_time():
    """A ring of modules importing each other (rank/session and rank/worker, rundir and status, the doctor's package
    and its checks, before) is a layer that is not one: the shared part belongs in a module both import."""
    assert _import_cycles() == []


def _record_rows() -> list[list[str]]:
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text.split("## Records")[1].split("## Layers")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[1:]]  # the header row left out


def test_the_record_table_names_every_wire_record_and_only_what_exists():
    import importlib

    import sgpu_magic.wire
    import sgpu_magic.wire.host
    import sgpu_magic.wire.mlflow
    import sgpu_magic.wire.payload
    import sgpu_magic.wire.session

    named = set()
    for row in _record_rows():
        for ref in re.findall(r"`(wire\.[\w.]+)`", " ".join(row)):
            module, _, attr = f"sgpu_magic.{ref}".rpartition(".")
            assert hasattr(importlib.import_module(module), attr), f"docs/architecture.md's record table: {ref}"
            named.add(ref)
        for path in re.findall(r"`((?:[a-z_]+/)+[a-z_]+)`", " ".join(row[2:])):
            assert (PACKAGE / f"{path}.py").exists() or (PACKAGE / path).is_dir(), f"record table: no {path}"
    records = {f"wire.{name}" for name in sgpu_magic.wire.__all__ if name[0].isupper() and not name.isupper()}
    commands = {f"wire.host.{cls.__name__}" for cls in sgpu_magic.wire.host.HostCommand.__args__}
    session = sgpu_magic.wire.session
    frames = {f"wire.session.{cls.__name__}" for cls in (*session.SessionCommand.__args__, *session.Frame.__args__)}
    others = {
        "wire.host.KeeperGreeting",
        "wire.host.StacksReply",
        "wire.session.ReleasePeers",
        "wire.session.SessionRecord",
        "wire.attach.AttachRecord",
        "wire.mlflow.MlflowRunRecord",
        "wire.errors.ObservedFailure",
        "wire.errors.FailedAttempt",
        "wire.errors.TeardownEnd",
        "wire.errors.RankOutcome",
        "wire.errors.RankExit",
        "wire.payload.Payload",
        *(f"wire.payload.{cls.__name__}" for cls in sgpu_magic.wire.payload.Body.__args__),
    }
    assert records | commands | frames | others <= named, sorted(records | commands | frames | others - named)
