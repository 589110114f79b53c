"""Imported first by a forkserver the launch host restarts (a fresh interpreter; the first one is a fork of the
host, see :meth:`sgpu_magic.launch.host.warm_pool.WarmPool.start_forked`): it dies with the host, even mid-preload.

PR_SET_PDEATHSIG makes the kernel send SIGKILL to the forkserver when its parent, the
launch host, ends (however it ends), so no forkserver outlives its kernel.

The cyclic garbage collector is off while the forkserver preloads (``sgpu_magic.launch.host.warm_ready``
turns it on again): the ~300k objects torch and torch._dynamo create live as long as the
forkserver, and collecting them during the import was 16% of its CPU time.
"""

import gc
import os
import signal

gc.disable()

from sgpu_magic._util.proc import die_with_parent  # noqa: E402 - after gc.disable(), first of the preload

_host = os.environ.get("SGPU_MAGIC_HOST_PID")
die_with_parent(signal.SIGKILL, int(_host) if _host else None)  # exits at once when the host is already gone
