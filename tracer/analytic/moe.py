"""What a mixture of experts reads: the experts a batch's tokens are routed to, expected and at most. Pure Python.

Each token's router picks k of a layer's E experts. Under uniform routing (every k-subset equally likely, tokens
independent) an expert escapes one token with probability 1 - k/E, so n tokens touch E·(1 - (1 - k/E)^n) distinct
experts on average, and at most min(E, k·n). A step reads only the experts it touches: its weight bytes are the
attention's, the router's, those experts' and the head's, between the one-expert-set bound of a single token
(k experts) and the bound with every expert read (E). Real routers are not uniform (a trained router favours some
experts), so the expectation is a model, the bounds are not; tests/test_moe.py checks the formula against a seeded
simulation of uniform routing.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import DType

# The batch sizes the views show a decode step's expert reads at.
BATCHES = (1, 4, 16, 64)


def expected_distinct_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """E·(1 - (1 - k/E)^n): the experts n tokens touch on average, each routed uniformly to k of E."""
    if not 0 < top_k <= n_experts or tokens < 0:
        raise ValueError(f"need 0 < k <= E and n >= 0, got k={top_k}, E={n_experts}, n={tokens}")
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def most_distinct_experts(n_experts: int, top_k: int, tokens: int) -> int:
    """min(E, k·n): the experts n tokens can touch at most."""
    return min(n_experts, top_k * tokens)


# Output records, read field by field and through asdict(): eq=False and repr=False spare compiling __eq__,
# __hash__ and __repr__ for each at import, which the analytical commands (answering in a blink) feel.
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ExpertReads:
    """One decode step of `batch` sequences (one token each): experts read per layer and the step's weight bytes."""

    batch: int
    expected_experts: float  # E·(1 - (1 - k/E)^B), uniform routing
    most_experts: int  # min(E, k·B)
    expected_weight_bytes: int  # the step's estimate: everything but the experts, plus the expected experts
    all_experts_weight_bytes: int  # the bound: everything but the experts, plus all E in every layer


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class MoeSummary:
    n_experts: int  # E per layer
    experts_per_token: int  # k
    router_norm: str  # "renormalised" (the k weights rescaled to sum 1) or "softmax" (kept as the softmax gave them)
    expert_bytes: int  # one expert's w1, w2, w3 in one layer, in the weights' dtype
    reads: tuple[ExpertReads, ...]  # a decode step at each of BATCHES and at the batch asked for
    shared_expert_dim: int | None = None  # Qwen2-MoE: the width of the expert every token runs beside its k


def moe_summary(config: ModelConfig, weights: DType, steps: dict[int, tuple[int, int]]) -> MoeSummary | None:
    """The routing figures of `config` (None for a dense model). steps: batch -> (a decode step's weight bytes as
    estimated, the part of them its expert products read), from tracer/analytic/estimate.py."""
    if config.moe is None:
        return None
    e, k = config.moe.n_experts, config.moe.experts_per_token
    one = expert_matrix_bytes(config, weights)
    reads = []
    for b, (step_bytes, expert_part) in sorted(steps.items()):
        other = step_bytes - expert_part  # attention, norms, routers, a shared expert, embedding rows, head
        reads.append(ExpertReads(b, expected_distinct_experts(e, k, b), most_distinct_experts(e, k, b),
                                 step_bytes, other + e * one * config.n_layers))
    return MoeSummary(e, k, config.moe.router_norm, one, tuple(reads), config.shared_expert_dim)


def batches_shown(batch: int) -> tuple[int, ...]:
    """BATCHES and the batch asked for, in order."""
    return tuple(sorted({*BATCHES, batch}))


def expert_matrix_bytes(config: ModelConfig, dtype: DType) -> int:
    """One expert's w1, w3 (F x d) and w2 (d x F) in `dtype`: what reading it once costs, per layer."""
    return 2 * dtype.matrix_bytes(config.ffn_dim, config.dim) + dtype.matrix_bytes(config.dim, config.ffn_dim)
