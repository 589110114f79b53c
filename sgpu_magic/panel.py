"""What the user sees while a job runs. For now the plain-text view: ``[rank N]`` lines.

Carriage returns behave as in a terminal (a tqdm bar shows its latest state), so a
progress bar is not stacked into hundreds of lines.
"""

from __future__ import annotations

import sys

from .rundir import is_traceback_marker


def terminal_line(line: str) -> str:
    """What a terminal would show for ``line``: the text after its last carriage return."""
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""


class TextView:
    """Streams each rank's lines to the cell's output, prefixed ``[rank N]``; notes and warnings to stderr.

    A rank's traceback is not streamed (the marker line before it is): the kernel shows the
    root-cause traceback once, in the error it raises, and the full text stays in the log file.
    """

    def __init__(self, out=None, err=None) -> None:
        self._out = out
        self._err = err
        self._failed_ranks: set[int] = set()

    def lines(self, rank: int, lines: list[str]) -> None:
        shown = []
        for line in lines:
            if rank in self._failed_ranks:
                continue
            if is_traceback_marker(line):
                self._failed_ranks.add(rank)
            shown.append(f"[rank {rank}] {terminal_line(line)}\n")
        out = self._out or sys.stdout
        out.write("".join(shown))
        out.flush()

    def note(self, text: str) -> None:
        out = self._out or sys.stdout
        out.write(text + "\n")
        out.flush()

    def warn(self, text: str) -> None:
        err = self._err or sys.stderr
        err.write(f"sgpu_magic warning: {text}\n")
        err.flush()
