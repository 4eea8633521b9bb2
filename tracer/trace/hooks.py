"""The Tracer: when each stage of the model ran, on what shapes, and what that cost.

It traces the path the model takes. On the fused path (the default when nothing else watches the model) the path
itself marks the end of each stage and the Tracer's mark reads the clock (tracer/trace/fused_marks.py). Stage by stage,
each stage module is wrapped (or hooked): one clock read before and one after it, then the shapes of the tensors
in and out (torch.Size objects, no copies), kept as the id of that set of shapes (ShapeTable). Either way FLOPs and
bytes are worked out from the shapes later, once per stage and set of shapes
(`Tracer.records()`, after the run), by tracer/trace/stage_cost.py with each stage kind's formula
(tracer/core/stage_kinds.py), which the analytical estimate reads too.

The instrumentation exists only inside `with Tracer(model) as tracer:` and is removed in `finally`, also after an
exception. Stage boundaries are stamped by tracer/trace/stage_clock.py: on cuda with CUDA events (the kernels' own
times, no synchronize between stages), on mps with the host clock after a synchronize, on cpu with the host clock.
"""

from __future__ import annotations

import operator
import time
from typing import Any

import torch
from torch import nn

from llmtrace.tracer.core import contract
from llmtrace.tracer.core.contract import INDEX_ARGUMENTS, TUPLE_OUTPUT_KINDS
from llmtrace.tracer.model.fused import TAKE_STAMPS, Mark, no_mark, watcher
from llmtrace.tracer.trace.fused_marks import FusedMarks, StepDims, fused_events, fused_stages, marks_off_reason
from llmtrace.tracer.trace.records import StageRecord
from llmtrace.tracer.trace.stage_clock import EventClock, HostClock, clock_for
from llmtrace.tracer.trace.stage_cost import INDEX_ITEMSIZE, StageCost, StageModule, stage_cost

MECHANISMS = ("auto", "fused", "wrap", "hooks")
MODULE_MECHANISMS = ("wrap", "hooks")  # the ones that instrument the stage modules
_NO_INSTANCE_FORWARD = object()  # marks a module whose forward came from its class (the usual case)

# A raw event, kept on the hot path of every traced stage call: (stage index, start stamp, end stamp, shape id).
# Four ints, not a record: the shapes a call saw are interned once per distinct set (ShapeTable), so a step's ~500
# events hold no lists or torch.Size objects. A tuple of ints is dropped from the garbage collector's lists at its
# first collection; events that held lists of torch.Size stayed tracked until the run's records were built, and
# the collector's passes over them grew with the run (BENCHMARKS.md, "`--staged` tracing overhead").
RawEvent = tuple[int, int, int, int]
ShapeKey = tuple[Any, ...]  # the input shapes, None, the output shapes (torch.Size or tuples: equal and same hash)
_SHAPE = operator.attrgetter("shape")  # through map(): no Python frame per tensor, unlike a comprehension


def stage_modules(model: nn.Module) -> list[tuple[StageModule, nn.Module]]:
    """The model's stage modules (the contract's stages, tracer/core/contract.py), in `named_modules()` order."""
    stages = contract.staged_stages(getattr(model, "config", None))
    layer_kinds = {s.role: s.kind for s in stages if s.in_layer}
    top_kinds = {s.role: s.kind for s in stages if not s.in_layer}
    found: list[tuple[StageModule, nn.Module]] = []
    for name, module in model.named_modules():
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
            kind = layer_kinds.get(parts[2])
            layer: int | None = int(parts[1])
        else:
            kind = top_kinds.get(name)
            layer = None
        if kind is None:
            continue
        found.append((StageModule.of(name, layer, kind, [module]), module))
    return found


class ShapeTable:
    """Interns the shapes of stage calls: each distinct (input shapes, output shapes) gets a small int id, once.

    A decode step repeats the same few shape sets in every layer (only S changes from step to step), so the hot path
    does one dict lookup of a tuple it builds anyway, and the record builder looks the shapes up by id."""

    __slots__ = ("ids", "shapes")

    def __init__(self) -> None:
        self.ids: dict[ShapeKey, int] = {}
        self.shapes: list[tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]] = []

    def add(self, key: ShapeKey) -> int:
        """The id of `key` (input shapes, None, output shapes), made on first sight."""
        found = self.ids.get(key)
        if found is None:
            cut = key.index(None)
            self.shapes.append((tuple(tuple(s) for s in key[:cut]), tuple(tuple(s) for s in key[cut + 1:])))
            found = self.ids[key] = len(self.shapes) - 1
        return found


def _shape_key(args: tuple[Any, ...], output: Any, tuple_output: bool) -> ShapeKey:
    """The torch.Size of each tensor a stage took, None, then of each it returned (no copies): both module
    mechanisms' hot path."""
    try:
        inputs = tuple(map(_SHAPE, args))
    except AttributeError:  # a non-tensor argument: keep the tensors only
        inputs = tuple(a.shape for a in args if isinstance(a, torch.Tensor))
    return (*inputs, None, *map(_SHAPE, output)) if tuple_output else (*inputs, None, output.shape)


def stage_wrapper(forward: Any, index: int, tuple_output: bool, append: Any, stamp: Any, table: ShapeTable) -> Any:
    """An instance-level forward for stage `index`: stamp, original forward, stamp, then the id of the shapes it saw
    (torch.Size, no copies, interned in `table`) and one `append` of four ints."""
    ids, add = table.ids, table.add

    # Written out per output kind, without a helper call: this runs ~500 times a decode step.
    if tuple_output:
        def traced_forward(*args: Any) -> Any:
            start = stamp()
            output = forward(*args)
            end = stamp()
            try:
                key = (*map(_SHAPE, args), None, *map(_SHAPE, output))
            except AttributeError:
                key = _shape_key(args, output, True)
            shape_id = ids.get(key)
            append((index, start, end, add(key) if shape_id is None else shape_id))
            return output
    else:
        def traced_forward(*args: Any) -> Any:
            start = stamp()
            output = forward(*args)
            end = stamp()
            try:
                key = (*map(_SHAPE, args), None, output.shape)
            except AttributeError:
                key = _shape_key(args, output, False)
            shape_id = ids.get(key)
            append((index, start, end, add(key) if shape_id is None else shape_id))
            return output

    return traced_forward


def stage_hooks(index: int, tuple_output: bool, starts: list[int], append: Any, stamp: Any,
                table: ShapeTable) -> tuple[Any, Any]:
    """The two hooks of stage `index`. Hot path: one stamp each, then the id of the shapes (as the wrapper's)."""
    ids, add = table.ids, table.add

    def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
        starts[index] = stamp()

    def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        end = stamp()
        key = _shape_key(args, output, tuple_output)
        shape_id = ids.get(key)
        append((index, starts[index], end, add(key) if shape_id is None else shape_id))

    return pre, post


def device_synchronizer(device: torch.device) -> Any:
    """A no-argument function that waits for the device's queued work, or None on cpu/meta."""
    if device.type == "cuda":
        return torch.cuda.synchronize
    if device.type == "mps":
        return torch.mps.synchronize
    return None


class Tracer:
    """Instruments `model` while inside `with`; collects one StageRecord per stage call.

    Use: `with Tracer(model, origin_ns) as t: t.begin_step("prefill", 0); backend.prefill(ids); t.end_step()`, with
    the run's backend (tracer/run/backends.py) `traced(t)` when it runs the fused path. `enabled=False` attaches
    nothing (the run is timed per step only).

    Mechanisms, same records:
    - "fused": the packed and native backends' fused path (tracer/model/fused.py), the one that runs when nothing
      watches, calls `mark` after each of its stages, which reads the clock (tracer/trace/fused_marks.py). Q|K|V and
      gate|up are one packed product each there, so they are one stage each ("attention.wqkv", "feed_forward.w13").
      Costs one clock read per stage.
    - "wrap": each stage module gets an instance-level `forward` that reads the clock around the original one;
      the modules backend runs stage by stage (Q, K, V, gate, up separately), slower than the fused path. Under
      `--staged`'s native backend a one-token step runs those stages apart in C instead and hands their C clock
      readings to `staged_take` (FusedMarks(staged=True)): the same records, the wrappers seeing no call in that
      step.
    - "hooks": as "wrap" through nn.Module forward pre/post hooks, which send every call through nn.Module's
      slow path (BENCHMARKS.md, "Tracing overhead").
    - "auto" (default): "fused" when the packed path can run the model when entered (its cache set up, nothing
      watching: Transformer.packed_off_reason, fused.watcher), else "wrap". The run's backend must be the one traced.
    Everything is undone in `finally`.
    """

    def __init__(self, model: nn.Module, origin_ns: int | None = None, enabled: bool = True,
                 mechanism: str = "auto", clock: HostClock | EventClock | None = None) -> None:
        if mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}")
        self.mechanism = mechanism
        self.model = model
        self.origin_ns = time.perf_counter_ns() if origin_ns is None else origin_ns
        self.enabled = enabled
        self.stages: list[StageModule] = []
        self._modules: list[nn.Module] = []
        self._handles: list[Any] = []  # hook handles, or (module, previous instance forward) for "wrap"
        # the marks that take the backend's own clock readings: the fused path's ("fused"), or the native staged
        # step's ("wrap" where it can stand in for the wrappers: FusedMarks.staged_usable)
        self._marks: FusedMarks | None = None
        self._starts: list[int] = []
        self._events: list[RawEvent] = []
        # finished steps, records not yet built: (phase, step, raw events, clock readings, B/T/S), a step that ran
        # through the stage modules with its events, one the model marked with its readings and sizes (and no events)
        self._steps: list[tuple[str, int, list[RawEvent], list[int], StepDims | None]] = []
        self._built: list[StageRecord] = []
        self._phase = ""
        self._step = -1
        norm = getattr(model, "norm", None)  # a Transformer: its dense final norm (stored matrices are meta)
        param = norm.weight if isinstance(getattr(norm, "weight", None), torch.Tensor) else next(model.parameters(), None)
        # Stage boundaries: CUDA events on cuda, the host clock elsewhere (tracer/trace/stage_clock.py).
        self.clock = clock or clock_for(param.device if param is not None else "cpu")
        self._records = StepRecords(self.origin_ns, param.dtype if param is not None else torch.float32)
        self._shape_table = self._records.shapes

    def _resolve(self) -> None:
        """Settle "auto" and list the stages to trace (at `__enter__`: the fused path needs the cache set up)."""
        if self.mechanism == "auto":
            blocker = getattr(self.model, "packed_off_reason", None)
            self.mechanism = "fused" if blocker is not None and not blocker() and not marks_off_reason(self.model) \
                and not watcher(self.model) else "wrap"
        if self.mechanism == "fused":
            self.stages = fused_stages(self.model)
            self._marks = FusedMarks(self.model, len(self.stages), self.clock)
        else:
            found = stage_modules(self.model)
            self.stages = [s for s, _ in found]
            self._modules = [m for _, m in found]
            self._starts = [0] * len(self.stages)
            if self.mechanism == "wrap" and FusedMarks.staged_usable(self.model, self.stages, self.clock):
                self._marks = FusedMarks(self.model, len(self.stages), self.clock, staged=True,
                                         order=FusedMarks.staged_indices(self.model, self.stages))

    # ---- context manager -------------------------------------------------------------------------------

    def __enter__(self) -> "Tracer":
        if not self.enabled:
            return self
        self._resolve()
        try:
            for index, module in enumerate(self._modules):
                tuple_output = self.stages[index].kind in TUPLE_OUTPUT_KINDS
                if self.mechanism == "hooks":
                    pre, post = stage_hooks(index, tuple_output, self._starts, self._events.append, self.clock.stamp,
                                            self._shape_table)
                    self._handles.append(module.register_forward_pre_hook(pre))
                    self._handles.append(module.register_forward_hook(post))
                else:
                    previous = module.__dict__.get("forward", _NO_INSTANCE_FORWARD)
                    self._handles.append((module, previous))
                    module.forward = stage_wrapper(module.forward, index, tuple_output, self._events.append,
                                                   self.clock.stamp, self._shape_table)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Undo every hook and wrapper (idempotent)."""
        handles, self._handles = self._handles, []
        for handle in reversed(handles):
            if isinstance(handle, tuple):
                module, previous = handle
                if previous is _NO_INSTANCE_FORWARD:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = previous
            else:
                handle.remove()

    @property
    def attached(self) -> int:
        """Hooks (two per stage) or wrappers (one per stage) in place; the fused path's marks attach nothing."""
        return len(self._handles)

    @property
    def mark(self) -> Mark:
        """What the fused path calls after each stage while this tracer records it (a clock reading), or no_mark."""
        marks = self._marks
        return marks.mark if self.enabled and marks is not None and not marks.staged else no_mark

    @property
    def staged_take(self) -> Any:
        """What takes the native staged step's C readings while this tracer records it (FusedMarks(staged=True)),
        or None: the step then runs unstamped."""
        marks = self._marks
        return getattr(marks.mark, TAKE_STAMPS, None) if self.enabled and marks is not None and marks.staged else None

    # ---- steps -----------------------------------------------------------------------------------------

    def begin_step(self, phase: str, step: int) -> None:
        self._phase, self._step = phase, step
        self._events.clear()
        if self._marks is not None:
            self._marks.begin_step()
        elif self.enabled:
            self.clock.begin_step()

    def end_step(self) -> None:
        """Close the step; its records are built when `records()` is next called (off the hot path)."""
        marks = self._marks
        if marks is not None and (not marks.staged or marks.taken()):  # a staged step without readings was wrapped
            self._steps.append((self._phase, self._step, [], *marks.end_step()))
        elif self.enabled:
            events = list(self._events)
            if self.clock.on_device:  # event indices -> host nanoseconds, with one synchronize for the step
                times = iter(self.clock.resolve([t for e in events for t in e[1:3]]))
                events = [(e[0], next(times), next(times), e[3]) for e in events]
            self._steps.append((self._phase, self._step, events, [], None))
        self._events.clear()

    def stamped_step(self, phase: str, step: int, readings: list[int], dims: StepDims) -> None:
        """Record a step that ran apart from begin_step/end_step and left its fused stages' clock readings
        (NativeStep.readings' layout) on `dims`; nothing when tracing is off."""
        marks = self._marks
        if not self.enabled or marks is None:
            return
        if len(readings) != marks.expected:
            raise RuntimeError(f"a stamped step left {len(readings)} clock readings, {marks.expected} expected")
        self._steps.append((phase, step, [], readings, dims))

    def records(self) -> tuple[StageRecord, ...]:
        """Every stage record so far, in call order."""
        for phase, step, events, marks, dims in self._steps:
            if dims is not None:  # a step the model marked: its events made now, off the hot path
                events = fused_events(self.model.config, self.stages, marks, dims, self._shape_table.add,
                                      self._marks.staged, self._marks.order)
            self._built.extend(self._records.of_step(self.stages, phase, step, events))
        self._steps.clear()
        return tuple(self._built)


class StepRecords:
    """A traced step's StageRecords from its raw events: the fields fixed by a stage and its shapes (what the call
    cost: tracer/trace/stage_cost.py) are worked out once per distinct (stage, shapes) and kept, positional in
    StageRecord's field order (layer .. kv_bytes_written), so each record costs one lookup and one constructor."""

    def __init__(self, origin_ns: int, dtype: torch.dtype) -> None:
        self.origin_ns = origin_ns
        self.shapes = ShapeTable()  # the ids the events carry
        self.activation_dtype = str(dtype).removeprefix("torch.")
        self.activation_itemsize = dtype.itemsize
        # (stage index, shape id) -> the record's fields that follow from them: a decode step's stages repeat their
        # shapes, so each distinct call is costed once
        self._static: dict[tuple[int, int], tuple[Any, ...]] = {}

    def of_step(self, stages: list[StageModule], phase: str, step: int, events: list[RawEvent]) -> list[StageRecord]:
        static = self._static
        origin = self.origin_ns
        records = []
        for index, start, end, shape_id in events:
            fields = static.get((index, shape_id))
            if fields is None:
                fields = static[(index, shape_id)] = self._static_fields(stages[index], shape_id)
            records.append(StageRecord(phase, step, *fields, start - origin, end - start, stages[index].weight_format))
        return records

    def _static_fields(self, stage: StageModule, shape_id: int) -> tuple[Any, ...]:
        """StageRecord's fields from `layer` to `kv_bytes_written` for `stage` on the shapes `shape_id`: what the
        call cost, from its shapes, the stage's weights and the dtype."""
        in_shapes, out_shapes = self.shapes.shapes[shape_id]
        act = self.activation_itemsize
        index_arg = INDEX_ARGUMENTS.get(stage.kind)
        inputs = [(s, INDEX_ITEMSIZE if i == index_arg else act) for i, s in enumerate(in_shapes)]
        cost: StageCost = stage_cost(stage, inputs, [(s, act) for s in out_shapes])
        return (stage.layer, stage.name, stage.kind, in_shapes, out_shapes, self.activation_dtype,
                cost.matmul_flops, cost.elementwise_flops, cost.weight_bytes_read, cost.activation_bytes_read,
                cost.activation_bytes_written, cost.kv_bytes_read, cost.kv_bytes_written)
