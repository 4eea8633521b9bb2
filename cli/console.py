"""The rich Console the analytical renderers print to."""

from __future__ import annotations

import sys

from rich.console import Console

# Wide enough for the formula columns when stdout is a pipe or a file (rich would otherwise assume 80).
PIPE_WIDTH = 140


def stdout_console() -> Console:
    # The renderers style what matters themselves: rich's regex highlighter and emoji codes cost milliseconds.
    return Console(width=None if sys.stdout.isatty() else PIPE_WIDTH, highlight=False, emoji=False)
