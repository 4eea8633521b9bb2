"""Rich rendering of the preset catalogue."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from cli import units
from tracer.catalog import ModelsReport


def render_models(console: Console, r: ModelsReport) -> None:
    table = Table(title=f"Model presets (weights and KV cache in {r.dtype})", title_justify="left", box=box.SIMPLE_HEAD)
    for name, justify in (("name", "left"), ("params", "right"), ("d", "right"), ("layers", "right"),
                          ("heads", "right"), ("KV heads", "right"), ("head dim", "right"), ("FFN", "right"),
                          ("vocab", "right"), ("context", "right"), ("tied", "center"), ("weights GB", "right"),
                          ("KV/token", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    for m in r.models:
        table.add_row(
            m.name, units.si(m.params), str(m.dim), str(m.n_layers), str(m.n_heads), str(m.n_kv_heads),
            str(m.head_dim), str(m.ffn_dim), f"{m.vocab_size:,}", f"{m.max_seq_len:,}", "yes" if m.tie_embeddings else "",
            f"{m.weight_bytes / 1e9:,.2f}", f"{m.kv_bytes_per_token / 2**10:,.1f} KiB",
        )
    console.print(table)
    console.print("Use a name with --model, or pass a model folder, config.json or .gguf file instead.")
