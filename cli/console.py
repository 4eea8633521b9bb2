"""The rich Console every command renders to: the terminal's width, COLUMNS when set, else PIPE_WIDTH."""

from __future__ import annotations

import os
import sys

from rich.console import Console

# Wide enough for the formula columns when stdout is a pipe or a file and COLUMNS is not set (rich would otherwise
# assume 80).
PIPE_WIDTH = 140


def console_width() -> int | None:
    """None (rich asks the terminal, or reads COLUMNS) on a terminal or when COLUMNS is set; else PIPE_WIDTH."""
    return None if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit() else PIPE_WIDTH


def stdout_console(stderr: bool = False) -> Console:
    """The console every command prints its report to (`stderr`: when stdout carries JSON). The renderers style what
    matters themselves: rich's regex highlighter and emoji codes cost milliseconds and would colour digits."""
    return Console(stderr=stderr, width=console_width(), highlight=False, emoji=False)
