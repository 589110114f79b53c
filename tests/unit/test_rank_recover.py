"""The socket part of a session's recover (:mod:`sgpu_magic.rank.recover`) and the words of its reports, on real
processes and sockets: only connections to the peers' processes are shut down."""

from __future__ import annotations

import socket
import subprocess
import sys

from sgpu_magic.launch.stacks import RankStack
from sgpu_magic.rank.recover import release_peer_connections
from sgpu_magic.session.core import Stuck
from sgpu_magic.session.outcome import _call_args, recovered_message

PEER = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("connected", flush=True)
data = s.recv(1)
print("eof" if data == b"" else "data", flush=True)
"""


def _connected_peer(listener: socket.socket) -> tuple[subprocess.Popen, socket.socket]:
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, str(listener.getsockname()[1])], stdout=subprocess.PIPE, text=True
    )
    conn, _ = listener.accept()
    assert peer.stdout is not None and peer.stdout.readline() == "connected\n"
    return peer, conn


def test_only_the_connections_to_peer_processes_are_shut_down():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer, to_peer = _connected_peer(listener)
        other, to_other = _connected_peer(listener)
        try:
            assert release_peer_connections([peer.pid]) == 1
            assert peer.communicate(timeout=30)[0] == "eof\n"  # its blocked recv returned: the connection closed
            assert to_peer.fileno() >= 0  # the descriptor is still this process's (gloo's), only shut down
            to_other.sendall(b"x")  # the connection to a process that is not a peer was left alone
            assert other.communicate(timeout=30)[0] == "data\n"
        finally:
            for p in (peer, other):
                p.kill()
                p.wait()
            to_peer.close()
            to_other.close()


def test_no_peer_or_a_gone_one_shuts_nothing():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert release_peer_connections([]) == 0
    assert release_peer_connections([gone.pid]) == 0


def test_the_arguments_of_the_aborted_collective_are_named():
    assert _call_args("dist.all_reduce(t, op=dist.ReduceOp.SUM)") == ["t"]
    assert _call_args("torch.distributed.all_gather(outs, grads[0])") == ["outs", "grads[0]"]
    assert _call_args("dist.broadcast(model.weight, src=0)") == ["model.weight"]
    assert _call_args("dist.barrier()") == []
    assert _call_args("y = f(t)") == []  # not a collective
    assert _call_args("dist.all_reduce(t,") == []  # a part of a statement that spans lines


def test_the_recover_report_names_where_each_rank_waited_and_what_may_differ():
    stack = RankStack(0, 1, "dist.all_reduce at Cell In[7] line 3", "", "dist.all_reduce(t)", True)
    stuck = Stuck(4, (0,), "session s1 cell 4", {0: stack})
    assert stuck.in_collectives
    assert recovered_message("s1", stuck, "gloo", 0.12) == (
        "session s1 recovered in 0.1 s (session s1 cell 4): rank 0 (in dist.all_reduce at Cell In[7] line 3) "
        "returned; the default process group (gloo) was made again on every rank; every rank's namespace is kept; "
        "values that were in the aborted collective may differ between ranks: t (rank 0); a DDP or FSDP model "
        "wrapped before holds the old group: wrap it again"
    )
    no_stack = Stuck(4, (0, 1), "session s1 cell 4", {0: stack})
    assert not no_stack.in_collectives  # rank 1's stack could not be taken: not known safe, no automatic recover
    assert recovered_message("s1", Stuck(2, (1,), "session s1 cell 2", {}), None, 1.0) == (
        "session s1 recovered in 1.0 s (session s1 cell 2): rank 1 returned; no rank had a process group; every "
        "rank's namespace is kept"
    )
