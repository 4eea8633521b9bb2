"""Section 5b of `llmtrace run`: the sampling lesson, the first token's logits at several temperatures side by side,
with what top-k, top-p and min-p keep at each and the draw the run actually made (a SamplingLesson record)."""

from __future__ import annotations

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_run import section
from llmtrace.tracer.trace.journey_records import FILTERS_ILLUSTRATIVE, SamplingLesson
from llmtrace.tracer.trace.records import RunSettings, StepRecord


def render_sampling_lesson(console: Console, lesson: SamplingLesson | None, step: StepRecord,
                           settings: RunSettings, numerics: str = "") -> None:
    """`numerics`: which numerics the logits come from (render_kernels.numerics_note)."""
    if lesson is None or not lesson.columns:
        return
    temperatures = ", ".join(f"{c.temperature:g}" for c in lesson.columns)
    table = Table(show_edge=False, pad_edge=False, box=None)
    table.add_column("token")
    table.add_column("logit", justify="right")
    for column in lesson.columns:
        table.add_column(f"T={column.temperature:g}", justify="right")
    for row, token in enumerate(lesson.tokens):
        cells = []
        for column in lesson.columns:
            p = fmt.probability(column.probabilities[row])
            cells.append(p if column.final_probabilities[row] > 0 else f"[dim]{p} ✗[/]")
        chosen = token.token_id == step.token_id
        table.add_row(("→" if chosen else " ") + escape(fmt.piece(token.piece)), f"{token.logit:.2f}", *cells,
                      style="bold" if chosen else None)
    table.add_row("entropy, bits", "", *(f"{c.entropy_bits:.2f}" for c in lesson.columns), end_section=True)
    kept_rows = [("top-k", lesson.top_k > 0, "n_after_top_k", f"{lesson.top_k}"),
                 ("top-p", lesson.top_p < 1, "n_after_top_p", f"{lesson.top_p:g}"),
                 ("min-p", lesson.min_p > 0, "n_after_min_p", f"{lesson.min_p:g}")]
    first = True
    for name, on, field, value in kept_rows:
        if not on:
            continue
        label = f"{'' if first else 'then '}{name} {value} keeps"
        table.add_row(label, "", *(f"{getattr(c, field):,}" for c in lesson.columns))
        first = False
    source = ("the run's own filters" if lesson.filters_from != FILTERS_ILLUSTRATIVE
              else "common values for illustration (the run set no filter)")
    notes = [f"the prefill's logits over {lesson.vocab_size:,} tokens divided by T before the softmax: low T sharpens "
             f"the distribution toward the top token, high T flattens it. Filters at every T: {source}; ✗ = "
             "filtered out, so it could not be drawn at that T. Top-k keeps the same count at every T; top-p and "
             "min-p follow the shape.",
             _drawn(step, settings)] + ([escape(numerics)] if numerics else [])
    console.print(section(f"5b · Sampling lesson  the same logits at T = {temperatures}",
                          Group(table, Text.from_markup("\n".join(notes)))))


def _drawn(step: StepRecord, settings: RunSettings) -> str:
    piece = f"[bold]{escape(fmt.piece(step.piece))}[/]"
    if step.greedy:
        return f"this run is greedy (T = 0, the T → 0 limit of these columns): it took the argmax, {piece}"
    return (f"this run sampled at T = {settings.temperature:g} and drew {piece} "
            f"(p = {fmt.probability(step.probability)} after its filters)")
