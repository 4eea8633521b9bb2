"""The one place that maps library errors to a one-line message and exit code 2."""

from __future__ import annotations

import os
import sys
from typing import Callable, TypeVar

import typer

from llmtrace.tracer.core.errors import LlmtraceError

T = TypeVar("T")
EXIT_USAGE = 2


def fail(message: str) -> "typer.Exit":
    """Print one line to stderr and return the Exit to raise (exit code 2). A message that quotes outside text over
    several lines (a chat template's Jinja error) is joined into one."""
    from llmtrace.cli.console import visible_controls  # a message may quote a model's metadata

    line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    print(f"llmtrace: error: {visible_controls(line)}", file=sys.stderr)
    return typer.Exit(code=EXIT_USAGE)


def run_guarded(fn: Callable[[], T]) -> T:
    """Run a command body; a user-fixable error becomes one line on stderr and exit 2 (traceback with LLMTRACE_DEBUG=1)."""
    try:
        return fn()
    except LlmtraceError as exc:
        if os.environ.get("LLMTRACE_DEBUG") == "1":
            raise
        raise fail(str(exc)) from None
