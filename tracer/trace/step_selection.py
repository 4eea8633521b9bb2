"""Which decode steps keep every stage record (`run --trace-steps`); the others keep one StepTotals each.

A traced step holds one StageRecord per stage call (423 a step on the default model), so a long generation's trace
is dominated by records that say the same thing step after step. `--trace-steps first,last,every:100` keeps the full
records of the chosen decode steps and reduces every other decode step to its sums (FLOPs, bytes, KV traffic, stage
time), so the run's totals, rates and summary stay exact while the file stays small. The prefill is always kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.trace.records import DECODE, StageRecord, StepTotals
from llmtrace.tracer.trace.run_trace import Trace

ALL = "all"


@dataclass(frozen=True, slots=True)
class StepSelection:
    """Decode steps (numbered 1, 2, ... as in the trace) whose stage records are kept."""

    first: bool = False
    last: bool = False
    every: int | None = None  # every k-th step: k, 2k, 3k, ...
    steps: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, spec: str) -> "StepSelection | None":
        """'all' (None: keep everything), or a comma list of first, last, every:K and step numbers, e.g.
        'first,last,every:64' or '1,2,10'."""
        if spec.strip() == ALL:
            return None
        first = last = False
        every: int | None = None
        steps: set[int] = set()
        for raw in spec.split(","):
            item = raw.strip()
            if item == "first":
                first = True
            elif item == "last":
                last = True
            elif item.startswith("every:") and _positive(item.removeprefix("every:")):
                every = int(item.removeprefix("every:"))
            elif _positive(item):
                steps.add(int(item))
            else:
                raise BadArgumentError(f"--trace-steps: {item!r} is not first, last, every:K or a step number >= 1; "
                                       "e.g. --trace-steps first,last,every:64 (or all)")
        return cls(first=first, last=last, every=every, steps=frozenset(steps))

    def keeps(self, step: int, last_step: int) -> bool:
        return ((self.first and step == 1) or (self.last and step == last_step) or step in self.steps
                or (self.every is not None and step % self.every == 0))

    def describe(self) -> str:
        """The canonical spelling, as `parse` reads it (stored in the trace's settings)."""
        parts = [p for p, on in (("first", self.first), ("last", self.last)) if on]
        parts += [f"every:{self.every}"] if self.every else []
        parts += [str(s) for s in sorted(self.steps)]
        return ",".join(parts)


def prune_steps(trace: Trace, selection: StepSelection | None) -> Trace:
    """`trace` with the stage records of the decode steps `selection` does not keep replaced by one StepTotals each
    (the trace itself when `selection` is None or there is nothing to drop)."""
    if selection is None or not trace.stages:
        return trace
    decode_steps = [s.step for s in trace.steps if s.phase == DECODE]
    last_step = max(decode_steps, default=0)
    kept: list[StageRecord] = []
    dropped: dict[int, list[StageRecord]] = {}
    for stage in trace.stages:
        if stage.phase != DECODE or selection.keeps(stage.step, last_step):
            kept.append(stage)
        else:
            dropped.setdefault(stage.step, []).append(stage)
    if not dropped:
        return trace
    totals = tuple(step_totals(DECODE, step, dropped[step]) for step in sorted(dropped))
    return replace(trace, stages=tuple(kept), pruned_steps=tuple(sorted((*trace.pruned_steps, *totals),
                                                                         key=lambda t: (t.phase != "prefill", t.step))))


def step_totals(phase: str, step: int, stages: list[StageRecord]) -> StepTotals:
    """The sums of one step's stage records."""
    return StepTotals(
        phase=phase, step=step, calls=len(stages),
        matmul_flops=sum(s.matmul_flops for s in stages),
        elementwise_flops=sum(s.elementwise_flops for s in stages),
        weight_bytes_read=sum(s.weight_bytes_read for s in stages),
        activation_bytes_read=sum(s.activation_bytes_read for s in stages),
        activation_bytes_written=sum(s.activation_bytes_written for s in stages),
        kv_bytes_read=sum(s.kv_bytes_read for s in stages),
        kv_bytes_written=sum(s.kv_bytes_written for s in stages),
        stage_ns=sum(s.duration_ns for s in stages),
    )


def _positive(text: str) -> bool:
    return text.isdigit() and int(text) >= 1
