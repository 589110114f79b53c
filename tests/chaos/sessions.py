"""Fault injection in live sessions through a real Jupyter kernel: one fault per episode, invariants after each.

Run the long version (the session table in RELIABILITY.md) with::

    .venv/bin/python tests/chaos/suite.py --sessions --jobs 100 --seed 7

``tests/chaos/test_session_chaos.py`` runs every kind once in CI.

A kernel holds session ``chaos`` (2 ranks leasing 2 GPUs of a fake ``4 x H100`` inventory, gloo on the CPU, MLflow on, the
panel on) whose ranks keep a model and its optimizer (one step taken: momentum buffers exist). Each episode
injects one fault the way a user meets it, with the magics a user types (``%%distributed --session``,
``%distributed_push``, ``%distributed_pull``, ``%distributed_debug``, Interrupt), and then checks:

- the cell (or command) ended within ``BOUND_S`` seconds of the fault, with an error that names the right rank
  and cause;
- the session is where it must be: ``idle`` with the **same rank processes and every rank's state checksum
  unchanged** (a SHA-256 of the model's weights and the optimizer's buffers, taken before the fault) for faults a
  session survives; ``broken`` naming the dead rank for a rank's death (torch elastic ends the world with it: the
  other ranks are stopped, their state is gone by design);
- nothing of a broken session is left (every process whose environment carries its job id) and its GPU lease is
  released; its MLflow run has ended (FAILED, or KILLED after a kernel kill);
- every line the cell's ranks printed is in their log files (numbered lines before the fault; a flood's lines
  all there);
- the next cell in the same session (after ``%distributed_session restart`` where it broke, in a fresh kernel
  after a kernel kill) runs an ``all_reduce`` right.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import shutil
import signal
import time
from pathlib import Path

import psutil

from helpers import job_processes
from kernel_utils import CellOutput, collect, execute, start_kernel
from suite import BOUND_S, Outcome, Runner, mount_tmpfs, unmount

SESSION_FAULTS = [
    "raise",
    "exit",
    "sigkill_busy",
    "sigkill_idle",
    "hang_collective",
    "interrupt_push",
    "unpicklable_pull",
    "debugger_interrupt",
    "kernel_sigkill",
    "disk_full",
    "flood",
]

DEATH = r"session {s} is broken: rank {r} died \({how}\); the other ranks were stopped"
SESSION_EXPECT: dict[str, tuple[str | None, str | None]] = {
    # fault: (the session's state after it, regex the error must match; {r} = the faulting rank, {s} = session)
    "raise": ("idle", r"RankFailedError: .*rank {r} failed \(root cause\): RuntimeError: chaos fault in rank {r}"),
    "exit": ("broken", DEATH.replace("{how}", "exit code 3")),
    "sigkill_busy": ("broken", DEATH.replace("{how}", r"killed by signal SIGKILL \(9\)")),
    "sigkill_idle": ("broken", DEATH.replace("{how}", r"killed by signal SIGKILL \(9\)")),
    # the interrupt lands in the rank's all_reduce (recovered), or, rarely, just before it (plain interrupt)
    "hang_collective": (
        "idle",
        r"CellInterruptedError: session {s} cell \d+ was interrupted; (session {s} recovered in [\d.]+ s \(session "
        r"{s} cell \d+\): rank {r} \(in dist\.all_reduce at .*\) returned; the default process group \(gloo\) was "
        r"made again on every rank; every rank's namespace is kept|the ranks and their state are kept)",
    ),
    # the interrupt lands while the value is pickled (nothing sent), or while it is sent or loaded (held until every
    # rank has it), or after the push returned (nothing to interrupt)
    "interrupt_push": (
        "idle",
        r"^(KeyboardInterrupt: (the push of chaos_big was interrupted after it reached the ranks: it completed on "
        r"every rank)?)?$",
    ),
    "unpicklable_pull": ("idle", None),  # two pulls, each checked on its own
    "debugger_interrupt": ("idle", r"^$"),  # the interrupt leaves pdb (q), as IPython's %debug does
    "kernel_sigkill": (None, None),  # the kernel is gone: nothing to read from it
    "disk_full": ("idle", r"RankFailedError: .*rank {r} failed \(root cause\): OSError: \[Errno 28\] No space left"),
    "flood": ("idle", r"^$"),
}

RANK_SETUP = r"""
import hashlib, json, os, signal, threading, time
import torch, torch.distributed as dist
if not dist.is_initialized():
    dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(1000 + rank)
model = torch.nn.Linear(128, 128)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.ones(8, 128)).sum().backward()
opt.step()

def chaos_checksum():
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().numpy().tobytes())
    for state in opt.state_dict()["state"].values():
        h.update(state["momentum_buffer"].numpy().tobytes())
    return h.hexdigest()[:16]

def chaos_mark(mark_dir):
    with open(os.path.join(mark_dir, f"fault_{rank}"), "w") as f:
        f.write(json.dumps({"t": time.time(), "pid": os.getpid()}))

def chaos_lines(n):
    for i in range(n):
        print(f"line {rank} {i}", flush=True)
"""

KERNEL_SETUP = r"""
import json, os, time
from sgpu_magic.front.sessions import find_session

def chaos_report(name, cell=None):
    sess = find_session(name)
    job = sess.job
    print("CHAOS " + json.dumps({
        "state": sess.state.value, "broken": sess.broken, "job_id": job.job_id if job else None,
        "pids": {str(r): p for r, p in sess.pids.items()}, "ended": time.time(),
        "mlflow_run_id": job.mlflow_run_id if job else None,
        "cell_run_dir": str(cell.run_dir) if cell is not None else None,
    }), flush=True)

def chaos_checksums(name):
    sess = find_session(name)
    print("CHAOS_SUMS " + json.dumps(sess.run_cell("chaos_checksum()")), flush=True)

def chaos_wait_broken(name, within_s=60):
    sess = find_session(name)
    deadline = time.monotonic() + within_s
    while sess.broken is None and time.monotonic() < deadline:
        time.sleep(0.05)
    print("CHAOS_BROKEN " + json.dumps({"t": time.time(), "broken": sess.broken}), flush=True)

def chaos_kernel_mark(mark_dir):
    with open(os.path.join(mark_dir, "fault_kernel"), "w") as f:
        f.write(json.dumps({"t": time.time()}))
"""

NEXT_CELL = "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()"
"""The next cell after each fault: every rank's share in one all_reduce (2 ranks: 3.0)."""


def error_text(out: CellOutput) -> str:
    """What the user saw as the cell's error: the traceback's last line, or a magic's UsageError line."""
    if out.error is not None:
        return f"{out.error['ename']}: {out.error['evalue']}"
    found = re.findall(r"^UsageError: .*$", out.stderr, re.M)
    return found[-1] if found else ""


def _lines(marker: str, stdout: str) -> dict:
    found = [line[len(marker) + 1 :] for line in stdout.splitlines() if line.startswith(marker + " ")]
    return json.loads(found[-1]) if found else {}


class SessionRunner(Runner):
    """One kernel (a fresh one after a kernel kill) with session ``chaos``, a private sgpu_magic home, lease dir
    and MLflow store (as :class:`suite.Runner`'s); ``disk_full`` episodes use a second session whose home is a small
    tmpfs."""

    def __init__(self, workdir: Path, flood_bytes: int, flood_cells: int, tmpfs: Path | None) -> None:
        super().__init__(workdir, flood_bytes, tmpfs)
        self.flood_cells = flood_cells
        self.env["SGPU_MAGIC_FAKE_GPUS"] = "4 x H100"  # room for the disk-full episode's second session
        self.session_runs: list[str] = []
        """MLflow runs of every session started (each must have ended by the end of the suite)."""

    # -- kernel and session

    def start(self) -> None:
        self.km, self.kc = start_kernel(cwd=self.workdir, env=self.env)
        out = execute(self.kc, KERNEL_SETUP)
        assert out.error is None, out.error
        self.start_session("chaos")

    def start_session(self, name: str, action: str = "start") -> dict:
        """Start (or restart) session ``name`` and make its ranks' state; its report."""
        line = f"%distributed_session {action} {name}" + (" --gpus 2" if action == "start" else "")
        out = execute(self.kc, line, timeout_s=180)
        assert out.error is None and "UsageError" not in out.stderr, (out.error, out.stderr)
        out = self.cell(name, RANK_SETUP)
        assert out.error is None, out.error
        report = self.report(name)
        self.session_runs.append(report["mlflow_run_id"])
        return report

    def cell(self, name: str, code: str, timeout_s: float = 300) -> CellOutput:
        return execute(self.kc, f"%%distributed --session {name} -o chaos_cell\n{code}", timeout_s)

    def report(self, name: str = "chaos", cell: bool = False) -> dict:
        out = execute(self.kc, f"chaos_report({name!r}{', chaos_cell' if cell else ''})")
        assert out.error is None, out.error
        return _lines("CHAOS", out.stdout)

    def checksums(self, name: str = "chaos") -> list[str] | None:
        out = execute(self.kc, f"chaos_checksums({name!r})", timeout_s=120)
        return _lines("CHAOS_SUMS", out.stdout) or None

    # -- one episode

    def run(self, fault: str, rng: random.Random) -> Outcome:
        self.counter += 1
        marks = self.workdir / f"marks-{self.counter}"
        marks.mkdir()
        r = rng.randrange(2)
        outcome = Outcome(fault)
        name = "chaos_full" if fault == "disk_full" else "chaos"
        if fault == "disk_full":  # a second session whose run dirs (its cells' too) are on the small tmpfs
            execute(self.kc, f"os.environ['SGPU_MAGIC_HOME'] = {str(self.tmpfs)!r}")
            self.start_session(name)
        before = self.report(name)
        sums = self.checksums(name)
        want_state, error_re = SESSION_EXPECT[fault]
        errors: list[str] = []
        fault_at: float | None = None
        cell_dirs: list[tuple[str, int, int]] = []  # (cell run dir, numbered lines per rank, flood lines per rank)

        if fault in ("raise", "exit", "disk_full"):
            body = {
                "raise": f"if rank == {r}:\n    raise RuntimeError(f'chaos fault in rank {{rank}}')\n'ok'",
                "exit": f"if rank == {r}:\n    os._exit(3)\ndist.barrier()",
                "disk_full": (
                    f"if rank == {r}:\n    i = 0\n    while i < 400_000:  # 84 MB: the tmpfs holds 8\n"
                    f"        print(f'fill {{rank}} {{i:09d}} ' + 'x' * 200, flush=True)\n        i += 1\n'ok'"
                ),
            }[fault]
            out = self.cell(name, f"chaos_lines(5)\nchaos_mark({str(marks)!r})\n{body}")
            returned = time.time()
            errors.append(error_text(out))
        elif fault in ("sigkill_busy", "hang_collective", "kernel_sigkill"):
            body = (
                f"if rank == {r}:\n    dist.all_reduce(torch.ones(1))\n'ok'"
                if fault == "hang_collective"
                else "time.sleep(300)"
            )
            msg_id = self.kc.execute(
                f"%%distributed --session {name} -o chaos_cell\nchaos_lines(5)\nchaos_mark({str(marks)!r})\n{body}"
            )
            pids = self._wait_rank_marks(marks, 2)
            if fault == "sigkill_busy":
                os.kill(pids[r], signal.SIGKILL)
            elif fault == "hang_collective":
                self._wait_blocked(pids[r])
                fault_at = time.time()
                self.km.interrupt_kernel()
            else:
                host = self.host_pid()
                fault_at = time.time()
                os.kill(self.km.provisioner.process.pid, signal.SIGKILL)
            if fault != "kernel_sigkill":
                out = collect(self.kc, msg_id, timeout_s=120)
                returned = time.time()
                errors.append(error_text(out))
        elif fault == "sigkill_idle":
            fault_at = time.time()
            os.kill(before["pids"][str(r)], signal.SIGKILL)
            seen = _lines("CHAOS_BROKEN", execute(self.kc, f"chaos_wait_broken({name!r})").stdout)
            returned = seen.get("t", time.time())
            errors.append(error_text(self.cell(name, "1")))
        elif fault == "interrupt_push":
            execute(self.kc, "import torch\nchaos_big = torch.ones(25_000_000)  # 100 MB")
            msg_id = self.kc.execute(f"chaos_kernel_mark({str(marks)!r})\n%distributed_push chaos_big --session {name}")
            self._wait_rank_marks(marks, 1, pattern="fault_kernel")
            time.sleep(rng.uniform(0, 0.4))  # when in the push the interrupt lands: the fault's draw, not a wait
            fault_at, returned, error = self._interrupt(msg_id)
            errors.append(error)
        elif fault == "unpicklable_pull":
            out = self.cell(
                name,
                "chaos_lock = threading.Lock()\nclass ChaosBad:\n    def __reduce__(self):\n"
                "        raise RuntimeError('chaos: this object refuses to be pickled')\nchaos_bad = ChaosBad()",
            )
            assert out.error is None, out.error
            fault_at = time.time()
            for pulled, want in (
                (
                    "chaos_lock",
                    rf"UsageError: 'chaos_lock' on rank {r} is a _thread.lock, which cannot be pickled to be pulled "
                    r"into the kernel \(TypeError: cannot pickle '_thread.lock' object\); pull plain Python",
                ),
                (
                    "chaos_bad",
                    rf"UsageError: 'chaos_bad' on rank {r} is a __main__.ChaosBad, which cannot be pickled .*"
                    r"\(RuntimeError: chaos: this object refuses to be pickled\)",
                ),
            ):
                got = error_text(execute(self.kc, f"%distributed_pull {pulled} --rank {r}"))
                if not re.search(want, got, re.S):
                    outcome.problems.append(f"pull {pulled}: error {got!r} does not match {want!r}")
            returned = time.time()
        elif fault == "debugger_interrupt":
            out = self.cell(name, f"chaos_lines(5)\nif rank == {r}:\n    chaos_secret = 7\n    1 / 0\n'ok'")
            if "ZeroDivisionError" not in error_text(out):
                outcome.problems.append(f"the cell to debug did not fail as planned: {error_text(out)!r}")
            msg_id = self.kc.execute("%distributed_debug", allow_stdin=True)
            self._wait_input_request(120)
            fault_at, returned, error = self._interrupt(msg_id)
            errors.append(error)
        elif fault == "flood":
            per_line = 100
            lines = max(1, self.flood_bytes // per_line)
            code = (
                "import sys\nfor _i in range(0, {n}, 10000):\n"
                "    sys.stdout.write(''.join(f'flood {{rank}} {{j:09d}} {pad}\\n' for j in range(_i, min(_i + 10000, {n}))))\n"
                "sys.stdout.flush()"
            ).format(n=lines, pad="x" * (per_line - 24))
            took = []
            for _ in range(self.flood_cells):  # the bound is per cell: the time from its start to its end
                fault_at = time.time()
                out = self.cell(name, code)
                took.append(time.time() - fault_at)
                errors.append(error_text(out))
                cell_dirs.append((self.report(name, cell=True)["cell_run_dir"], 0, lines))
            returned = fault_at + max(took)
            outcome.notes.append(f"cells {min(took):.2f}-{max(took):.2f} s")
        else:
            raise AssertionError(fault)

        if fault_at is None:
            fault_at = self._fault_time(marks)
        if fault_at is None:
            outcome.problems.append("the fault was never injected (no mark file)")
            return self._close(outcome)

        # the kernel is gone: every process of the session goes, then its host; its lease and MLflow run end
        if fault == "kernel_sigkill":
            gone_at = self._wait(lambda: not job_processes(before["job_id"]), 60)
            outcome.to_final_s = (gone_at or time.time()) - fault_at
            if gone_at is None:
                outcome.problems.append("ranks still run 60 s after the kernel was killed")
            if host is not None and self._wait(lambda: not psutil.pid_exists(host), BOUND_S) is None:
                outcome.problems.append(f"the launch host still runs {BOUND_S:g} s after the kernel was killed")
            self._check_gone(outcome, before["job_id"], "session")
            self._check_mlflow(outcome, before["mlflow_run_id"], "KILLED")
            self.stop()
            self.start()
            self._check_next(outcome, "chaos")
            return self._close(outcome)

        outcome.to_final_s = returned - fault_at
        if outcome.to_final_s > BOUND_S:
            outcome.problems.append(f"the cell ended {outcome.to_final_s:.1f} s after the fault (bound {BOUND_S:g} s)")
        if error_re is not None:
            want = error_re.format(r=r, s=name)
            for got in errors:
                if not re.search(want, got, re.S):
                    outcome.problems.append(f"error {got!r} does not match {want!r}")
        if fault == "hang_collective" and errors and "recovered in" in errors[0]:
            outcome.notes.append("recovered")
        after = self.report(
            name, cell=fault in ("raise", "exit", "sigkill_busy", "hang_collective", "disk_full", "debugger_interrupt")
        )
        if after["state"] != want_state:
            outcome.problems.append(f"session state {after['state']!r}, expected {want_state!r} ({after['broken']})")
        if after.get("cell_run_dir"):
            cell_dirs.append((after["cell_run_dir"], 5, 0))
        if fault == "disk_full":  # the flood's log fills the disk: free it, as a user would, then go on
            for path in Path(after["cell_run_dir"] or "/nonexistent").glob("logs/rank_*.log"):
                path.unlink()
            cell_dirs.clear()
        lost = self._lines_lost(cell_dirs)
        if lost:
            outcome.lines_lost, why = lost
            outcome.problems.append(why)

        if want_state == "broken":
            self._check_gone(outcome, before["job_id"], "session")
            self._check_mlflow(outcome, before["mlflow_run_id"], "FAILED")
            self.start_session(name, "restart")
        else:
            if after["pids"] != before["pids"]:
                outcome.problems.append(f"the ranks changed: {before['pids']} -> {after['pids']}")
            if fault == "interrupt_push":  # pushed to every rank or to none
                out = execute(
                    self.kc,
                    f"print('CHAOS_HAVE ' + json.dumps(find_session({name!r}).run_cell(\"'chaos_big' in globals()\")))",
                )
                have = _lines("CHAOS_HAVE", out.stdout)
                if not isinstance(have, list) or len(set(have)) != 1:
                    outcome.problems.append(f"the push reached some ranks only: {have or out.stdout[-300:]}")
                if have and not have[0] and "completed on every rank" in errors[0]:
                    outcome.problems.append("the push said it completed, but no rank has the value")
                outcome.notes.append("pushed" if have and have[0] else "not pushed")
                execute(self.kc, f"%%distributed --session {name}\nchaos_big = None")
            after_sums = self.checksums(name)
            if after_sums != sums:
                outcome.state_lost = True
                outcome.problems.append(f"rank state checksums changed: {sums} -> {after_sums}")
        self._check_next(outcome, name)
        if fault == "disk_full":
            execute(self.kc, f"%distributed_session stop {name}\nos.environ['SGPU_MAGIC_HOME'] = {str(self.home)!r}")
            self._check_gone(outcome, before["job_id"], "session")
            self._check_mlflow(outcome, before["mlflow_run_id"], "FINISHED")
            shutil.rmtree(self.tmpfs / "runs", ignore_errors=True)
        return self._close(outcome)

    def finish(self, outcomes: list[Outcome]) -> None:
        """Stop the sessions: every session's MLflow run must have ended (FINISHED for the live one)."""
        if self.km is None:
            return
        report = self.report("chaos")
        out = execute(self.kc, "%distributed_session stop --all")
        if out.error is not None:
            outcomes.append(Outcome("stop", ok=False, problems=[f"stop failed: {error_text(out)}"]))
            return
        end = Outcome("stop")
        self._check_gone(end, report["job_id"], "session")
        self._check_mlflow(end, report["mlflow_run_id"], "FINISHED")
        from mlflow import MlflowClient

        client = MlflowClient(self.env["MLFLOW_TRACKING_URI"])
        running = [r for r in self.session_runs if r and client.get_run(r).info.status == "RUNNING"]
        if running:
            end.problems.append(f"{len(running)} session MLflow run(s) still RUNNING: {running}")
        if end.problems:
            end.ok = False
            outcomes.append(end)

    # -- checks

    def _check_next(self, outcome: Outcome, name: str) -> None:
        out = self.cell(name, NEXT_CELL, timeout_s=120)
        if out.error is not None or out.results[-1:] != ["3.0"]:
            outcome.problems.append(f"the next cell did not all_reduce right: {error_text(out) or out.results}")

    def _check_mlflow(self, outcome: Outcome, run_id: str | None, want: str) -> None:
        problem = self._mlflow_problem(run_id, "", want) if run_id else "the session has no MLflow run"
        if problem:
            outcome.problems.append(problem)

    @staticmethod
    def _lines_lost(cells: list[tuple[str, int, int]]) -> tuple[int, str] | None:
        lost, why = 0, []
        for run_dir, numbered, flood in cells:
            for rank in (0, 1):
                try:
                    text = (Path(run_dir) / "logs" / f"rank_{rank}.log").read_text(errors="replace")
                except OSError as exc:
                    lost += numbered + flood
                    why.append(f"rank {rank}: no log ({exc})")
                    continue
                if numbered:
                    got = [int(m) for m in re.findall(rf"^line {rank} (\d+)$", text, re.M)]
                    if got != list(range(numbered)):
                        lost += numbered - len(set(got))
                        why.append(f"rank {rank}: lines {got} of 0..{numbered - 1} in {run_dir}")
                if flood:
                    got = re.findall(rf"^flood {rank} (\d{{9}}) ", text, re.M)
                    if len(got) != flood or int(got[-1]) != flood - 1:
                        lost += flood - len(set(got))
                        why.append(f"rank {rank}: {flood - len(set(got))} of {flood} flood lines missing in {run_dir}")
        return (lost, "; ".join(why)) if why else None

    @staticmethod
    def _wait_rank_marks(marks: Path, want: int, pattern: str = "fault_*", within_s: float = 120) -> dict[int, int]:
        deadline = time.monotonic() + within_s
        while len(list(marks.glob(pattern))) < want:
            if time.monotonic() > deadline:
                raise AssertionError(f"no fault mark in {marks} after {within_s} s")
            time.sleep(0.02)
        pids = {}
        for path in marks.glob("fault_[0-9]*"):
            for _ in range(50):  # written by another process: read it once it is whole
                try:
                    pids[int(path.name.rsplit("_", 1)[1])] = json.loads(path.read_text())["pid"]
                    break
                except ValueError:
                    time.sleep(0.01)
        return pids

    @staticmethod
    def _wait_blocked(pid: int, within_s: float = 10) -> None:
        """Until rank ``pid``'s main thread sleeps in the kernel (it marked, then entered the collective)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_SLEEPING:
                    return
            except psutil.Error:
                return
            time.sleep(0.01)

    def _interrupt(self, msg_id: str) -> tuple[float, float, str]:
        """The notebook's Interrupt now, during execute request ``msg_id``: when it was sent, when the cell ended,
        and the cell's error (``""``: none)."""
        sent = time.time()
        self.km.interrupt_kernel()
        out = collect(self.kc, msg_id, timeout_s=120)
        return sent, time.time(), error_text(out)

    def _wait_input_request(self, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_stdin_msg(timeout=0.1)
            except queue.Empty:
                continue
            if msg["msg_type"] == "input_request":
                return
        raise AssertionError(f"the debugger asked for no input within {within_s} s")


def run_session_suite(
    episodes: int | None,
    seed: int,
    flood_bytes: int,
    flood_cells: int,
    workdir: Path,
    faults: list[str] | None = None,
    log=print,
) -> list[Outcome]:
    """Run ``episodes`` session faults drawn at random (``None``: each of ``faults`` once, in order)."""
    rng = random.Random(seed)
    tmpfs = mount_tmpfs("8m")
    kinds = [f for f in (faults or SESSION_FAULTS) if tmpfs is not None or f != "disk_full"]
    plan = kinds if episodes is None else [rng.choice(kinds) for _ in range(episodes)]
    runner = SessionRunner(workdir, flood_bytes, flood_cells, tmpfs)
    outcomes: list[Outcome] = []
    try:
        runner.start()
        for i, fault in enumerate(plan):
            t0 = time.monotonic()
            try:
                outcome = runner.run(fault, rng)
            except Exception as exc:  # noqa: BLE001 - an episode the runner could not drive is a failed one
                outcome = Outcome(fault, ok=False, problems=[f"the runner failed: {type(exc).__name__}: {exc}"])
            outcomes.append(outcome)
            log(
                f"[{i + 1}/{len(plan)}] {fault}: {'ok' if outcome.ok else 'FAILED ' + '; '.join(outcome.problems)} "
                f"({outcome.to_final_s if outcome.to_final_s is None else round(outcome.to_final_s, 2)} s to final, "
                f"{time.monotonic() - t0:.1f} s in all{''.join('; ' + n for n in outcome.notes)})"
            )
            if not outcome.ok and runner.km is not None and fault != "kernel_sigkill":
                _reset(runner)
        runner.finish(outcomes)
    finally:
        runner.stop()
        unmount(tmpfs)
    return outcomes


def _reset(runner: SessionRunner) -> None:
    """After a failed episode: a fresh kernel and session, so one failure does not fail every later episode."""
    runner.stop()
    runner.start()


def session_table(outcomes: list[Outcome]) -> str:
    """One row per session fault kind: episodes, survived, worst time to the cell's end, lines lost, processes
    leaked, episodes whose surviving ranks' state changed."""
    rows: dict[str, list[Outcome]] = {}
    for o in outcomes:
        rows.setdefault(o.fault, []).append(o)
    lines = [
        "| fault | episodes | survived | worst s to final | lines lost | processes leaked | state changed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for fault in [*SESSION_FAULTS, "stop"]:
        got = rows.get(fault)
        if not got:
            continue
        worst = max((o.to_final_s for o in got if o.to_final_s is not None), default=None)
        kept = "-" if SESSION_EXPECT.get(fault, ("broken",))[0] != "idle" else sum(o.state_lost for o in got)
        lines.append(
            f"| {fault} | {len(got)} | {sum(o.ok for o in got)} | {'-' if worst is None else f'{worst:.1f}'} | "
            f"{sum(o.lines_lost for o in got)} | {sum(o.leaked for o in got)} | {kept} |"
        )
    return "\n".join(lines)
