"""One check shared by the tracer tests: a traced prompt and decode steps carry the FLOPs and the weight and KV
traffic that tracer/analytic/estimate.py computes for the same prompt length and contexts, in total and per stage."""

from __future__ import annotations

from typing import Sequence

from llmtrace.tracer.analytic import estimate
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.trace.records import StageRecord
from llmtrace.tracer.trace.summary import stage_totals


def assert_traced_equals_estimate(config: ModelConfig, records: Sequence[StageRecord], prompt_len: int,
                                  decode_steps: int) -> None:
    """Step 0 is the prefill of `prompt_len` tokens (fp32 weights), steps 1.. decode one token each. A packed stage
    of the fused path carries the components of its parts; the scores stage includes the scaling, a projection its
    bias add (estimate.stage_components)."""
    dtypes = estimate.Dtypes.for_weights(FP32)
    for step in range(decode_steps + 1):
        stages = [r for r in records if r.step == step]
        phase = (estimate.prefill(config, prompt_len, dtypes) if step == 0
                 else estimate.decode_step(config, prompt_len - 1 + step, dtypes))
        ours = stage_totals(stages)
        assert ours.flops == phase.totals.total_flops
        assert ours.matmul_flops == phase.totals.matmul_flops
        assert ours.weight_bytes_read == phase.totals.weight_bytes
        assert ours.kv_bytes_read == phase.totals.kv_read_bytes
        assert ours.kv_bytes_written == phase.totals.kv_write_bytes
        components = {c.name: c for c in phase.components}
        for record in (r for r in stages if r.layer == 0):
            role = record.short_name
            expected = sum(components[part].flops for part in estimate.stage_components(role, config))
            assert record.flops == expected, (step, role)
