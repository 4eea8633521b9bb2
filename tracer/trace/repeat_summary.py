"""Several runs of one generation summarised as medians and spreads, as llama-bench's `-r` reports them.

One run's times are one sample of a noisy machine; `llmtrace run --repeat K` runs the same generation K times and
this module turns the K traces into the median, min, max and standard deviation (the sample's, n - 1, as
llama-bench's `stddev`) of the time to first token, the prefill and decode tokens/s, the decode time per token and
each stage role's time per step. `--json` writes the record as the trace's "repeat" block. Pure functions of the
records (no torch).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from llmtrace.tracer.trace.records import DECODE, PREFILL
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.summary import role_rows, run_summary


SECONDS, TOKENS_PER_SECOND = "s", "tok/s"


@dataclass(frozen=True, slots=True)
class Spread:
    """One figure over the repeats."""

    unit: str  # SECONDS (a time: the fastest is the min) or TOKENS_PER_SECOND (a rate: the fastest is the max)
    median: float
    min: float
    max: float
    stddev: float  # the sample standard deviation (n - 1); 0 for one run
    samples: tuple[float, ...]  # in run order

    @classmethod
    def of(cls, samples: Sequence[float], unit: str = SECONDS) -> "Spread":
        stddev = statistics.stdev(samples) if len(samples) > 1 else 0.0
        return cls(unit, statistics.median(samples), min(samples), max(samples), stddev, tuple(samples))

    @property
    def fastest(self) -> float:
        return self.max if self.unit == TOKENS_PER_SECOND else self.min

    @property
    def slowest(self) -> float:
        return self.min if self.unit == TOKENS_PER_SECOND else self.max

    @property
    def relative_spread(self) -> float:
        """(max - min) / median: how much the machine moved the figure."""
        return (self.max - self.min) / self.median if self.median else 0.0


@dataclass(frozen=True, slots=True)
class StageSpread:
    role: str  # a stage role ("attention.wqkv", "output", ...), every layer's instance together
    kind: str
    prefill: Spread  # the role's time in the prefill, all layers
    decode_per_step: Spread  # the role's time per decode step, all layers


@dataclass(frozen=True, slots=True)
class RepeatSummary:
    repeats: int
    decode_steps: int  # per run (the same in every run); 0 when the first token ended the generation
    ttft: Spread  # tokenization + prefill step, as RunSummary.ttft_ns
    prefill_forward: Spread  # the prefill forward pass alone
    decode_per_token: Spread  # decode step wall time (forward + sampling + detokenization) per token
    decode_forward_per_token: Spread  # the decode forward passes alone, per token
    prefill_tokens_per_second: Spread  # prompt tokens / prefill forward time (the summary's figure, per run)
    decode_tokens_per_second: Spread  # decode tokens / the decode steps' wall time (the summary's figure, per run)
    stages: tuple[StageSpread, ...]  # empty when tracing was off


def repeat_summary(traces: Sequence[Trace]) -> RepeatSummary:
    """Medians and spreads over `traces`, runs of the same generation (same prompt, settings and token count)."""
    if not traces:
        raise ValueError("repeat_summary needs at least one trace")
    summaries = [run_summary(t) for t in traces]
    steps = {s.decode.steps for s in summaries}
    if len(steps) != 1:
        raise ValueError(f"the runs generated different numbers of decode steps ({sorted(steps)}); "
                         "repeat a greedy or seeded generation")
    n = steps.pop()

    def per_token(ns: int) -> float:
        return ns / 1e9 / n if n else 0.0

    prefill_roles = [{r.role: r for r in role_rows(t.stages_of(PREFILL))} for t in traces]
    decode_roles = [{r.role: r for r in role_rows(t.stages_of(DECODE))} for t in traces]
    stages = []
    for role, first in prefill_roles[0].items():
        if not all(role in p for p in prefill_roles):
            continue
        stages.append(StageSpread(
            role=role, kind=first.kind,
            prefill=Spread.of([p[role].totals.stage_ns / 1e9 for p in prefill_roles]),
            decode_per_step=Spread.of([per_token(d[role].totals.stage_ns) if role in d else 0.0
                                       for d in decode_roles]),
        ))
    return RepeatSummary(
        repeats=len(traces), decode_steps=n,
        ttft=Spread.of([s.ttft_ns / 1e9 for s in summaries]),
        prefill_forward=Spread.of([s.prefill.forward_ns / 1e9 for s in summaries]),
        decode_per_token=Spread.of([per_token(s.decode.step_ns) for s in summaries]),
        decode_forward_per_token=Spread.of([per_token(s.decode.forward_ns) for s in summaries]),
        prefill_tokens_per_second=Spread.of([s.prefill.forward_tokens_per_second for s in summaries],
                                            TOKENS_PER_SECOND),
        decode_tokens_per_second=Spread.of([s.decode_tokens_per_second for s in summaries], TOKENS_PER_SECOND),
        stages=tuple(stages),
    )
