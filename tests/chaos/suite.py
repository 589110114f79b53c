"""Fault injection through a real Jupyter kernel: many jobs, one fault each, invariants after each.

Run the long version (the table in RELIABILITY.md) with::

    .venv/bin/python tests/chaos/suite.py --jobs 150 --seed 7

and the faults in live sessions (tests/chaos/sessions.py) with ``--sessions --jobs 100``.

``tests/chaos/test_chaos.py`` runs the short version in CI: every fault kind once.

Each job is ``chaos_job(...)`` in the kernel: 2 ranks (leasing 2 GPUs of a fake ``2 x H100``
inventory, so leases are exercised; the ranks run on CPU with gloo) that print numbered lines
``line <rank> <step>`` and all_reduce each step; at ``fault_step`` the chosen rank (or every rank,
for faults that act from outside) writes ``fault_<rank>`` with the time and injects the fault. After
each job the runner checks:

- the job reached a final state within ``BOUND_S`` seconds of the fault (``timeout_s`` + that for
  hangs), and that state and its error name the right rank and cause;
- no process started for the job survives (every process whose environment carries the job's
  ``SGPU_MAGIC_JOB_ID``: ranks, their children, double-forked daemons) and no GPU lease is held;
  the launch host is gone only when the fault killed it or the kernel;
- every line the ranks wrote is in their log files with no gap (lines ``0..n`` per rank, and the
  faulting rank's lines up to ``fault_step``); a flooding rank's lines are all there;
- the job's MLflow run has the matching status and an end time;
- the next job in the same kernel (a fresh one after a kernel kill) succeeds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import job_processes
from kernel_utils import collect, execute, start_kernel, stop_kernel

BOUND_S = 15.0
"""Seconds from a fault to the job's final state (after the timeout, for faults that end by timeout)."""

TIMEOUT_S = 6.0
"""The job timeout for faults that only a timeout ends (a hung collective, a rank that never joins)."""

STEPS = 40
FAULTS = [
    "raise",
    "exit",
    "sigkill",
    "sigsegv",
    "hang_collective",
    "no_rendezvous",
    "children",
    "timeout",
    "cancel_api",
    "cancel_stop",
    "kernel_interrupt",
    "kernel_sigkill",
    "launcher_killed",
    "disk_full",
    "flood",
]

EXPECT = {
    # fault: (final state, MLflow status, regex the kernel's error must match; {r} = the faulting rank)
    "raise": ("failed", "FAILED", r"rank {r} failed \(root cause\): RuntimeError: chaos fault in rank {r} at step"),
    "exit": ("failed", "FAILED", r"rank {r} failed \(root cause\).*exit code 3"),
    "sigkill": ("failed", "FAILED", r"rank {r} failed \(root cause\).*SIGKILL"),
    "sigsegv": ("failed", "FAILED", r"rank {r} failed \(root cause\).*SIGSEGV"),
    "hang_collective": ("timed_out", "KILLED", r"ran longer than its timeout of 6 s; every rank was stopped"),
    "no_rendezvous": ("timed_out", "KILLED", r"ran longer than its timeout of 6 s; every rank was stopped"),
    "children": ("succeeded", "FINISHED", None),
    "timeout": ("timed_out", "KILLED", r"ran longer than its timeout of 6 s; every rank was stopped"),
    "cancel_api": ("cancelled", "KILLED", r"cancel"),
    "cancel_stop": ("cancelled", "KILLED", r"cancel"),
    "kernel_interrupt": ("cancelled", "KILLED", r"JobCancelledError"),
    "kernel_sigkill": (None, "KILLED", None),  # the kernel is gone: no state to read from it
    "launcher_killed": ("failed", "FAILED", r"launch host"),
    "disk_full": ("failed", "FAILED", r"rank {r} failed \(root cause\).*No space left on device"),
    "flood": ("succeeded", "FINISHED", None),
}

SETUP = r"""
import json, os, time
from sgpu_magic import distributed

def _chaos_rank(fault, fault_rank, fault_step, steps, mark_dir, flood_bytes):
    import ctypes, os, signal, subprocess, sys, time
    import torch, torch.distributed as dist

    rank = int(os.environ["RANK"])
    mine = rank == fault_rank
    def mark():
        with open(os.path.join(mark_dir, f"fault_{rank}"), "w") as f:
            f.write(json.dumps({"t": time.time(), "job_id": os.environ["SGPU_MAGIC_JOB_ID"]}))
    if fault == "no_rendezvous" and mine:
        mark()
        time.sleep(3600)
    dist.init_process_group("gloo")
    everyone = fault in ("timeout", "cancel_api", "cancel_stop", "kernel_interrupt", "kernel_sigkill", "launcher_killed")
    for step in range(steps):
        print(f"line {rank} {step}", flush=True)
        if fault != "none" and step == fault_step and (mine or everyone):
            mark()
            if fault == "raise":
                raise RuntimeError(f"chaos fault in rank {rank} at step {step}")
            if fault == "exit":
                os._exit(3)
            if fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "sigsegv":
                ctypes.string_at(0)
            if fault in ("hang_collective", "timeout") or everyone:
                time.sleep(3600)
            if fault == "children":  # left running: a child, one in its own session, a double-forked daemon
                subprocess.Popen(["sleep", "600"])
                subprocess.Popen(["sleep", "600"], start_new_session=True)
                if os.fork() == 0:
                    if os.fork() == 0:
                        os.setsid()
                        time.sleep(600)
                    os._exit(0)
            if fault == "flood":
                line = 0
                written = 0
                while written < flood_bytes:
                    block = "".join(f"flood {rank} {i:09d} {'x' * 80}\n" for i in range(line, line + 10000))
                    sys.stdout.write(block)
                    line += 10000
                    written += len(block)
                sys.stdout.flush()
                with open(os.path.join(mark_dir, f"flood_{rank}"), "w") as f:
                    f.write(str(line))
            if fault == "disk_full":
                i = 0
                while True:
                    print(f"fill {rank} {i:09d} {'x' * 200}", flush=True)
                    i += 1
        t = torch.ones(1)
        dist.all_reduce(t)
    dist.barrier()
    return rank

def chaos_job(fault, fault_rank, fault_step, steps, mark_dir, flood_bytes=0, timeout=120, background=False):
    fn = distributed(gpus=2, timeout=timeout)(_chaos_rank)
    if background:
        return fn.submit(fault, fault_rank, fault_step, steps, mark_dir, flood_bytes)
    try:
        value, error = fn.distributed(fault, fault_rank, fault_step, steps, mark_dir, flood_bytes), None
    except BaseException as exc:
        value, error = None, f"{type(exc).__name__}: {exc}"
    report(fn.last_job, value, error)

def report(job, value=None, error=None):
    if error is None and job.state.value not in ("succeeded", "pending", "starting", "running"):
        exc = job.exception()
        error = None if exc is None else f"{type(exc).__name__}: {exc}"
    print("CHAOS " + json.dumps({"job_id": job.job_id, "run_dir": str(job.run_dir), "state": job.state.value,
                                 "value": value, "error": error, "ended": time.time(),
                                 "mlflow_run_id": job.mlflow_run_id}), flush=True)
"""


FINAL = ("succeeded", "failed", "cancelled", "timed_out")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@dataclass
class Outcome:
    fault: str
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    to_final_s: float | None = None
    lines_lost: int = 0
    leaked: int = 0
    notes: list[str] = field(default_factory=list)
    state_lost: bool = False
    """A live session's surviving ranks' state changed (sessions only)."""


class Runner:
    """One kernel (a fresh one after a kernel kill) and a private sgpu_magic home, lease dir and MLflow store."""

    def __init__(self, workdir: Path, flood_bytes: int, tmpfs: Path | None) -> None:
        self.workdir, self.flood_bytes, self.tmpfs = workdir, flood_bytes, tmpfs
        self.home = workdir / "home"
        self.home.mkdir(mode=0o700, exist_ok=True)
        self.env = {
            "SGPU_MAGIC_HOME": str(self.home),
            "SGPU_MAGIC_LEASE_DIR": str(workdir / "leases"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{workdir}/mlflow.db",
            "SGPU_MAGIC_FAKE_GPUS": "2 x H100",
            "SGPU_MAGIC_WIDGETS": "1",
            "MLFLOW_EXPERIMENT_NAME": "chaos",
        }
        self.km = self.kc = None
        self.counter = 0

    # -- kernel

    def start(self) -> None:
        self.km, self.kc = start_kernel(cwd=self.workdir, env=self.env)
        out = execute(self.kc, SETUP)
        assert out.error is None, out.error

    def stop(self) -> None:
        if self.km is not None:
            stop_kernel(self.km, self.kc)
            self.km = None

    def host_pid(self) -> int | None:
        kernel = psutil.Process(self.km.provisioner.process.pid) if self.km and self.km.has_kernel else None
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if (
                "sgpu_magic.launch.host.boot import main" in cmd
                and kernel is not None
                and cmd.endswith(f" {kernel.pid}")
            ):
                return p.pid
        return None

    # -- one job

    def run(self, fault: str, rng: random.Random) -> Outcome:
        self.counter += 1
        marks = self.workdir / f"marks-{self.counter}"
        marks.mkdir()
        fault_rank, fault_step = rng.randrange(2), rng.randrange(1, 8)
        timeout = TIMEOUT_S if fault in ("hang_collective", "no_rendezvous", "timeout") else 120
        background = fault in ("cancel_api", "cancel_stop")
        call = (
            f"chaos_job({fault!r}, {fault_rank}, {fault_step}, {STEPS}, {str(marks)!r}, {self.flood_bytes}, "
            f"{timeout}, {background})"
        )
        outcome = Outcome(fault)
        old_home = None
        if fault == "disk_full":
            old_home = self.env["SGPU_MAGIC_HOME"]
            execute(self.kc, f"os.environ['SGPU_MAGIC_HOME'] = {str(self.tmpfs)!r}")
        report = None
        if fault in ("cancel_api", "cancel_stop"):
            out = execute(self.kc, f"job = {call}")
            self._wait_marks(marks, everyone=True)
            action = "job.cancel()" if fault == "cancel_api" else "job.view.stop_button.click()"
            out = execute(self.kc, f"{action}\njob.exception(timeout_s=60)\nreport(job)")
            report = self._report(out.stdout)
        elif fault in ("kernel_interrupt", "kernel_sigkill", "launcher_killed"):
            msg_id = self.kc.execute(call)
            self._wait_marks(marks, everyone=True)
            if fault == "kernel_interrupt":
                self.km.interrupt_kernel()
            elif fault == "launcher_killed":
                os.kill(self.host_pid(), signal.SIGKILL)
            else:
                host = self.host_pid()
                os.kill(self.km.provisioner.process.pid, signal.SIGKILL)
            if fault != "kernel_sigkill":
                report = self._report(collect(self.kc, msg_id, timeout_s=120).stdout)
        else:
            out = execute(self.kc, call, timeout_s=300)
            report = self._report(out.stdout)
        if old_home is not None:
            execute(self.kc, f"os.environ['SGPU_MAGIC_HOME'] = {old_home!r}")
        fault_at = self._fault_time(marks)
        if fault_at is None:
            outcome.problems.append("the fault was never injected (no mark file)")
            return self._close(outcome)
        job_id = json.loads(next(marks.glob("fault_*")).read_text())["job_id"]
        root = Path(self.tmpfs if fault == "disk_full" else self.home)
        run_dir = root / "runs" / job_id
        state, mlflow_want, error_re = EXPECT[fault]
        if fault == "kernel_sigkill":  # final: every process of the job gone; then the host must go too
            gone_at = self._wait(lambda: not job_processes(job_id), 60)
            outcome.to_final_s = (gone_at or time.time()) - fault_at
            if gone_at is None:
                outcome.problems.append("ranks still run 60 s after the kernel was killed")
            host_gone = self._wait(lambda: not psutil.pid_exists(host), BOUND_S)
            if host_gone is None:
                outcome.problems.append(f"the launch host still runs {BOUND_S:g} s after the kernel was killed")
            else:
                outcome.notes.append(f"host gone {host_gone - fault_at:.1f} s after the kill")
        else:
            if report is None:
                outcome.problems.append("the kernel printed no report")
                return self._close(outcome)
            status = _read_json(run_dir / "status.json")  # the host's record of when the job ended
            ended = status.get("ended_s") if status.get("state") in FINAL else None
            outcome.to_final_s = (ended or report["ended"]) - fault_at
            if report["state"] != state:
                outcome.problems.append(f"state {report['state']!r}, expected {state!r} (error: {report['error']})")
            if error_re and not re.search(error_re.format(r=fault_rank), report["error"] or "", re.S):
                outcome.problems.append(f"error {report['error']!r} does not match {error_re.format(r=fault_rank)!r}")
            if not error_re and report["error"]:
                outcome.problems.append(f"unexpected error {report['error']!r}")
        bound = BOUND_S + (timeout if timeout == TIMEOUT_S else 0)
        if outcome.to_final_s is not None and outcome.to_final_s > bound:
            outcome.problems.append(f"final state {outcome.to_final_s:.1f} s after the fault (bound {bound:g} s)")
        self._check_gone(outcome, job_id)
        if fault == "disk_full":
            shutil.rmtree(self.tmpfs / "runs", ignore_errors=True)  # the next disk-full job starts empty
        # lines
        if fault != "disk_full":
            lost, why = self._lines_lost(run_dir, fault, fault_rank, fault_step, marks)
            outcome.lines_lost = lost
            if why:
                outcome.problems.append(why)
        # MLflow
        problem = self._mlflow_problem(report["mlflow_run_id"] if report else None, job_id, mlflow_want)
        if problem:
            outcome.problems.append(problem)
        # the next job
        if fault == "kernel_sigkill":
            self.stop()
            self.start()
        nxt = execute(self.kc, f"chaos_job('none', 0, 0, 3, {str(marks)!r})", timeout_s=180)  # marks nothing
        rep = self._report(nxt.stdout)
        if rep is None or rep["state"] != "succeeded" or rep["value"] != [0, 1]:
            outcome.problems.append(f"the next job did not succeed: {rep or nxt.stdout[-500:]}")
        return self._close(outcome)

    def _close(self, outcome: Outcome) -> Outcome:
        outcome.ok = not outcome.problems
        return outcome

    # -- checks

    @staticmethod
    def _report(stdout: str) -> dict | None:
        found = [line[6:] for line in stdout.splitlines() if line.startswith("CHAOS ")]
        return json.loads(found[-1]) if found else None

    @staticmethod
    def _wait_marks(marks: Path, everyone: bool, within_s: float = 120) -> None:
        want = 2 if everyone else 1
        deadline = time.monotonic() + within_s
        while len(list(marks.glob("fault_*"))) < want:
            if time.monotonic() > deadline:
                raise AssertionError(f"no fault mark in {marks} after {within_s} s")
            time.sleep(0.05)

    @staticmethod
    def _fault_time(marks: Path) -> float | None:
        times = [json.loads(p.read_text())["t"] for p in marks.glob("fault_*")]
        return min(times) if times else None

    @staticmethod
    def _wait(condition, within_s: float) -> float | None:
        """Poll ``condition`` until true; the time it became true, or ``None`` after ``within_s``."""
        deadline = time.monotonic() + within_s
        while True:
            if condition():
                return time.time()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def _check_gone(self, outcome: Outcome, job_id: str, what: str = "job") -> None:
        """Nothing of job ``job_id`` left running (what is, is counted as leaked and killed), no lease held."""
        if self._wait(lambda: not job_processes(job_id), BOUND_S) is None:
            left = job_processes(job_id)
            outcome.leaked = len(left)
            outcome.problems.append(f"{len(left)} process(es) of the {what} still run: {left}")
            for p in left:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
        if self._wait(lambda: not self._lease_held(job_id), BOUND_S) is None:
            outcome.problems.append(f"the {what}'s GPU lease is still held")

    def _lease_held(self, job_id: str) -> bool:
        from sgpu_magic.launch.leases import LeaseRegistry

        return any(h["job_id"] == job_id for h in LeaseRegistry(self.workdir / "leases").snapshot()["holders"])

    def _lines_lost(self, run_dir: Path, fault: str, fault_rank: int, fault_step: int, marks: Path) -> tuple[int, str]:
        lost, why = 0, []
        for rank in (0, 1):
            text = (run_dir / "logs" / f"rank_{rank}.log").read_text(errors="replace")
            steps = [int(m) for m in re.findall(rf"^line {rank} (\d+)$", text, re.M)]
            want_max = max(steps, default=-1)
            if rank == fault_rank and fault not in ("no_rendezvous",):
                want_max = max(want_max, fault_step)
            missing = sorted(set(range(want_max + 1)) - set(steps))
            if missing or len(steps) != len(set(steps)):
                lost += len(missing)
                why.append(f"rank {rank}: lines missing {missing[:10]} or repeated")
            flood = marks / f"flood_{rank}"
            if flood.exists():
                n = int(flood.read_text())
                got = [int(m) for m in re.findall(rf"^flood {rank} (\d{{9}}) ", text, re.M)]
                if got != list(range(n)):
                    lost += n - len(set(got))
                    why.append(f"rank {rank}: {n - len(set(got))} of {n} flood lines missing or out of order")
        return lost, "; ".join(why)

    def _mlflow_problem(self, run_id: str | None, job_id: str, want: str) -> str | None:
        from mlflow import MlflowClient

        client = MlflowClient(self.env["MLFLOW_TRACKING_URI"])
        if run_id is None:
            runs = client.search_runs(
                [client.get_experiment_by_name("chaos").experiment_id],
                filter_string=f"tags.`sgpu_magic.job_id` = '{job_id}'",
            )
            if not runs:
                return "no MLflow run for the job"
            run_id = runs[0].info.run_id
        info = None
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            info = client.get_run(run_id).info
            if info.status != "RUNNING" and info.end_time:
                break
            time.sleep(0.2)
        if info.status != want or not info.end_time:
            return f"MLflow run status {info.status} (end time {info.end_time}), expected {want} with an end time"
        return None


def mount_tmpfs(size: str = "4m") -> Path | None:
    """A small tmpfs for the disk-full fault, or ``None`` when this process cannot mount one (not root)."""
    path = Path(tempfile.mkdtemp(prefix="sgpu-chaos-full-"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        path.rmdir()
        return None
    return path


def unmount(path: Path | None) -> None:
    if path is not None:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
        path.rmdir()


def run_suite(
    jobs: int | None, seed: int, flood_bytes: int, workdir: Path, faults: list[str] | None = None, log=print
) -> list[Outcome]:
    """Run ``jobs`` jobs with random faults (``None``: each of ``faults`` once, in order); return the outcomes."""
    rng = random.Random(seed)
    tmpfs = mount_tmpfs()
    kinds = [f for f in (faults or FAULTS) if tmpfs is not None or f != "disk_full"]
    plan = kinds if jobs is None else [rng.choice(kinds) for _ in range(jobs)]
    runner = Runner(workdir, flood_bytes, tmpfs)
    outcomes = []
    try:
        runner.start()
        for i, fault in enumerate(plan):
            t0 = time.monotonic()
            outcome = runner.run(fault, rng)
            outcomes.append(outcome)
            log(
                f"[{i + 1}/{len(plan)}] {fault}: {'ok' if outcome.ok else 'FAILED ' + '; '.join(outcome.problems)} "
                f"({outcome.to_final_s if outcome.to_final_s is None else round(outcome.to_final_s, 2)} s to final, "
                f"{time.monotonic() - t0:.1f} s in all{''.join('; ' + n for n in outcome.notes)})"
            )
    finally:
        runner.stop()
        unmount(tmpfs)
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    """One row per fault kind: jobs run, faults survived, worst time to final state, lines lost, processes leaked."""
    rows = collections.defaultdict(list)
    for o in outcomes:
        rows[o.fault].append(o)
    lines = [
        "| fault | jobs | survived | worst s to final state | lines lost | processes leaked |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for fault in FAULTS:
        if fault not in rows:
            continue
        got = rows[fault]
        worst = max((o.to_final_s for o in got if o.to_final_s is not None), default=None)
        lines.append(
            f"| {fault} | {len(got)} | {sum(o.ok for o in got)} | "
            f"{'-' if worst is None else f'{worst:.1f}'} | {sum(o.lines_lost for o in got)} | "
            f"{sum(o.leaked for o in got)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=150, help="jobs to run, each with one random fault (default 150)")
    parser.add_argument("--each", action="store_true", help="run each fault kind once, in order (CI's short version)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--flood-mb",
        type=int,
        default=None,
        help="MB a flooding rank prints (jobs: default 1024 = 1 GB; sessions: per cell, default 10)",
    )
    parser.add_argument("--fault", action="append", help="only these fault kinds (repeatable)")
    parser.add_argument(
        "--sessions",
        action="store_true",
        help="faults in live sessions instead of jobs (tests/chaos/sessions.py); --jobs counts episodes",
    )
    parser.add_argument(
        "--flood-cells", type=int, default=100, help="sessions: cells of the flood episode (default 100)"
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unmount and stop the kernel
    if args.sessions:
        from sessions import SESSION_FAULTS, run_session_suite, session_table

        kinds, flood_bytes = SESSION_FAULTS, (args.flood_mb or 10) << 20
    else:
        kinds, flood_bytes = FAULTS, (args.flood_mb or 1024) << 20
    unknown = sorted(set(args.fault or ()) - set(kinds))
    if unknown:
        parser.error(f"unknown fault kind(s) {', '.join(unknown)}; choose from {', '.join(kinds)}")
    runs = None if args.each else args.jobs
    with tempfile.TemporaryDirectory(prefix="sgpu-chaos-") as tmp:
        if args.sessions:
            outcomes = run_session_suite(runs, args.seed, flood_bytes, args.flood_cells, Path(tmp), args.fault)
        else:
            outcomes = run_suite(runs, args.seed, flood_bytes, Path(tmp), args.fault)
    print(session_table(outcomes) if args.sessions else table(outcomes))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
