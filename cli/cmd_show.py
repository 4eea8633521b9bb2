"""`llmtrace show trace.json`: a trace that `llmtrace run --json` saved, rendered again, without the model.

The renderers read only trace records, so a saved run shows the same sections as it did live (the decode stream as
its final table), on any machine. The roofline rows of the summary are left out: they compare the run with the
machine it ran on, which need not be this one (`llmtrace roofline --hardware ...` gives the bound anywhere).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from llmtrace.cli import formatting as fmt
from llmtrace.cli.app import app
from llmtrace.cli.command import command_class
from llmtrace.cli.errors import run_guarded
from llmtrace.cli.options import Detail, DetailOption

if TYPE_CHECKING:
    from llmtrace.tracer.trace.run_trace import Trace


@app.command("show", cls=command_class(), epilog="\b\nExample:\n  llmtrace run 今天天气真 --json-file run.json\n  llmtrace show run.json --detail ops")
def show(
    path: Annotated[Path, typer.Argument(metavar="TRACE.json", help="A trace written by `llmtrace run --json` "
                                                                    "(.json or .json.gz; '-' reads standard input).")],
    detail: DetailOption = Detail.layers,
    chrome_trace: Annotated[Optional[Path], typer.Option(
        "--chrome-trace", metavar="<path>", help="Also write it as a Chrome/Perfetto trace.")] = None,
    html: Annotated[Optional[Path], typer.Option(
        "--html", metavar="<path>", help="Also write a self-contained HTML report (inline SVG figures; needs the "
                                       "html extra: matplotlib).")] = None,
) -> None:
    """Render a saved trace again: the same sections as `llmtrace run`, no model, no torch."""
    # Imported here, not at the top: `llmtrace --help` imports every command module, and these (the trace records
    # and the renderers) would double its start-up (BENCHMARKS.md, "Analytical commands").
    from rich.markup import escape

    from llmtrace.cli.console import stdout_console
    from llmtrace.cli.output_files import check_outputs, check_writable, write_output
    from llmtrace.cli.render_run_report import render_ending, render_journey
    from llmtrace.tracer.trace.chrome import chrome_trace as chrome_trace_doc
    from llmtrace.tracer.trace.report import run_report

    console = stdout_console()

    def body() -> int:
        check_outputs({"--chrome-trace": chrome_trace, "--html": html},
                      {"TRACE.json": None if str(path) == "-" else path})
        for output in (chrome_trace, html):
            if output is not None:
                check_writable(output)
        trace = read_trace(path)
        env = trace.environment
        console.print(fmt.flow([f"[dim]{escape(str(path))}:[/]", f"[dim]llmtrace {env.llmtrace_version}[/]",
                                f"[dim]· torch {env.torch_version}[/]", f"[dim]· {escape(env.device_name)}[/]"],
                               console.width))
        render_journey(console, trace, detail.value)
        no_roofline = ("roofline: left out of a saved trace (it may come from another machine); see "
                       "`llmtrace roofline --model <model> --hardware <machine>`")
        render_ending(console, trace, detail.value, run_report(trace), None, no_roofline)
        if chrome_trace is not None:
            write_output(chrome_trace, json.dumps(chrome_trace_doc(trace), ensure_ascii=False))
            console.print(f"[dim]Chrome trace written to {chrome_trace} (open in ui.perfetto.dev)[/]")
        if html is not None:
            from llmtrace.cli.render_html import html_report

            write_output(html, html_report(trace, None, no_roofline))
            console.print(f"[dim]HTML report written to {html} (self-contained: open it in any browser)[/]")
        return 0

    code = run_guarded(body)
    if code:
        raise typer.Exit(code)


def read_trace(path: Path) -> Trace:
    """The trace in `path` ('-': standard input; gzip or not), or a one-line error saying what is wrong with it."""
    from llmtrace.cli.output_files import read_input
    from llmtrace.tracer.core.errors import LlmtraceError
    from llmtrace.tracer.trace.run_trace import Trace

    text = read_input(path, "trace", f"write one with `llmtrace run ... --json {path}`")
    try:
        return Trace.from_json(text)
    except LlmtraceError as exc:  # the same typed error, naming the file
        raise type(exc)(f"{path}: {exc}") from None
