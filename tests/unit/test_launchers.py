"""Both launchers implement the Launcher protocol (sgpu_magic.launch.base) that the Job handle relies on, and both
session channels the Channel protocol (sgpu_magic.session.channel) that a session relies on."""

from __future__ import annotations

import inspect

import pytest

from sgpu_magic.launch.base import Launcher
from sgpu_magic.launch.client import LaunchHost
from sgpu_magic.launch.ray.launcher import RayLauncher


def _methods(cls) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(getattr(cls, name)) for name in ("launch", "cancel", "alive", "where", "preparing")}


def test_the_ray_launcher_is_a_launcher_and_says_where_its_diagnostics_are():
    launcher = RayLauncher("ray://127.0.0.1:10001", None)  # connects only when a job is launched
    assert isinstance(launcher, Launcher)
    assert launcher.where() == "the kernel's Ray driver"


def test_the_local_launch_host_has_the_protocols_methods_with_its_signatures():
    assert _methods(LaunchHost) == _methods(Launcher)
    assert _methods(RayLauncher) == _methods(Launcher)


def test_both_session_channels_have_the_channels_methods_with_its_signatures():
    from sgpu_magic.session.channel import Channel, SessionChannel
    from sgpu_magic.session.ray_channel import RaySessionChannel

    names = ("make", "attach", "send", "read_ready", "interrupt", "close")
    expected = {n: inspect.signature(getattr(Channel, n)) for n in names}
    for cls in (SessionChannel, RaySessionChannel):
        assert {n: inspect.signature(getattr(cls, n)) for n in names} == expected, cls


def test_a_ray_session_channel_refuses_to_send_before_its_ranks_run(tmp_path):
    from sgpu_magic.rundir import RunDir
    from sgpu_magic.session.ray_channel import RaySessionChannel

    rd = RunDir.create(tmp_path)
    channel = RaySessionChannel(rd, 2)
    channel.make()
    assert rd.session_dir.is_dir()  # the mark that tells the Ray launcher's agents to make the ranks' FIFOs
    with pytest.raises(OSError, match=r"the session's ranks on the Ray cluster are not running \(.*\)"):
        channel.send((0, 1), {"op": "push", "values": {}, "seq": 1})
    channel.interrupt(0, 123)  # nothing to interrupt yet: no error
    channel.close()
    assert channel.read_ready(0.01) == []
