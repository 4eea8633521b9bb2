"""A dry run's traced figures beside the analytical estimate (llmtrace.tracer.analytic.estimate) for the same passes.

`llmtrace run --dry-run` builds the model on the meta device: nothing is computed, but every stage is traced with its
shapes, FLOPs and bytes. The two counts are independent (hooks on the real modules; formulas per stage), so
`DryRunPass.equal` is a check, not a copy. Pure Python over the records.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrace.tracer.analytic import estimate
from llmtrace.tracer.analytic.kernels import Kernels
from llmtrace.tracer.core.dtypes import get_dtype
from llmtrace.tracer.trace.records import DECODE, PREFILL
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.summary import layer_rows, stage_totals


@dataclass(frozen=True, slots=True)
class DryRunPass:
    phase: str  # PREFILL or DECODE
    new_tokens: int  # T
    context_length: int  # S: positions attended after the pass
    traced_flops: int
    estimated_flops: int
    equal: bool
    matmul_flops: int  # traced
    weight_bytes_read: int  # traced
    kv_bytes_moved: int  # traced KV bytes read + written


@dataclass(frozen=True, slots=True)
class DryRunCheck:
    passes: tuple[DryRunPass, ...]  # the prefill, then the decode step when one was traced
    n_layers: int
    layer_output_shapes: tuple[tuple[int, ...], ...]  # distinct output shapes of the prefill's layers
    kv_live_bytes_after_prefill: int | None
    dtype: str  # what the trace computed in ("bfloat16")


def dry_run_check(trace: Trace) -> DryRunCheck:
    dtypes = estimate.Dtypes.for_weights(get_dtype(trace.environment.dtype))  # "bfloat16" -> bf16
    passes = []
    for phase in (PREFILL, DECODE):
        step = next((s for s in trace.steps if s.phase == phase), None)
        if step is None:
            continue
        # llmtrace's model runs eager kernels (every attention pair computed): the estimate is asked for the same
        if phase == PREFILL:
            est = estimate.prefill(trace.config, step.input_tokens, dtypes, kernels=Kernels.EAGER)
        else:
            est = estimate.decode_step(trace.config, step.context_length - step.input_tokens, dtypes,
                                       kernels=Kernels.EAGER)
        traced = stage_totals(trace.stages_of(phase))
        passes.append(DryRunPass(
            phase=phase, new_tokens=step.input_tokens, context_length=step.context_length,
            traced_flops=traced.flops, estimated_flops=est.totals.total_flops,
            equal=traced.flops == est.totals.total_flops, matmul_flops=traced.matmul_flops,
            weight_bytes_read=traced.weight_bytes_read, kv_bytes_moved=traced.kv_bytes_read + traced.kv_bytes_written,
        ))
    rows = layer_rows(trace.stages_of(PREFILL))
    prefill = trace.prefill_step
    return DryRunCheck(
        passes=tuple(passes), n_layers=len(rows),
        layer_output_shapes=tuple(sorted({tuple(r.stages[-1].output_shapes[0]) for r in rows})),
        kv_live_bytes_after_prefill=prefill.kv_live_bytes if prefill is not None else None,
        dtype=trace.environment.dtype,
    )
