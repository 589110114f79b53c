"""TerminalBuffer against the bytes real progress libraries write (Rich, tqdm), and the terminal sequences one by
one: cursor up and down, erases, columns, dropped sequences, sequences cut between writes, the max_lines bound."""

from __future__ import annotations

import doctest
import io
import random
import re

import pytest

import sgpu_magic.ui.terminal
from sgpu_magic.ui.terminal import TerminalBuffer, has_controls

SGR = re.compile(r"\x1b\[[0-9;]*m")


def plain(line: str) -> str:
    """``line`` without its colour codes."""
    return SGR.sub("", line)


def feed(data: str, chunk: int | None = None, max_lines: int | None = 2000) -> TerminalBuffer:
    """A buffer fed ``data`` in writes of ``chunk`` characters (default: one write)."""
    buf = TerminalBuffer(max_lines=max_lines)
    step = chunk or max(1, len(data))
    for i in range(0, len(data), step):
        buf.write(data[i : i + step])
    return buf


def rich_output(tasks: int = 3, steps: int = 200, print_every: int = 50) -> str:
    """What a real ``rich.progress.Progress`` writes to a terminal: ``tasks`` bars advanced over ``steps``
    refreshes, with an ordinary line printed above the display every ``print_every`` steps."""
    from rich.console import Console
    from rich.progress import Progress

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system="standard")
    with Progress(console=console, auto_refresh=False) as progress:
        ids = [progress.add_task(f"task {i}", total=steps) for i in range(tasks)]
        for step in range(steps):
            for task in ids:
                progress.advance(task)
            if step % print_every == 0:
                progress.console.print(f"ordinary line {step}")
            progress.refresh()
    return out.getvalue()


def tqdm_output(bars: int = 3, steps: int = 100, write_every: int = 25) -> str:
    """What real tqdm bars with ``position=`` write, with ``tqdm.write`` lines between every ``write_every``
    steps."""
    from tqdm import tqdm

    out = io.StringIO()
    handles = [tqdm(total=steps, desc=f"bar {i}", position=i, file=out, mininterval=0, ncols=80) for i in range(bars)]
    for step in range(steps):
        for bar in handles:
            bar.update()
        if step % write_every == 0:
            tqdm.write(f"ordinary line {step}", file=out)
    for bar in handles:
        bar.close()
    return out.getvalue()


@pytest.mark.parametrize("chunk", [None, 1, 7, 100, 4096])
def test_a_rich_progress_display_ends_as_its_final_frame(chunk):
    data = rich_output()
    assert data.count("\x1b[1A") > 300  # the display was redrawn 200 times, going up over its lines
    buf = feed(data, chunk)
    lines = [plain(line) for line in buf.lines]
    assert lines[:4] == [f"ordinary line {step}" for step in (0, 50, 100, 150)]  # nothing lost of them
    assert [line.split()[:2] for line in lines[4:]] == [["task", "0"], ["task", "1"], ["task", "2"]]
    assert all("100%" in line for line in lines[4:]) and buf.current == ""
    assert buf.total_lines == 7 and buf.hidden_lines == 0 and buf.reach == 2 and not buf.cursor_hidden
    assert "\x1b[35m100%\x1b[0m" in buf.lines[-1]  # colours stay for the frontend
    assert not has_controls(buf.text())  # every other sequence is gone


@pytest.mark.parametrize("chunk", [None, 1, 13, 4096])
def test_tqdm_bars_with_position_end_as_one_line_each(chunk):
    data = tqdm_output()
    buf = feed(data, chunk)
    assert list(buf.lines)[:4] == [f"ordinary line {step}" for step in (0, 25, 50, 75)]
    bars = list(buf.lines)[4:]
    assert [bar.split(":")[0] for bar in bars] == ["bar 0", "bar 1", "bar 2"]
    assert all("100%" in bar and "100/100" in bar for bar in bars), bars
    assert buf.current == "" and buf.total_lines == 7 and buf.reach == 2


def test_a_single_tqdm_bar_is_one_line_and_the_lines_after_it_stay():
    from tqdm import tqdm

    out = io.StringIO()
    for _ in tqdm(range(300), desc="single", file=out, mininterval=0, ncols=80):
        pass
    out.write("after the bar\n")
    buf = feed(out.getvalue(), 5)
    assert [line.split(":")[0] for line in buf.lines] == ["single", "after the bar"]
    assert "300/300" in buf.lines[0] and buf.total_lines == 2 and buf.reach == 0


def test_a_redrawn_display_keeps_the_max_lines_bound():
    buf = feed(rich_output(steps=300, print_every=1), 512, max_lines=50)
    assert len(buf.lines) == 50 and buf.total_lines == 303 and buf.hidden_lines == 253
    assert [plain(line) for line in list(buf.lines)[:47]] == [f"ordinary line {s}" for s in range(253, 300)]
    assert all("100%" in line for line in list(buf.lines)[47:])


def test_cursor_up_reaches_only_the_lines_kept():
    buf = TerminalBuffer(max_lines=3)
    buf.write("".join(f"line {i}\n" for i in range(10)))
    buf.write("\x1b[50A\rtop")  # 50 up from the bottom line: the oldest line kept
    assert list(buf.lines) == ["top", "line 8", "line 9"] and buf.current == "" and buf.reach == 3
    buf.write("\x1b[50Bbottom\n")  # down again, to the bottom line at most
    assert list(buf.lines) == ["line 8", "line 9", "   bottom"]  # a terminal keeps the column
    assert buf.total_lines == 11 and buf.hidden_lines == 8


def test_an_escape_sequence_cut_between_writes_is_kept_for_the_next_write():
    buf = TerminalBuffer()
    for piece in [
        "first\nsecond\x1b",
        "[1",
        "A\r\x1b[",
        "2KFIRST\x1b[1",
        "B\x1b[3",
        "2m!\x1b[0m\x1b]0;ti",
        "tle\x07\n",
    ]:
        buf.write(piece)
    # up, erase, FIRST; down to column 5 of "second", a green "!" over its "d"; the window title dropped
    assert list(buf.lines) == ["FIRST", "secon\x1b[32m!\x1b[0m"] and buf.current == ""


def test_plain_text_after_a_redraw_goes_where_the_cursor_is():
    buf = TerminalBuffer()
    buf.write("a\nb\nc")
    buf.write("\x1b[2F")  # up two, column 0: then plain text overwrites there, as in a terminal
    buf.write("A\nB\n")
    assert buf.text() == "A\nB\nc" and buf.total_lines == 2
    buf.write("\n" + "plain\n" * 3)  # down to the bottom, then the fast path again
    assert buf.text() == "A\nB\nc\nplain\nplain\nplain\n" and buf.total_lines == 6


@pytest.mark.parametrize(
    ("written", "shown"),
    [
        ("abcdef\x1b[3G\x1b[K\n", "ab\n"),  # column 3, erase to the end
        ("abcdef\x1b[3G\x1b[0K\n", "ab\n"),
        ("abcdef\x1b[3G\x1b[1K\n", "   def\n"),  # erase from the start through the cursor
        ("abcdef\x1b[3GXY\n", "abXYef\n"),  # text overwrites cell by cell
        ("abcdef\x1b[2K\n", "\n"),
        ("abcdef\x1b[2Kxy\n", "      xy\n"),  # the cursor stays in its column
        ("abcdef\r\x1b[Kxy\n", "xy\n"),
        ("abcdef\rxy\n", "xy\n"),  # after \r the next text replaces the line (no leftover "cdef")
        ("one\ntwo\nthree\x1b[2F\x1b[2KONE\x1b[2E!\n", "ONE\ntwo\n!hree\n"),
        ("one\ntwo\x1b[A\x1b[B\rTWO\n", "one\nTWO\n"),
        ("\x1b[32mabc\x1b[0m\x1b[2GX\n", "\x1b[32maXc\x1b[0m\n"),  # colour codes take no column
        ("\x1b[1;31mred\x1b[0m\rplain\n", "plain\n"),
        ("\x1b[?25lhidden cursor\x1b[?25h\n", "hidden cursor\n"),
        ("\x1b[2J\x1b[Hscreen cleared\x1b[5;3H\x1b[s\x1b[u\n", "screen cleared\n"),  # other CSI: dropped
        ("\x1b]8;;https://example.com\x1b\\link\x1b]8;;\x1b\\\n", "link\n"),  # OSC hyperlink: dropped
        ("\x1b]0;title\x07a\x1b7b\x1b8c\x1b(B\n", "abc\n"),  # window title, ESC 7 / ESC 8, charset: dropped
        ("lone \x1b[\x1b\n", "lone [\n"),
    ],
)
def test_terminal_sequences(written, shown):
    assert feed(written).text() == shown
    assert feed(written, 1).text() == shown  # the same, written a character at a time


def test_any_split_of_mixed_output_shows_what_one_write_shows():
    """Colour codes aside: where text overwrites the middle of a line, the codes among the cells it covers go with
    them, so where they end up depends on how the text was cut (a terminal keeps colour per cell)."""
    rng = random.Random(7)
    pieces = ["x", "yz\n", "\r", "\x1b[1A", "\x1b[2B", "\x1b[2K", "\x1b[K", "\x1b[1K", "\x1b[4G", "\x1b[31m", "\x1b[0m"]
    pieces += ["\x1b[2F", "\x1b[E", "\x1b[?25l", "\x1b]0;t\x07", "\n", "abc"]
    for _ in range(500):
        data = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 60)))
        whole = feed(data, max_lines=5)
        cuts = sorted(rng.sample(range(len(data) + 1), min(len(data) + 1, rng.randint(1, 8))))
        split = TerminalBuffer(max_lines=5)
        for start, end in zip([0, *cuts], [*cuts, len(data)]):
            split.write(data[start:end])
        for buf in (split, whole):
            assert not has_controls(buf.text()), repr(data)
        state = [plain(buf.text()) for buf in (split, whole)] + [(b.total_lines, b.reach) for b in (split, whole)]
        assert state[0] == state[1] and state[2] == state[3], repr(data)


MODEL_PIECES = ["x", "abc", "yz\n", "\r", "\n", "\x1b[1A", "\x1b[3A", "\x1b[2B", "\x1b[2K", "\x1b[K", "\x1b[1K"]
MODEL_PIECES += ["\x1b[4G", "\x1b[G", "\x1b[2F", "\x1b[E"]


def model_terminal(pieces: list[str]) -> list[str]:
    """A plain model of the terminal, cell by cell (no colours, no bound): the lines it shows, trailing blanks
    left out. As in TerminalBuffer, the text after a carriage return replaces the line."""
    lines: list[list[str]] = [[]]
    row = col = 0
    cr = False
    for piece in pieces:
        csi = re.fullmatch(r"\x1b\[(\d*)([A-Z])", piece)
        if csi:
            n, final = int(csi.group(1) or 1), csi.group(2)
            if final in "AF":
                row = max(row - n, 0)
            elif final in "BE":
                row = min(row + n, len(lines) - 1)
            if final in "FE" or final == "G":
                col = n - 1 if final == "G" else 0
            if final == "K":
                erase = {"\x1b[2K": range(len(lines[row])), "\x1b[1K": range(min(col + 1, len(lines[row])))}
                for i in erase.get(piece, range(col, len(lines[row]))):
                    lines[row][i] = " "
            else:
                cr = False
            continue
        for ch in piece:
            if ch == "\r":
                col, cr = 0, True
            elif ch == "\n":
                row, col, cr = row + 1, 0, False
                if row == len(lines):
                    lines.append([])
            else:
                if cr:
                    lines[row], cr = [], False
                lines[row] += [" "] * (col + 1 - len(lines[row]))
                lines[row][col] = ch
                col += 1
    return ["".join(line).rstrip(" ") for line in lines]


def test_matches_a_cell_by_cell_terminal_model_on_random_sequences():
    rng = random.Random(11)
    for _ in range(2000):
        pieces = [rng.choice(MODEL_PIECES) for _ in range(rng.randint(1, 40))]
        data = "".join(pieces)
        for chunk in (None, rng.randint(1, 6)):
            shown = [line.rstrip(" ") for line in feed(data, chunk, max_lines=None).text().split("\n")]
            assert shown == model_terminal(pieces), repr(data)


def test_take_settled_keeps_what_the_cursor_can_still_reach():
    buf = TerminalBuffer(max_lines=None)
    buf.write("log 0\nlog 1\n")
    assert buf.take_settled(50) == ["log 0", "log 1"]  # no cursor movement yet: every complete line is final
    buf.write("a 0%\nb 0%\x1b[1A\r\x1b[2Ka 50%\nb 50%\nlog 2\n")
    assert buf.reach == 1 and buf.take_settled(50) == ["a 50%", "b 50%"]  # log 2 is within reach of 1
    # a live display hides the cursor: its lines are held until it has gone up over them, however tall it grew
    buf.write("\x1b[?25lc 0%\nd 0%\ne 0%")
    assert buf.take_settled(50) == ["log 2"] and buf.take_settled(1) == ["c 0%"]
    buf.write("\r\x1b[2K\x1b[1A\x1b[2K\x1b[1A\x1b[2Kc 50%\nd 50%\ne 50%")  # up 2, but c 0% was taken: to d
    assert buf.reach == 1 and list(buf.lines) == ["c 50%", "d 50%"] and buf.current == "e 50%"
    buf.write("\r\x1b[2K\x1b[1A\x1b[2K\x1b[1A\x1b[2Klog 3\nc 60%\nd 60%\ne 60%\nf 0%")  # a line above; f: grown
    assert buf.take_settled(50) == []  # log 3 and the grown display: drawn since the cursor last went up
    assert buf.take_settled(3) == ["log 3"]  # at most 3 held: the display's c, d and e (f is being drawn)
    buf.write("\r\x1b[2K\x1b[1A\x1b[2K\x1b[1A\x1b[2K\x1b[1A\x1b[2Kc 100%\nd 100%\ne 100%\nf 100%\n\x1b[?25h")
    assert buf.reach == 3 and buf.take_settled(50) == ["c 100%"] and list(buf.lines) == ["d 100%", "e 100%", "f 100%"]


def test_the_module_examples_hold(monkeypatch):
    import builtins

    # doctest shows results through sys.displayhook, which leaves the last one in builtins._; IPython's displayhook
    # then stops updating the shared shell's _ (it leaves a builtin _ to gettext): undone after the test
    monkeypatch.setattr(builtins, "_", None, raising=False)
    assert doctest.testmod(sgpu_magic.ui.terminal).failed == 0
