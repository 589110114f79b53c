"""What the user sees while a job runs. For now the plain-text view: ``[rank N]`` lines.

Carriage returns behave as in a terminal (a tqdm bar shows its latest state), so a
progress bar is not stacked into hundreds of lines.
"""

from __future__ import annotations

import sys


def terminal_line(line: str) -> str:
    """What a terminal would show for ``line``: the text after its last carriage return."""
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""


class TextView:
    """Streams each rank's lines to the cell's output, prefixed ``[rank N]``; notes and warnings to stderr."""

    def __init__(self, out=None, err=None) -> None:
        self._out = out
        self._err = err

    def lines(self, rank: int, lines: list[str]) -> None:
        out = self._out or sys.stdout
        out.write("".join(f"[rank {rank}] {terminal_line(line)}\n" for line in lines))
        out.flush()

    def note(self, text: str) -> None:
        out = self._out or sys.stdout
        out.write(text + "\n")
        out.flush()

    def warn(self, text: str) -> None:
        err = self._err or sys.stderr
        err.write(f"sgpu_magic warning: {text}\n")
        err.flush()
