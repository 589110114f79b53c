"""The doctor's rows about this machine's ports, sgpu_magic's home and the kernel's launch host."""

from __future__ import annotations

import os
from pathlib import Path

from sgpu_magic.errors import ResourceError
from sgpu_magic.front.doctor._machine import FREE_SPACE_WARNING_BYTES, Facts, unwritable
from sgpu_magic.front.doctor._rows import Check, DoctorConfig, error, ok, warning
from sgpu_magic.launch.resources import check_port_free, free_port


def _ephemeral_range() -> str:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return f"{low}-{high}"
    except (OSError, ValueError):
        return "the system's ephemeral range"


def _listener(port: int) -> str:
    """`` by pid N (name)`` for the process listening on ``port``, where it can be seen; else ``""``."""
    import psutil

    try:
        pids = {
            c.pid
            for c in psutil.net_connections("tcp")
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid
        }
        return "".join(f" by pid {pid} ({psutil.Process(pid).name()})" for pid in sorted(pids)[:1])
    except psutil.Error:  # another user's process, or no right to list sockets
        return ""


def port_rows(config: DoctorConfig, facts: Facts) -> list[Check]:
    rows = [
        ok(
            "ports",
            f"each job's rendezvous listens on 127.0.0.1, on a free port from {_ephemeral_range()} "
            f"(e.g. {free_port()} now) unless port= / --port pins one",
        )
    ]
    port = config.port
    if port is None:
        return rows
    if not 1 <= port <= 65535:
        rows.append(
            error(
                f"port {port}",
                f"{port} is not a TCP port",
                "pin a port in 1-65535, or leave port out to take a free one",
            )
        )
        return rows
    try:
        check_port_free(port)
    except ResourceError:
        rows.append(
            error(
                f"port {port}",
                f"the pinned port {port} is in use{_listener(port)}: a job pinned to it is refused before launch",
                "leave port= / --port out (each job takes a free port), or pin a free one",
            )
        )
        return rows
    rows.append(ok(f"port {port}", f"the pinned port {port} is free now"))
    return rows


def home_rows(config: DoctorConfig, facts: Facts) -> list[Check]:
    import shutil

    from sgpu_magic.rundir import default_root

    root = default_root()
    if root.exists() and root.stat().st_uid != os.getuid():
        return [
            error(
                "home",
                f"sgpu_magic's home {root} is owned by uid {root.stat().st_uid}, not by you: jobs refuse to run there",
                "set SGPU_MAGIC_HOME to a private directory of yours",
            )
        ]
    why = unwritable(root)
    if why is not None:
        return [
            error(
                "home",
                f"sgpu_magic's home {root} cannot be used: {why}",
                "set SGPU_MAGIC_HOME to a directory you can write",
            )
        ]
    probe = root if root.exists() else next(p for p in root.parents if p.exists())
    free = shutil.disk_usage(probe).free
    details = f"{root} (run directories, logs, host logs): {free / 2**30:.1f} GiB free"
    if free < FREE_SPACE_WARNING_BYTES:
        return [warning("home", details, "free some disk space, or set SGPU_MAGIC_HOME to a larger disk")]
    return [ok("home", details)]


def host_rows(config: DoctorConfig, facts: Facts) -> list[Check]:
    from sgpu_magic.launch.client import running_host

    cold = os.environ.get("SGPU_MAGIC_START_METHOD", "forkserver") == "subprocess"
    how = (
        "every launch is cold (SGPU_MAGIC_START_METHOD=subprocess)"
        if cold
        else "ranks fork from a forkserver that has imported torch"
    )
    if not config.in_shell:
        return [
            ok(
                "launch host",
                f"none in this process: each kernel starts its own with %load_ext sgpu_magic "
                f"(%distributed_doctor there shows it); {how}",
            )
        ]
    host = running_host()
    if host is None:
        return [ok("launch host", "not started (it starts with %load_ext sgpu_magic and with the first job)")]
    if not host.alive():
        return [
            warning(
                "launch host",
                f"pid {host.pid} has exited (its log: {host.log_path})",
                "nothing to do: the next job starts a new one; the log says why this one ended",
            )
        ]
    state = (
        "cold by choice"
        if cold
        else "warm"
        if host.warm
        else "warming up (ranks start cold until its forkserver has imported torch)"
    )
    return [ok("launch host", f"pid {host.pid}, {state}: {how}; log {host.log_path}")]
