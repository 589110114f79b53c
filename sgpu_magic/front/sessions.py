"""The live sessions of this kernel: :func:`sessions`, :func:`current_session` (what ``%%distributed --session``
uses) and :func:`find_session` (``--session NAME``)."""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING

from sgpu_magic.errors import SessionError
from sgpu_magic.session.core import SessionState

if TYPE_CHECKING:
    from sgpu_magic.front.session import Session

_SESSIONS: list[Session] = []
_SESSIONS_LOCK = threading.Lock()
_NUMBERS = itertools.count(1)


def register(session: Session) -> None:
    """Add a session that was just made."""
    with _SESSIONS_LOCK:
        _SESSIONS.append(session)


def next_name() -> str:
    """The next free default name: ``s1``, ``s2``, ..."""
    taken = {s.name for s in sessions()}
    return next(f"s{n}" for n in _NUMBERS if f"s{n}" not in taken)


def sessions() -> list[Session]:
    """Every session started in this kernel, oldest first (stopped ones too)."""
    with _SESSIONS_LOCK:
        return list(_SESSIONS)


def current_session() -> Session | None:
    """The latest session of this kernel that is not stopped (the one ``%%distributed --session`` uses), or
    ``None``."""
    live = [s for s in sessions() if s.state is not SessionState.STOPPED]
    return live[-1] if live else None


def find_session(name: str | None) -> Session:
    """The session named ``name``, or the current one (``name`` ``None`` or ``""``).

    Raises:
        SessionError: there is no session, or none of that name; the message lists the kernel's sessions.
    """
    if not name:
        session = current_session()
        if session is None:
            raise SessionError(
                "no live session in this kernel; start one with %distributed_session start --gpus N "
                "(or sess = Session(gpus=N))"
            )
        return session
    for session in reversed(sessions()):
        if session.name == name:
            return session
    known = ", ".join(f"{s.name} ({s.state.value})" for s in sessions()) or "none yet"
    raise SessionError(f"no session named {name!r} in this kernel (sessions: {known})")
