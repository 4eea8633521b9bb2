"""`llmtrace run --dry-run`: the summary of a meta-device run, traced figures beside the analytical estimate
(llmtrace.tracer.trace.dry_run's record)."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_run import section
from llmtrace.tracer.trace.dry_run import DryRunCheck
from llmtrace.tracer.trace.records import PREFILL


def render_dry_run_summary(console: Console, check: DryRunCheck, model: str, note: str = "") -> None:
    """`model`: what to pass to `llmtrace roofline --model` for times on real hardware; `note`: a line more (a
    mixture of experts' routing)."""
    table = Table(show_edge=False, pad_edge=False, box=None)
    for name, justify in (("pass", "left"), ("traced\nFLOPs", "right"), ("estimate.py\nFLOPs", "right"),
                          ("", "left"), ("matmul\nshare", "right"), ("weights\nread", "right"),
                          ("KV read\n+ written", "right")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for p in check.passes:
        label = f"prefill T={p.new_tokens}" if p.phase == PREFILL else f"decode S={p.context_length}"
        table.add_row(label, fmt.flops(p.traced_flops), fmt.flops(p.estimated_flops),
                      "[green]= equal[/]" if p.equal else "[red]≠ differs[/]",
                      fmt.share(p.matmul_flops, p.traced_flops), fmt.nbytes(p.weight_bytes_read),
                      fmt.nbytes(p.kv_bytes_moved))
    exact = ", ".join(("prefill " if p.phase == PREFILL else "decode step ") + fmt.count(p.traced_flops)
                      for p in check.passes)
    kv = fmt.nbytes(check.kv_live_bytes_after_prefill) if check.kv_live_bytes_after_prefill is not None else "-"
    lines = [
        f"{check.n_layers} layers, each turning {' / '.join(fmt.shape(s) for s in check.layer_output_shapes)} into "
        f"the same shape (the residual stream); nothing was computed: the model lives on the meta device.",
        f"exact FLOPs: {exact}",
        f"KV cache after the prefill: {kv} in {check.dtype}",
        *([note] if note else []),
        f"[dim]for times on real hardware: llmtrace roofline --model {model}[/]",
    ]
    console.print(section("Dry run · FLOPs traced on the meta device vs the analytical estimate",
                          Group(table, Text.from_markup("\n".join(lines)))))
