"""`llmtrace run`, section 6: decode, one token per step, streamed live (rich Live) as the steps happen.

While streaming, the panel fits the terminal's height (rich Live crops anything taller, and the progress bar, the
speed and the text are at the bottom): the text shows its last lines, the table its latest steps, at most
STREAM_ROWS of them. Once finished, the panel shows every step and the whole text.

Redrawing is paced (RedrawPacer), not done per token: rich renders this panel at about 1 ms per table row on a
2-core AMD EPYC (45-55 ms for a 40-line terminal), so a redraw per step at 25 tokens/s more than doubled the
run's wall time (BENCHMARKS.md, "Decode step overhead").
"""

from __future__ import annotations

import time
from typing import Callable

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_run import PANEL_FRAME, section
from llmtrace.tracer.trace.records import StepRecord
from llmtrace.tracer.trace.summary import steps_per_second

# Lines of the streaming panel that are not table rows or text: its two borders, the table's header, the status
# line (more when it wraps), and one that rich Live keeps for the cursor.
_FIXED_LINES = 5
# The most step rows the streaming panel shows (each costs ~1 ms a redraw); the finished panel shows them all.
STREAM_ROWS = 12


class RedrawPacer:
    """Decides when the live view redraws: never twice within `min_interval` seconds, and after a redraw that took
    d seconds not again for d / `share` (so redrawing takes at most `share` of the run, whatever the terminal's
    size or speed). The first call always redraws."""

    def __init__(self, min_interval: float = 0.1, share: float = 0.04,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.min_interval = min_interval
        self.share = share
        self.clock = clock
        self._next = float("-inf")

    def redraw(self, refresh: Callable[[], None]) -> bool:
        """Call `refresh` if a redraw is due; whether it was."""
        start = self.clock()
        if start < self._next:
            return False
        refresh()
        end = self.clock()
        self._next = end + max(self.min_interval, (end - start) / self.share)
        return True


class DecodeView:
    """The decode panel; `add(step)` after each step, rendered by rich Live on every refresh."""

    def __init__(self, limit: int, prefill: StepRecord) -> None:
        self.limit = limit
        self.prefill = prefill
        self.steps: list[StepRecord] = []
        self.text = prefill.text
        self.generated = 1
        self.all_rows = False  # True once finished: the final table shows every step
        self.interrupted = False

    def add(self, step: StepRecord, generated: int) -> None:
        self.steps.append(step)
        self.text += step.text
        self.generated = generated

    def finish(self, interrupted: bool) -> None:
        self.all_rows = True
        self.interrupted = interrupted

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        status = self._status()
        text = Text("text so far: ", style="dim") + Text(self.text, style="green")
        if self.all_rows:
            yield self._panel(self.steps, status, text)
            return
        height = options.height or console.height
        width = max(options.max_width - PANEL_FRAME, 20)
        status_lines = len(status.wrap(console, width))
        lines = text.wrap(console, width)
        text_lines = min(len(lines), max(1, (height - _FIXED_LINES) // 3))
        if text_lines < len(lines):
            text = Text("…", style="dim") + Text("\n").join(lines[-text_lines:])
        rows = max(1, height - _FIXED_LINES - (status_lines - 1) - text_lines - 1)  # - 1: the "… earlier" row
        rows = min(rows, STREAM_ROWS)
        yield self._panel(self.steps[-rows:], status, text)

    def _status(self) -> Text:
        return Text.assemble(
            fmt.bar(self.generated / self.limit if self.limit else 1.0, 20, "green"),
            f" {self.generated}/{self.limit} tokens after a {self.prefill.input_tokens}-token prompt · "
            f"{fmt.tokens_per_s(steps_per_second(self.steps))}" + (" · [interrupted]" if self.interrupted else ""),
        )

    def _panel(self, rows: list[StepRecord], status: Text, text: Text) -> object:
        table = Table(show_edge=False, pad_edge=False, box=None)
        sampled = not self.prefill.greedy  # under greedy the final probability is always 100%: not shown
        columns = [("step", "right"), ("fed", "left"), ("→ next", "left"), ("p model", "right")]
        if sampled:
            columns.append(("p sampled", "right"))
        columns += [("step time", "right"), ("context", "right"), ("KV live", "right")]
        for name, justify in columns:
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        if len(rows) < len(self.steps):
            table.add_row("…", f"{len(self.steps) - len(rows)} earlier steps", *[""] * (len(columns) - 2))
        previous = {s.step: s for s in [self.prefill, *self.steps]}
        for step in rows:
            fed = previous.get(step.step - 1)
            model_p = fmt.probability(step.sampling.probability_raw) if step.sampling is not None else "-"
            cells = [str(step.step), fmt.piece(fed.piece) if fed else "", Text(fmt.piece(step.piece), style="bold"),
                     model_p]
            if sampled:
                cells.append(fmt.probability(step.probability))
            cells += [fmt.duration_ns(step.duration_ns), str(step.context_length), fmt.nbytes(step.kv_live_bytes)]
            table.add_row(*cells)
        return section("6 · Decode  one token per step, each reading the whole KV cache", Group(table, status, text))
