"""`llmtrace run --batch N` and `show` of a batched trace: the sections that follow N sequences instead of one.

Tokenization becomes one row per sequence (its tokens and its left pads), the LM head section each sequence's first
token, the decode stream one row per sequence (its tokens so far, how it ended, the end of its text) above the steps
(rows in the batch, step time, KV), and the summary adds a table of the sequences. Every table fits 80 columns: texts
are cut to the width left, from the left for the live text (its newest characters matter).
"""

from __future__ import annotations

from typing import Sequence

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_run import section
from llmtrace.tracer.trace.batch_records import BatchRun
from llmtrace.tracer.trace.records import StepRecord, TokenizationRecord
from llmtrace.tracer.trace.summary import steps_per_second

MAX_SEQUENCE_ROWS = 16  # sequences listed in full; more are summed up in one line
_FIXED_LINES = 7  # the live panel's lines that are not table rows: borders, two headers, status, Live's cursor


def _one_line(text: str) -> str:
    return text.replace("\r", "").replace("\n", "⏎")


def render_batch_tokenization(console: Console, records: Sequence[TokenizationRecord], pads: Sequence[int]) -> None:
    table = Table(show_edge=False, pad_edge=False, box=None)
    table.add_column("seq", justify="right", style="dim")
    table.add_column("tokens", justify="right", style="cyan")
    table.add_column("pads", justify="right", style="dim")
    table.add_column("prompt", overflow="ellipsis", no_wrap=True)
    for index, (record, pad) in enumerate(list(zip(records, pads))[:MAX_SEQUENCE_ROWS]):
        table.add_row(str(index), str(len(record.ids)), str(pad), _one_line(record.text))
    if len(records) > MAX_SEQUENCE_ROWS:
        table.add_row("…", "", "", f"{len(records) - MAX_SEQUENCE_ROWS} more sequences")
    longest = max(len(r.ids) for r in records)
    seconds = sum(r.duration_ns for r in records)
    notes = [
        f"{len(records)} prompts → [bold]{sum(len(r.ids) for r in records)} tokens[/] in {fmt.duration_ns(seconds)}; "
        f"batched prefill [bold]{fmt.shape((len(records), longest))}[/]",
    ]
    if any(pads):
        notes.append(f"[dim]shorter prompts are left-padded to {longest}: pads are never attended and each "
                     "sequence's positions count from its own first token, so its logits are its batch-1 run's[/]")
    console.print(section("1 · Tokenization  N prompts → one batch", Group(table, Text.from_markup("\n".join(notes)))))


def render_batch_first_tokens(console: Console, prefill: StepRecord, dry_run: bool = False) -> None:
    """Section 5 for a batch: each sequence's first token, sampled from its own row of the logits."""
    if dry_run or not prefill.rows:
        return
    table = Table(show_edge=False, pad_edge=False, box=None)
    table.add_column("seq", justify="right", style="dim")
    table.add_column("→ first token")
    table.add_column("p", justify="right")
    for row in prefill.rows[:MAX_SEQUENCE_ROWS]:
        table.add_row(str(row.sequence), Text(fmt.piece(row.piece), style="bold"), fmt.probability(row.probability))
    if len(prefill.rows) > MAX_SEQUENCE_ROWS:
        table.add_row("…", f"{len(prefill.rows) - MAX_SEQUENCE_ROWS} more", "")
    how = "argmax of its row" if prefill.greedy else "each sequence its own sampler and seed"
    note = Text.from_markup(f"logits [{prefill.batch}, V] → one token per sequence ({how}) "
                            f"in {fmt.duration_ns(prefill.sample_ns)}")
    console.print(section("5 · LM head and sampling  one token per sequence", Group(table, note)))


class BatchDecodeView:
    """The decode panel of a batched run; `add(step)` after each step, rendered by rich Live on every refresh."""

    def __init__(self, sequences: int, limit: int, prefill: StepRecord) -> None:
        self.sequences = sequences
        self.limit = limit  # tokens per sequence at most
        self.prefill = prefill
        self.steps: list[StepRecord] = []
        self.tokens = [0] * sequences
        self.texts = [""] * sequences
        self.ended = [""] * sequences
        self.all_rows = False
        self.interrupted = False
        self._take(prefill)

    def _take(self, step: StepRecord) -> None:
        for row in step.rows:
            self.tokens[row.sequence] += 1
            self.texts[row.sequence] += row.text
            self.ended[row.sequence] = row.finished

    def add(self, step: StepRecord, generated: int = 0) -> None:
        self.steps.append(step)
        self._take(step)

    def finish(self, interrupted: bool) -> None:
        self.all_rows = True
        self.interrupted = interrupted

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        height = options.height or console.height
        seq_rows = min(self.sequences, MAX_SEQUENCE_ROWS)
        if self.all_rows:
            steps = self.steps
        else:
            steps = self.steps[-max(1, height - _FIXED_LINES - seq_rows - 1):]
        yield section("6 · Decode  one token per sequence per step",
                      Group(self._sequences(), Text(""), self._steps(steps), self._status()))

    def _sequences(self) -> Table:
        table = Table(show_edge=False, pad_edge=False, box=None)
        table.add_column("seq", justify="right", style="dim")
        table.add_column("tokens", justify="right")
        table.add_column("state")
        table.add_column("text so far (its end)", overflow="ellipsis", no_wrap=True, ratio=1)
        for q in range(min(self.sequences, MAX_SEQUENCE_ROWS)):
            state = self.ended[q] or ("stopped" if self.interrupted else "running")
            text = _one_line(self.texts[q])
            table.add_row(str(q), f"{self.tokens[q]}/{self.limit}", state, Text(text[-60:], style="green"))
        if self.sequences > MAX_SEQUENCE_ROWS:
            table.add_row("…", f"{sum(self.tokens[MAX_SEQUENCE_ROWS:])}", "",
                          f"{self.sequences - MAX_SEQUENCE_ROWS} more sequences")
        return table

    def _steps(self, shown: list[StepRecord]) -> Table:
        table = Table(show_edge=False, pad_edge=False, box=None)
        for name in ("step", "rows", "step time", "per token", "context", "KV live", "left batch"):
            table.add_column(name, justify="left" if name == "left batch" else "right")
        if len(shown) < len(self.steps):
            table.add_row("…", f"{len(self.steps) - len(shown)} earlier steps", *[""] * 5)
        for step in shown:
            left = [str(r.sequence) for r in step.rows if r.finished]
            table.add_row(str(step.step), str(step.batch), fmt.duration_ns(step.duration_ns),
                          fmt.duration_ns(step.duration_ns / max(step.batch, 1)), str(step.context_length),
                          fmt.nbytes(step.kv_live_bytes), ",".join(left[:6]) + ("…" if len(left) > 6 else ""))
        return table

    def _status(self) -> Text:
        done = sum(self.tokens)
        total = self.limit * self.sequences
        running = sum(1 for e in self.ended if not e)
        rate = sum(s.tokens_out for s in self.steps)
        seconds = sum(s.duration_ns for s in self.steps) / 1e9
        return Text.assemble(
            fmt.bar(done / total if total else 1.0, 20, "green"),
            f" {done} tokens · {running} of {self.sequences} running · "
            f"{fmt.tokens_per_s(rate / seconds if seconds else 0.0)} (all)"
            + (" · [interrupted]" if self.interrupted else ""),
        )


def render_batch_summary(console: Console, batch: BatchRun) -> None:
    """Each sequence: prompt tokens, pads, tokens generated, how it ended, its KV bytes and text."""
    table = Table(show_edge=False, pad_edge=False, box=None)
    table.add_column("seq", justify="right", style="dim")
    table.add_column("prompt", justify="right")
    table.add_column("pads", justify="right", style="dim")
    table.add_column("new", justify="right")
    table.add_column("stopped")
    table.add_column("KV", justify="right")
    table.add_column("text", overflow="ellipsis", no_wrap=True, ratio=1)
    for s in batch.sequences[:MAX_SEQUENCE_ROWS]:
        table.add_row(str(s.index), str(len(s.tokenization.ids)), str(s.pad), str(len(s.generated_ids)),
                      f"{s.stop_reason} @{s.last_step}", fmt.nbytes(s.kv_live_bytes),
                      Text(_one_line(s.generated_text), style="green"))
    if len(batch.sequences) > MAX_SEQUENCE_ROWS:
        rest = batch.sequences[MAX_SEQUENCE_ROWS:]
        table.add_row("…", str(sum(len(s.tokenization.ids) for s in rest)), str(sum(s.pad for s in rest)),
                      str(sum(len(s.generated_ids) for s in rest)), "", fmt.nbytes(sum(s.kv_live_bytes for s in rest)),
                      f"{len(rest)} more sequences")
    notes = [
        f"{len(batch.sequences)} sequences · {batch.prompt_tokens} prompt tokens, {batch.generated_tokens} generated "
        f"· {batch.padding} padding, finished rows: {batch.finished_rows}",
        f"KV per sequence: {fmt.nbytes(batch.kv_bytes_per_position)} per position (all layers, K and V); "
        f"pads hold {fmt.nbytes(batch.kv_pad_bytes)}, never read",
    ]
    console.print(section("Sequences", Group(table, Text.from_markup("[dim]" + "\n".join(notes) + "[/]"))))
