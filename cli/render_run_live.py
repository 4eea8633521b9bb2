"""`llmtrace run`, section 6: decode, one token per step, streamed live (rich Live) as the steps happen."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from llmtrace.cli import render_run_format as fmt
from llmtrace.cli.render_run import section
from llmtrace.tracer.trace.records import StepRecord

LIVE_ROWS = 24  # rows kept on screen while streaming; the final table shows every step


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

    def __rich__(self) -> RenderableType:
        table = Table(show_edge=False, pad_edge=False, box=None)
        sampled = not self.prefill.greedy  # under greedy the final probability is always 100%: not shown
        columns = [("step", "right"), ("fed", "left"), ("→ next", "left"), ("p model", "right")]
        if sampled:
            columns.append(("p sampled", "right"))
        columns += [("step time", "right"), ("context", "right"), ("KV live", "right")]
        for name, justify in columns:
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        rows = self.steps if self.all_rows else self.steps[-LIVE_ROWS:]
        if len(rows) < len(self.steps):
            table.add_row("…", f"{len(self.steps) - len(rows)} earlier steps", *[""] * (len(columns) - 2))
        previous = {s.step: s for s in [self.prefill, *self.steps]}
        for step in rows:
            fed = previous.get(step.step - 1)
            model_p = f"{100 * step.sampling.probability_raw:.1f}%" if step.sampling is not None else "-"
            cells = [str(step.step), fmt.piece(fed.piece) if fed else "", Text(fmt.piece(step.piece), style="bold"),
                     model_p]
            if sampled:
                cells.append(f"{100 * step.probability:.1f}%")
            cells += [fmt.ms(step.duration_ns), str(step.context_length), fmt.nbytes(step.kv_live_bytes)]
            table.add_row(*cells)
        decode_ns = sum(s.duration_ns for s in self.steps)
        rate = len(self.steps) / (decode_ns / 1e9) if decode_ns else 0.0
        status = Text.assemble(
            fmt.bar(self.generated / self.limit if self.limit else 1.0, 30, "green"),
            f" {self.generated}/{self.limit} tokens · {rate:.1f} tok/s"
            + (" · [interrupted]" if self.interrupted else ""),
        )
        text = Text(self.text, style="green")
        body = Group(table, status, Text("text so far: ", style="dim") + text)
        return section(f"6 · Decode  one token per step, each reading the whole KV cache "
                       f"(prompt {self.prefill.input_tokens} tokens)", body)
