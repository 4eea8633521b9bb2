"""Rendering of the preset catalogue."""

from __future__ import annotations

from rich.console import Console

from llmtrace.cli import units
from llmtrace.cli.text_table import TextTable, print_table
from llmtrace.tracer.analytic.catalog import ModelsReport


def render_models(console: Console, r: ModelsReport) -> None:
    table = TextTable(["name", "params", "d", "layers", "heads", "KV heads", "head dim", "FFN", "vocab", "context",
                       "tied", "weights GB", "KV/position"], "<>>>>>>>>><>>")
    for m in r.models:
        table.add_row(
            m.name, units.si(m.params), str(m.dim), str(m.n_layers), str(m.n_heads), str(m.n_kv_heads),
            str(m.head_dim), str(m.ffn_dim), f"{m.vocab_size:,}", f"{m.max_seq_len:,}", "yes" if m.tie_embeddings else "",
            f"{m.weight_bytes / 1e9:,.2f}", f"{m.kv_bytes_per_token / 2**10:,.1f} KiB",
        )
    print_table(console, f"[bold]Model presets[/] (weights and KV cache in {r.dtype}; sources in tracer/core/presets.py)",
                table, blank_line=False)
    console.print("\nUse a name with --model, or give a model folder, config.json or .gguf file instead.")
