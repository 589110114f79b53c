"""Length-prefixed frames over a pipe or FIFO: the session channel between the kernel and its ranks.

A frame is an 8-byte big-endian length and that many bytes. Writes and reads loop until the whole frame has
passed, so a frame of any size (a 100 MB tensor) crosses a pipe whose buffer holds 64 KiB.
"""

from __future__ import annotations

import os
import struct

_HEADER = struct.Struct("!Q")
_CHUNK = 1 << 20


def write_frame(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` as one frame to the file descriptor ``fd`` (blocking until all of it is written).

    Raises:
        OSError: the reader is gone (``BrokenPipeError``) or the write failed.
    """
    view = memoryview(data)
    _write_all(fd, _HEADER.pack(view.nbytes))
    _write_all(fd, view)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.write(fd, view[:_CHUNK])
        view = view[written:]


def read_frame(fd: int) -> bytearray | None:
    """Read one frame from ``fd``; ``None`` at end of file before a frame starts (the writer is gone).

    Raises:
        EOFError: the writer went away in the middle of a frame.
    """
    header = _read_exactly(fd, _HEADER.size, allow_eof=True)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    body = _read_exactly(fd, size)
    assert body is not None  # allow_eof=False raises instead
    return body


def _read_exactly(fd: int, size: int, allow_eof: bool = False) -> bytearray | None:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = os.readv(fd, [view[got : got + _CHUNK]])
        if n == 0:
            if got == 0 and allow_eof:
                return None
            raise EOFError(f"the channel closed after {got} of {size} bytes of a frame")
        got += n
    return buf
