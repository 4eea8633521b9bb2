"""Numbers derived from a Trace: per-layer and per-role rows, phase totals, TTFT, tokens/s, achieved FLOP/s and
bytes/s.

Pure functions of the records (no torch), so a trace read back from JSON summarises the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from llmtrace.tracer.trace.records import (
    DECODE,
    MATMUL_KINDS,
    PREFILL,
    ByteTraffic,
    StageRecord,
    StepRecord,
    StepTotals,
)
from llmtrace.tracer.trace.run_trace import Trace


@dataclass(frozen=True, slots=True)
class StageTotals(ByteTraffic):
    """Sums over a set of stage records (their byte sums: records.ByteTraffic)."""

    calls: int
    flops: int
    matmul_flops: int
    weight_bytes_read: int
    activation_bytes_read: int
    activation_bytes_written: int
    kv_bytes_read: int
    kv_bytes_written: int
    stage_ns: int  # sum of the stages' own times


_COUNTS = ("calls", "flops", "matmul_flops", "weight_bytes_read", "activation_bytes_read",
           "activation_bytes_written", "kv_bytes_read", "kv_bytes_written", "stage_ns")


def _summed(parts: Iterable[StageTotals]) -> StageTotals:
    sums = dict.fromkeys(_COUNTS, 0)
    for part in parts:
        for name in _COUNTS:
            sums[name] += getattr(part, name)
    return StageTotals(**sums)


def _of_stage(s: StageRecord) -> StageTotals:
    return StageTotals(1, s.flops, s.matmul_flops, s.weight_bytes_read, s.activation_bytes_read,
                       s.activation_bytes_written, s.kv_bytes_read, s.kv_bytes_written, s.duration_ns)


def _of_pruned_step(t: StepTotals) -> StageTotals:
    return StageTotals(t.calls, t.matmul_flops + t.elementwise_flops, t.matmul_flops, t.weight_bytes_read,
                       t.activation_bytes_read, t.activation_bytes_written, t.kv_bytes_read, t.kv_bytes_written,
                       t.stage_ns)


def stage_totals(stages: Iterable[StageRecord]) -> StageTotals:
    return _summed(_of_stage(s) for s in stages)


def with_pruned(totals: StageTotals, pruned: Iterable[StepTotals]) -> StageTotals:
    """`totals` plus the sums of the steps whose stage records --trace-steps left out."""
    return _summed([totals, *(_of_pruned_step(t) for t in pruned)])


@dataclass(frozen=True, slots=True)
class LayerRow:
    """One transformer layer in one step: wall time from its first stage's start to its last stage's end."""

    layer: int
    wall_ns: int
    totals: StageTotals
    stages: tuple[StageRecord, ...]


def layer_rows(stages: Iterable[StageRecord]) -> list[LayerRow]:
    by_layer: dict[int, list[StageRecord]] = {}
    for s in stages:
        if s.layer is not None:
            by_layer.setdefault(s.layer, []).append(s)
    rows = []
    for layer, members in sorted(by_layer.items()):
        wall = max(s.end_ns for s in members) - min(s.start_ns for s in members)
        rows.append(LayerRow(layer, wall, stage_totals(members), tuple(members)))
    return rows


@dataclass(frozen=True, slots=True)
class RoleRow:
    """One stage role ("attention.wqkv", "ffn_norm", "output", ...): every layer's instance of it together."""

    role: str
    kind: str
    totals: StageTotals


def role_rows(stages: Iterable[StageRecord]) -> list[RoleRow]:
    """The stages grouped by role, in the order the roles first ran (a layer's order, the LM head last)."""
    by_role: dict[str, list[StageRecord]] = {}
    for s in stages:
        by_role.setdefault(s.short_name, []).append(s)
    return [RoleRow(role, members[0].kind, stage_totals(members)) for role, members in by_role.items()]


@dataclass(frozen=True, slots=True)
class PhaseSummary:
    """One phase (the prefill, or all decode steps together): its sums, and the rates they give."""

    phase: str
    steps: int
    tokens_in: int  # tokens fed through the model
    forward_ns: int  # model forward time, summed over steps
    step_ns: int  # whole steps (forward + sample + detokenize)
    totals: StageTotals  # empty (all zero) when tracing was off
    forward_tokens_per_second: float  # tokens_in / forward time (0 without a timed forward)
    step_ns_mean: float  # step_ns / steps: the time per generated token of this phase (0 without steps)
    flops_per_step: float  # totals.flops / steps
    bytes_read_per_step: float  # totals.bytes_read / steps
    flops_per_second: float  # totals.flops / forward time: the FLOP rate the forward passes reached
    min_bytes_per_second: float  # weight and KV traffic / forward time
    # FLOPs executed per byte the kernels moved (weights, KV and activations: the roofline's x axis), as
    # llmtrace.tracer.analytic.estimate defines it; the traced model runs eager kernels.
    arithmetic_intensity: float


def phase_summary(trace: Trace, phase: str) -> PhaseSummary:
    steps = [s for s in trace.steps if s.phase == phase]
    totals = with_pruned(stage_totals(trace.stages_of(phase)), [t for t in trace.pruned_steps if t.phase == phase])
    n = len(steps)
    forward_ns = sum(s.forward_ns for s in steps)
    step_ns = sum(s.duration_ns for s in steps)
    tokens_in = sum(s.input_tokens for s in steps)
    forward_s = forward_ns / 1e9
    return PhaseSummary(
        phase=phase,
        steps=n,
        tokens_in=tokens_in,
        forward_ns=forward_ns,
        step_ns=step_ns,
        totals=totals,
        forward_tokens_per_second=tokens_in / forward_s if forward_ns else 0.0,
        step_ns_mean=step_ns / n if n else 0.0,
        flops_per_step=totals.flops / n if n else 0.0,
        bytes_read_per_step=totals.bytes_read / n if n else 0.0,
        flops_per_second=totals.flops / forward_s if forward_ns else 0.0,
        min_bytes_per_second=totals.min_bytes / forward_s if forward_ns else 0.0,
        arithmetic_intensity=totals.flops / totals.bytes_moved if totals.bytes_moved else 0.0,
    )


def steps_per_second(steps: Sequence[StepRecord]) -> float:
    """Tokens the steps generated (one per step; one per row of a batched step) per second of their wall time,
    sampling included; 0 for none."""
    ns = sum(s.duration_ns for s in steps)
    return sum(s.tokens_out for s in steps) / (ns / 1e9) if ns else 0.0


@dataclass(frozen=True, slots=True)
class RunSummary:
    prompt_tokens: int  # a batched run: every sequence's, pads not counted
    generated_tokens: int  # a batched run: every sequence's
    # Tokenization + the prefill step (forward, sampling, detokenization): the request's time to first token (a
    # batched run: every prompt's tokenization and the batched prefill, the first token of every sequence). Not
    # the wall time since tokenization, which also holds llmtrace's own set-up (KV cache allocation, the warm-up
    # pass, entering the tracer), none of which a server pays per request.
    ttft_ns: int
    prefill: PhaseSummary
    decode: PhaseSummary
    decode_tokens_per_second: float  # decode tokens (all sequences) / the decode steps' wall time (sampling included)
    kv_allocated_bytes: int
    kv_live_bytes: int
    peak_rss_bytes: int
    peak_device_bytes: int | None


def run_summary(trace: Trace) -> RunSummary:
    prefill = phase_summary(trace, PREFILL)
    decode = phase_summary(trace, DECODE)
    first: StepRecord | None = trace.prefill_step
    if trace.batch is not None:
        tokenize_ns = sum(s.tokenization.duration_ns for s in trace.batch.sequences)
    else:
        tokenize_ns = trace.tokenization.duration_ns if trace.tokenization is not None else 0
    last = trace.steps[-1] if trace.steps else None
    return RunSummary(
        prompt_tokens=(trace.batch.prompt_tokens if trace.batch is not None else first.input_tokens if first else 0),
        generated_tokens=trace.batch.generated_tokens if trace.batch is not None else len(trace.generated_ids),
        ttft_ns=tokenize_ns + first.duration_ns if first else 0,
        prefill=prefill,
        decode=decode,
        decode_tokens_per_second=steps_per_second(trace.decode_steps),
        kv_allocated_bytes=last.kv_allocated_bytes if last else 0,
        kv_live_bytes=last.kv_live_bytes if last else 0,
        peak_rss_bytes=trace.peak_rss_bytes,
        peak_device_bytes=trace.peak_device_bytes,
    )


# ---- decode by stage ----------------------------------------------------------------------------------------

_WEIGHT_KINDS = frozenset({"linear", "lm_head"})  # the stages that stream a weight matrix


@dataclass(frozen=True, slots=True)
class DecodeStageRow:
    """One stage role over the decode steps, every layer's instance together, per step (mean over the steps)."""

    role: str
    kind: str
    calls_per_step: int
    ns_per_step: float
    flops_per_step: float
    bytes_moved_per_step: float  # weights, activations and KV, read and written
    bytes_per_second: float | None  # bytes moved over the stage's own time (None: not timed)
    flops_per_second: float | None  # for matmul stages only


@dataclass(frozen=True, slots=True)
class DecodeByStage:
    """Where a decode step's time goes, stage by stage (`llmtrace run`'s "Decode by stage")."""

    steps: int  # the decode steps averaged over: those whose stage records the trace kept
    all_steps: int  # every decode step of the run (more than `steps` when --trace-steps pruned some)
    forward_ns_per_step: float
    stages_ns_per_step: float  # the stages' own times; the rest of the forward is Python between them
    rows: tuple[DecodeStageRow, ...]
    weight_products_ns_per_step: float  # projections, FFN, LM head
    weight_stream_bytes_per_second: float | None  # their weight bytes over their time


def decode_by_stage(trace: Trace, decode: PhaseSummary) -> DecodeByStage | None:
    """`decode`: the run's decode summary. None when no decode step was traced (--no-trace, one token)."""
    stages = trace.stages_of(DECODE)
    traced = trace.traced_steps(DECODE)  # --trace-steps may have kept the stage records of some steps only
    if not stages or not traced:
        return None
    n = len(traced)
    rows = []
    for r in role_rows(stages):
        t = r.totals
        seconds = t.stage_ns / 1e9
        rows.append(DecodeStageRow(
            role=r.role, kind=r.kind, calls_per_step=t.calls // n, ns_per_step=t.stage_ns / n,
            flops_per_step=t.flops / n, bytes_moved_per_step=t.bytes_moved / n,
            bytes_per_second=t.bytes_moved / seconds if seconds else None,
            flops_per_second=t.flops / seconds if seconds and r.kind in MATMUL_KINDS else None,
        ))
    weights = stage_totals(s for s in stages if s.kind in _WEIGHT_KINDS)
    return DecodeByStage(
        steps=n, all_steps=decode.steps, forward_ns_per_step=sum(s.forward_ns for s in traced) / n,
        stages_ns_per_step=stage_totals(stages).stage_ns / n,
        rows=tuple(rows), weight_products_ns_per_step=weights.stage_ns / n,
        weight_stream_bytes_per_second=(weights.weight_bytes_read / (weights.stage_ns / 1e9)
                                        if weights.stage_ns else None),
    )
