"""Imported first by the launch host's forkserver: it dies with the host, even mid-preload.

PR_SET_PDEATHSIG makes the kernel send SIGKILL to the forkserver when its parent, the
launch host, ends (however it ends), so no forkserver outlives its kernel.
"""

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1
_host = os.environ.get("SGPU_MAGIC_HOST_PID")
try:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
except (OSError, AttributeError):
    pass
if _host and os.getppid() != int(_host):
    os._exit(1)  # the host is already gone
