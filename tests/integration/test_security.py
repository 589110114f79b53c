"""Security: private files, pickles only from private places, loopback-only listeners, no secrets out.

Real rank processes, a real launch host, a real ``mlflow server`` and a sqlite MLflow store;
another local user is played by ``os.chown`` to uid 65534 (the tests run as root in CI and here).
"""

from __future__ import annotations

import os
import pickle
import stat
import uuid
from pathlib import Path

import psutil
import pytest

from sgpu_magic import JobState, distributed
from sgpu_magic._util.redact import redact, secret_values
from sgpu_magic.rundir import RunDir, default_root, read_json, read_private
from sgpu_magic.tracking.worker import worker

LOOPBACK = {"127.0.0.1", "::1"}


def _status_file(job) -> dict:
    """The job's status.json as its launcher wrote it (every key, not only the typed ones of job.status)."""
    return read_json(RunDir(job.run_dir).status_file)


@distributed(gpus=2, timeout=120, mlflow=False)
def listeners():
    """Each rank: join a gloo group, all_reduce, and report the addresses it and the launch host listen on."""
    import os

    import psutil
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)

    def listening(pid):
        return sorted(
            {c.laddr.ip for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN}
        )

    seen = {
        "rank": listening(os.getpid()),
        "host": listening(int(os.environ["SGPU_MAGIC_HOST_PID"])),
        "sum": t.item(),
        "agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"],
    }
    dist.barrier()
    return seen


def test_a_job_listens_on_loopback_only():
    """The rendezvous store (served by the host) and gloo's pair sockets listen on 127.0.0.1, nowhere else."""
    seen = listeners.distributed()
    assert [s["sum"] for s in seen] == [2.0, 2.0]
    for rank, s in enumerate(seen):
        assert s["rank"] and set(s["rank"]) <= LOOPBACK, f"rank {rank} listens on {s['rank']}"
        assert s["host"] == ["127.0.0.1"], f"the launch host listens on {s['host']}"  # the rendezvous store
        assert s["agent_store"] == "True"
    host_pid = int(_status_file(listeners.last_job)["host_pid"])
    job = listeners.last_job
    port = _status_file(job)["port"]
    assert not [
        c
        for c in psutil.Process(host_pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ], "the store outlived its job"


def test_the_launch_host_takes_commands_only_from_its_pipe():
    """No socket and no named file: the host's only command channel is the unnamed pipe on its stdin."""
    from sgpu_magic.launch.client import get_host

    host = psutil.Process(get_host().pid)
    assert not [c for c in host.net_connections("all") if c.status == psutil.CONN_LISTEN]
    assert not host.net_connections("unix")
    assert stat.S_ISFIFO(os.stat(f"/proc/{host.pid}/fd/0").st_mode)


@distributed(gpus=1, timeout=120)
def returns_one():
    return 1


@distributed(gpus=2, timeout=120)
def rank_1_fails():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails")
    return 0


def test_everything_a_job_writes_is_private(sgpu_home):
    """Every folder and file under sgpu_magic's home, after a tracked job that succeeds and one whose rank
    fails (results, errors, logs, status, the MLflow mark, host and kernel logs, the forkserver's marker):
    directories 0700, files 0600, owned by us, links (a session cell's to its session) pointing inside the home;
    also what other tests left there (the MLflow UI's log, more
    jobs). Not walked: the session's MLflow store, which conftest keeps there (mlflow.db, mlruns/: MLflow's
    files), and the VolumeDataset cache (cache/: copies of the user's data files)."""
    from sgpu_magic.errors import RankFailedError

    from helpers import wait_for

    assert returns_one.distributed() == [1]
    with pytest.raises(RankFailedError, match=r"rank 1 failed \(root cause\): ValueError: rank 1 fails"):
        rank_1_fails.distributed()
    # the host's forkserver marks itself ready with a file there: wait for it, so it is checked too
    wait_for(lambda: list((default_root() / "hosts").glob("*.warm")), 120, "the warm forkserver's marker")
    for job in (returns_one.last_job, rank_1_fails.last_job):
        assert job.mlflow_run_id and (job.run_dir / "mlflow_ended").exists()  # tracked, and its run ended
    assert list((rank_1_fails.last_job.run_dir / "errors").iterdir())
    assert default_root() == sgpu_home
    store = {sgpu_home / "mlflow.db", sgpu_home / "mlflow.db-journal", sgpu_home / "mlruns", sgpu_home / "cache"}
    loose, seen = [], 0
    for dirpath, dirnames, filenames in os.walk(sgpu_home):
        dirnames[:] = [d for d in dirnames if Path(dirpath, d) not in store]
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]  # os.walk lists, never enters
        for name in [dirpath] + [os.path.join(dirpath, f) for f in filenames + links if Path(dirpath, f) not in store]:
            try:
                st = os.lstat(name)
            except FileNotFoundError:  # a temporary file renamed meanwhile
                continue
            seen += 1
            if stat.S_ISLNK(st.st_mode):  # a session cell's .reserve-of: a link's own mode is always 0777 (unused)
                target = Path(dirpath, os.readlink(name)).resolve()
                if st.st_uid != os.getuid() or not target.is_relative_to(sgpu_home.resolve()):
                    loose.append(f"{name} -> {target}")
                continue
            want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
            if st.st_uid != os.getuid() or st.st_mode & 0o777 & ~want or st.st_mode & 0o077:
                loose.append(f"{name} {oct(st.st_mode & 0o777)}")
    assert not loose, loose
    assert seen > 20


def test_a_lease_directory_is_created_private(tmp_path):
    from sgpu_magic.launch.leases import LeaseRegistry
    from sgpu_magic.launch.resources import fake_gpus

    lease, why = LeaseRegistry(tmp_path / "leases").try_acquire("job-1", 1, fake_gpus("2 x H100"))
    assert lease is not None, why
    lease.release()
    assert stat.S_IMODE(os.stat(tmp_path / "leases").st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "leases").iterdir()} == {
        "registry.json": 0o600,
        "registry.lock": 0o600,
    }


# ----------------------------------------------------------------------------- planted pickles


@pytest.fixture
def private_file(tmp_path):
    run = tmp_path / "run"
    (run / "results").mkdir(parents=True, mode=0o700)
    os.chmod(run, 0o700)
    path = run / "results" / "rank_0.pkl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, pickle.dumps("ok"))
    os.close(fd)
    return run, path


def test_read_private_reads_a_private_file(private_file):
    run, path = private_file
    assert pickle.loads(read_private(path, run)) == "ok"


def _plant_symlink(run, path, tmp_path):
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps("evil"))
    path.unlink()
    path.symlink_to(evil)


PLANTS = {  # how another user could plant a pickle -> what the refusal must say
    "file-mode": (
        lambda run, path, tmp: os.chmod(path, 0o666),
        r"the file has mode 0o666, open to other users \(want 0600\)",
    ),
    "file-owner": (lambda run, path, tmp: os.chown(path, 65534, 65534), r"the file is owned by uid 65534, not by you"),
    "dir-mode": (
        lambda run, path, tmp: os.chmod(path.parent, 0o777),
        r"its directory has mode 0o777, open to other users \(want 0700\)",
    ),
    "run-dir-mode": (lambda run, path, tmp: os.chmod(run, 0o755), r"its directory has mode 0o755"),
    "run-dir-owner": (lambda run, path, tmp: os.chown(run, 65534, 65534), r"its directory is owned by uid 65534"),
    "symlink": (_plant_symlink, r"it is a symlink"),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_pickle_is_refused(private_file, tmp_path, plant):
    """Each way another user could plant a payload or result is refused, naming the file and the remedy."""
    if os.getuid() != 0 and "owner" in plant:
        pytest.skip("chown to another user needs root")
    run, path = private_file
    action, why = PLANTS[plant]
    action(run, path, tmp_path)
    with pytest.raises(PermissionError, match=rf"refusing to read {path}: {why}"):
        read_private(path, run)


def test_a_job_whose_result_was_made_readable_to_others_is_refused():
    """Through a real job: the kernel will not unpickle a result file that is open to other users."""
    job = returns_one.submit()
    assert job.wait(60) is JobState.SUCCEEDED  # its result not read yet
    result = RunDir(job.run_dir).result_file(0)
    os.chmod(result, 0o644)
    try:
        with pytest.raises(
            PermissionError,
            match=r"rank_0\.pkl: the file has mode 0o644, open to other users .*"
            r"remove this run directory, or set SGPU_MAGIC_HOME",
        ):
            job.result()
    finally:  # the home is shared with the test that checks everything in it is private
        os.chmod(result, 0o600)


# ----------------------------------------------------------------------------- secrets

SECRETS = {
    "HF_TOKEN": "hf_abcdefghijklmnop",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIK7MDENG",
    "MY_DB_PASSWORD": "hunter2hunter2",
    "OPENAI_API_KEY": "sk-proj-0123456789",
}


def test_redact_blanks_url_passwords_and_secret_variables():
    env = {**SECRETS, "HOME": "/root", "SHORT_TOKEN": "1", "PATH": "/usr/bin"}
    assert (
        redact("postgresql://bob:pa55word@db:5432/mlflow and https://tok@host/x and hf_abcdefghijklmnop", env)
        == "postgresql://bob:***@db:5432/mlflow and https://tok@host/x and ***"
    )
    assert set(secret_values(env)) == set(SECRETS.values())  # "1" is too short to look for; HOME is no secret


# names and values as a Linux desktop, a container, Jupyter, git and Hugging Face set them: none is a secret
NOT_SECRETS = {
    "PWD": "/home/ana/proj",
    "OLDPWD": "/home/ana",
    "JPY_SESSION_NAME": "/home/ana/proj/train.ipynb",
    "XDG_SESSION_CLASS": "user",
    "XDG_SESSION_TYPE": "wayland",
    "DESKTOP_SESSION": "ubuntu",
    "DBUS_SESSION_BUS_ADDRESS": "unix:path=/run/user/1000/bus",
    "SESSION_MANAGER": "local/box:@/tmp/.ICE-unix/9",
    "SSH_AUTH_SOCK": "/tmp/ssh-XXXX/agent.99",
    "GIT_AUTHOR_NAME": "Ana Lopez",
    "GIT_AUTHOR_EMAIL": "ana@x.org",
    "TOKENIZERS_PARALLELISM": "false",
    "GOOGLE_APPLICATION_CREDENTIALS": "/home/ana/.config/gcp.json",
    "AWS_SHARED_CREDENTIALS_FILE": "/home/ana/.aws/credentials",
    "XAUTHORITY": "/run/user/1000/xauth",
    "HOME": "/home/ana",
    "PATH": "/usr/bin:/bin",
    "VIRTUAL_ENV": "/home/ana/proj/.venv",
}
MORE_SECRETS = {
    "AWS_SESSION_TOKEN": "FwoGZXIvYXdzEJr",
    "MYSQL_PWD": "s3cret-mysql",
    "NPM_AUTH_TOKEN": "npm_abcdef",
    "BASIC_AUTH": "bob:hunter22",
    "HTTP_AUTHORIZATION": "Bearer abc.def",
    "SSH_PRIVATE_KEY": "-----BEGIN",
    "STRIPE_KEY": "sk_live_123",
    "JUPYTER_TOKEN": "0123abcd",
    "MLFLOW_TRACKING_PASSWORD": "mlpass99",
    "GPG_PASSPHRASE": "open sesame",
    "COOKIE_SECRET": "c00kie!",
}


def test_paths_and_ordinary_words_are_not_secrets():
    """Issue 18: ``%mlflow_ui`` printed ``sqlite:///***/term/mlflow.db``, because PWD counted as a secret."""
    assert redact("sqlite:////home/ana/proj/m.db", {"PWD": "/home/ana/proj"}) == "sqlite:////home/ana/proj/m.db"
    text = " ".join(NOT_SECRETS.values())
    assert redact(text, NOT_SECRETS) == text
    assert set(secret_values({**NOT_SECRETS, **MORE_SECRETS})) == set(MORE_SECRETS.values())
    for name, value in MORE_SECRETS.items():
        assert redact(f"x {value} y", {**NOT_SECRETS, name: value}) == "x *** y", name


@distributed(gpus=1, timeout=120)
def tracked():
    return 1


def test_secrets_in_the_environment_reach_neither_mlflow_nor_what_sgpu_magic_prints(monkeypatch, capfd):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"test-{uuid.uuid4().hex[:8]}")
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    assert tracked.distributed() == [1]
    run = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(tracked.last_job.mlflow_run_id)
    recorded = repr(run.data.params) + repr(run.data.tags) + repr(run.data.metrics)
    out, err = capfd.readouterr()
    for value in SECRETS.values():
        assert value not in recorded and value not in out and value not in err
    assert run.data.params["gpus"] == "1"  # the params are there, just not the secrets


def test_a_tracking_failure_warning_hides_the_uri_password(monkeypatch, capfd):
    """A tracking server that cannot be reached: the warning names it without the password in its URL."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:s3cr3t-pw@127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    assert tracked.distributed() == [1]
    # the run is made off the launch path: its failure is told once the tracking worker has tried
    assert worker().flush(60)
    out, err = capfd.readouterr()
    assert "MLflow tracking is off for job" in err
    assert "s3cr3t-pw" not in out + err
