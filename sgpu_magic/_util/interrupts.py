"""Hold the kernel's interrupt (SIGINT) while a message to the ranks is being written, so a frame is never cut.

IPython turns SIGINT into ``KeyboardInterrupt`` wherever the main thread is. A push of a 100 MB value is a
frame written in pieces to each rank's FIFO; an interrupt between two pieces left the rank reading the rest of a
frame that never came and the session busy for good. :func:`held_interrupt` records the first interrupt
instead (the caller finishes the exchange, then raises), and lets a second one through at once: the way out
when the other side does not read.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def held_interrupt() -> Iterator[Callable[[], bool]]:
    """Within the block, the first SIGINT is recorded, a second raises ``KeyboardInterrupt``; yields a function
    that says whether one came. Outside the main thread (where no signal handler can be set) interrupts pass as
    they would, and it always says no."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    seen: list[int] = []

    def hold(signum: int, frame: object) -> None:
        seen.append(signum)
        if len(seen) > 1:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield lambda: bool(seen)
    finally:
        signal.signal(signal.SIGINT, previous)
