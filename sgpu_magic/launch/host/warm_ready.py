"""Imported last by a forkserver the launch host restarts (a fresh interpreter): marks its preloading as finished.

The host sets ``SGPU_MAGIC_WARM_MARKER`` to a file path before starting the forkserver;
once that file exists, warm launches are faster than cold ones, so the host uses them.
"""

import os

from sgpu_magic._util.fs import touch_private

_marker = os.environ.get("SGPU_MAGIC_WARM_MARKER")
if _marker:
    touch_private(_marker)  # private, like everything in the host folder

# Everything preloaded so far lives as long as the forkserver: move it out of the collector's
# sight, so a rank's gc.collect() (its teardown runs one) does not walk ~300k inherited objects.
import gc  # noqa: E402

gc.freeze()
gc.enable()  # off while preloading (sgpu_magic.launch.host.forkserver_guard); ranks collect their own objects
