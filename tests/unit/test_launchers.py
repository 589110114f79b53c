"""The launchers (the kernel's launch host, the run keeper, Ray) implement the Launcher protocol (sgpu_magic.launch.base) that the Job handle relies on, and both
session channels the Channel protocol (sgpu_magic.session.channel) that a session relies on."""

from __future__ import annotations

import inspect

import pytest

from sgpu_magic.launch.base import Launcher
from sgpu_magic.launch.client import LaunchHost
from sgpu_magic.launch.ray.launcher import RayLauncher


def _methods(cls) -> dict[str, inspect.Signature]:
    names = ("launch", "cancel", "alive", "where", "preparing", "stacks")
    return {name: inspect.signature(getattr(cls, name)) for name in names}


def _shape(signature: inspect.Signature) -> list[tuple[str, object, object]]:
    """A signature's parameters without their annotations: a Ray channel types the job it is given by what it
    uses of it (it may not import the Job handle, a higher layer), the protocol by the class."""
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def test_the_ray_launcher_is_a_launcher_and_says_where_its_diagnostics_are():
    launcher = RayLauncher("ray://127.0.0.1:10001", None)  # connects only when a job is launched
    assert isinstance(launcher, Launcher)
    assert launcher.where() == "the kernel's Ray driver"


def test_the_local_launch_host_has_the_protocols_methods_with_its_signatures():
    from sgpu_magic.launch.keeper import RunKeeper
    from sgpu_magic.session.execution import CellExecution

    assert _methods(LaunchHost) == _methods(Launcher)
    assert _methods(RunKeeper) == _methods(Launcher)
    assert _methods(RayLauncher) == _methods(Launcher)
    assert _methods(CellExecution) == _methods(Launcher)


def test_both_session_channels_have_the_channels_methods_with_its_signatures():
    from sgpu_magic.launch.ray.session_channel import RaySessionChannel
    from sgpu_magic.session.channel import Channel, SessionChannel

    names = ("make", "attach", "send", "read_ready", "interrupt", "close")
    expected = {n: inspect.signature(getattr(Channel, n)) for n in names}
    assert {n: inspect.signature(getattr(SessionChannel, n)) for n in names} == expected
    ray = {n: inspect.signature(getattr(RaySessionChannel, n)) for n in names}
    assert {n: _shape(s) for n, s in ray.items()} == {n: _shape(s) for n, s in expected.items()}
    assert {n: s.return_annotation for n, s in ray.items()} == {n: s.return_annotation for n, s in expected.items()}


def test_a_ray_session_channel_refuses_to_send_before_its_ranks_run(tmp_path):
    from sgpu_magic.launch.ray.session_channel import RaySessionChannel
    from sgpu_magic.rundir import RunDir

    rd = RunDir.create(tmp_path)
    channel = RaySessionChannel(rd, 2)
    channel.make()
    assert rd.session_dir.is_dir()  # the mark that tells the Ray launcher's agents to make the ranks' FIFOs
    with pytest.raises(OSError, match=r"the session's ranks on the Ray cluster are not running \(.*\)"):
        channel.send((0, 1), {"op": "push", "values": {}, "seq": 1})
    channel.interrupt(0, 123)  # nothing to interrupt yet: no error
    channel.close()
    assert channel.read_ready(0.01) == []
