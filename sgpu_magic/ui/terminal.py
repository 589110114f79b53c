"""What a terminal would show for a rank's output: the part of a terminal that progress bars use, over the last
``max_lines`` lines.

A rank's output goes to a file, but ranks inherit ipykernel's ``FORCE_COLOR=1``, so Rich (Lightning's default
progress bar) animates as in a terminal: each refresh moves the cursor up over the last frame, erases its lines and
draws the next one; tqdm's bars with ``position=`` do the same with ``\\n`` and cursor up. :class:`TerminalBuffer`
follows these sequences, so a progress display ends up as its last frame:

- ``\\r`` returns to column 0, and the next text replaces the line (a shorter redraw leaves nothing of a longer
  one behind, where a terminal would show the rest of it); ``\\n`` moves to the next line, making a new one below
  the last (a terminal's scroll; the column goes back to 0, as a tty's ``onlcr`` does);
- ``ESC[nA`` / ``ESC[nF`` cursor up (``F``: to column 0), over the lines still kept; ``ESC[nB`` / ``ESC[nE``
  cursor down, to the last line at most (``E``: to column 0); ``ESC[nG`` to column n;
- ``ESC[2K`` erases the line, ``ESC[K`` / ``ESC[0K`` from the cursor to its end, ``ESC[1K`` from its start to the
  cursor (cells before other text become spaces);
- SGR colour codes (``ESC[...m``) stay in the text for the frontend to render (they take no column); every other
  escape sequence (``ESC[?25l``/``h`` show and hide the cursor, OSC titles and hyperlinks, ESC 7 ...) is dropped.
  A sequence cut by the end of a write is kept until the next one.

Text written over the middle of a line overwrites it cell by cell, one column a character (no wide characters);
the colour codes of the cells overwritten or erased go with them.

Why not `pyte <https://pypi.org/project/pyte/>`_ (0.8.2, 2023), the maintained terminal emulator on PyPI: it
models a screen, a fixed grid of ``columns x lines`` cells; lines wrap at the width and what scrolls off the top
is lost (``HistoryScreen`` keeps pages of it, for paging back, not for a log view that grows). Each cell is a
``Char`` with its colours as attributes, so the SGR codes would have to be written back, and plain text would pay
a Python object per character, where this buffer keeps lines as strings and adds plain output with one ``split``
(measured: benchmarks/, BENCHMARKS.md "logging").
"""

from __future__ import annotations

import collections
import itertools
import re
from collections.abc import Sequence

DEFAULT_MAX_LINES = 2000

MAX_PENDING = 256
"""A write's trailing incomplete escape sequence is kept for the next write up to this many characters
(an unterminated OSC longer than this is shown as text)."""

_SGR = re.compile(r"\x1b\[[0-9;:]*m")
"""A colour code (select graphic rendition): kept in the text."""

_CONTROL = re.compile(r"\x1b(?!\[[0-9;:]*m)")
"""The start of an escape sequence that is not a complete colour code (also one cut off at the end of the text)."""

_TOKEN = re.compile(
    r"[\r\n]"
    r"|\x1b\[(?![0-9;:]*m)(?P<params>[0-?]*)[ -/]*(?P<final>[@-~])"  # CSI other than SGR
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC (a window title, a hyperlink), ended by BEL or ST
    r"|\x1b[ -/]*[0-Z\\^-~]"  # two-character escapes (ESC 7, ESC ( B, ...)
    r"|\x1b(?!\[[0-9;:]*m)"  # an ESC that starts nothing known (but not a colour code): dropped
)
"""What the terminal acts on, or drops; SGR codes and other text between these tokens are written."""

_PARTIAL = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*\x1b?|[ -/]*)\Z")
"""An escape sequence cut off at the end of a write."""


def terminal_line(line: str) -> str:
    """What a terminal would show for ``line``: the text after its last carriage return."""
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""


def has_controls(text: str) -> bool:
    """Whether ``text`` holds an escape sequence other than a colour code (or the start of one at its end).

    >>> has_controls("\\x1b[32mok\\x1b[0m"), has_controls("\\x1b[1A"), has_controls("\\x1b[3")
    (False, True, True)
    """
    return "\x1b" in text and _CONTROL.search(text) is not None


def _width(text: str) -> int:
    """Columns ``text`` takes: its characters, less its colour codes."""
    if "\x1b" not in text:
        return len(text)
    return len(text) - sum(m.end() - m.start() for m in _SGR.finditer(text))


def _cut(line: str, col: int) -> tuple[str, str]:
    """``line`` split before column ``col`` (colour codes at the cut go to the second part); a line shorter
    than ``col`` is padded with spaces."""
    seen, pos = 0, 0
    if "\x1b" in line:
        for m in _SGR.finditer(line):
            if seen + m.start() - pos >= col:
                break
            seen, pos = seen + m.start() - pos, m.end()
    index = pos + col - seen
    if index > len(line):
        return line + " " * (index - len(line)), ""
    return line[:index], line[index:]


class TerminalBuffer:
    """The last ``max_lines`` lines a terminal would show for a stream of text (see the module's docstring for
    the sequences it follows).

    Parameters:
        max_lines (int | None): complete lines kept, default 2000 (``DEFAULT_MAX_LINES``); the earlier ones are
            dropped and counted in :attr:`hidden_lines`. ``None``: no bound (the text view takes the lines out
            itself, see :meth:`take_settled`).

    The line being written is :attr:`current` (the bottom line; the cursor may be on a line above it, at most
    ``max_lines`` up). Plain text (no ``\\r``, no escape other than colours) written with the cursor at the end of
    the bottom line takes a fast path: one ``split``, no per-line Python work.

    >>> buf = TerminalBuffer(max_lines=100)
    >>> buf.write("start\\nA 0%\\nB 0%")
    >>> buf.write("\\r\\x1b[2K\\x1b[1A\\x1b[2KA 100%\\nB 100%\\n")
    >>> buf.text()
    'start\\nA 100%\\nB 100%\\n'
    """

    def __init__(self, max_lines: int | None = DEFAULT_MAX_LINES) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        self.current = ""
        self.total_lines = 0
        """Lines ended at the bottom so far (a redraw of lines above it adds none)."""
        self.skipped_bytes = 0
        self.reach = 0
        """The furthest the cursor has gone up so far, in lines above the bottom line (0 for output that never
        moved it): lines further up can no longer change."""
        self.cursor_hidden = False
        """Whether the output hid the cursor (``ESC[?25l``) and has not shown it again (``ESC[?25h``): a live
        display such as Rich's is drawing."""
        self._top = 0  # the line the cursor last went up to, or was on when hidden (the bottom line is total_lines)
        self._row = 0  # lines above the bottom line where the cursor is
        self._col: int | None = None  # its column; None: right after the line's last character
        self._cr = False  # after a carriage return: the cursor is at column 0, the next text replaces the line
        self._pending = ""  # an escape sequence cut off at the end of the last write
        self._plain = True  # the cursor is at the end of the bottom line (or after \r on it), nothing pending

    def write(self, text: str) -> None:
        """Add ``text`` (any piece of the stream: it may end mid-line or mid-sequence)."""
        if not self._plain or "\r" in text or ("\x1b" in text and _CONTROL.search(text)):
            self._write_terminal(text)
            return
        complete = text.count("\n")  # the fast path: no per-line Python work, only the last max_lines kept
        if not complete:
            if text:
                self.current = text if self._cr else self.current + text
                self._cr = False
            return
        self.total_lines += complete
        maxlen = self.lines.maxlen
        if maxlen and complete > maxlen:  # split off just the lines that stay
            parts = text.rsplit("\n", maxlen + 1)
            self.lines.extend(parts[1:-1])
        else:
            parts = text.split("\n")
            head = parts[0]
            self.lines.append((head or self.current) if self._cr else self.current + head)
            if complete > 1:
                self.lines.extend(parts[1:complete])
        self.current, self._cr = parts[-1], False

    def _write_terminal(self, text: str) -> None:
        """The slow path: text with carriage returns or escape sequences, or a cursor off the end."""
        text, self._pending = self._pending + text, ""
        cut = _PARTIAL.search(text, max(0, len(text) - MAX_PENDING)) if "\x1b" in text else None
        if cut is not None:
            text, self._pending = text[: cut.start()], text[cut.start() :]
        pos = 0
        for m in _TOKEN.finditer(text):
            if m.start() > pos:
                self._put(text[pos : m.start()])
            pos = m.end()
            token = m.group()
            if token == "\n":
                self._newline()
            elif token == "\r":
                self._col, self._cr = None, True
            elif m.group("final"):
                self._csi(m.group("params"), m.group("final"))
        if pos < len(text):
            self._put(text[pos:])
        self._plain = not self._row and self._col is None and not self._pending

    def _line(self) -> str:
        return self.lines[-self._row] if self._row else self.current

    def _set_line(self, line: str) -> None:
        if self._row:
            self.lines[-self._row] = line
        else:
            self.current = line

    def _column(self, line: str) -> int:
        """The cursor's column on ``line``, the line it is on."""
        if self._cr:
            return 0
        return _width(line) if self._col is None else self._col

    def _put(self, text: str) -> None:
        """Text without line ends at the cursor: replacing the line after ``\\r``, else overwriting its cells."""
        line = self._line()
        if self._col is None:
            self._set_line(text if self._cr else line + text)
            self._cr = False
            return
        head, tail = _cut(line, self._col)
        rest = _cut(tail, _width(text))[1]
        if _SGR.sub("", rest).strip(" "):
            self._set_line(head + text + rest)
            self._col += _width(text)
        else:  # only blank cells after the text: the cursor is at the line's end
            self._set_line(head + text)
            self._col = None

    def _newline(self) -> None:
        """``\\n``: to column 0 of the next line; on the bottom line, a new line below it."""
        self._cr = False
        if self._row:
            self._row -= 1
            self._col = 0
            return
        self.lines.append(self.current)
        self.total_lines += 1
        self.current, self._col = "", None

    def _csi(self, params: str, final: str) -> None:
        """A control sequence: the cursor moves and erases the module's docstring lists; others are dropped."""
        first = params.split(";", 1)[0]
        n = int(first) if first.isdigit() else 0
        if final in "AFBE":
            self._move(max(n, 1) if final in "AF" else -max(n, 1), 0 if final in "FE" else None)
        elif final == "G":
            self._col, self._cr = max(n, 1) - 1, False
        elif final == "K" and not params.startswith("?"):
            self._erase(n)
        elif final in "lh" and params == "?25":
            self.cursor_hidden = final == "l"
            self._top = self.total_lines - self._row

    def _move(self, up: int, col: int | None) -> None:
        """Cursor ``up`` lines (down where negative), to column ``col`` (``None``: the same column)."""
        col = self._column(self._line()) if col is None else col
        self._row = min(max(self._row + up, 0), len(self.lines))
        if up > 0:
            self.reach = max(self.reach, self._row)
            self._top = self.total_lines - self._row
        self._col, self._cr = col, False

    def _erase(self, mode: int) -> None:
        """``ESC[K`` (``mode`` 0: cursor to end), ``ESC[1K`` (start to cursor), ``ESC[2K`` (the whole line)."""
        if mode == 0 and self._col is None and not self._cr:
            return  # at the line's end: nothing after the cursor
        line = self._line()
        col = self._column(line)
        if mode == 2:
            line = ""
        elif mode == 1:
            tail = _cut(line, col + 1)[1]
            line = " " * (col + 1) + tail if _SGR.sub("", tail).strip(" ") else ""
        else:
            line = _cut(line, col)[0] if col < _width(line) else line
        self._set_line(line)
        if not self._cr:
            self._col = col

    def take_settled(self, held: int) -> list[str]:
        """Remove and return the complete lines the cursor can no longer come back to: all but the last
        ``min(reach, held)``, and while the cursor is hidden, also not those drawn since it last went up (or since it
        was hidden): a live display that grows is as tall as that; never the line the cursor is on.

        Parameters:
            held (int): lines kept back at most, however far up the cursor has gone.

        Returns:
            list[str]: the lines, oldest first (``[]`` when all are still within reach).

        >>> buf = TerminalBuffer(max_lines=None)
        >>> buf.write("a\\nb\\nc\\n\\x1b[1A")
        >>> buf.take_settled(50), list(buf.lines)
        (['a', 'b'], ['c'])
        """
        keep = min(self.reach, held)
        if self.cursor_hidden:
            keep = max(keep, min(self.total_lines - self._top, held))
        keep = max(keep, self._row)
        return [self.lines.popleft() for _ in range(len(self.lines) - keep)]

    def skip(self, nbytes: int) -> None:
        """``nbytes`` of output (ending at a line end) were passed over: they are only in the log file."""
        self.lines.clear()
        self.current, self._cr, self._row, self._col, self._pending, self._plain = "", False, 0, None, "", True
        self._top = self.total_lines
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
