"""`llmtrace run`, after section 6: where a decode step's time goes, stage by stage (every layer's instance of a
stage together, averaged over the decode steps), with the bytes each moved and the rate it reached."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from llmtrace.cli import render_run_format as fmt
from llmtrace.cli.render_run import STAGE_LABELS, TOP_STAGE_LABELS, section
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.records import DECODE, MATMUL_KINDS
from llmtrace.tracer.trace.summary import PhaseSummary, role_rows, stage_totals

# Roles whose layer label is shared by two roles of a layer: say which one.
_ROLE_LABELS = {"attention_norm": "RMSNorm (attention)", "ffn_norm": "RMSNorm (FFN)",
                "attn_residual": "residual + (attention)", "ffn_residual": "residual + (FFN)"}
_WEIGHT_KINDS = frozenset({"linear", "lm_head"})


def render_decode_stages(console: Console, trace: Trace, phase: PhaseSummary) -> None:
    """`phase`: the run's decode summary. Nothing when the run traced no decode step (--no-trace, one token)."""
    stages = trace.stages_of(DECODE)
    if not stages or not phase.steps:
        return
    steps = phase.steps
    forward_per_step = phase.forward_ns / steps
    rows = role_rows(stages)
    slowest = max(r.totals.stage_ns for r in rows) or 1
    table = Table(show_edge=False, pad_edge=False, box=None)
    for name, justify in (("stage", "left"), ("× / step", "right"), ("time / step", "right"), ("share", "right"),
                          ("FLOPs / step", "right"), ("bytes / step", "right"), ("rate", "right"), ("", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        t = row.totals
        label = _ROLE_LABELS.get(row.role) or STAGE_LABELS.get(row.role) or TOP_STAGE_LABELS.get(row.role, row.role)
        seconds = t.stage_ns / 1e9
        rate = fmt.bytes_per_second(t.bytes_moved / seconds) if seconds else "-"
        if row.kind in MATMUL_KINDS and seconds:
            rate += f" · {fmt.flops_per_second(t.flops / seconds)}"
        style = "" if row.kind in MATMUL_KINDS else "dim"
        table.add_row(Text(label, style=style), str(t.calls // steps), fmt.ms(t.stage_ns / steps),
                      fmt.percent(t.stage_ns, phase.forward_ns), fmt.flops(t.flops / steps),
                      fmt.nbytes(t.bytes_moved / steps), Text(rate, style=style),
                      fmt.bar(t.stage_ns / slowest, 16))
    weights = stage_totals(s for s in stages if s.kind in _WEIGHT_KINDS)
    staged = phase.totals
    streamed = (fmt.bytes_per_second(weights.weight_bytes_read / (weights.stage_ns / 1e9)) if weights.stage_ns
                else "-")
    note = (
        f"mean of {steps} decode steps, every layer's instance of a stage together; rate = bytes moved (weights, "
        f"activations, KV) and FLOPs over the stage's own time.\n"
        f"the weight products (projections, FFN, LM head) take {fmt.percent(weights.stage_ns, phase.forward_ns)} "
        f"of the forward and stream their weights at {streamed}; "
        f"the other stages move little and cost their launch overhead.\n"
        f"stages add up to {fmt.ms(staged.stage_ns / steps)} of the {fmt.ms(forward_per_step)} forward per step "
        f"(the rest: Python between them)."
    )
    console.print(section(f"6 · Decode by stage  where a step's {fmt.ms(forward_per_step)} go",
                          Group(table, Text(note, style="dim"))))
