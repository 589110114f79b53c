"""RunDir: private directories, atomic writes, one name per file."""

import os
import stat

import pytest

from sgpu_magic.rundir import RunDir, atomic_write_json, make_private_dir, read_json


def test_create_is_private_and_names_every_file(tmp_path):
    rd = RunDir.create(tmp_path)
    assert stat.S_IMODE(rd.path.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "runs").stat().st_mode) == 0o700
    assert rd.log_file(1) == rd.path / "logs" / "rank_1.log"
    assert rd.result_file(0).parent.is_dir() and rd.error_file(0).parent.is_dir()
    assert rd.job_id == rd.path.name


def test_atomic_write_leaves_no_temporary_and_is_private(tmp_path):
    path = tmp_path / "status.json"
    atomic_write_json(path, {"state": "running"})
    atomic_write_json(path, {"state": "succeeded"})
    assert read_json(path) == {"state": "succeeded"}
    assert os.listdir(tmp_path) == ["status.json"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_read_json_missing_is_none(tmp_path):
    assert read_json(tmp_path / "nope.json") is None


def test_loose_permissions_are_tightened(tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    make_private_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory owned by another user")
def test_directory_of_another_user_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir()
    os.chown(d, 12345, 12345)
    with pytest.raises(PermissionError, match=r"owned by uid 12345, not by you; set SGPU_MAGIC_HOME"):
        make_private_dir(d)
