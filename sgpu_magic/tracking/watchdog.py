"""``python -m sgpu_magic.tracking.watchdog <kernel_pid> <server command ...>``: the MLflow UI server's parent.

Runs in a session of its own (:class:`sgpu_magic.tracking.server.MlflowUI` starts it so): starts the server,
and stops the server's process group when the kernel closes the pipe on this process's stdin or dies
(checked every ``CHECK_S``), so the server never outlives the kernel. Imports nothing but the standard
library (``sgpu_magic``'s ``__init__`` is lazy), so it starts in a few milliseconds.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

CHECK_S = 0.5
"""How often the kernel's pipe and pid are checked."""
STOP_WAIT_S = 2.0
"""How long the server gets to stop after SIGTERM (uvicorn stops in ~0.3 s; the CLI parent's own exit can take
seconds) before what is left of the group is killed."""


def _kill_group_leftovers() -> None:
    """SIGKILL every other process of this process group (the server's children that outlived SIGTERM)."""
    me, group = os.getpid(), os.getpgid(0)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            try:
                if os.getpgid(int(entry)) == group:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


def main(argv: list[str]) -> int:
    """Run the server ``argv[2:]`` while the kernel ``argv[1]`` lives; returns the server's exit code."""
    kernel_pid = int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = subprocess.Popen(argv[2:], stdin=subprocess.DEVNULL)
    try:
        while server.poll() is None:
            ready, _, _ = select.select([0], [], [], CHECK_S)
            if (ready and not os.read(0, 4096)) or os.getppid() != kernel_pid:
                break  # the kernel closed the pipe, or it is gone
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            os.killpg(0, signal.SIGTERM)  # the server and what it started share this session's group
        except OSError:
            pass
        deadline = time.monotonic() + STOP_WAIT_S
        while server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        _kill_group_leftovers()
    return server.returncode or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
