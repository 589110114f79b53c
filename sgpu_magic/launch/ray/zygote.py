"""A warm Ray rank agent's zygote: ``python -m sgpu_magic.launch.ray.zygote``, a child of the agent that has imported
torch (never CUDA) and forks one rank per request, so a job on warm agents skips the interpreter's start and ``import
torch`` on every node (the local launch host's forkserver does the same: :mod:`sgpu_magic.launch.host.warm_pool`).

Why not ``multiprocessing``'s forkserver: its children re-run the parent's ``__main__`` (for a Ray worker, Ray's
``default_worker.py``, which imports Ray) before their target, a second or more per rank.

The channel is the zygote's stdin and stdout, private pipes to its agent, in :mod:`sgpu_magic._util.frames` frames
of pickles: the agent sends ``(run_dir, env)``; the zygote answers ``("ready",)`` once it has preloaded, then
``("started", pid)`` per rank and ``("exited", pid, code)`` when the rank ends (``code`` as ``Popen.returncode``:
``-N`` for signal ``N``). It dies with its agent (``PR_SET_PDEATHSIG``) and when its stdin closes; each rank dies
with the zygote, as a local warm rank dies with its forkserver.
"""

from __future__ import annotations

import gc

gc.disable()  # ~300k long-lived objects from torch: no collection while importing them (frozen below)

import os  # noqa: E402
import pickle  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

from sgpu_magic._util.frames import read_frame, write_frame  # noqa: E402
from sgpu_magic._util.proc import die_with_parent  # noqa: E402

PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "sgpu_magic.rank.worker")
"""What a warm rank finds imported (the local launch host's preload, less elastic: no elastic here)."""


def _rank(run_dir: str, env: dict[str, str], keep: tuple[int, ...]) -> None:
    """In the forked child: drop the zygote's pipes, lead a session of its own (the agent stops the rank's
    whole session), run the rank as the launch host's warm ranks run (:func:`sgpu_magic.rank.worker.rank_entry`)
    and exit with its code."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1):
            os.dup2(devnull, fd)
        for fd in keep:
            os.close(fd)
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        gc.enable()
        from sgpu_magic.rank.worker import rank_entry

        rank_entry(run_dir, env)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a failure rank_entry did not record: its code says it
        code = 1
    finally:
        os._exit(code)


def serve() -> None:
    agent = int(os.environ.get("SGPU_MAGIC_HOST_PID", "0") or 0)
    die_with_parent(signal.SIGKILL, agent or None)
    commands, replies = os.dup(0), os.dup(1)
    os.dup2(2, 1)  # a stray print goes to the agent's log, never into a frame
    for name in PRELOAD:
        __import__(name)
    gc.freeze()
    gc.enable()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    write_frame(replies, pickle.dumps(("ready",)))
    while True:
        ready, _, _ = select.select([commands, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 512)
        if commands in ready:
            frame = read_frame(commands)
            if frame is None:
                return  # the agent is gone
            run_dir, env = pickle.loads(frame)
            pid = os.fork()
            if pid == 0:
                _rank(run_dir, env, (commands, replies, wake_r, wake_w))
            write_frame(replies, pickle.dumps(("started", pid)))
        _reap(replies)


def _reap(replies: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        write_frame(replies, pickle.dumps(("exited", pid, os.waitstatus_to_exitcode(status))))


if __name__ == "__main__":
    try:
        serve()
    except (BrokenPipeError, KeyboardInterrupt):
        pass
    sys.exit(0)
