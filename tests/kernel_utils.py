"""Drive a real Jupyter kernel through jupyter_client, as a notebook frontend does."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CellOutput:
    """What one executed cell produced."""

    stdout: str = ""
    stderr: str = ""
    results: list[str] = field(default_factory=list)
    error: dict | None = None


def collect(kc, msg_id: str, timeout_s: float = 180.0) -> CellOutput:
    """Gather the iopub messages of one execute request until the kernel is idle again."""
    out = CellOutput()
    while True:
        msg = kc.get_iopub_msg(timeout=timeout_s)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            if content["name"] == "stdout":
                out.stdout += content["text"]
            else:
                out.stderr += content["text"]
        elif kind in ("execute_result", "display_data"):
            out.results.append(content["data"].get("text/plain", ""))
        elif kind == "error":
            out.error = content
        elif kind == "status" and content["execution_state"] == "idle":
            return out


def collect_all(kc, msg_id: str, timeout_s: float = 180.0, until=None) -> list[dict]:
    """Every iopub message (of any cell) until the cell ``msg_id`` is idle again, or ``until(msg)`` is true."""
    seen = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout_s)
        seen.append(msg)
        if until is not None and until(msg):
            return seen
        if (
            msg["parent_header"].get("msg_id") == msg_id
            and msg["msg_type"] == "status"
            and msg["content"]["execution_state"] == "idle"
        ):
            return seen


def execute(kc, code: str, timeout_s: float = 180.0) -> CellOutput:
    """Execute ``code`` in the kernel and wait for it to finish."""
    return collect(kc, kc.execute(code), timeout_s)


def start_kernel(cwd=None, env=None):
    """A fresh ``python3`` kernel (in ``cwd``, with ``env`` added to this process's environment, if given)
    with ``%load_ext sgpu_magic`` done; returns (km, kc)."""
    import os

    from jupyter_client.manager import start_new_kernel

    kwargs = {"cwd": str(cwd)} if cwd is not None else {}
    if env:
        kwargs["env"] = {**os.environ, **env}
    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=90, **kwargs)
    out = execute(kc, "%load_ext sgpu_magic")
    assert out.error is None, out.error
    return km, kc


def stop_kernel(km, kc) -> None:
    """Close the client's channels and kill the kernel if it still runs."""
    kc.stop_channels()
    if km.has_kernel:
        km.shutdown_kernel(now=True)
