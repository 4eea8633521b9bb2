"""Rich rendering of a KVMemReport: formula, per-token and total bytes, a context-length table, GQA, budget."""

from __future__ import annotations

from rich.console import Console, Group
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.tables import report_table
from llmtrace.tracer.analytic.kvmem import KVMemReport


def render_kvmem(console: Console, r: KVMemReport) -> None:
    s = r.size
    held = ""
    if s.cached_positions != s.seq:
        held = f" (sliding window: it holds the last {fmt.count(s.cached_positions)}"
        held += f" on all but {s.global_layers} global layers)" if s.global_layers else ")"
    lines = [
        f"[bold]{r.model}[/] KV cache: {s.dtype}, batch {s.batch}, {fmt.count(s.seq)} positions per sequence{held}",
        *([f"  [dim]{r.dtype_note}; --dtype for another[/]"] if r.dtype_note else []),
        fmt.flow(_formula_phrases(r.formula), console.width, indent="    "),
        *([fmt.flow([f"{'  ' if i == 0 else ''}[dim]{phrase}[/]" for i, phrase in enumerate(fmt.phrases(r.run_note))],
                    console.width, indent="    ")] if r.run_note else []),
        fmt.flow([f"  Per position: {fmt.count(s.bytes_per_token_per_layer)} B per layer;",
                  f"{fmt.count(s.bytes_per_token)} B = {fmt.bytes_both(s.bytes_per_token)}",
                  f"over {s.n_layers} layers (one sequence)."], console.width, indent="    "),
        f"  Per layer: {fmt.bytes_both(s.bytes_per_layer)}.  Total: [bold]{fmt.bytes_both(s.total_bytes)}[/].",
    ]
    if s.seq > r.max_seq_len:
        lines.append(f"  [yellow]Note: {fmt.count(s.seq)} positions exceed the model's trained context "
                     f"({fmt.count(r.max_seq_len)}).[/]")
    g = r.without_gqa
    if g.n_kv_heads != s.n_kv_heads:
        lines.append(f"  Without GQA ({g.n_kv_heads} KV heads instead of {s.n_kv_heads}): "
                     f"{fmt.bytes_both(g.total_bytes)}, {fmt.times(r.gqa_saving)} more.")
    else:
        lines.append(f"  No GQA here: each of the {g.n_kv_heads} query heads keeps its own K and V.")
    table = report_table()
    for name in ("positions", "GB", "GiB"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("")
    for row in r.table:
        mark = [m for m, hit in (("← --seq", row.seq == s.seq), ("model max", row.seq == r.max_seq_len)) if hit]
        table.add_row(fmt.count(row.seq), fmt.number_in(row.total_bytes, "G", fmt.EXACT),
                      fmt.number_in(row.total_bytes, "GiB", fmt.EXACT), ", ".join(mark),
                      style="bold" if row.seq == s.seq else "")
    title = f"\nKV cache over context length ({s.dtype}, batch {s.batch})"
    parts: list = [Text.from_markup("\n".join(lines)), Text(title), table]
    b = r.budget
    if b is not None:
        beside = (f"{fmt.count(b.max_positions_with_weights)} beside the {b.weights_dtype} weights "
                  f"({fmt.nbytes(b.weights_bytes)})" if b.max_positions_with_weights else
                  f"none beside the {b.weights_dtype} weights, which alone take {fmt.nbytes(b.weights_bytes)}")
        parts.append(Text(
            f"\nIn {fmt.bytes_both(b.budget_bytes)}: {fmt.count(b.max_positions_kv_only)} positions per sequence of "
            f"KV cache alone (batch {s.batch}); {beside}.\nThe model was trained for "
            f"{fmt.count(b.model_max_seq_len)} positions."
        ))
    console.print(Group(*parts))


def _formula_phrases(formula: str) -> list[str]:
    """'2 × 32 layers × … = 2,097,152,000 B' as phrases that each begin with their operator (but the first)."""
    terms = formula.replace(" = ", " × = ").split(" × ")
    return ["  " + terms[0], *(t if t.startswith("=") else "× " + t for t in terms[1:])]
