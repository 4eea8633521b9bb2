"""A Trace as a Chrome / Perfetto trace (the JSON "Trace Event Format"): open it in ui.perfetto.dev or chrome://tracing.

Spans ("X" complete events, one thread) nest like the computation:

    tokenize
    prefill | decode step j
      tok_embeddings
      layer i
        attention_norm
        attention      (wqkv rope kv_cache scores softmax pv wo; wq wk wv for a stage-by-stage trace)
        attn_residual
        ffn_norm
        ffn            (w13 act w2; w1 w3 act w2 stage by stage)
        ffn_residual
      norm
      lm_head
      sample
      detokenize

A tensor-parallel run (`--tp N`) gets one track (thread) per rank: "rank r", each with its own steps and stages,
and its collectives as spans of their own ("all_reduce after layers.3.attention.wo", category "collective") between
the stages they follow, with their bytes as args. Sampling and detokenizing show on the base rank's track.

Leaf spans are measured stage calls; "layer i", "attention" and "ffn" span their first to their last stage, so every
child lies inside its parent. Each span carries FLOPs and bytes (summed over its stages) as args.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from llmtrace.tracer.trace.records import PREFILL, StageRecord, StepRecord
from llmtrace.tracer.trace.summary import stage_totals
from llmtrace.tracer.trace.tp_records import CollectiveRecord, RankStep

if TYPE_CHECKING:
    from llmtrace.tracer.trace.run_trace import Trace

_PID = 1
_TID = 1


def chrome_trace(trace: "Trace") -> dict[str, Any]:
    setup = trace.tensor_parallel
    base_tid = _TID if setup is None else setup.base_rank + 1
    where = f"{trace.config.name} on {trace.environment.device}"
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": _PID, "tid": base_tid, "args": {"name": "llmtrace"}},
        {"name": "thread_name", "ph": "M", "pid": _PID, "tid": base_tid,
         "args": {"name": where if setup is None else f"rank {setup.base_rank} · {where}"}},
    ]
    tokenized = ([(f"tokenize seq {s.index}", s.tokenization) for s in trace.batch.sequences]
                 if trace.batch is not None else [("tokenize", trace.tokenization)])
    for name, tok in tokenized:
        if tok is not None:
            events.append(_span(name, tok.start_ns, tok.duration_ns, "tokenize",
                                {"tokens": len(tok.ids), "text": tok.model_text}, base_tid))
    by_step = _by_step(trace.stages)
    for step in trace.steps:
        events.extend(_step_events(step, by_step.get((step.phase, step.step), []), base_tid))
    for other_rank in trace.rank_stages:
        tid = other_rank.rank + 1
        events.append({"name": "thread_name", "ph": "M", "pid": _PID, "tid": tid,
                       "args": {"name": f"rank {other_rank.rank} · {where}"}})
        theirs = _by_step(other_rank.stages)
        for rank_step in other_rank.steps:
            events.extend(_rank_step_events(rank_step, theirs.get((rank_step.phase, rank_step.step), []), tid))
    events.extend(_collective(c) for c in trace.collectives)
    other: dict[str, Any] = {"model": trace.config.name, "source": trace.model.source,
                             "generated_text": trace.generated_text}
    if trace.batch is not None:
        other["batch"] = len(trace.batch.sequences)
        other["generated_texts"] = [s.generated_text for s in trace.batch.sequences]
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": other}


def _by_step(stages: Iterable[StageRecord]) -> dict[tuple[str, int], list[StageRecord]]:
    out: dict[tuple[str, int], list[StageRecord]] = {}
    for stage in stages:
        out.setdefault((stage.phase, stage.step), []).append(stage)
    return out


def _step_name(phase: str, step: int) -> str:
    return "prefill" if phase == PREFILL else f"decode step {step}"


def _step_events(step: StepRecord, stages: list[StageRecord], tid: int = _TID) -> list[dict[str, Any]]:
    events = [_span(_step_name(step.phase, step.step), step.start_ns, step.duration_ns, step.phase, {
        **_totals(stages), "input_tokens": step.input_tokens, "context_length": step.context_length,
        "token_id": step.token_id, "piece": step.piece, "kv_live_bytes": step.kv_live_bytes,
        "kv_allocated_bytes": step.kv_allocated_bytes,
        **({"batch": step.batch, "tokens": " | ".join(f"{r.sequence}:{r.piece}" for r in step.rows)} if step.rows else {}),
    }, tid)]
    events.extend(_stage_events(stages, tid))
    forward_end = step.start_ns + step.forward_ns
    sampled = ({"rows": len(step.rows), "token_ids": [r.token_id for r in step.rows]} if step.rows else
               {"token_id": step.token_id, "probability": step.probability})
    events.append(_span("sample", forward_end, step.sample_ns, "sample",
                        {**sampled, "filters": ",".join(step.filters) or "greedy"}, tid))
    events.append(_span("detokenize", forward_end + step.sample_ns, step.detokenize_ns, "detokenize",
                        {"texts": [r.text for r in step.rows]} if step.rows else {"text": step.text}, tid))
    if step.compact_ns:
        events.append(_span("compact batch", forward_end + step.sample_ns + step.detokenize_ns, step.compact_ns,
                            "compact", {"left": [r.sequence for r in step.rows if r.finished]}, tid))
    return events


def _rank_step_events(step: RankStep, stages: list[StageRecord], tid: int) -> list[dict[str, Any]]:
    """Another rank's forward of one step: its span (the forward only: that rank's sampling is not timed apart)."""
    span = _span(_step_name(step.phase, step.step), step.start_ns, step.forward_ns, step.phase, _totals(stages), tid)
    return [span, *_stage_events(stages, tid)]


def _collective(c: CollectiveRecord) -> dict[str, Any]:
    return _span(f"{c.kind} after {c.after}", c.start_ns, c.duration_ns, "collective", {
        "kind": c.kind, "payload_bytes": c.payload_bytes, "bytes_sent": c.bytes_sent, "ranks": list(c.ranks),
        "layer": c.layer, "step": c.step,
    }, c.rank + 1)


def _stage_events(stages: list[StageRecord], tid: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    layers: dict[int, list[StageRecord]] = {}
    for stage in stages:
        if stage.layer is None:
            events.append(_leaf(stage, "lm_head" if stage.kind == "lm_head" else stage.stage, tid))
        else:
            layers.setdefault(stage.layer, []).append(stage)
    for layer, members in sorted(layers.items()):
        events.append(_group(f"layer {layer}", members, {"layer": layer}, tid))
        groups: dict[str, list[StageRecord]] = {}
        for stage in members:
            role = stage.short_name
            if role.startswith("attention."):
                groups.setdefault("attention", []).append(stage)
            elif role.startswith("feed_forward."):
                groups.setdefault("ffn", []).append(stage)
            events.append(_leaf(stage, role, tid))
        for group_name, group in groups.items():
            events.append(_group(group_name, group, {"layer": layer}, tid))
    return events


def _leaf(stage: StageRecord, name: str, tid: int = _TID) -> dict[str, Any]:
    return _span(name, stage.start_ns, stage.duration_ns, stage.kind, {
        "stage": stage.stage,
        "input_shapes": [list(s) for s in stage.input_shapes],
        "output_shapes": [list(s) for s in stage.output_shapes],
        "dtype": stage.dtype,
        **_totals([stage]),
    }, tid)


def _group(name: str, members: list[StageRecord], extra: dict[str, Any], tid: int = _TID) -> dict[str, Any]:
    start = min(s.start_ns for s in members)
    end = max(s.end_ns for s in members)
    return _span(name, start, end - start, "group", {**extra, **_totals(members)}, tid)


def _totals(stages: Iterable[StageRecord]) -> dict[str, int]:
    t = stage_totals(stages)
    return {
        "flops": t.flops,
        "matmul_flops": t.matmul_flops,
        "bytes_read": t.bytes_read,
        "bytes_written": t.bytes_written,
        "weight_bytes_read": t.weight_bytes_read,
        "kv_bytes_read": t.kv_bytes_read,
        "kv_bytes_written": t.kv_bytes_written,
    }


def _span(name: str, start_ns: int, duration_ns: int, category: str, args: dict[str, Any],
          tid: int = _TID) -> dict[str, Any]:
    # ts/dur are microseconds; ns / 1000 keeps the nanoseconds as the fraction.
    return {"name": name, "cat": category, "ph": "X", "pid": _PID, "tid": tid,
            "ts": start_ns / 1000, "dur": duration_ns / 1000, "args": args}
