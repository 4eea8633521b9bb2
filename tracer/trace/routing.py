"""A mixture of experts' routing, recorded per step: for every layer, the k experts each token row was sent to and
their router weights; and what follows from them over a run (the distinct experts a step read, each expert's load,
each token's experts), which the terminal and the HTML report show alike.

The choices are read after each step's forward from every layer's route stage, which keeps its last call's
(weights, experts) (tracer/model/moe.py Route.last): no hook, nothing in the step's clocks. The records hold plain
ints and floats (asdict() is their JSON: tracer/trace/trace_schema.json's RoutingStep), and this module imports no
torch: the tensors are only asked for .tolist().
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmtrace.tracer.analytic.moe import expected_distinct_experts, most_distinct_experts
from llmtrace.tracer.trace.records import DECODE, PREFILL


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


def one_row_routing(phase: str, step: int, experts: list[list[int]], weights: list[list[float]]) -> RoutingStep:
    """A one-token step's choices from per-layer lists (each layer's k experts and their weights), as the native
    step's run-ahead calls return them (tracer/model/native_step.py AheadRun.routes)."""
    return RoutingStep(phase, step, tuple(LayerRouting(index, (tuple(e),), (tuple(w),))
                                          for index, (e, w) in enumerate(zip(experts, weights, strict=True))))


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


# ---- what the views show (cli/render_experts.py in the terminal, cli/html_experts.py in the HTML report) ----------


@dataclass(frozen=True, slots=True)
class TokenRoute:
    """One token row fed to the model and its experts in every layer (the router's favourite first)."""

    piece: str  # the prompt's piece, or for a decode step the token the step before chose
    step: int
    experts: tuple[tuple[int, ...], ...]  # per layer


def token_routes(steps: tuple[RoutingStep, ...], prompt_pieces: tuple[str, ...],
                 chosen: dict[int, str]) -> tuple[TokenRoute, ...]:
    """Every token row of one sequence's run in order: the prompt's (the prefill), then each decode step's input.
    `chosen`: the piece each step chose, by step."""
    rows = []
    for step in steps:
        for row in range(step.tokens):
            if step.phase == PREFILL:
                piece = prompt_pieces[row] if row < len(prompt_pieces) else ""
            else:
                piece = chosen.get(step.step - 1, "")
            rows.append(TokenRoute(piece, step.step, tuple(layer.experts[row] for layer in step.layers)))
    return tuple(rows)


@dataclass(frozen=True, slots=True)
class StepReads:
    """The experts a layer read in steps of `rows` token rows: measured (the mean over layers and steps, and the
    least and most of any layer), beside uniform routing's expectation and the most there can be."""

    phase: str
    steps: int
    rows: int
    measured: float
    least: int
    most_measured: int
    expected: float  # E·(1 - (1 - k/E)^rows)
    most: int  # min(E, k·rows)


def step_reads(steps: tuple[RoutingStep, ...], n_experts: int, top_k: int) -> tuple[StepReads, ...]:
    """The prefill, then the decode steps grouped by their rows (one group for a single sequence)."""
    out = []
    for phase in (PREFILL, DECODE):
        mine = [s for s in steps if s.phase == phase]
        for rows in sorted({s.tokens for s in mine}):
            same = [s for s in mine if s.tokens == rows]
            distinct = [layer.distinct for s in same for layer in s.layers]
            out.append(StepReads(phase, len(same), rows, sum(s.distinct_mean for s in same) / len(same),
                                 min(distinct), max(distinct), expected_distinct_experts(n_experts, top_k, rows),
                                 most_distinct_experts(n_experts, top_k, rows)))
    return tuple(out)
