"""Rich rendering of a KVMemReport: formula, per-token and total bytes, a context-length table, GQA, budget."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from cli import units
from tracer.kvmem import KVMemReport


def render_kvmem(console: Console, r: KVMemReport) -> None:
    s = r.size
    console.print(f"[bold]{r.model}[/] KV cache, {s.dtype}, batch {s.batch}, {s.seq:,} positions")
    console.print(f"  {r.formula}")
    console.print(
        f"  Per position: {s.bytes_per_token_per_layer:,} B per layer, {s.bytes_per_token:,} B "
        f"({units.bytes_both(s.bytes_per_token)}) over {s.n_layers} layers, per sequence."
    )
    console.print(
        f"  Total: [bold]{units.bytes_both(s.total_bytes)}[/], {units.bytes_both(s.bytes_per_layer)} per layer."
    )
    if s.seq > r.max_seq_len:
        console.print(f"  [yellow]Note: {s.seq:,} positions exceed the model's trained context ({r.max_seq_len:,}).[/]")
    g = r.without_gqa
    if g.n_kv_heads != s.n_kv_heads:
        console.print(
            f"  Without GQA ({g.n_kv_heads} KV heads instead of {s.n_kv_heads}): {units.bytes_both(g.total_bytes)}, "
            f"{r.gqa_saving:g}× more."
        )
    else:
        console.print(f"  No GQA: every one of the {s.n_kv_heads} query heads has its own K and V.")
    table = Table(title=f"KV cache over context length (batch {s.batch})", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("positions", justify="right")
    table.add_column("GB", justify="right")
    table.add_column("GiB", justify="right")
    table.add_column("", no_wrap=True)
    for row in r.table:
        mark = []
        if row.seq == s.seq:
            mark.append("← --seq")
        if row.seq == r.max_seq_len:
            mark.append("model max")
        table.add_row(f"{row.seq:,}", f"{row.total_bytes / 1e9:,.3f}", f"{row.total_bytes / 2**30:,.3f}",
                      ", ".join(mark), style="bold" if row.seq == s.seq else "")
    console.print(table)
    b = r.budget
    if b is not None:
        beside = (f"{b.max_positions_with_weights:,} beside the {b.weights_dtype} weights ({units.gb(b.weights_bytes)})"
                  if b.max_positions_with_weights else f"none: the {b.weights_dtype} weights alone take "
                  f"{units.gb(b.weights_bytes)}")
        console.print(
            f"  In {units.bytes_both(b.budget_bytes)}: {b.max_positions_kv_only:,} positions per sequence of KV cache "
            f"alone (batch {s.batch}); {beside}. The model was trained for {b.model_max_seq_len:,}."
        )
