"""Every rank's trace of a tensor-parallel run as one Trace: the base rank's (0 unless it left none) with the others'
stage records (`rank_stages`), every rank's collectives and the run's set-up (`tensor_parallel`) added, every time on
the base rank's clock."""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmtrace.tracer.trace.records import StageRecord
from llmtrace.tracer.trace.run_trace import STOP_RANK_FAILED, Trace
from llmtrace.tracer.trace.tp_records import STATUS_OK, CollectiveRecord, RankStages, RankStep, TensorParallelRun


@dataclass(frozen=True, slots=True)
class RankTrace:
    """What one rank left: its own trace and collectives, times relative to its own origin."""

    rank: int
    origin_ns: int  # the rank's origin on the machine's monotonic clock
    trace: Trace
    collectives: tuple[CollectiveRecord, ...]


def _shift_stage(stage: StageRecord, by: int) -> StageRecord:
    return replace(stage, start_ns=stage.start_ns + by) if by else stage


def merge_rank_traces(ranks: list[RankTrace], setup: TensorParallelRun) -> Trace:
    """One Trace of the ranks' traces (at least one); `setup.status` other than "ok" marks it rank_failed."""
    ordered = sorted(ranks, key=lambda r: r.rank)
    base = ordered[0]
    others: list[RankStages] = []
    collectives: list[CollectiveRecord] = []
    status = setup.status
    for r in ordered:
        shift = r.origin_ns - base.origin_ns
        collectives.extend(replace(c, start_ns=c.start_ns + shift) for c in r.collectives)
        if r is base:
            continue
        if status == STATUS_OK and r.trace.generated_ids != base.trace.generated_ids:
            status = (f"rank {r.rank} generated other tokens than rank {base.rank} (a sharding or sampling bug); "
                      "report it with this trace")
        steps = tuple(RankStep(s.phase, s.step, s.start_ns + shift, s.forward_ns) for s in r.trace.steps)
        others.append(RankStages(r.rank, steps, tuple(_shift_stage(s, shift) for s in r.trace.stages),
                                 r.trace.peak_rss_bytes))
    trace = base.trace
    stop = trace.stop_reason if status == STATUS_OK else STOP_RANK_FAILED
    return replace(trace, stop_reason=stop, tensor_parallel=replace(setup, status=status, base_rank=base.rank),
                   collectives=tuple(collectives), rank_stages=tuple(others))
