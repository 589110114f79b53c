"""The MLflow UI server's watchdog (python -m sgpu_magic.tracking.watchdog), run for real with a stand-in server."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil

from helpers import wait_for

SERVER = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_the_watchdog_stops_its_server_when_the_kernel_closes_the_pipe():
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "sgpu_magic.tracking.watchdog", str(os.getpid()), *SERVER],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        (server,) = wait_for(lambda: psutil.Process(watchdog.pid).children(), 60, "the watchdog to start its server")
        watchdog.stdin.close()  # what the kernel's end does
        watchdog.wait(timeout=30)
        assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    finally:
        if watchdog.poll() is None:
            os.killpg(watchdog.pid, 9)
            watchdog.wait()
