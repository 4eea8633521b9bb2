"""The rich Console every command renders to: the terminal's width, COLUMNS when set, else PIPE_WIDTH."""

from __future__ import annotations

import io
import os
import re
import sys
from typing import TextIO

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.segment import Segment
from rich.text import Text

# Wide enough for the formula columns when stdout is a pipe or a file and COLUMNS is not set (rich would otherwise
# assume 80).
PIPE_WIDTH = 140


def console_width() -> int | None:
    """None (rich asks the terminal, or reads COLUMNS) on a terminal or when COLUMNS is set; else PIPE_WIDTH."""
    return None if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit() else PIPE_WIDTH


def stdout_console(stderr: bool = False, file: TextIO | None = None) -> Console:
    """The console every command prints its report to (`stderr`: when stdout carries JSON; `file`: another stream,
    e.g. ReaderGoneSafe). The renderers style what matters themselves: rich's regex highlighter and emoji codes cost
    milliseconds and would colour digits. Control characters in what is printed are shown, not obeyed
    (SafeConsole)."""
    return SafeConsole(stderr=stderr, file=file, width=console_width(), highlight=False, emoji=False)


def warn(message: str, label: str = "warning") -> None:
    """A warning or a note (`label`) on stderr, as compilers and pip print theirs: stdout keeps the report (or the
    JSON), and a reader of a piped report does not get them mixed in. Wrapped at the terminal's width (80 columns
    when stderr is not a terminal and COLUMNS is not set), never one long line; control characters shown."""
    console = SafeConsole(stderr=True, highlight=False, emoji=False)
    text = Text(f"{label}: ", style="yellow")
    text.append(message)
    console.print(text)


# C0 and C1 control characters but tab and newline: ESC starts a terminal escape sequence (retitle, clear, move the
# cursor, write to the clipboard), and a model's metadata (general.name, token pieces, a chat template's error)
# is outside text. rich strips only BEL, BS, VT, FF and CR from what it prints.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible_controls(text: str) -> str:
    """`text` with every control character but tab and newline written as a visible escape (ESC as \\x1b)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class SafeConsole(Console):
    """A rich Console that never sends a control character it did not make itself: the text of every segment is
    passed through `visible_controls`; rich's own control segments (cursor moves of Live) pass unchanged."""

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> RenderResult:
        for segment in super().render(renderable, options):
            if segment.control is None and _CONTROL.search(segment.text):
                yield Segment(visible_controls(segment.text), segment.style)
            else:
                yield segment


class ReaderGoneSafe(io.TextIOBase):
    """stdout that turns into a sink once its reader has gone (`llmtrace run ... | head -1`).

    Python ignores SIGPIPE, so the next print would raise BrokenPipeError in the middle of a run and lose its
    trace files. Here the run goes on silently instead; file descriptor 1 is pointed at /dev/null (as the Python
    docs advise), so the interpreter's final flush does not complain either.
    """

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                self._stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone()

    def _gone(self) -> None:
        self.reader_gone = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, io.UnsupportedOperation):
            pass  # not a real file descriptor (a test's captured stream): nothing will flush it at exit

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")
