"""Both launchers implement the Launcher protocol (sgpu_magic.launch.base) that the Job handle relies on."""

from __future__ import annotations

import inspect

from sgpu_magic.launch.base import Launcher
from sgpu_magic.launch.client import LaunchHost
from sgpu_magic.launch.ray.launcher import RayLauncher


def _methods(cls) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(getattr(cls, name)) for name in ("launch", "cancel", "alive", "where")}


def test_the_ray_launcher_is_a_launcher_and_says_where_its_diagnostics_are():
    launcher = RayLauncher("ray://127.0.0.1:10001", None)  # connects only when a job is launched
    assert isinstance(launcher, Launcher)
    assert launcher.where() == "the kernel's Ray driver"


def test_the_local_launch_host_has_the_protocols_methods_with_its_signatures():
    assert _methods(LaunchHost) == _methods(Launcher)
    assert _methods(RayLauncher) == _methods(Launcher)
