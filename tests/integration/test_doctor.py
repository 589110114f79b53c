"""``python -m sgpu_magic doctor`` and ``%distributed_doctor``: every error row with its remedy, on this machine,
with the fake-GPU seam, against real lease registries, sockets, MLflow stores and servers, and in a real IPython shell.

Most checks run in this process (``diagnose``) with the environment set per test; the command line runs as a
real subprocess. Rows that need a GPU machine (a CPU build of torch beside GPUs, a driver older than torch's
CUDA) are pinned through :func:`torch_gpu_problem`, the rule the torch row applies.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sgpu_magic.front.doctor import Check, DoctorConfig, Report, Status, diagnose
from sgpu_magic.front.doctor._machine import torch_gpu_problem
from sgpu_magic.front.doctor._services import jupyter_row, widgets_row

REPO = Path(__file__).resolve().parents[2]
IPYWIDGETS_REQUIRES = [
    "comm>=0.1.3",
    "ipython>=6.1.0",
    "widgetsnbextension~=4.0.16",
    "jupyterlab_widgets~=3.0.17",
    'pytest>=3.6.0; extra == "test"',
]
"""ipywidgets 8.1.9's own requirements, as its metadata lists them."""
GOOD_VERSIONS = {
    "ipywidgets": "8.1.9",
    "jupyterlab_widgets": "3.0.17",
    "widgetsnbextension": "4.0.16",
    "jupyterlab": "4.6.6",
    "notebook": "7.6.5",
    "ipykernel": "7.4.0",
}


def row(report: Report, name: str) -> Check:
    (found,) = [r for r in report.rows if r.name == name]
    return found


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """This machine as a new user has it: a private home, a local sqlite store, no fake GPUs, no cluster."""
    monkeypatch.setenv("SGPU_MAGIC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "ray_tmp"))
    for name in (
        "SGPU_MAGIC_FAKE_GPUS",
        "SGPU_MAGIC_LEASE_DIR",
        "SGPU_MAGIC_REMOTE_CLUSTER",
        "RAY_ADDRESS",
        "TORCH_EXTENSIONS_DIR",
        "CXX",
    ):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def closed_port() -> socket.socket:
    """A socket bound to a port of 127.0.0.1 without listening: connecting there is refused. Keep it open."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def cli(*args: str, env: dict[str, str], block: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python -m sgpu_magic doctor ARGS`` in a fresh interpreter; ``block``: modules made unimportable first."""
    code = (
        (
            "import sys\n"
            + "".join(f"sys.modules[{m!r}] = None\n" for m in block)
            + "from sgpu_magic.__main__ import main\nsys.exit(main(sys.argv[1:]))"
        )
        if block
        else None
    )
    cmd = (
        [sys.executable, "-c", code, "doctor", *args] if code else [sys.executable, "-m", "sgpu_magic", "doctor", *args]
    )
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)


# ----------------------------------------------------------------------------- the command line


@pytest.mark.slow
def test_cli_on_this_machine_prints_one_row_per_check_and_exits_0(clean_env):
    proc = cli(env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert re.fullmatch(r"sgpu_magic doctor: (all \d+ checks ok|\d+ warnings? \(of \d+ checks\))", lines[0]), lines[0]
    assert re.fullmatch(r"check +status +details", lines[1])
    names = [m.group(1) for line in lines[2:] if (m := re.match(r"(\S+(?: \S+)?) {2,}(ok|warning) ", line))]
    for expected in (
        "python",
        "sgpu_magic",
        "torch",
        "gpus",
        "leases",
        "ports",
        "home",
        "launch host",
        "mlflow",
        "widgets",
        "jupyter",
        "view",
        "ray",
        "deepspeed",
    ):
        assert expected in names, (expected, proc.stdout)
    column = lines[1].index("details")
    assert all(line[column - 2 : column] == "  " for line in lines[2:]), proc.stdout  # details aligned in one column


def test_cli_json_and_exit_1_when_the_mlflow_server_does_not_answer(clean_env):
    with closed_port() as s:
        port = s.getsockname()[1]
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"}
        proc = cli("--json", "--timeout-s", "1", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is False and report["errors"] == 1
    assert {c["status"] for c in report["checks"]} <= {"ok", "warning", "error"}
    (mlflow,) = [c for c in report["checks"] if c["name"] == "mlflow"]
    assert mlflow["status"] == "error"
    assert re.fullmatch(
        rf"mlflow \S+, tracking URI http://127\.0\.0\.1:{port}: the tracking server does not answer "
        rf"within 1 s \(\[Errno 111\] Connection refused\): jobs would run untracked",
        mlflow["details"],
    )
    assert mlflow["remedy"] == (
        f"start it (e.g. mlflow server --host 127.0.0.1 --port {port}), or set "
        f"MLFLOW_TRACKING_URI (or mlflow.set_tracking_uri) to a server that runs (--no-mlflow / "
        f"mlflow=False runs a job untracked on purpose)"
    )


def test_cli_bad_option_is_argparses_exit_2(clean_env):
    proc = cli("--port", "x", env=dict(os.environ))
    assert proc.returncode == 2 and "argument --port: invalid int value: 'x'" in proc.stderr


@pytest.mark.slow
def test_torch_that_cannot_be_imported_and_a_cluster_without_ray_are_errors(clean_env):
    env = {**os.environ, "SGPU_MAGIC_REMOTE_CLUSTER": "ray://head:10001"}
    proc = cli("--json", env=env, block=("torch", "ray"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["torch"] == {
        "name": "torch",
        "status": "error",
        "details": "cannot be imported (import of torch halted; None in sys.modules)",
        "remedy": "install it: pip install torch (on a GPU machine, the CUDA build pytorch.org's install selector gives)",
    }
    assert checks["ray"] == {
        "name": "ray",
        "status": "error",
        "details": "SGPU_MAGIC_REMOTE_CLUSTER names the Ray cluster 'ray://head:10001', but Ray is not installed",
        "remedy": "pip install 'sgpu_magic[ray]' (or pip install ray), the same version as the cluster's",
    }
    assert checks["deepspeed"]["status"] == "ok"  # not checked further without torch, and not an error


# ----------------------------------------------------------------------------- GPUs, leases and their holders

HOLDER = """
import os, sys
from sgpu_magic.launch.leases import LeaseRegistry
from sgpu_magic.launch.resources import list_gpus
lease, why = LeaseRegistry().try_acquire("job-doctor", 2, list_gpus()[2:])
print("held" if lease else why, flush=True)
sys.stdin.read()
os._exit(0)  # gone without releasing: the registry keeps the entry until someone looks
"""


def test_fake_gpus_with_a_lease_held_by_another_process_show_its_holder(clean_env, monkeypatch):
    monkeypatch.setenv("SGPU_MAGIC_FAKE_GPUS", "8 x H100")
    monkeypatch.setenv("SGPU_MAGIC_LEASE_DIR", str(clean_env / "leases"))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        report = diagnose()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    gpus = row(report, "gpus")
    assert gpus == Check(
        "gpus",
        Status.WARNING,
        "8 x H100 (fake) from SGPU_MAGIC_FAKE_GPUS (a test seam): jobs lease "
        "them as real GPUs and their ranks run on CPU with gloo",
        "unset SGPU_MAGIC_FAKE_GPUS to use this machine's real GPUs",
    )
    held_by = rf"job job-doctor \(kernel pid {holder.pid}, user {re.escape(getpass.getuser())}\) since \d\d:\d\d:\d\d"
    for index in (2, 3):
        assert re.fullmatch(rf"H100 \(fake\): leased by {held_by}", row(report, f"gpu {index}").details)
    for index in (0, 1, 4, 5, 6, 7):
        assert row(report, f"gpu {index}") == Check(f"gpu {index}", Status.OK, "H100 (fake): free")
    assert re.fullmatch(
        rf"{re.escape(str(clean_env / 'leases'))}: GPUs 2,3 held by {held_by}", row(report, "leases").details
    )
    assert report.ok  # leased GPUs are how sharing works, not an error

    after = diagnose()  # the holder died without releasing: its entry is dropped, as the next job drops it
    assert row(after, "gpu 2").details == "H100 (fake): free"
    assert row(after, "leases").details.endswith(": no GPU leased, no job waiting")


def test_real_gpus_show_the_nvml_driver_and_its_cuda_version(clean_env, monkeypatch):
    # this machine has no NVIDIA driver: the two NVML reads are replaced by what an H200 machine returns (a
    # regression test: the inventory once took the driver version for an NVML read error, fields shifted by one)
    from sgpu_magic.front.doctor import _machine
    from sgpu_magic.launch.resources import Gpu

    h200 = [Gpu(i, "NVIDIA H200", f"GPU-{i:08d}") for i in range(2)]
    monkeypatch.setattr(_machine, "list_gpus", lambda: h200)
    monkeypatch.setattr(_machine, "_nvml_driver", lambda: ("570.86.15", (12, 8), 2))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert row(diagnose(), "gpus") == Check("gpus", Status.OK, "2 x NVIDIA H200; NVIDIA driver 570.86.15 (CUDA 12.8)")


def test_a_fake_gpu_inventory_that_does_not_parse_is_an_error(clean_env, monkeypatch):
    monkeypatch.setenv("SGPU_MAGIC_FAKE_GPUS", "lots of H100")
    assert row(diagnose(), "gpus") == Check(
        "gpus",
        Status.ERROR,
        "SGPU_MAGIC_FAKE_GPUS='lots of H100' is not a GPU inventory",
        "write it as '8 x H100' (count x name), or unset SGPU_MAGIC_FAKE_GPUS to use the real GPUs",
    )


def test_no_gpu_here_means_cpu_ranks_and_unused_leases(clean_env):
    from sgpu_magic.launch.resources import list_gpus

    if list_gpus():
        pytest.skip("this machine has GPUs (tests/integration/test_gpu.py covers them)")
    report = diagnose()
    assert row(report, "gpus") == Check(
        "gpus", Status.OK, "none (no NVIDIA driver or GPU seen through NVML): jobs run CPU ranks with gloo"
    )
    assert row(report, "leases").details.endswith(": made by the first GPU job (not used here: CPU jobs lease nothing)")
    assert not (clean_env / "home").exists()  # the doctor creates nothing, not even sgpu_magic's home


LEASE_DIR_REMEDY = (
    "set SGPU_MAGIC_LEASE_DIR (or %config DistributedMagics.lease_dir) to a directory you can write; "
    "for a team, one every user can write (e.g. mode 2775 with a shared group)"
)


def test_a_lease_directory_that_cannot_be_made_is_an_error(clean_env, monkeypatch):
    (clean_env / "a_file").write_text("")
    monkeypatch.setenv("SGPU_MAGIC_LEASE_DIR", str(clean_env / "a_file" / "leases"))
    assert row(diagnose(), "leases") == Check(
        "leases",
        Status.ERROR,
        f"the lease directory {clean_env / 'a_file' / 'leases'} cannot be used: "
        f"{clean_env / 'a_file'} is not a directory",
        LEASE_DIR_REMEDY,
    )


def test_the_lease_directory_of_the_kernels_config_is_the_one_checked(clean_env):
    (clean_env / "a_file").write_text("")
    report = diagnose(DoctorConfig(lease_dir=str(clean_env / "a_file")))
    assert (
        row(report, "leases").details == f"the lease directory {clean_env / 'a_file'} cannot be used: "
        f"{clean_env / 'a_file'} is not a directory"
    )


def test_an_unreadable_lease_registry_is_an_error(clean_env, monkeypatch):
    leases = clean_env / "leases"
    leases.mkdir()
    (leases / "registry.json").write_text("{half a regis")
    monkeypatch.setenv("SGPU_MAGIC_LEASE_DIR", str(leases))
    found = row(diagnose(), "leases")
    assert found.status is Status.ERROR
    assert re.fullmatch(
        rf"the lease registry {re.escape(str(leases / 'registry.json'))} cannot be read \(Expecting "
        rf"property name enclosed in double quotes: line 1 column 2 \(char 1\)\)",
        found.details,
    )
    assert found.remedy == "remove it while no sgpu_magic job runs (the next job writes a new one)"


# ----------------------------------------------------------------------------- ports and home


def test_a_pinned_port_that_is_in_use_names_its_listener(clean_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        report = diagnose(DoctorConfig(port=port))
    assert row(report, f"port {port}") == Check(
        f"port {port}",
        Status.ERROR,
        f"the pinned port {port} is in use by pid {os.getpid()} "
        f"({__import__('psutil').Process().name()}): a job pinned to it is refused "
        f"before launch",
        "leave port= / --port out (each job takes a free port), or pin a free one",
    )
    assert re.fullmatch(
        r"each job's rendezvous listens on 127\.0\.0\.1, on a free port from \d+-\d+ \(e\.g\. \d+ now\) "
        r"unless port= / --port pins one",
        row(report, "ports").details,
    )


def test_a_pinned_port_that_is_free_or_not_a_port(clean_env):
    with closed_port() as s:
        port = s.getsockname()[1]
    assert row(diagnose(DoctorConfig(port=port)), f"port {port}").status is Status.OK
    assert row(diagnose(DoctorConfig(port=70000)), "port 70000") == Check(
        "port 70000",
        Status.ERROR,
        "70000 is not a TCP port",
        "pin a port in 1-65535, or leave port out to take a free one",
    )


def test_a_home_that_cannot_be_made_is_an_error(clean_env, monkeypatch):
    (clean_env / "a_file").write_text("")
    monkeypatch.setenv("SGPU_MAGIC_HOME", str(clean_env / "a_file" / "home"))
    assert row(diagnose(), "home") == Check(
        "home",
        Status.ERROR,
        f"sgpu_magic's home {clean_env / 'a_file' / 'home'} cannot be used: {clean_env / 'a_file'} is not a directory",
        "set SGPU_MAGIC_HOME to a directory you can write",
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_home_owned_by_another_user_is_an_error(clean_env, monkeypatch):
    home = clean_env / "theirs"
    home.mkdir()
    os.chown(home, 65534, 65534)
    monkeypatch.setenv("SGPU_MAGIC_HOME", str(home))
    assert row(diagnose(), "home") == Check(
        "home",
        Status.ERROR,
        f"sgpu_magic's home {home} is owned by uid 65534, not by you: jobs refuse to run there",
        "set SGPU_MAGIC_HOME to a private directory of yours",
    )


# ----------------------------------------------------------------------------- MLflow

MLFLOW_FILE_REMEDY = (
    "point MLFLOW_TRACKING_URI (or mlflow.set_tracking_uri) at a new sqlite:/// file, or move that "
    "one away (--no-mlflow / mlflow=False runs a job untracked on purpose)"
)
MLFLOW_PLACE_REMEDY = (
    "set MLFLOW_TRACKING_URI (or mlflow.set_tracking_uri) to a place you can write (--no-mlflow / "
    "mlflow=False runs a job untracked on purpose)"
)


def _mlflow(uri: str, monkeypatch, **config) -> Check:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return row(diagnose(DoctorConfig(**config)), "mlflow")


def test_mlflow_sqlite_stores(clean_env, monkeypatch):
    found = _mlflow(f"sqlite:///{clean_env}/new.db", monkeypatch)
    assert found.status is Status.OK and found.details.endswith(
        f"tracking URI sqlite:///{clean_env}/new.db: made with the first tracked job (its tables take about 4 s)"
    )
    (clean_env / "notes.db").write_text("not a database")
    found = _mlflow(f"sqlite:///{clean_env}/notes.db", monkeypatch)
    assert (found.status, found.remedy) == (Status.ERROR, MLFLOW_FILE_REMEDY)
    assert found.details.endswith(
        f"tracking URI sqlite:///{clean_env}/notes.db: {clean_env}/notes.db is not an SQLite database"
    )
    (clean_env / "dir.db").mkdir()
    found = _mlflow(f"sqlite:///{clean_env}/dir.db", monkeypatch)
    assert (found.status, found.remedy) == (Status.ERROR, MLFLOW_FILE_REMEDY)
    assert found.details.endswith(f"{clean_env}/dir.db cannot be read (Is a directory)")
    (clean_env / "a_file").write_text("")
    found = _mlflow(f"sqlite:///{clean_env}/a_file/mlflow.db", monkeypatch)
    assert (found.status, found.remedy) == (Status.ERROR, MLFLOW_PLACE_REMEDY)
    assert found.details.endswith(f": the database cannot be created: {clean_env}/a_file is not a directory")


def test_mlflow_sqlite_store_that_exists_and_a_real_database(clean_env, monkeypatch):
    import sqlite3

    sqlite3.connect(clean_env / "real.db").execute("create table t (x)").connection.close()
    found = _mlflow(f"sqlite:///{clean_env}/real.db", monkeypatch)
    assert found.status is Status.OK and re.search(r": SQLite store, \d+\.\d MiB$", found.details)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write any file")
def test_mlflow_sqlite_store_that_is_not_writable(clean_env, monkeypatch):
    import sqlite3

    sqlite3.connect(clean_env / "ro.db").execute("create table t (x)").connection.close()
    os.chmod(clean_env / "ro.db", 0o400)
    found = _mlflow(f"sqlite:///{clean_env}/ro.db", monkeypatch)
    assert (found.status, found.remedy) == (Status.ERROR, MLFLOW_FILE_REMEDY)
    assert found.details.endswith(f"{clean_env}/ro.db is not writable by you")


def test_mlflow_file_store_that_cannot_be_written(clean_env, monkeypatch):
    (clean_env / "a_file").write_text("")
    found = _mlflow(f"file://{clean_env}/a_file/mlruns", monkeypatch)
    assert (found.status, found.remedy) == (Status.ERROR, MLFLOW_PLACE_REMEDY)
    assert found.details.endswith(f": the file store cannot be written: {clean_env}/a_file is not a directory")
    found = _mlflow(str(clean_env / "mlruns"), monkeypatch)
    assert found.status is Status.OK and found.details.endswith(": file store, made with the first tracked job")


def test_mlflow_off_in_the_kernels_config_is_not_checked(clean_env, monkeypatch):
    with closed_port() as s:
        found = _mlflow(f"http://127.0.0.1:{s.getsockname()[1]}", monkeypatch, mlflow=False)
    assert found == Check("mlflow", Status.OK, "off (DistributedMagics.mlflow = False): jobs are not tracked")


def test_mlflow_server_password_is_not_shown(clean_env, monkeypatch):
    with closed_port() as s:
        found = _mlflow(f"http://ana:hunter22@127.0.0.1:{s.getsockname()[1]}", monkeypatch, timeout_s=1)
    assert found.status is Status.ERROR and "hunter22" not in found.details and "ana:***@127.0.0.1" in found.details


@pytest.mark.slow
def test_mlflow_server_that_answers(clean_env, monkeypatch):
    from sgpu_magic.tracking.server import MlflowUI

    ui = MlflowUI(f"sqlite:///{clean_env}/served.db")
    try:
        ui.wait_ready()
        found = _mlflow(ui.url, monkeypatch)
    finally:
        ui.stop()
    assert found.status is Status.OK
    assert re.fullmatch(
        rf"mlflow \S+, tracking URI {re.escape(ui.url)}: the tracking server answers \(\d+ ms\)", found.details
    )


# ----------------------------------------------------------------------------- widgets and Jupyter


def test_widgets_whose_frontend_extension_does_not_match_will_not_render():
    assert widgets_row(GOOD_VERSIONS, IPYWIDGETS_REQUIRES).status is Status.OK
    old_lab = widgets_row({**GOOD_VERSIONS, "jupyterlab_widgets": "1.1.7"}, IPYWIDGETS_REQUIRES)
    assert old_lab == Check(
        "widgets",
        Status.ERROR,
        "ipywidgets 8.1.9 needs jupyterlab_widgets~=3.0.17 (its JupyterLab, Notebook 7 "
        "extension), but jupyterlab_widgets is 1.1.7: the panel will not render ('Error "
        "displaying widget')",
        "pip install 'jupyterlab_widgets~=3.0.17' in the environment the Jupyter server runs in",
    )
    missing = widgets_row({**GOOD_VERSIONS, "widgetsnbextension": None}, IPYWIDGETS_REQUIRES)
    assert missing.status is Status.ERROR and missing.details.startswith(
        "ipywidgets 8.1.9 needs widgetsnbextension~=4.0.16 (its classic Notebook extension), but widgetsnbextension "
        "is not installed"
    )
    assert widgets_row({**GOOD_VERSIONS, "ipywidgets": None}, []) == Check(
        "widgets",
        Status.WARNING,
        "ipywidgets is not installed: jobs show plain [rank N] text, no panel",
        "pip install ipywidgets",
    )


def test_the_installed_widget_stack_matches():
    from sgpu_magic.front.doctor._services import frontend_rows

    assert frontend_rows(DoctorConfig(), None)[0].status is Status.OK


def test_jupyter_without_subshells_warns_that_stop_waits_for_the_cell():
    assert jupyter_row(GOOD_VERSIONS) == Check(
        "jupyter", Status.OK, "JupyterLab 4.6.6, Notebook 7.6.5, ipykernel 7.4.0"
    )
    old = jupyter_row({**GOOD_VERSIONS, "jupyterlab": "4.2.5", "ipykernel": "6.29.5"})
    assert old == Check(
        "jupyter",
        Status.WARNING,
        "JupyterLab 4.2.5, Notebook 7.6.5, ipykernel 6.29.5: with ipykernel 6.29.5 and "
        "JupyterLab 4.2.5 the panel's Stop button waits until a blocking cell ends (no "
        "kernel subshells)",
        "use the notebook's Interrupt button meanwhile (it cancels the job too), or upgrade: pip install "
        "'ipykernel>=7' 'jupyterlab>=4.4' (Notebook: 'notebook>=7.4')",
    )
    assert jupyter_row({"ipykernel": "7.4.0"}).details == (
        "JupyterLab not installed, Notebook not installed, "
        "ipykernel 7.4.0 (the Jupyter server may run in another "
        "environment)"
    )


# ----------------------------------------------------------------------------- torch on GPU machines


def test_torch_builds_that_cannot_use_the_gpus():
    assert torch_gpu_problem(None, 0, None) is None  # a CPU build on a CPU machine: CPU ranks
    assert torch_gpu_problem("12.8", 8, (12, 4)) is None  # CUDA's minor-version compatibility
    assert torch_gpu_problem(None, 8, (12, 4)) == (
        "it is a CPU build, but 8 GPU(s) are visible: jobs would give their ranks GPUs and nccl that this torch "
        "cannot use",
        "install a CUDA build of torch (the pip command from pytorch.org's install selector), or hide the GPUs "
        "(CUDA_VISIBLE_DEVICES='') to run CPU ranks",
    )
    assert torch_gpu_problem("13.0", 1, (12, 4)) == (
        "it is built for CUDA 13.0, but the NVIDIA driver supports CUDA up to 12.4: ranks would fail to initialise CUDA",
        "update the NVIDIA driver, or install a torch build for CUDA 12",
    )


# ----------------------------------------------------------------------------- Ray and DeepSpeed

RAY_REMEDY = (
    "start the cluster (ray start --head), or fix the address: ray://host:10001 (Ray client), host:6379 "
    "(its GCS) or auto"
)


def test_a_ray_cluster_where_nothing_answers_is_an_error(clean_env, monkeypatch):
    with closed_port() as s:
        port = s.getsockname()[1]
        found = row(diagnose(DoctorConfig(cluster=f"ray://127.0.0.1:{port}", timeout_s=1)), "ray")
        monkeypatch.setenv("SGPU_MAGIC_REMOTE_CLUSTER", f"127.0.0.1:{port}")
        configured = row(diagnose(DoctorConfig(timeout_s=1)), "ray")
        from_kernel = row(diagnose(DoctorConfig(remote_cluster=f"127.0.0.1:{port}", timeout_s=1)), "ray")
    assert found == Check(
        "ray",
        Status.ERROR,
        f"--cluster names the Ray cluster 'ray://127.0.0.1:{port}', but nothing "
        f"answers at ray://127.0.0.1:{port} within 1 s ([Errno 111] Connection "
        f"refused)",
        RAY_REMEDY,
    )
    assert configured.details.startswith(f"SGPU_MAGIC_REMOTE_CLUSTER names the Ray cluster '127.0.0.1:{port}'")
    assert from_kernel.details.startswith(f"DistributedMagics.remote_cluster names the Ray cluster '127.0.0.1:{port}'")


def test_a_ray_address_that_answers_and_auto(clean_env, monkeypatch):
    with socket.socket() as s:  # a TCP listener: the doctor checks that the address accepts connections
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        found = row(diagnose(DoctorConfig(cluster=f"127.0.0.1:{port}")), "ray")
        assert found.status is Status.OK and found.details.startswith(f"--cluster: '127.0.0.1:{port}' answers at ")
        address_file = clean_env / "ray_tmp" / "ray" / "ray_current_cluster"
        address_file.parent.mkdir(parents=True)
        address_file.write_text(f"127.0.0.1:{port}\n")  # what `ray start --head` leaves for address="auto"
        assert row(diagnose(DoctorConfig(cluster="auto")), "ray").status is Status.OK
    address_file.unlink()
    assert row(diagnose(DoctorConfig(cluster="auto")), "ray") == Check(
        "ray",
        Status.ERROR,
        "--cluster is 'auto', but no Ray cluster was started on this machine (no RAY_ADDRESS, no "
        "ray_current_cluster file)",
        "start one (ray start --head), or give its address, e.g. ray://head:10001",
    )
    assert row(diagnose(), "ray").details.startswith("no cluster configured: jobs run on this machine; ")


def test_deepspeed_without_a_compiler_and_an_empty_op_cache(clean_env, monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("CXX", str(clean_env / "no-such-c++"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(clean_env / "ext"))
    report = diagnose()
    toolchain = row(report, "deepspeed")
    assert toolchain.status is Status.WARNING and toolchain.details.endswith(
        f", but no C++ compiler ({clean_env / 'no-such-c++'} not found): DeepSpeed cannot build its JIT ops (on CPU, "
        f"the communication op deepspeed.init_distributed needs; DeepSpeedCPUAdam)"
    )
    assert toolchain.remedy == "install one (apt-get install g++), or set CXX to a compiler"
    assert row(report, "torch extensions") == Check(
        "torch extensions",
        Status.OK,
        f"{clean_env / 'ext'}: none built yet; DeepSpeed's first start compiles a C++ "
        f"op (about 60 s on 2 cores) and caches it here",
    )
    (clean_env / "ext" / "deepspeed_shm_comm").mkdir(parents=True)
    (clean_env / "ext" / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    assert row(diagnose(), "torch extensions").details == f"{clean_env / 'ext'}: 1 op(s) built (deepspeed_shm_comm)"


# ----------------------------------------------------------------------------- the report itself


def test_text_and_html_of_a_report():
    report = Report(
        [Check("a", Status.OK, "fine"), Check("longer name", Status.ERROR, "<bad> & " + "x " * 80, "fix it")]
    )
    text = str(report).splitlines()
    assert text[0] == "sgpu_magic doctor: 1 error (of 2 checks)"
    assert text[2] == "a            ok       fine"
    assert text[3].startswith("longer name  error    <bad> & x x")
    assert all(line.startswith(" " * 22) for line in text[4:]) and text[-1] == " " * 22 + "remedy: fix it"
    assert all(len(line) <= 122 for line in text)
    page = report._repr_html_()
    assert "&lt;bad&gt; &amp; x" in page and "<bad>" not in page and "<i>remedy: fix it</i>" in page
    assert Report([Check("a", Status.OK, "fine")]).summary() == "sgpu_magic doctor: all 1 checks ok"


# ----------------------------------------------------------------------------- %distributed_doctor


def test_distributed_doctor_in_an_ipython_shell_shows_its_launch_host(ip, clean_env):
    from sgpu_magic.launch.client import get_host

    from helpers import wait_for

    host = get_host()
    wait_for(lambda: host.warm, 120, "the launch host's forkserver to finish preloading")
    report = ip.run_line_magic("distributed_doctor", "")
    assert row(report, "launch host") == Check(
        "launch host",
        Status.OK,
        f"pid {host.pid}, warm: ranks fork from a forkserver that has imported torch; log {host.log_path}",
    )
    assert row(report, "view").details == "plain [rank N] text and a summary line (SGPU_MAGIC_WIDGETS=0)"
    from IPython.core.formatters import HTMLFormatter

    assert ip.display_formatter.format(report)[0]["text/plain"].startswith("sgpu_magic doctor: ")
    assert HTMLFormatter()(report).startswith("<b>sgpu_magic doctor: ")  # what a Jupyter kernel displays


def test_distributed_doctor_reads_the_kernels_config_and_its_options(ip, clean_env):
    from IPython.core.error import UsageError

    magics = ip.magics_manager.registry["DistributedMagics"]
    (clean_env / "a_file").write_text("")
    old = magics.lease_dir, magics.mlflow
    try:
        ip.run_line_magic("config", f"DistributedMagics.lease_dir = {str(clean_env / 'a_file')!r}")
        ip.run_line_magic("config", "DistributedMagics.mlflow = False")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            report = ip.run_line_magic("distributed_doctor", f"--port {port}")
    finally:
        magics.lease_dir, magics.mlflow = old
    assert row(report, "leases").status is Status.ERROR
    assert row(report, "mlflow").details.startswith("off (DistributedMagics.mlflow = False)")
    assert row(report, f"port {port}").status is Status.ERROR
    with pytest.raises(UsageError, match=r"argument --port: invalid int value: 'x'"):
        ip.run_line_magic("distributed_doctor", "--port x")


def test_distributed_doctor_says_when_the_launch_host_has_exited(ip, clean_env):
    import signal

    from sgpu_magic.launch.client import get_host

    from helpers import wait_for

    host = get_host()
    os.kill(host.pid, signal.SIGKILL)
    wait_for(lambda: not host.alive(), 30, "the killed launch host to be gone")
    assert row(ip.run_line_magic("distributed_doctor", ""), "launch host") == Check(
        "launch host",
        Status.WARNING,
        f"pid {host.pid} has exited (its log: {host.log_path})",
        "nothing to do: the next job starts a new one; the log says why this one ended",
    )
    assert get_host().pid != host.pid  # as the next job does
