"""What the KV cache saves, analytically: the FLOPs of generating without it against generating with it.

Without a cache, the step that produces token t+1 runs the whole sequence again: a prefill of the t positions so far
(its attention dense over t x t, as executed, and the LM head on the last position only). With it, that step is one
token attending to t cached positions. Per step the ratio is prefill(t) / decode_step(t - 1); over a generation of N
tokens from a P-token prompt it is

    [prefill(P) + sum over i = 1 .. N-1 of prefill(P + i)]  /  [prefill(P) + sum of decode_step(P + i - 1)],

both sums every step exactly (llmtrace.tracer.analytic.estimate). For LLaMA-7B this is 981x for the step at
t = 1000 but 494x (P = 1) to 540x (P = 100) over a 1000-token generation, not the "about 1000x" often quoted: the
early steps of a generation save far less than its last.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrace.tracer.analytic import estimate
from llmtrace.tracer.analytic.estimate import Dtypes
from llmtrace.tracer.core.config import ModelConfig


@dataclass(frozen=True, slots=True)
class NoCacheEstimate:
    """One generation's FLOPs with and without a KV cache."""

    prompt_len: int
    new_tokens: int
    cached_flops: int  # prefill + every decode step, dense as executed
    uncached_flops: int  # prefill + every step recomputing the whole sequence
    last_step_ratio: float  # the last step's uncached / cached FLOPs (1.0 when the prefill is the only step)

    @property
    def ratio(self) -> float:
        return self.uncached_flops / self.cached_flops


def prefill_flops(cfg: ModelConfig, positions: int, dtypes: Dtypes) -> int:
    return estimate.prefill(cfg, positions, dtypes).totals.total_flops


def step_ratio(cfg: ModelConfig, positions: int, dtypes: Dtypes) -> float:
    """FLOPs of the step that runs `positions` tokens without a cache, over the same step with one (the new token
    attending to `positions` cached positions, itself included); 1.0 for the first step, which is the prefill."""
    uncached = prefill_flops(cfg, positions, dtypes)
    return uncached / estimate.decode_step(cfg, positions - 1, dtypes).totals.total_flops if positions > 1 else 1.0


def generation_without_cache(cfg: ModelConfig, prompt_len: int, new_tokens: int, dtypes: Dtypes) -> NoCacheEstimate:
    """FLOPs of a generation of `new_tokens` from `prompt_len`, with and without a KV cache, every step summed.

    A prefill's FLOPs are a quadratic polynomial in its length (the linear terms per token, attention's t x t
    products and softmax), so the sum of prefill(P + i) over i comes from the polynomial through three lengths,
    exactly, in integers (tested against the step-by-step sum): a 1000-token horizon costs three estimates, not 1000.
    """
    cached = estimate.generation(cfg, prompt_len, new_tokens, dtypes).totals.total_flops
    first, last = prompt_len, prompt_len + new_tokens - 1
    uncached = _sum_of_quadratic([prefill_flops(cfg, n, dtypes) for n in (1, 2, 3)], first, last)
    return NoCacheEstimate(prompt_len, new_tokens, cached, uncached, step_ratio(cfg, last, dtypes))


def _sum_of_quadratic(values_at_1_2_3: list[int], first: int, last: int) -> int:
    """sum of f(n) for n = first .. last, f the quadratic with f(1), f(2), f(3) = the values (exact integers)."""
    f1, f2, f3 = values_at_1_2_3
    # f(n) = f1 + (n-1) d1 + (n-1)(n-2)/2 d2, with the first and second differences d1, d2 (Newton's form)
    d1, d2 = f2 - f1, f3 - 2 * f2 + f1

    def prefix(n: int) -> int:  # sum of f(1) .. f(n): sums of C(k, 0), C(k, 1), C(k, 2) for k = 0 .. n-1
        return n * f1 + (n * (n - 1) // 2) * d1 + (n * (n - 1) * (n - 2) // 6) * d2

    return prefix(last) - prefix(first - 1)
