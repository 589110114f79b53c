"""Background jobs and GPU leases through real Jupyter kernels (jupyter_client, nbclient)."""

import os
import signal

import pytest

from helpers import wait_for
from kernel_utils import collect_all, execute, start_kernel, stop_kernel

pytestmark = pytest.mark.slow


def value(kc, expr: str) -> str:
    """The text/plain repr of ``expr`` evaluated in the kernel."""
    out = execute(kc, expr)
    assert out.error is None, out.error
    return out.results[-1]


def wait_state(kc, name: str, state: str, timeout_s: float = 90) -> None:
    wait_for(lambda: value(kc, f"{name}.state.value") == repr(state), timeout_s, f"{name} to be {state}")


@pytest.fixture
def fake_env(tmp_path):
    return {"SGPU_MAGIC_FAKE_GPUS": "8 x H100", "SGPU_MAGIC_LEASE_DIR": str(tmp_path / "leases")}


def test_two_kernels_queue_for_a_fake_8_gpu_inventory(tmp_path, fake_env):
    """Each kernel asks for 6 of 8 GPUs: the second waits (or, with --no-wait, fails naming the holder) and
    starts when the first ends; SIGKILL of the first kernel frees its GPUs for the second (how soon: the figure
    kernel_kill_to_start_s of ``python -m benchmarks.run --only responsive``)."""
    go = tmp_path / "go"
    km_a, kc_a = start_kernel(env=fake_env)
    km_b, kc_b = start_kernel(env=fake_env)
    try:
        pid_a = int(value(kc_a, "import os; os.getpid()"))
        hold = f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.02)\n"
        out = execute(kc_a, f"%%distributed --gpus 6 --background -o a\n{hold}")
        assert out.error is None, out.error
        wait_state(kc_a, "a", "running")
        job_a = value(kc_a, "a.job_id").strip("'")
        assert value(kc_a, "a.gpus") == "[0, 1, 2, 3, 4, 5]"

        out = execute(kc_b, "%%distributed --gpus 6 --no-wait\npass")
        assert out.error is not None and out.error["ename"] == "ResourceError"
        assert (
            f"waiting for 6 GPU(s): 2 of 8 free; GPUs 0,1,2,3,4,5 held by job {job_a} (kernel pid {pid_a}, "
            in out.error["evalue"]
        )

        out = execute(kc_b, "%%distributed --gpus 6 --background -o b\nimport os\nos.environ['SGPU_MAGIC_GPUS']")
        assert out.error is None, out.error
        assert value(kc_b, "b.state.value") == "'pending'"
        assert job_a in value(kc_b, "b.pending_reason")
        go.touch()
        assert value(kc_b, "sorted(set(b.result(timeout_s=90))), len(b.result())") == "(['0,1,2,3,4,5'], 6)"

        # the first kernel holds 6 GPUs again and is SIGKILLed while the second kernel's job waits for them
        out = execute(kc_a, f"%%distributed --gpus 6 --background -o a2\n{hold.replace('go', 'never')}")
        assert out.error is None, out.error
        wait_state(kc_a, "a2", "running")
        out = execute(kc_b, "%%distributed --gpus 6 --background -o b2\nimport time\ntime.time()")
        assert out.error is None, out.error
        assert value(kc_b, "b2.state.value") == "'pending'"
        os.kill(pid_a, signal.SIGKILL)
        assert float(value(kc_b, "b2.result(timeout_s=60)[0]")) > 0  # started once the dead kernel's lease went
    finally:
        stop_kernel(km_a, kc_a)
        stop_kernel(km_b, kc_b)


def test_kernel_shutdown_gives_back_the_gpus_at_once(tmp_path, fake_env):
    """The launch host releases a job's lease when it stops the ranks on its way down."""
    from sgpu_magic.launch.leases import LeaseRegistry

    registry = LeaseRegistry(fake_env["SGPU_MAGIC_LEASE_DIR"])
    km, kc = start_kernel(env=fake_env)
    try:
        out = execute(
            kc,
            f"%%distributed --gpus 2 --background -o held\nimport os, time\n"
            f"while not os.path.exists({str(tmp_path / 'never')!r}):\n    time.sleep(0.02)\n",
        )
        assert out.error is None, out.error
        wait_state(kc, "held", "running")
        assert [h["indices"] for h in registry.snapshot()["holders"]] == [[0, 1]]
        km.shutdown_kernel(now=False)  # what Jupyter's "Shut down kernel" does
        registry_file = registry.file
        wait_for(lambda: '"holders": []' in registry_file.read_text(), 10, "the lease to be released")
    finally:
        stop_kernel(km, kc)


def test_late_output_goes_to_the_starting_cell_and_interrupt_spares_background_jobs(tmp_path):
    go = tmp_path / "go"
    km, kc = start_kernel()
    try:
        start = kc.execute(
            f"%%distributed --gpus 2 --background -o bg\nimport os, time\nprint('before go', flush=True)\n"
            f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.02)\n"
            f"for i in range(3):\n    print('after go', i, flush=True)\n"
        )
        messages = collect_all(kc, start)
        wait_state(kc, "bg", "running")
        # a blocking cell, interrupted: Jupyter signals the kernel's process group; the job must not notice
        block = kc.execute("import threading\nprint('blocking', flush=True)\nthreading.Event().wait()")
        messages += collect_all(
            kc, block, until=lambda m: m["msg_type"] == "stream" and "blocking" in m["content"]["text"]
        )
        km.interrupt_kernel()
        messages += collect_all(kc, block)
        assert any(m["msg_type"] == "error" and m["content"]["ename"] == "KeyboardInterrupt" for m in messages)
        assert value(kc, "bg.state.value") == "'running'"
        go.touch()
        finish = kc.execute("bg.wait(timeout_s=90).value")
        messages += collect_all(kc, finish)
        job_text = {}
        for m in messages:
            if m["msg_type"] == "stream":
                job_text.setdefault(m["parent_header"]["msg_id"], []).append(m["content"]["text"])
        started_cell = "".join(job_text.get(start, []))
        for rank in range(2):
            for i in range(3):
                assert f"[rank {rank}] after go {i}\n" in started_cell
        assert "sgpu_magic: job" in started_cell and "succeeded" in started_cell
        later = "".join(text for msg_id, texts in job_text.items() if msg_id != start for text in texts)
        assert "[rank" not in later and "sgpu_magic: job" not in later
        assert value(kc, "bg.state.value") == "'succeeded'"
    finally:
        stop_kernel(km, kc)


def test_background_lifecycle_in_a_notebook(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    go, never = tmp_path / "go", tmp_path / "never"
    cells = [
        "%load_ext sgpu_magic",
        "from sgpu_magic import distributed\n\n@distributed(gpus=2, timeout=120)\ndef wait_for(path):\n"
        "    import os, time\n    while not os.path.exists(path):\n        time.sleep(0.02)\n"
        "    print('late line', flush=True)\n    return int(os.environ['RANK'])",
        f"job = wait_for.submit({str(go)!r})\njob.state.value in ('pending', 'starting', 'running')",
        "sum(range(10))",
        "%distributed_jobs",
        f"open({str(go)!r}, 'w').close()\njob.result(timeout_s=90)",
        f"stuck = wait_for.submit({str(never)!r})\nstuck.cancel()\nstuck.state.value",
        "%distributed_jobs",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

    def text(i):
        return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in nb.cells[i].outputs)

    assert text(2).endswith("True")
    assert text(3) == "45"
    table = text(4).splitlines()
    assert table[0].split()[:2] == ["job", "state"]
    assert table[1].split()[1:4] in (["pending", "2", "cpu"], ["starting", "2", "cpu"], ["running", "2", "cpu"])
    assert "[0, 1]" in text(5)
    assert "'cancelled'" in text(6)
    final = text(7).splitlines()
    assert [row.split()[1] for row in final[1:]] == ["succeeded", "cancelled"]
    # the job's lines, printed after its cell ended, never land in a later cell
    assert not any("late line" in text(i) or "[rank" in text(i) for i in range(3, 8))
