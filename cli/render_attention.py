"""Section 5d of `llmtrace run --attention`: where the first token's predicted position looks, as a layers x
positions heat strip (heads averaged) and the most focused heads (AttentionStep records)."""

from __future__ import annotations

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_run import section
from llmtrace.tracer.trace.attention_focus import focused_heads, sink_heads
from llmtrace.tracer.trace.journey_records import AttentionStep

SHADES = ((0.6, "███"), (0.35, "▓▓▓"), (0.15, "▒▒▒"), (0.05, "░░░"), (0.0, " · "))
HEAD_POSITIONS, TAIL_POSITIONS = 2, 11  # a long prompt shows its first and last positions
PIECE_WIDTH = 5


def render_attention(console: Console, first: AttentionStep | None, numerics: str = "") -> None:
    """The first token's predicted position (later steps are in the JSON); `numerics`: which the products ran."""
    if first is None:
        return
    positions = list(range(first.positions))
    if len(positions) > HEAD_POSITIONS + TAIL_POSITIONS + 1:
        positions = [*positions[:HEAD_POSITIONS], -1, *positions[-TAIL_POSITIONS:]]
    table = Table(show_edge=False, pad_edge=False, box=None)
    table.add_column("layer")
    for p in positions:
        table.add_column("…" if p < 0 else escape(fmt.piece(first.pieces[p])[:PIECE_WIDTH]), justify="center",
                         no_wrap=True)
    for layer, row in enumerate(first.mean_weights):
        table.add_row(f"L{layer}", *("" if p < 0 else _shade(row[p]) for p in positions))
    sink = sink_heads(first)
    heads = focused_heads(first)
    focused = [
        f"L{h.layer} head {h.head}: {h.entropy_bits:.2f} bits, "
        f"{100 * h.top_weights[0]:.0f}% on {escape(fmt.piece(first.pieces[h.top_positions[0]]))!s} "
        f"(position {h.top_positions[0]})" for h in heads
    ]
    notes = [
        f"the predicted position ({first.position}) attending over {first.positions} positions, each layer's heads "
        "averaged: █ ≥ 60%, ▓ ≥ 35%, ▒ ≥ 15%, ░ ≥ 5%, · below (weights are the staged model's softmax output; "
        f"instrumentation: {fmt.duration_ns(first.instrument_ns)}, not in the stages' time).",
        f"{len(sink)} of {len(first.heads)} heads put most weight on position 0 (the first token: an attention "
        "sink); the most focused of the others (lowest entropy):", *(f"  {line}" for line in focused),
    ] + ([escape(numerics)] if numerics else [])
    console.print(section("5d · Attention  where the predicted position looks",
                          Group(table, Text.from_markup("\n".join(notes)))))


def _shade(weight: float) -> str:
    return next(s for threshold, s in SHADES if weight >= threshold)
