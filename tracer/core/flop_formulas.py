"""One FLOP function per stage of a LLaMA forward pass. Pure Python; each formula is in its docstring.

Conventions (shared by the analytical estimate and the run tracer, so both give the same figure for one shape):
- 2 FLOPs per multiply-add (a MAC). `macs()` converts a matmul figure back.
- Matmul FLOPs are exact: they are what a dense GEMM executes (FlopCounterMode counts the same).
- Elementwise FLOPs are estimates with fixed, documented constants (one FLOP per add, multiply, divide, exp,
  rsqrt, max or compare); kernels may fuse or approximate them, so they are reported apart from matmuls.
- Attention products are counted as executed densely over every (query, key) pair, masked ones included;
  `causal_useful_pairs` gives the pairs a causal mask keeps, for the "useful" figure of a prefill.
- Embedding lookup is a gather: 0 FLOPs.

Symbols: B batch, T new tokens (queries), S cached positions (keys, including the new ones), H query heads,
Hkv KV heads, D head dim, d model dim, F FFN dim (each expert's in a mixture of experts), V vocabulary,
E experts per layer, k experts each token is routed to.
"""

from __future__ import annotations

# Elementwise constants, one place so the README and the tests quote the same numbers.
RMSNORM_FLOPS_PER_ELEMENT = 4  # square, sum, x * rsqrt, * weight
RMSNORM_FLOPS_PER_ROW = 3  # / d (mean), + eps, rsqrt
ROPE_FLOPS_PER_ELEMENT = 3  # x*cos + rotate_half(x)*sin: two multiplies and an add (the sign flip is free)
SOFTMAX_FLOPS_PER_ELEMENT = 5  # max, subtract, exp, sum, divide
SCORE_SCALE_FLOPS_PER_ELEMENT = 1  # scores / sqrt(D); the causal mask is a select, 0 FLOPs
SWIGLU_FLOPS_PER_ELEMENT = 6  # sigmoid(g) = 1/(1+exp(-g)) is 4, g*sigmoid(g) is 1, *up is 1
# gelu_tanh(g) = 0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³))): g³ 2, ·0.044715 1, +g 1, ·√(2/π) 1, tanh 1, +1 1,
# ·g 1, ·0.5 1; then *up 1
GEGLU_FLOPS_PER_ELEMENT = 10
SCALE_FLOPS_PER_ELEMENT = 1  # x * c
SOFTCAP_FLOPS_PER_ELEMENT = 3  # x / c, tanh, * c
RESIDUAL_FLOPS_PER_ELEMENT = 1  # x + delta
BIAS_FLOPS_PER_ELEMENT = 1  # y + b
TOPK_FLOPS_PER_PICK_PER_EXPERT = 1  # top-k of E logits as k passes of a max: one compare per logit per pass
RENORM_FLOPS_PER_PICK = 2  # the k kept weights summed, then each divided by the sum
SIGMOID_FLOPS = 4  # 1 / (1 + exp(-x)): negate, exp, add, divide
SHARED_ADD_FLOPS_PER_ELEMENT = 2  # routed + s * shared: a multiply and an add


def linear_flops(tokens: int, in_dim: int, out_dim: int) -> int:
    """A bias-free linear layer y = x Wᵀ on `tokens` rows: 2 * tokens * in_dim * out_dim.

    Used for wq (d -> H*D), wk and wv (d -> Hkv*D), wo (H*D -> d), w1/w3 (d -> F), w2 (F -> d), LM head (d -> V).
    `tokens` is B*T (all rows of the batch).
    """
    return 2 * tokens * in_dim * out_dim


def bias_add_flops(tokens: int, out_dim: int) -> int:
    """A linear layer's bias add y + b on `tokens` rows: tokens * out_dim (Q/K/V biases of Qwen2 and of LLaMA with
    attention_bias, which also biases wo). Elementwise: FlopCounterMode counts addmm as its product only."""
    return BIAS_FLOPS_PER_ELEMENT * tokens * out_dim


def attention_scores_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int) -> int:
    """Scores Q Kᵀ, dense as executed: 2 * B * H * T * S * D (every query against every cached key).

    GQA does not reduce it: each of the H query heads multiplies against its (shared) KV head.
    """
    return 2 * batch * heads * q_len * kv_len * head_dim


def attention_values_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int) -> int:
    """Weighted sum of values P V, dense as executed: 2 * B * H * T * S * D."""
    return 2 * batch * heads * q_len * kv_len * head_dim


def causal_useful_pairs(q_len: int, kv_len: int, window: int | None = None) -> int:
    """(query, key) pairs a causal mask keeps when T new queries sit at the end of S positions.

    Query i (0-based, at position S - T + i) sees keys 0..S-T+i, so the count is
    sum_{i<T} (S - T + i + 1) = T * (S - T) + T * (T + 1) / 2.
    A full prefill (S = T) keeps T(T+1)/2 of T² pairs; a decode step (T = 1) keeps all S.
    With a sliding window W a query sees at most W keys (itself and the W - 1 before it):
    sum_{i<T} min(S - T + i + 1, W).
    """
    if q_len > kv_len:
        raise ValueError(f"q_len ({q_len}) cannot exceed kv_len ({kv_len})")
    first = kv_len - q_len + 1  # keys the first query sees without a window
    if window is None or first + q_len - 1 <= window:
        return q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2
    below = min(max(window - first, 0), q_len)  # queries whose causal span is still shorter than the window
    return below * first + below * (below - 1) // 2 + (q_len - below) * window


def causal_attention_product_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                                   window: int | None = None) -> int:
    """Useful FLOPs of one attention product (QKᵀ or PV) under a causal (sliding-window) mask: 2 * B * H * pairs * D."""
    return 2 * batch * heads * causal_useful_pairs(q_len, kv_len, window) * head_dim


def score_scale_flops(batch: int, heads: int, q_len: int, kv_len: int) -> int:
    """Scaling scores by 1/sqrt(D): 1 * B * H * T * S (the causal mask is a select, counted as 0)."""
    return SCORE_SCALE_FLOPS_PER_ELEMENT * batch * heads * q_len * kv_len


def softmax_flops(batch: int, heads: int, q_len: int, kv_len: int) -> int:
    """Row softmax over S keys: 5 * B * H * T * S (max, subtract, exp, sum, divide per element)."""
    return SOFTMAX_FLOPS_PER_ELEMENT * batch * heads * q_len * kv_len


def rmsnorm_flops(tokens: int, dim: int) -> int:
    """RMSNorm x * rsqrt(mean(x²) + eps) * w on `tokens` rows: tokens * (4 * d + 3).

    Per element: square, sum, multiply by rsqrt, multiply by weight (4); per row: mean divide, + eps, rsqrt (3).
    """
    return tokens * (RMSNORM_FLOPS_PER_ELEMENT * dim + RMSNORM_FLOPS_PER_ROW)


def rope_flops(tokens: int, n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """RoPE on q and k: 3 * tokens * (H + Hkv) * D (x*cos + rotate_half(x)*sin; cos/sin tables are cached). Under
    a partial rotary `head_dim` is the R values of each head turned (Phi-4-mini: 96 of 128); the rest cost none."""
    return ROPE_FLOPS_PER_ELEMENT * tokens * (n_heads + n_kv_heads) * head_dim


def swiglu_activation_flops(tokens: int, ffn_dim: int) -> int:
    """silu(gate) * up on `tokens` rows: 6 * tokens * F (sigmoid 4, times gate 1, times up 1)."""
    return SWIGLU_FLOPS_PER_ELEMENT * tokens * ffn_dim


def geglu_activation_flops(tokens: int, ffn_dim: int) -> int:
    """gelu_tanh(gate) * up on `tokens` rows: 10 * tokens * F (GEGLU_FLOPS_PER_ELEMENT)."""
    return GEGLU_FLOPS_PER_ELEMENT * tokens * ffn_dim


def scale_flops(tokens: int, dim: int) -> int:
    """x * c over `tokens` rows of `dim` (Gemma's embeddings times sqrt(d))."""
    return SCALE_FLOPS_PER_ELEMENT * tokens * dim


def softcap_flops(tokens: int, dim: int) -> int:
    """c·tanh(x / c) over `tokens` rows of `dim` (Gemma's final logits)."""
    return SOFTCAP_FLOPS_PER_ELEMENT * tokens * dim


def route_flops(tokens: int, n_experts: int, top_k: int, renormalised: bool) -> int:
    """A router's choice from its E logits on `tokens` rows: softmax over E (5·E), top-k as k passes of a max
    (k·E compares), and where the model renormalises the k kept weights to sum 1 (Mixtral, Qwen3-MoE) a sum and k
    divides (2·k): tokens * (5·E + k·E [+ 2·k]). The router's logits are a linear d -> E (`linear_flops`)."""
    per_token = SOFTMAX_FLOPS_PER_ELEMENT * n_experts + TOPK_FLOPS_PER_PICK_PER_EXPERT * top_k * n_experts
    return tokens * (per_token + (RENORM_FLOPS_PER_PICK * top_k if renormalised else 0))


def expert_combine_flops(tokens: int, dim: int, top_k: int) -> int:
    """The k chosen experts' outputs summed, each times its router weight: tokens * d * (2·k - 1) (k multiplies,
    k - 1 adds per element)."""
    return tokens * dim * (2 * top_k - 1)


def shared_expert_add_flops(tokens: int, dim: int) -> int:
    """A shared expert's output scaled by the sigmoid of its gate's one logit and added to the routed experts' sum
    (Qwen2-MoE): tokens * (4 + 2·d) (the sigmoid once a token, then a multiply and an add per element)."""
    return tokens * (SIGMOID_FLOPS + SHARED_ADD_FLOPS_PER_ELEMENT * dim)


def residual_flops(tokens: int, dim: int) -> int:
    """Residual add x + delta: tokens * d."""
    return RESIDUAL_FLOPS_PER_ELEMENT * tokens * dim


def embedding_flops(tokens: int, dim: int) -> int:
    """Embedding lookup is a row gather: 0 FLOPs (it only reads tokens * d values)."""
    del tokens, dim
    return 0


def macs(matmul_flops: int) -> int:
    """Multiply-accumulates of a matmul figure: FLOPs / 2 (exact, since matmul FLOPs are 2 per MAC)."""
    return matmul_flops // 2
