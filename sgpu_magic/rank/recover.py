"""A session rank's side of ``Session.recover()``: release a collective that waits for peers, and make the world's
process group again, without ending the rank (its namespace stays).

A rank blocked in a gloo collective waits inside C++ for its peers' bytes: neither ``KeyboardInterrupt`` nor any
Python code of its main thread runs until the call returns. Two things do return it:

- its peers' connections close (gloo raises ``RuntimeError: ... Connection closed by peer`` at once, and the
  rank's Python state is intact): :func:`release_peer_connections` shuts down, from the rank's control thread
  (:func:`start_control_thread`), every TCP connection of this process whose other end belongs to another rank of
  the session, which is what gloo's pairs are (the rendezvous store's connection goes to the launch host, and stays);
- NCCL: its communicators are aborted (``torch.distributed.distributed_c10d._abort_process_group``, as torch's own
  fault-tolerance path does).

Then the kernel asks every rank to :func:`ungroup` (destroy the broken default process group) and :func:`regroup`
(``init_process_group`` again, on the job's rendezvous store at ``MASTER_ADDR:MASTER_PORT`` under a new prefix,
so no key of the first rendezvous is read again).

The control channel is one more FIFO per rank in the session's private run directory (0600 in a 0700 folder,
checked before use), read by a daemon thread; what it carries is JSON, never a pickle.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from datetime import timedelta

from sgpu_magic._compat import torch as torch_compat
from sgpu_magic.errors import RecordError
from sgpu_magic.wire.session import ReleasePeers

RECOVER_STORE_PREFIX = "sgpu_magic/recover"
"""The rendezvous store's key prefix of a process group made again by :func:`regroup` (then ``/<generation>/``)."""

REGROUP_TIMEOUT_S = 60.0
"""Seconds :func:`regroup`'s store client waits for the rendezvous store and the other ranks' keys."""


def start_control_thread(fd: int) -> threading.Thread:
    """Serve the kernel's control commands on the FIFO ``fd`` (opened for reading) in a daemon thread: one JSON
    line per command (:class:`~sgpu_magic.wire.session.ReleasePeers`). Ends at end of file (the kernel is gone)."""
    thread = threading.Thread(target=_serve_control, args=(fd,), name="sgpu_magic session control", daemon=True)
    thread.start()
    return thread


def _serve_control(fd: int) -> None:
    pending = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                command = ReleasePeers.decode(line)
            except RecordError as exc:  # a newer kernel's line: said in the rank's log
                print(f"sgpu_magic: {exc}", file=sys.stderr, flush=True)
                continue
            _release(command)


def _release(command: ReleasePeers) -> None:
    try:
        abort_nccl()
        count = release_peer_connections(list(command.peers))
        print(f"sgpu_magic: recover: closed {count} connection(s) to the other ranks", file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - said in the rank's log; the kernel sees the rank not return
        print(f"sgpu_magic: recover: could not release ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)


def abort_nccl() -> None:
    """Abort every NCCL communicator of this process (a collective waiting in one returns with an error); nothing
    without torch.distributed, a process group or NCCL."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if "nccl" in str(dist.get_backend()):
        torch_compat.abort_process_groups(dist.distributed_c10d)


def release_peer_connections(peer_pids: list[int]) -> int:
    """Shut down (both directions) every TCP connection of this process to one of the processes ``peer_pids``;
    how many. A blocked gloo call on such a connection raises ``RuntimeError: ... Connection closed by peer``.

    Which socket is which comes from psutil (``/proc``): a connection of this process whose remote end is a local
    end of a peer's socket. The descriptor is checked again (its peer address) just before the shutdown."""
    import psutil

    peer_ends: set[tuple[str, int]] = set()
    for pid in peer_pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        peer_ends |= {(c.laddr.ip, c.laddr.port) for c in connections if c.laddr}
    count = 0
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.fd < 0 or not c.raddr or (c.raddr.ip, c.raddr.port) not in peer_ends:
            continue
        try:
            sock = socket.socket(fileno=c.fd)
        except OSError:  # closed meanwhile
            continue
        try:
            if tuple(sock.getpeername()[:2]) == (c.raddr.ip, c.raddr.port):
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the descriptor stays gloo's
    return count


def ungroup() -> str | None:
    """Destroy this rank's default process group (and every other group); its backend (``"gloo"``), or ``None``
    when there was none."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    backend = str(dist.get_backend())
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a group whose connections were closed may not end cleanly
        print(f"sgpu_magic: recover: destroy_process_group: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    return backend


def regroup(backend: str, generation: int) -> None:
    """``init_process_group(backend)`` again, with this rank's ``RANK`` and ``WORLD_SIZE``, on the rendezvous store
    at ``MASTER_ADDR:MASTER_PORT`` under the prefix ``sgpu_magic/recover/<generation>/``.

    Raises:
        RuntimeError: (torch's) the other ranks did not join within :data:`REGROUP_TIMEOUT_S`.
    """
    import torch.distributed as dist

    if dist.is_initialized():  # a cell made a group since (or ungroup could not end it): replace it
        ungroup()
    timeout = timedelta(seconds=REGROUP_TIMEOUT_S)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"{RECOVER_STORE_PREFIX}/{generation}/", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
