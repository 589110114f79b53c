"""Imported first by the launch host's forkserver: it dies with the host, even mid-preload.

PR_SET_PDEATHSIG makes the kernel send SIGKILL to the forkserver when its parent, the
launch host, ends (however it ends), so no forkserver outlives its kernel.

The cyclic garbage collector is off while the forkserver preloads (``sgpu_magic.launch.host.warm_ready``
turns it on again): the ~300k objects torch and torch._dynamo create live as long as the
forkserver, and collecting them during the import was 16% of its CPU time.
"""

import ctypes
import gc
import os
import signal

gc.disable()

_PR_SET_PDEATHSIG = 1
_host = os.environ.get("SGPU_MAGIC_HOST_PID")
try:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
except (OSError, AttributeError):
    pass
if _host and os.getppid() != int(_host):
    os._exit(1)  # the host is already gone
