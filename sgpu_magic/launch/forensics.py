"""Why a rank died by a signal: whether the kernel's OOM killer ended it.

Two witnesses, read by the launch host when it sees a rank killed by ``SIGKILL``:

- the kernel log (``/dev/kmsg``, what ``dmesg`` prints): a ``Killed process <pid>`` line names the rank's process.
  Reading it needs ``CAP_SYSLOG`` where ``kernel.dmesg_restrict`` is 1 (most distributions, most containers);
- the ``oom_kill`` count of the rank's memory cgroup: cgroup v2 ``memory.events``, cgroup v1 ``memory.oom_control``
  (``/proc/<pid>/cgroup`` names the cgroup). The host reads it for the cgroup the ranks start in before they start,
  and for each cgroup it sees a rank in while it samples them (about once a second); a count that went up while the
  rank ran says the OOM killer fired in its cgroup (it may have chosen another process of that cgroup).

Neither may be readable: the error then says that the OOM killer is the usual cause of a SIGKILL and how to check.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")
KMSG = "/dev/kmsg"


def memory_cgroup_file(pid: int | str, root: Path = CGROUP_ROOT) -> Path | None:
    """The file that counts OOM kills in the memory cgroup of process ``pid`` (``"self"`` for this one): cgroup v2
    ``<root>/<path>/memory.events``, or cgroup v1 ``<root>/memory/<path>/memory.oom_control``; ``None`` when there is
    none to read (the process has ended, or no memory controller is mounted where expected)."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    return _counter_file(text, root)


@functools.lru_cache(maxsize=64)
def _counter_file(text: str, root: Path) -> Path | None:
    """:func:`memory_cgroup_file` for the ``/proc/<pid>/cgroup`` text ``text`` (the same text names the same file)."""
    lines = text.splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            candidate = root / "memory" / path.lstrip("/") / "memory.oom_control"
            if candidate.exists():
                return candidate
    for line in lines:
        if line.startswith("0::"):
            candidate = root / line[3:].lstrip("/") / "memory.events"
            if candidate.exists():
                return candidate
    return None


def oom_kills(path: Path) -> int | None:
    """The ``oom_kill`` count in ``path`` (``memory.events`` or ``memory.oom_control``); ``None`` when unreadable."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def kernel_log_kill(pid: int) -> str | None:
    """The kernel log's ``Killed process <pid> ...`` line (the OOM killer's), ``""`` when the log has none, ``None``
    when the log cannot be read (``/dev/kmsg`` needs CAP_SYSLOG where ``kernel.dmesg_restrict`` is 1)."""
    try:
        fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    found = ""
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # a record was overwritten while read: go on with the next
                    continue
                return found or None
            if not record:
                break
            message = record.decode(errors="replace").split(";", 1)[-1].split("\n", 1)[0]
            if f"Killed process {pid} " in message:
                found = message.strip()
    finally:
        os.close(fd)
    return found


class OomWatch:
    """The OOM-kill counts of the memory cgroups the ranks of one job run in, to say afterwards whether the OOM
    killer ended a rank. :meth:`watch` before the ranks start, :meth:`sample` while they run, :meth:`verdict` after."""

    def __init__(self) -> None:
        self.baseline: dict[Path, int] = {}
        self.cgroups: dict[int, set[Path]] = {}

    def _note(self, rank: int, path: Path | None) -> None:
        if path is None:
            return
        if path not in self.baseline:
            count = oom_kills(path)
            if count is None:
                return
            self.baseline[path] = count
        self.cgroups.setdefault(rank, set()).add(path)

    def watch(self, ranks: Iterable[int]) -> None:
        """Before ``ranks`` start: the counts of this process's cgroup, where they start."""
        here = memory_cgroup_file("self")
        for rank in ranks:
            self._note(rank, here)

    def sample(self, pids: dict[int, int]) -> None:
        """Note the cgroup each running rank is in now (a rank may move itself)."""
        for rank, pid in pids.items():
            self._note(rank, memory_cgroup_file(pid))

    def verdict(self, rank: int, pid: int | None, exitcode: int | None) -> dict[str, Any]:
        """For a rank killed by SIGKILL: ``{"oom_killed": True | None, "oom": "<what shows it, or how to check>"}``
        (for :class:`~sgpu_magic.errors.RankFailure`); ``{}`` for any other end."""
        if exitcode != -signal.SIGKILL:
            return {}
        logged = kernel_log_kill(pid) if pid else None
        if logged:
            return {"oom_killed": True, "oom": f"the kernel's OOM killer ended it (kernel log: {logged!r})"}
        for path in sorted(self.cgroups.get(rank, ())):
            now, before = oom_kills(path), self.baseline[path]
            if now is not None and now > before:
                return {
                    "oom_killed": True,
                    "oom": f"the kernel's OOM killer fired in its memory cgroup while it ran (oom_kill in {path} "
                    f"went from {before} to {now})",
                }
        looked = [] if logged is None else ["the kernel log has no OOM kill of it"]
        looked += ["its memory cgroup's oom_kill count did not change"] if self.cgroups.get(rank) else []
        return {"oom_killed": None, "oom": _hint(looked)}


def _hint(looked: list[str]) -> str:
    seen = f" ({'; '.join(looked)})" if looked else ""
    return (
        f"nothing here shows the OOM killer{seen}, but it is the usual cause of a SIGKILL: look for "
        f"'Killed process' in `dmesg` or `journalctl -k`, and compare the rank's peak RSS with the memory limit "
        f"(`cat /sys/fs/cgroup/memory.max`, or memory.limit_in_bytes under cgroup v1)"
    )
