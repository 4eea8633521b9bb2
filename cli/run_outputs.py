"""The files and stdout JSON a `run` writes (--json, --json-file, --chrome-trace, --html, --summary-json).

`save` is called as soon as the run has its trace and summary, before the ending is rendered: nothing after it
(rendering to a closed pipe, --repeat, a signal) can lose them, and stop signals wait for the writes.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from llmtrace.cli.run_args import OutputArgs

if TYPE_CHECKING:
    from llmtrace.tracer.roofline.compare import MeasuredVsBound
    from llmtrace.tracer.trace.repeat_summary import RepeatSummary
    from llmtrace.tracer.trace.run_trace import Trace
    from llmtrace.tracer.trace.summary_block import SummaryBlock

TRACE_SCHEMA = "tracer/trace/trace_schema.json"


class RunOutputs:
    """Writes one run's outputs once, and remembers what it wrote to say so after the report."""

    def __init__(self, options: OutputArgs, stdout: Any, repeat: int = 1) -> None:
        self.options = options
        self.stdout = stdout
        self.repeat = repeat  # --repeat K > 1: stdout, which takes one document, gets the trace after the K runs
        self.received: Any = None  # the stop-signal gate (cli/interrupts.py) the writes wait behind
        self.written: list[str] = []

    def save(self, trace: Trace, block: SummaryBlock, comparison: MeasuredVsBound | None,
             repeated: RepeatSummary | None = None, again: bool = False, roofline_note: str = "") -> None:
        """`again`: after --repeat's runs, the trace once more with their spreads (`repeated`); `roofline_note`:
        why there is no comparison (the summary's line, which the HTML report repeats)."""
        from llmtrace.cli.interrupts import deferred_interrupts

        with deferred_interrupts(self.received) if self.received is not None else nullcontext():
            self._write_trace(trace, block, repeated, again)
            if not again:
                self._write_others(trace, block, comparison, roofline_note)

    def _write_trace(self, trace: Trace, block: SummaryBlock, repeated: RepeatSummary | None, again: bool) -> None:
        from llmtrace.cli.output_files import write_output

        o = self.options
        if o.json and (again or self.repeat == 1):
            self.print(trace.to_json(indent=1, summary=block, repeat=repeated))
        if o.json_file is not None and (not again or repeated is not None):
            write_output(o.json_file, trace.to_json(indent=1, summary=block, repeat=repeated))
            if not again:
                self.written.append(f"trace written to {o.json_file} (JSON; schema {TRACE_SCHEMA})")

    def _write_others(self, trace: Trace, block: SummaryBlock, comparison: MeasuredVsBound | None,
                      roofline_note: str) -> None:
        from llmtrace.cli.output_files import write_output

        o = self.options
        if o.chrome_trace is not None:
            from llmtrace.tracer.trace.chrome import chrome_trace

            write_output(o.chrome_trace, json.dumps(chrome_trace(trace), ensure_ascii=False))
            self.written.append(f"Chrome trace written to {o.chrome_trace} (open in ui.perfetto.dev)")
        if o.summary_json:
            from llmtrace.cli.json_output import json_text

            self.print(json_text(block, indent=None))
        if o.html is not None:
            from llmtrace.cli.render_html import html_report

            write_output(o.html, html_report(trace, comparison, roofline_note))
            self.written.append(f"HTML report written to {o.html} (self-contained: open it in any browser)")

    def save_record(self, text: str, what: str, schema: str) -> None:
        """A record that is not a trace (--batch-sweep's): stdout with --json, the file with --json-file."""
        from llmtrace.cli.output_files import write_output

        if self.options.json:
            self.print(text)
        if self.options.json_file is not None:
            write_output(self.options.json_file, text)
            self.written.append(f"{what} written to {self.options.json_file} (JSON; schema {schema})")

    def print(self, text: str) -> None:
        self.stdout.write(text.rstrip("\n") + "\n")
        self.stdout.flush()

    def say_written(self, console: Any) -> None:
        for line in self.written:
            console.print(f"[dim]{line}[/]")
