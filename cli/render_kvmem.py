"""Rich rendering of a KVMemReport: formula, per-token and total bytes, a context-length table, GQA, budget."""

from __future__ import annotations

from rich.console import Console

from llmtrace.cli import units
from llmtrace.cli.text_table import TextTable, print_table
from llmtrace.tracer.analytic.kvmem import KVMemReport


def render_kvmem(console: Console, r: KVMemReport) -> None:
    s = r.size
    lines = [
        f"[bold]{r.model}[/] KV cache: {s.dtype}, batch {s.batch}, {s.seq:,} positions per sequence",
        f"  {r.formula}",
        f"  Per position: {s.bytes_per_token_per_layer:,} B per layer; {s.bytes_per_token:,} B "
        f"= {units.bytes_both(s.bytes_per_token)} over {s.n_layers} layers (one sequence).",
        f"  Per layer: {units.bytes_both(s.bytes_per_layer)}.  Total: [bold]{units.bytes_both(s.total_bytes)}[/].",
    ]
    if s.seq > r.max_seq_len:
        lines.append(f"  [yellow]Note: {s.seq:,} positions exceed the model's trained context ({r.max_seq_len:,}).[/]")
    g = r.without_gqa
    if g.n_kv_heads != s.n_kv_heads:
        lines.append(f"  Without GQA ({g.n_kv_heads} KV heads instead of {s.n_kv_heads}): "
                     f"{units.bytes_both(g.total_bytes)}, {r.gqa_saving:g}× more.")
    else:
        lines.append(f"  No GQA here: each of the {g.n_kv_heads} query heads keeps its own K and V.")
    console.print("\n".join(lines), soft_wrap=True)
    table = TextTable(["positions", "GB", "GiB", ""], ">>><")
    for row in r.table:
        mark = [m for m, hit in (("← --seq", row.seq == s.seq), ("model max", row.seq == r.max_seq_len)) if hit]
        table.add_row(f"{row.seq:,}", f"{row.total_bytes / 1e9:,.3f}", f"{row.total_bytes / 2**30:,.3f}",
                      ", ".join(mark), style="bold" if row.seq == s.seq else "")
    print_table(console, f"KV cache over context length ({s.dtype}, batch {s.batch})", table)
    b = r.budget
    if b is not None:
        beside = (f"{b.max_positions_with_weights:,} beside the {b.weights_dtype} weights ({units.gb(b.weights_bytes)})"
                  if b.max_positions_with_weights else
                  f"none beside the {b.weights_dtype} weights, which alone take {units.gb(b.weights_bytes)}")
        console.print(
            f"\nIn {units.bytes_both(b.budget_bytes)}: {b.max_positions_kv_only:,} positions per sequence of KV cache "
            f"alone (batch {s.batch}); {beside}.\nThe model was trained for {b.model_max_seq_len:,} positions.",
            soft_wrap=True,
        )
