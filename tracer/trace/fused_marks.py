"""Tracing the model's fused path (tracer/model/fused.py) from inside, for one clock read per stage.

The fused path is what runs when nothing watches the stage modules: packed Q|K|V and gate|up products, in place
RoPE, one K|V copy. It calls `mark()` after each of its stages, in a fixed order (`fused_stages`), so while
`FusedMarks` is installed a step leaves one clock reading before its first stage and one after each stage, and a
stage's time is the difference of two consecutive readings. A traced step therefore runs exactly the tensor ops of
an untraced one.

The shapes each stage saw follow from the step's batch B, new tokens T and cached positions S (read from the model
around the step) and the config. They are written in the stage-by-stage path's layout ((B, T, dim) activations,
(B, H, T, S) scores, ...), which is what the fused path's tensors hold (for one token it runs 1-D views of them);
tests check them against the shapes that path's modules record for the same step.

The native staged step. Under `--staged` the tracer wraps every stage module ("wrap", tracer/trace/hooks.py) and a
prefill runs through them. A one-token step of one sequence of a model whose decode step is native runs in C instead
(tracer/run/backends.py's StagedNativeBackend, FusedPlan.staged_step): the stages of contract.staged_stages one by
one, each its own phase ended by a barrier and a clock reading on the clock time.perf_counter_ns reads, no module
called. The backend hands those readings to the tracer's `staged_take` (`FusedMarks(staged=True)`), and a step's
readings become the raw events the wrappers would have left, as a fused step's do: stage i ran from reading i to
reading i + 1, on the shapes the stage modules see in that step (`stage_shapes(staged=True)`, which tests hold
against the modules' own). The records built from them are the wrapped path's records (names, order, shapes, FLOPs,
bytes, formats) with C's times.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

from torch import nn

from llmtrace.tracer.core import contract
from llmtrace.tracer.core.config import ModelConfig, first_attended_position
from llmtrace.tracer.core.stage_kinds import KINDS, CallDims
from llmtrace.tracer.model.fused import TAKE_STAMPS
from llmtrace.tracer.trace.stage_clock import EventClock, HostClock, reads_host_clock
from llmtrace.tracer.trace.stage_cost import StageModule

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepDims:
    """The sizes of one step: B sequences, T new tokens each, S cached positions after it."""

    batch: int
    new: int
    seen: int
    per_row_positions: bool = False  # a left-padded batch: each row's RoPE positions (B, T), not one (T,)


def marks_off_reason(model: nn.Module) -> str:
    """Why a step's marks cannot trace `model` (they follow a fixed stage order), or "": a mixture of experts runs its
    expert stages once per expert its tokens chose, a count that varies (the native step stamps them apart)."""
    if getattr(getattr(model, "config", None), "moe", None) is not None:
        return "a traced mixture of experts runs its expert stages once per expert chosen (a varying count)"
    return ""


def _in_model_order(model: nn.Module, packed: bool) -> list[tuple[str, int | None, contract.FusedStage]]:
    """(name prefix, layer, stage) of every stage a step marks, in its order: the stages before the layers, each
    layer's stages, the ones after (contract.fused_stages, packed or not). A mixture of experts' one-token step (the
    native step's) runs its expert stages, those between the route and the weighted sum, once per chosen expert:
    k times in a row. OLMoE's whole-projection QK-norm runs between K and V where they run apart (the stage modules
    normalise q and k before V's product: Attention.forward)."""
    config = getattr(model, "config", None)
    specs = list(contract.fused_stages(config, packed))
    if not packed and getattr(config, "qk_norm_whole", False):
        roles = [spec.role for spec in specs]
        specs.insert(roles.index("attention.wv"), specs.pop(roles.index("attention.qk_norm")))
    moe = getattr(config, "moe", None)
    if moe is not None:
        roles = [spec.role for spec in specs]
        after, before = roles.index(ROUTE) + 1, roles.index(COMBINE)
        specs[after:before] = specs[after:before] * moe.experts_per_token
    in_layer = [i for i, spec in enumerate(specs) if spec.in_layer]
    first, last = in_layer[0], in_layer[-1]
    order: list[tuple[str, int | None, contract.FusedStage]] = [("", None, spec) for spec in specs[:first]]
    for index in range(len(model.layers)):
        order.extend((f"layers.{index}.", index, spec) for spec in specs[first : last + 1])
    order.extend(("", None, spec) for spec in specs[last + 1 :])
    return order


ROUTE, COMBINE = "feed_forward.route", "feed_forward.combine"  # a mixture of experts' stages around its experts'
EXPERT_ROLES = ("feed_forward.w1", "feed_forward.w3", "feed_forward.w13", "feed_forward.w2", "feed_forward.act")


def fused_stages(model: nn.Module) -> list[StageModule]:
    """The fused path's stages in the order it marks them (contract.fused_stages: the embedding, every layer's
    stages with Q|K|V and gate|up packed, the final norm and the LM head). A packed stage's weight is its
    modules' weights together."""
    modules = dict(model.named_modules())  # one walk of the tree, not one per lookup
    return [StageModule.of(prefix + spec.role, layer, spec.kind, [modules[prefix + m.role] for m in spec.members])
            for prefix, layer, spec in _in_model_order(model, packed=True)]


def staged_order(model: nn.Module) -> list[str]:
    """The stage names the native staged step stamps, in its order: the embedding, each layer's staged stages (a
    mixture of experts' expert stages once per chosen expert), the final norm and the LM head
    (contract.staged_stages)."""
    return [prefix + spec.role for prefix, _, spec in _in_model_order(model, packed=False)]


def stage_shapes(config: ModelConfig, step: StepDims,
                 staged: bool = False) -> dict[str, tuple[list[Shape], list[Shape]]]:
    """Each fused stage role's (input shapes, output shapes) in a step of `step`'s B, T and S: its kind's
    (stage_kinds.KINDS, in the argument order of the stage-by-stage modules, whose records these must match). A
    projection's widths come from its weights' shapes in the contract (a packed one's rows add up). Under a sliding
    window the cache's slices, and so the scores, span the keys attended, as the cache returns them. `staged`: each
    staged stage role's instead (contract.staged_stages: Q, K, V, gate and up apart), for the native staged step
    (`FusedMarks(staged=True)`)."""
    keys = step.seen - first_attended_position(step.seen, step.new, config.sliding_window)  # a window's
    shapes = {}
    moe = config.moe
    for spec in contract.fused_stages(config, packed=not staged):
        if moe is not None and (spec.role in EXPERT_ROLES or spec.kind in ("route", "expert_combine")
                                or spec.role in ("feed_forward.router", *contract.SHARED_EXPERT_ROLES)):
            shapes[spec.role] = _expert_shapes(config, spec, step.batch * step.new)
            continue
        widths = (0, 0)
        if spec.kind in ("linear", "lm_head"):
            weights = [contract.shape_of(m.tensors[0], config) for m in spec.members]  # (out, in) each
            widths = (weights[0][1], sum(w[0] for w in weights))
        dims = CallDims(step.batch, step.new, keys, config.dim, config.n_heads, config.n_kv_heads, config.head_dim,
                        config.ffn_dim, (step.batch, step.new) if spec.in_layer else (step.batch,),
                        step.per_row_positions, config.qk_norm_whole, widths, vocab=config.vocab_size)
        shapes[spec.role] = KINDS[spec.kind].shapes(dims)
    return shapes


def _expert_shapes(config: ModelConfig, spec: contract.FusedStage, tokens: int
                   ) -> tuple[list[Shape], list[Shape]]:
    """A mixture of experts' stage as tracer/model/moe.py's modules see it on `tokens` token rows (N = B*T, flat),
    each chosen expert on the one row of a one-token step (the native step's: its only user here), a shared expert
    (Qwen2-MoE) on every row."""
    dim, ffn, experts, k = config.dim, config.ffn_dim, config.moe.n_experts, config.moe.experts_per_token
    if spec.role in contract.SHARED_EXPERT_ROLES:
        shared = config.shared_expert_dim or 0
        if spec.kind == "swiglu":
            return [(tokens, shared), (tokens, shared)], [(tokens, shared)]
        if spec.kind == "shared_expert_add":
            return [(tokens, dim), (tokens, dim), (tokens, 1)], [(tokens, dim)]
        widths = [contract.shape_of(m.tensors[0], config) for m in spec.members]  # (out, in) each
        return [(tokens, widths[0][1])], [(tokens, sum(w[0] for w in widths))]
    if spec.role == "feed_forward.router":
        return [(tokens, dim)], [(tokens, experts)]
    if spec.kind == "route":
        return [(tokens, experts)], [(tokens, k), (tokens, k)]
    if spec.kind == "expert_combine":
        return [(tokens, k, dim), (tokens, k)], [(tokens, dim)]
    if spec.kind == "swiglu":
        return [(1, ffn), (1, ffn)], [(1, ffn)]
    widths = [contract.shape_of(m.tensors[0], config) for m in spec.members]  # (out, in) each
    return [(1, widths[0][1])], [(1, sum(w[0] for w in widths))]


@functools.lru_cache(maxsize=8)  # a run traces one model
def _unwindowed(config: ModelConfig) -> ModelConfig:
    """`config` with no window: the shapes of Gemma 3's global layers, which read every position where the others
    read their window's (made once per model, not per traced step: the replace checks the whole config again)."""
    return replace(config, sliding_window=None, full_layers=())


def fused_events(config: ModelConfig, stages: list[StageModule], marks: list[int], dims: StepDims,
                 add: Callable[[tuple], int], staged: bool = False,
                 order: list[int] | None = None) -> list[tuple[int, int, int, int]]:
    """The raw events (stage index, start, end, shape id from `add`) of one step a backend marked (the fused path's
    readings, or with `staged` the native staged step's): the n-th stage ran from reading n to reading n + 1, the
    stage `order[n]` of `stages` (by default n itself; a mixture of experts' steps run its expert stages k times)."""
    shapes = stage_shapes(config, dims, staged)
    full = stage_shapes(_unwindowed(config), dims, staged) if config.mixed_windows else shapes
    events = []
    for n, index in enumerate(range(len(stages)) if order is None else order):
        stage = stages[index]
        role = stage.name if stage.layer is None else stage.name.split(".", 2)[2]
        inputs, outputs = (full if stage.layer in config.full_layers else shapes)[role]
        events.append((index, marks[n], marks[n + 1], add((*inputs, None, *outputs))))
    return events


class FusedMarks:
    """A clock-reading `mark` for the fused path (the run's backend calls it) and one step's readings.

    `begin_step()` before a prefill or decode step, `end_step()` after it
    returns the step's readings (host nanoseconds) and (B, T, S). `clock` (tracer/trace/stage_clock.py) stamps each
    mark: the host clock on cpu (after a synchronize on mps), a CUDA event on cuda, resolved at the end of the step.
    On the plain host clock the mark also takes readings made outside Python (fused.TAKE_STAMPS): the native decode
    step (tracer/model/native_step.py) stamps its stages in C on that clock, so a traced step still leaves one
    reading per stage, each taken where the stage ended.

    `staged=True`: the native staged step's mark instead, while a "wrap" Tracer is attached (`staged_usable` says when
    it can stand in for the wrappers): only that step's C readings come to it, and a step that ran through the
    wrappers leaves none (`taken()` is False; its events are the wrappers').
    """

    def __init__(self, model: nn.Module, stages: int, clock: HostClock | EventClock | None = None,
                 staged: bool = False, order: list[int] | None = None) -> None:
        self.model = model
        # the stage each reading ends (indices of the tracer's stages), when not one each in order: a mixture of
        # experts' native staged step runs its expert stages once per chosen expert (`staged_indices`)
        self.order = order
        self.expected = (stages if order is None else len(order)) + 1  # a reading before the first stage, one after
        # each stage run
        self.clock = clock or HostClock()
        self.staged = staged
        self._marks: list[int] = []
        self._pos_before = 0
        marks, stamp = self._marks, self.clock.stamp
        self.mark: Callable[[], None] = lambda: marks.append(stamp())
        if reads_host_clock(self.clock):
            # Readings the native decode step took in C on the same clock stand for the mark() calls of its stages.
            setattr(self.mark, TAKE_STAMPS, marks.extend)

    @staticmethod
    def staged_usable(model: nn.Module, stages: list[StageModule], clock: HostClock | EventClock) -> bool:
        """Whether `FusedMarks(staged=True)` can stand in for the wrappers of `stages`: the stages are the native
        staged step's stages in its order, and the clock is the plain host clock."""
        if not hasattr(model, "packed_off_reason") or not reads_host_clock(clock):
            return False
        return sorted(s.name for s in stages) == sorted(set(staged_order(model)))

    @staticmethod
    def staged_indices(model: nn.Module, stages: list[StageModule]) -> list[int] | None:
        """For each stage the native staged step runs, in its order, its index in `stages` (those `staged_usable`
        accepted); None when that is each stage once, in order (a model without a mixture of experts or OLMoE's
        QK-norm)."""
        names = staged_order(model)
        if names == [s.name for s in stages]:
            return None
        index = {s.name: i for i, s in enumerate(stages)}
        return [index[name] for name in names]

    def begin_step(self) -> None:
        self._marks.clear()
        self._pos_before = self.model.pos
        self.clock.begin_step()

    def taken(self) -> bool:
        """Whether the step since `begin_step` left readings (under `staged`: it ran as the native staged step)."""
        return bool(self._marks)

    def end_step(self) -> tuple[list[int], StepDims]:
        """This step's clock readings (one before the first stage, one after each) and its (B, T, S)."""
        marks = list(self._marks)
        self._marks.clear()
        if len(marks) != self.expected:
            if self.staged:
                raise RuntimeError(f"the native staged step left {len(marks)} clock readings, {self.expected} expected")
            raise RuntimeError(
                f"the fused path marked {len(marks)} times in this step, {self.expected} expected: the step ran "
                "stage by stage (the modules backend, or a backend not traced by this Tracer) while a fused-path "
                "Tracer was attached; trace it with mechanism='wrap' instead"
            )
        model = self.model
        seen = model.pos
        # the model's list of caches (`batch`), not layers[0].attention.kv_cache: four nn.Module lookups, ~20 us cold
        return self.clock.resolve(marks), StepDims(model.batch, seen - self._pos_before, seen, any(model.pads))
