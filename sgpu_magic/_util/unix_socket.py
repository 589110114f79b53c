"""The run keeper's command channel: a Unix socket, 0600 in a 0700 folder, that only its own user may use.

Used by the keeper (:mod:`sgpu_magic.launch.host.keeper`) and its kernel-side client
(:mod:`sgpu_magic.launch.keeper`). The file modes keep other users out; the keeper also checks each caller's uid
(``SO_PEERCRED``, Linux), so a socket whose folder was opened up by mistake still serves no one else.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import sys
from pathlib import Path

MAX_SOCKET_PATH = 107
"""The longest path a Unix socket may be bound to on Linux (``sun_path`` holds 108 bytes, with its NUL)."""


def keeper_tag() -> str:
    """Eight hex digits naming this Python and this copy of sgpu_magic: each pair gets its own keeper (its ranks
    run this interpreter, with these packages)."""
    here = Path(__file__).resolve().parents[1]
    return hashlib.sha256(f"{sys.executable}\0{here}".encode()).hexdigest()[:8]


def bind_private(path: Path) -> socket.socket:
    """A listening Unix socket at ``path`` with mode 0600 (its folder must be private); an old file there is
    replaced (the caller holds the keeper's start lock: no live keeper owns it).

    Raises:
        OSError: the path is too long for a Unix socket (the message says how to shorten it), or binding failed.
    """
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise OSError(
            f"the run keeper's socket path {path} is longer than the {MAX_SOCKET_PATH} bytes a Unix socket may "
            f"have; set SGPU_MAGIC_HOME to a shorter private directory"
        )
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # made 0600, never briefly open to others
    try:
        listener.bind(os.fspath(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    listener.listen(64)
    return listener


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of the Unix socket ``sock`` (``None`` where the OS does not say)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    return int(uid)
