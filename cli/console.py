"""The rich Console every command renders to: the terminal's width, COLUMNS when set, else PIPE_WIDTH."""

from __future__ import annotations

import functools
import os
import re
import sys
import unicodedata
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
    e.g. pipes.PipeGuard). The renderers style what matters themselves: rich's regex highlighter and emoji codes cost
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


# What a terminal obeys or hides rather than shows, so that outside text (a model's general.name, token pieces, a
# prompt, a chat template's error) could restyle it or lie about what it says:
# - C0 and C1 control characters but tab and newline (Unicode category Cc): ESC starts a terminal escape sequence
#   (retitle, clear, move the cursor, write to the clipboard); rich strips only BEL, BS, VT, FF and CR itself;
# - format characters (Cf): bidi overrides and isolates (U+202A-202E, U+2066-2069) reorder what follows, so a
#   right-to-left override turns a header around; zero-width spaces and joiners, U+FEFF and the tag characters are
#   invisible;
# - the line and paragraph separators (Zl U+2028, Zp U+2029), which some terminals break lines at;
# - lone surrogates (Cs), which a UTF-8 stream cannot even encode (text decoded with surrogateescape).
_ESCAPED = frozenset(("Cc", "Cf", "Zl", "Zp", "Cs"))
# Where those live (Unicode 14: every Cf, Zl, Zp and Cs code point is in these ranges; tests/test_terminal_text.py
# checks this against the running Python's unicodedata, code point by code point): a quick first look, so that
# ASCII and most of the BMP never reach the per-character check.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\xad\u0600-\u08ff\u180e\u200b-\u206f\ud800-\udfff"
                      "\ufeff\ufff9-\ufffb\U00010000-\U0010ffff]")


@functools.cache
def _shown(char: str) -> str:
    """`char` itself, or its escape when its category is one a terminal would obey or hide: \\x1b, \\u202e,
    \\U000e0041 (Python's own spellings)."""
    if unicodedata.category(char) not in _ESCAPED:
        return char
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def visible_controls(text: str) -> str:
    """`text` with every control, format, separator and lone-surrogate character (tab and newline kept) written as a
    visible escape: ESC as \\x1b, a right-to-left override as \\u202e."""
    return _CONTROL.sub(lambda m: _shown(m.group()), text)


class SafeConsole(Console):
    """A rich Console that never sends a control or format character it did not make itself: the text of every
    segment is passed through `visible_controls`; rich's own control segments (cursor moves of Live) pass unchanged."""

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> RenderResult:
        for segment in super().render(renderable, options):
            if segment.control is None and _CONTROL.search(segment.text):
                shown = visible_controls(segment.text)
                yield Segment(shown, segment.style) if shown != segment.text else segment
            else:
                yield segment
