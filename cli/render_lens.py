"""Section 5c of `llmtrace run --lens`: the logit lens, what the residual stream after each layer would predict
through the final norm and the LM head (LensStep records), for the first token, and where later tokens settle."""

from __future__ import annotations

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_run import section
from llmtrace.tracer.trace.journey_records import LensLayer, LensStep, LensToken

PIECE_WIDTH = 10


def render_lens(console: Console, first: LensStep | None, numerics: str = "") -> None:
    """The first token's lens (later steps are in the JSON); `numerics`: which the products ran (render_kernels)."""
    if first is None:
        return
    chosen = escape(fmt.piece(first.piece))
    table = Table(show_edge=False, pad_edge=False, box=None)
    table.add_column("after")
    for name in ("top 1", "top 2", "top 3"):
        table.add_column(name)
    table.add_column(f"{chosen[:PIECE_WIDTH]} rank", justify="right")
    table.add_column("p", justify="right")
    for layer in first.layers:
        top = layer.chosen_rank == 1
        marker = " ◀ first top" if layer.layer is not None and layer.layer == first.first_top_layer else ""
        table.add_row("embed" if layer.layer is None else f"L{layer.layer}", *_tops(layer, first.token_id),
                      f"{layer.chosen_rank:,}", f"{100 * layer.chosen_probability:.1f}%{marker}",
                      style="bold green" if top else None)
    n_layers = len(first.layers) - 1
    if first.first_top_layer is None:
        headline = f"{chosen} is never the top token before the sampler (it was drawn at rank {first.layers[-1].chosen_rank})"
    else:
        headline = (f"{chosen} first becomes the top token after layer {first.first_top_layer} of {n_layers} "
                    f"(layers 0-{n_layers - 1}); after the embedding it ranks {first.layers[0].chosen_rank:,}")
    notes = [f"[bold]{headline}[/]",
             "each row: the residual stream at the predicted position after that layer, through the final RMSNorm "
             "and the LM head, as if the model stopped there (instrumentation: not in the stages' FLOPs or time; "
             f"{fmt.duration_ns(first.instrument_ns)} for this step)."] + ([escape(numerics)] if numerics else [])
    console.print(section(f"5c · Logit lens  what each layer would predict at position {first.position}",
                          Group(table, Text.from_markup("\n".join(notes)))))


def _tops(layer: LensLayer, chosen: int) -> list[str]:
    return [_token(t, t.token_id == chosen) for t in layer.top]


def _token(token: LensToken, chosen: bool) -> str:
    piece = escape(fmt.piece(token.piece)[:PIECE_WIDTH])
    text = f"{piece} {100 * token.probability:.0f}%"
    return f"[underline]{text}[/]" if chosen else text
