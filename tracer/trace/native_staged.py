"""Tracing `--staged` one-token steps that run as the native decode step with the stages apart.

Under `--staged` the tracer wraps every stage module ("wrap", tracer/trace/hooks.py) and a prefill runs through them.
A one-token step of one sequence of a model whose decode step is native runs in C instead
(Transformer.staged_native, FusedPlan.staged_step): the stages of contract.staged_stages one by one, each its own
phase ended by a barrier and a clock reading on the clock time.perf_counter_ns reads, no module called. The model
hands those readings to its `staged_mark`'s TAKE_STAMPS; `NativeStagedMarks` is that mark, and turns one step's
readings into the raw events the wrappers would have left: stage i ran from reading i to reading i + 1, on the shapes
the stage modules see in that step (fused_marks.stage_shapes(staged=True), which tests hold against the modules'
own). The records built from them are the wrapped path's records (names, order, shapes, FLOPs, bytes, formats)
with C's times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from llmtrace.tracer.core import contract
from llmtrace.tracer.model.fused import TAKE_STAMPS
from llmtrace.tracer.trace.fused_marks import StepDims, stage_shapes
from llmtrace.tracer.trace.stage_clock import EventClock, HostClock, reads_host_clock
from llmtrace.tracer.trace.stage_cost import StageModule


def staged_order(model: nn.Module) -> list[str]:
    """The stage names the native staged step stamps, in its order: the embedding, each layer's staged stages, the
    final norm and the LM head (contract.staged_stages)."""
    specs = contract.staged_stages(getattr(model, "config", None))
    in_layer = [i for i, spec in enumerate(specs) if spec.in_layer]
    first, last = in_layer[0], in_layer[-1]
    names = [spec.role for spec in specs[:first]]
    for index in range(len(model.layers)):
        names.extend(f"layers.{index}.{spec.role}" for spec in specs[first : last + 1])
    names.extend(spec.role for spec in specs[last + 1 :])
    return names


@dataclass(frozen=True, slots=True)
class StagedStep:
    """One native staged step as taken: its clock readings (the start, then one after each stage) and its sizes."""

    readings: list[int]
    dims: StepDims


class NativeStagedMarks:
    """The model's `staged_mark` while a "wrap" Tracer is attached: takes the native staged step's readings.

    `usable()` says whether it can stand in for the wrappers (the model asks for the native staged step, the tracer's
    stages are that step's stages in its order, the clock is the plain host clock); `install()` / `remove()` around
    the run; `begin_step()` before a step; after it `taken()` says whether the step ran natively, and `take()` keeps
    its readings (a StagedStep, cheap: the tracer's end_step runs between decode steps), which `events()` turns into
    raw events (stage index, start, end, shape id) when the records are built, after the run."""

    def __init__(self, model: nn.Module, stages: list[StageModule]) -> None:
        self.model = model
        self.expected = len(stages) + 1  # a reading at the step's start, one after each stage
        self._readings: list[int] = []
        self._previous: Any = None
        self._pos_before = 0
        # each stamped stage's role (a layer stage's role inside its layer), in the step's order
        self._roles = [name.split(".", 2)[2] if name.startswith("layers.") else name for name in staged_order(model)]

        def mark() -> None:  # never called: the model reads only its TAKE_STAMPS
            return None

        setattr(mark, TAKE_STAMPS, self._readings.extend)
        self._mark = mark

    @staticmethod
    def usable(model: nn.Module, stages: list[StageModule], clock: HostClock | EventClock) -> bool:
        if not getattr(model, "staged_native", False) or not hasattr(model, "staged_mark"):
            return False
        if not reads_host_clock(clock):
            return False
        return [s.name for s in stages] == staged_order(model)

    def install(self) -> None:
        self._previous = self.model.staged_mark
        self.model.staged_mark = self._mark

    def remove(self) -> None:
        if self._previous is not None:
            self.model.staged_mark, self._previous = self._previous, None

    def begin_step(self) -> None:
        self._readings.clear()
        self._pos_before = self.model.pos

    def taken(self) -> bool:
        """Whether the step since `begin_step` ran as the native staged step (it left readings)."""
        return bool(self._readings)

    def take(self) -> StagedStep:
        """The step's readings and sizes, for `events` later."""
        readings = list(self._readings)
        self._readings.clear()
        if len(readings) != self.expected:
            raise RuntimeError(f"the native staged step left {len(readings)} clock readings, {self.expected} expected")
        seen = self.model.pos
        return StagedStep(readings, StepDims(1, seen - self._pos_before, seen))

    def events(self, step: StagedStep, add_shapes: Any) -> list[tuple[int, int, int, int]]:
        """The step's raw events; `add_shapes` interns a (input shapes, None, output shapes) key (ShapeTable.add)."""
        readings = step.readings
        shapes = stage_shapes(self.model.config, step.dims, staged=True)
        ids = {role: add_shapes((*inputs, None, *outputs)) for role, (inputs, outputs) in shapes.items()}
        return [(index, readings[index], readings[index + 1], ids[role]) for index, role in enumerate(self._roles)]
