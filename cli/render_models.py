"""Rendering of the preset catalogue: one table when the console is wide enough, else the dimensions and the sizes
as two tables (an 80-column terminal), so no row wraps."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.tables import natural_width, report_table
from llmtrace.tracer.analytic.catalog import ModelRow, ModelsReport

_DIMENSIONS = (("d", "dim"), ("layers", "n_layers"), ("heads", "n_heads"), ("KV heads", "n_kv_heads"),
               ("head dim", "head_dim"), ("FFN", "ffn_dim"))


def render_models(console: Console, r: ModelsReport) -> None:
    title = f"[bold]Model presets[/] (weights and KV cache in {r.dtype}; sources in tracer/core/presets.py)"
    whole = _table(r, dimensions=True, sizes=True)
    if natural_width(console, whole) <= console.width:
        parts: list = [Text.from_markup(title), whole]
    else:
        parts = [Text.from_markup(title), _table(r, dimensions=True, sizes=False),
                 Text.from_markup(f"\n[bold]Sizes[/] in {r.dtype}"), _table(r, dimensions=False, sizes=True)]
    moe = [m for m in r.models if m.n_experts > 1]
    if moe:
        parts.append(Text("\nMixtures of experts (FFN E×F: E experts of F each; active: the parameters a token's "
                          "pass uses): " + ", ".join(_experts(m) for m in moe) + "."))
    windowed = [m for m in r.models if m.windowed_layers]
    if windowed:
        parts.append(Text("\nSliding windows (KV/position holds up to the window; past it a position adds only the "
                          "global layers' K and V): " + "; ".join(_window(m) for m in windowed) + "."))
    partial = [m for m in r.models if m.rotary_dim != m.head_dim]
    if partial:
        parts.append(Text("\nPartial rotary (RoPE turns the first values of each head, the rest pass through): "
                          + ", ".join(f"{m.name} {m.rotary_dim} of {m.head_dim}" for m in partial) + "."))
    console.print(Group(*parts, Text("\nUse a name with --model, or give a model folder, config.json or .gguf file "
                                      "instead.")))


def _experts(m: ModelRow) -> str:
    """"mixtral-8x7b top-2 of 8", with a shared expert every token runs where the model has one (Qwen2-MoE)."""
    shared = f" and a shared expert of {m.shared_expert_dim}" if m.shared_expert_dim else ""
    return f"{m.name} top-{m.experts_per_token} of {m.n_experts}{shared}"


def _table(r: ModelsReport, dimensions: bool, sizes: bool) -> Table:
    table = report_table(gap=1 if dimensions else 2)  # fourteen columns in 120, ten in 80
    table.add_column("name", no_wrap=True)
    if sizes:
        table.add_column("params", justify="right", no_wrap=True)
        table.add_column("active", justify="right", no_wrap=True)  # a mixture of experts' per token, else blank
    if dimensions:
        for header, _ in _DIMENSIONS:  # stacked headers ("KV" over "heads") when the sizes have their own table
            table.add_column(header if sizes else header.replace(" ", "\n"), justify="right", no_wrap=True)
        table.add_column("vocab", justify="right", no_wrap=True)
        table.add_column("context", justify="right", no_wrap=True)
        table.add_column("tied", no_wrap=True)
    if sizes:
        table.add_column("weights GB", justify="right", no_wrap=True)
        table.add_column("KV/position", justify="right", no_wrap=True)
    for m in r.models:
        table.add_row(*_cells(m, dimensions, sizes))
    return table


def _cells(m: ModelRow, dimensions: bool, sizes: bool) -> list[str]:
    cells = [m.name]
    if sizes:
        cells += [fmt.si(m.params, ""), fmt.si(m.active_params, "") if m.active_params != m.params else ""]
    if dimensions:
        cells += [str(getattr(m, field)) for _, field in _DIMENSIONS]
        if m.n_experts > 1:  # the FFN cell: E experts of F
            cells[-1] = f"{m.n_experts}×{m.ffn_dim}"
        cells += [fmt.count(m.vocab_size), fmt.count(m.max_seq_len), "yes" if m.tie_embeddings else ""]
    if sizes:
        cells += [fmt.number_in(m.weight_bytes, "G", fmt.EXACT), f"{fmt.figures(m.kv_bytes_per_token / 2**10, fmt.EXACT)} KiB"]
    return cells


def _window(m: ModelRow) -> str:
    """`gemma3-1b 22 of 26 layers at 512 positions, then 4.000 KiB a position`."""
    layers = "every layer" if m.windowed_layers == m.n_layers else f"{m.windowed_layers} of {m.n_layers} layers"
    past = (f"then {fmt.figures(m.kv_bytes_per_token_past_window / 2**10, fmt.EXACT)} KiB a position"
            if m.kv_bytes_per_token_past_window else "then nothing more")
    return f"{m.name} {layers} at {m.sliding_window:,} positions, {past}"
