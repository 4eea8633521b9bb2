"""`llmtrace run --dry-run`: the summary of a meta-device run, traced figures beside tracer/analytic/estimate.py's."""

from __future__ import annotations

from typing import Any, Sequence

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from llmtrace.cli import render_run_format as fmt
from llmtrace.cli.render_run import section
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.records import DECODE, PREFILL, StageRecord
from llmtrace.tracer.trace.summary import layer_rows, stage_totals


def dry_run_estimates(trace: Trace) -> dict[str, Any]:
    """tracer/analytic/estimate.py's figures for the passes a dry run traced (same prompt length, same context): "prefill"
    and "decode" -> PhaseEstimate."""
    from llmtrace.tracer.analytic import estimate
    from llmtrace.tracer.core.dtypes import get_dtype

    dtypes = estimate.Dtypes.for_weights(get_dtype(trace.environment.dtype))  # "bfloat16" -> bf16
    prefill = trace.prefill_step
    if prefill is None:
        return {}
    out: dict[str, Any] = {"prefill": estimate.prefill(trace.config, prefill.input_tokens, dtypes)}
    if trace.decode_steps:
        out["decode"] = estimate.decode_step(trace.config, prefill.context_length, dtypes)
    return out


def render_dry_run_summary(console: Console, trace: Trace) -> None:
    """The traced figures of a dry run beside `dry_run_estimates(trace)`."""
    estimates = dry_run_estimates(trace)
    table = Table(show_edge=False, pad_edge=False, box=None)
    for name, justify in (("pass", "left"), ("traced FLOPs", "right"), ("estimate.py", "right"), ("", "left"),
                          ("matmul", "right"), ("weights read", "right"), ("KV read + written", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    totals_of = {phase: stage_totals(trace.stages_of(phase)) for phase in (PREFILL, DECODE)}
    for phase, totals in totals_of.items():
        step = next((s for s in trace.steps if s.phase == phase), None)
        if step is None:
            continue
        est = estimates.get(phase)
        est_flops = est.totals.total_flops if est is not None else None
        same = "[green]= equal[/]" if est_flops == totals.flops else "[red]≠ differs[/]"
        label = (f"prefill, T = {step.input_tokens}" if phase == PREFILL
                 else f"decode step, S = {step.context_length}")
        table.add_row(label, fmt.flops(totals.flops), fmt.flops(est_flops) if est_flops is not None else "-", same,
                      fmt.percent(totals.matmul_flops, totals.flops), fmt.nbytes(totals.weight_bytes_read),
                      fmt.nbytes(totals.kv_bytes_read + totals.kv_bytes_written))
    rows = layer_rows(trace.stages_of(PREFILL))
    shapes = sorted({_shape(r.stages) for r in rows})
    prefill_step = trace.prefill_step
    lines = [
        f"{len(rows)} layers, each turning {' / '.join(shapes)} into the same shape "
        f"(the residual stream); nothing was computed: the model lives on the meta device.",
        f"exact FLOPs: prefill {totals_of[PREFILL].flops:,}, decode step {totals_of[DECODE].flops:,}",
        f"KV cache after the prefill: {fmt.nbytes(prefill_step.kv_live_bytes) if prefill_step else '-'} "
        f"in {trace.environment.dtype}",
        f"[dim]for times on real hardware: llmtrace roofline --model {trace.settings.model or trace.config.name}[/]",
    ]
    console.print(section("Dry run · FLOPs traced on the meta device vs the analytical estimate",
                          Group(table, Text.from_markup("\n".join(lines)))))


def _shape(stages: Sequence[StageRecord]) -> str:
    return fmt.shape(stages[-1].output_shapes[0])
