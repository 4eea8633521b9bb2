"""A mixture of experts' routing, recorded per step: for every layer, the k experts each token row was sent to and
their router weights; and what follows from them over a run (the distinct experts a step read, each expert's load).

The choices are read after each step's forward from every layer's route stage, which keeps its last call's
(weights, experts) (tracer/model/moe.py Route.last): no hook, nothing in the step's clocks. The records hold plain
ints and floats (asdict() is their JSON: tracer/trace/trace_schema.json's RoutingStep), and this module imports no
torch: the tensors are only asked for .tolist().
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LayerRouting:
    """One layer's choices in one step: token rows in the step's order (a batch's rows one after another)."""

    layer: int
    experts: tuple[tuple[int, ...], ...]  # per token row: its k experts, largest router weight first
    weights: tuple[tuple[float, ...], ...]  # per token row: those experts' router weights (renormalised or not)

    @property
    def distinct(self) -> int:
        """The experts this layer ran in the step: each one's matrices read once, whatever its tokens."""
        return len({e for row in self.experts for e in row})


@dataclass(frozen=True, slots=True)
class RoutingStep:
    """Every layer's choices in one step (prefill = step 0)."""

    phase: str
    step: int
    layers: tuple[LayerRouting, ...]

    @property
    def tokens(self) -> int:
        return len(self.layers[0].experts) if self.layers else 0

    @property
    def distinct_mean(self) -> float:
        """The distinct experts a layer read in this step, averaged over the layers."""
        return sum(layer.distinct for layer in self.layers) / len(self.layers) if self.layers else 0.0


def routing_step(model: Any, phase: str, step: int) -> RoutingStep | None:
    """The last forward's choices in every layer of `model` (a Transformer), None for a dense model."""
    layers = []
    for index, layer in enumerate(model.layers):
        route = getattr(layer.feed_forward, "route", None)
        if route is None or route.last is None:
            return None
        weights, experts = route.last  # (N, k) fp32, (N, k) int64
        layers.append(LayerRouting(index, tuple(map(tuple, experts.tolist())), tuple(map(tuple, weights.tolist()))))
    return RoutingStep(phase, step, tuple(layers))


def expert_load(steps: tuple[RoutingStep, ...], n_experts: int) -> tuple[tuple[int, ...], ...]:
    """Per layer, how many token rows each of the E experts took over `steps` (each row counts once for each of its
    k experts)."""
    if not steps:
        return ()
    counts = [[0] * n_experts for _ in steps[0].layers]
    for step in steps:
        for layer in step.layers:
            for row in layer.experts:
                for expert in row:
                    counts[layer.layer][expert] += 1
    return tuple(map(tuple, counts))
