"""`llmtrace diff A.json B.json`: two saved traces side by side, without the model or torch."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmtrace.cli.app import app
from llmtrace.cli.command import command_class
from llmtrace.cli.errors import run_guarded
from llmtrace.cli.options import JsonOption


@app.command("diff", cls=command_class(), epilog=(
    "Example: llmtrace run capital --json a.json; llmtrace run capital --staged --json b.json; "
    "llmtrace diff a.json b.json"))
def diff_command(
    trace_a: Annotated[Path, typer.Argument(metavar="A.json", help="A trace written by `llmtrace run --json`.")],
    trace_b: Annotated[Path, typer.Argument(metavar="B.json", help="Another one, compared with A (ratios B/A).")],
    json_out: JsonOption = False,
) -> None:
    """Two runs side by side: same model or what differs, time, FLOPs and bytes per phase and per stage role (B/A),
    and the token where the generations part."""

    def body() -> int:
        from llmtrace.cli.cmd_show import read_trace
        from llmtrace.tracer.trace.diff import diff_traces

        diff = diff_traces(read_trace(trace_a), read_trace(trace_b))
        from llmtrace.cli.json_output import print_record
        from llmtrace.cli.render_diff import render_diff

        print_record(diff, json_out, render_diff, str(trace_a), str(trace_b))
        return 0

    code = run_guarded(body)
    if code:
        raise typer.Exit(code)
