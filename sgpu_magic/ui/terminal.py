"""What a terminal would show for a rank's output: carriage returns (a tqdm bar is one updating line), the last
``max_lines`` lines kept."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence

DEFAULT_MAX_LINES = 2000


def terminal_line(line: str) -> str:
    """What a terminal would show for ``line``: the text after its last carriage return."""
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""


class TerminalBuffer:
    """The last ``max_lines`` lines a terminal would show for a stream of text.

    ``\r`` returns to the start of the line (the next text replaces it, as a tqdm bar
    does); ``\n`` ends it. ANSI colour codes are kept for the frontend to render.
    """

    def __init__(self, max_lines: int = DEFAULT_MAX_LINES) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        self.current = ""
        self.total_lines = 0
        self.skipped_bytes = 0
        self._cr = False

    def write(self, text: str) -> None:
        if "\r" not in text:  # fast path (no per-line Python work): only the last max_lines lines are kept
            complete = text.count("\n")
            maxlen = self.lines.maxlen
            if maxlen and complete > maxlen:  # split off just the lines that stay
                parts = text.rsplit("\n", maxlen + 1)
                self.total_lines += complete
                self.lines.extend(parts[1:-1])
                self.current, self._cr = "", False
                self._feed(parts[-1])
                return
            parts = text.split("\n")
            self._feed(parts[0])
            if complete:
                self.total_lines += complete
                self.lines.append(self.current)
                self.lines.extend(parts[1:complete])
                self.current, self._cr = "", False
                self._feed(parts[-1])
            return
        parts = text.split("\n")
        for part in parts[:-1]:
            self._feed(part)
            self.lines.append(self.current)
            self.total_lines += 1
            self.current, self._cr = "", False
        self._feed(parts[-1])

    def _feed(self, part: str) -> None:
        """Text without a newline: after a carriage return, the next text replaces the line."""
        for i, segment in enumerate(part.split("\r") if "\r" in part else (part,)):
            if i:
                self._cr = True
            if segment:
                self.current = segment if self._cr else self.current + segment
                self._cr = False

    def skip(self, nbytes: int) -> None:
        """``nbytes`` of output (ending at a line end) were passed over: they are only in the log file."""
        self.lines.clear()
        self.current, self._cr = "", False
        self.skipped_bytes += nbytes

    @property
    def hidden_lines(self) -> int:
        """Lines that dropped out of the buffer (still in the log file), not counting skipped output."""
        return self.total_lines - len(self.lines)

    def text(self, last: int | None = None) -> str:
        """What the view shows: the kept lines (only the ``last`` ones if given) and the current line."""
        lines: Sequence[str] = self.lines
        if last is not None and len(lines) > last:
            lines = list(itertools.islice(lines, len(lines) - last, None))
        body = "\n".join(lines)
        if self.current:
            return f"{body}\n{self.current}" if lines else self.current
        return f"{body}\n" if lines else ""
