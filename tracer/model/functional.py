"""The layer's math, written once: the stage modules (tracer/model/transformer.py: the model and its hook points) call
these, whether they run as modules or under the packed backend (tracer/model/fused.py: the same forwards on Q|K|V
and gate|up packed, no hooks), so every route rounds the same way (the way HF transformers' eager LlamaForCausalLM
does). Shapes as in transformer.py's legend; G = B*Hkv groups of R query heads sharing a KV head."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from llmtrace.tracer.model.weight_formats import PackedWeight


def rms_norm_floor(dim: int, eps: float, device: torch.device | str) -> torch.Tensor:
    """sqrt(dim * eps) as an fp32 scalar tensor on `device`: `rms_norm`'s floor."""
    return torch.tensor((dim * eps) ** 0.5, dtype=torch.float32, device=device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, floor: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, normalised in fp32 and cast back before the weight (as HF does); into
    `out` when given (x itself: the packed path normalises q and k in place, where its Q|K|V product put them).

    `floor` is sqrt(dim * eps) as an fp32 scalar tensor: sqrt(mean(x^2) + eps) == hypot(||x||, floor) / sqrt(dim),
    five small ops where F.rms_norm's CPU kernel costs twice as long on one token (BENCHMARKS.md, "Model speed").
    """
    dim = x.shape[-1]
    rms = torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32), floor).mul_(dim**-0.5)
    if x.dtype == torch.float32:
        return torch.div(x, rms, out=out).mul_(weight)
    normed = torch.div(x, rms)
    return (normed.to(x.dtype) if out is None else out.copy_(normed)).mul_(weight)


class PlusOne:
    """1 + w in fp32 for a (1 + w) RMSNorm's weight w, made once and again only when w changes (another tensor, or
    written in place: its version moves), as HF computes it each call (1.0 + w.float())."""

    __slots__ = ("key", "value")

    def __init__(self) -> None:
        self.key: tuple[int, int, torch.device] | None = None
        self.value: torch.Tensor | None = None

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        key = (id(weight), weight._version, weight.device)
        if key != self.key or self.value is None:
            with torch.no_grad():
                self.value = 1.0 + weight.detach().float()
            self.key = key
        return self.value


def rms_norm_plus_one(x: torch.Tensor, shifted: torch.Tensor, floor: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + w), all in fp32 and cast back after the multiply (HF's
    Gemma3RMSNorm: "(x * w).to(float16)", where LLaMA's casts before). `shifted` is 1 + w in fp32; into `out` when
    given (x itself, as rms_norm's)."""
    dim = x.shape[-1]
    rms = torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32), floor).mul_(dim**-0.5)
    if x.dtype == torch.float32:
        return torch.div(x, rms, out=out).mul_(shifted)
    normed = torch.div(x.float(), rms).mul_(shifted)
    return normed.to(x.dtype) if out is None else out.copy_(normed)


def matvec(weight: torch.Tensor, vector: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """weight @ vector (+ bias): torch.mv, or mm while a TorchDispatchMode is active (FlopCounterMode counts mm,
    not mv), so what a FLOP counter sees is the product that runs. The bias is added to the product's result."""
    if torch._C._len_torch_dispatch_stack():
        out = torch.mm(weight, vector.view(-1, 1)).view(-1)
    else:
        out = torch.mv(weight, vector)
    return out if bias is None else out.add_(bias)


def matvec_mm(weight: torch.Tensor, vector: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """weight @ vector (+ bias) through mm, as a (1, in) @ (in, out) product, as F.linear runs one row: on AVX-512
    1.55x torch.mv for bf16 (whose mv takes a slower path), slower on AVX2 for bf16; the default table says which a
    run takes (tracer/hardware/kernel_defaults.py matvec_for), `llmtrace tune` may measure it."""
    out = torch.mm(vector.view(1, -1), weight.t()).view(-1)
    return out if bias is None else out.add_(bias)


# The matrix-vector kernels a decode step can run, by the name the kernel choice records (KernelChoice.decode_kernel).
MATVEC_KERNELS = {"mv": matvec, "mm": matvec_mm}


def project(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None,
            vector_kernel: Callable[..., torch.Tensor] = matvec) -> torch.Tensor:
    """x (..., in) -> x weightᵀ (+ bias) (..., out): one row as a matrix-vector product through `vector_kernel`
    (torch.mv unless the machine's measurement chose mm: MATVEC_KERNELS), more rows as F.linear (mm, addmm with a
    bias). A weight held as the GGUF stores it (PackedWeight) multiplies through its own kernel (FlopCounterMode
    does not count torch's int4 kernel: count FLOPs on dense weights)."""
    if isinstance(weight, PackedWeight):
        out = weight(x)  # (..., out)
        return out if bias is None else out.add_(bias)
    if x.dim() == 1:
        return vector_kernel(weight, x, bias)  # (out,)
    if x.numel() == weight.shape[1]:
        return vector_kernel(weight, x.reshape(-1), bias).view(x.shape[:-1] + (weight.shape[0],))  # (..., out)
    return F.linear(x, weight, bias)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE: x (..., D) rotated by the angles whose cos and signed sin (rope.rope_tables: the first half negated)
    broadcast against it, as x * cos + roll(x, D/2) * sin (HF's rotate_half in three ops); into `out` when given
    (the packed path rotates q and k together, in place). Tables narrower than x (..., R) (partial rotary) turn its
    first R values so, roll(x, R/2) over them, and pass the other D - R through (HF's q_rot, q_pass)."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(rotary // 2, dims=-1), sin, out=out)
    if out is None:
        out = x.clone()  # the passed-through values as they are
    elif out.data_ptr() != x.data_ptr() or out.stride() != x.stride():
        out.copy_(x)
    turned = x.narrow(-1, 0, rotary)
    torch.addcmul(turned * cos, turned.roll(rotary // 2, dims=-1), sin, out=out.narrow(-1, 0, rotary))
    return out


def attention_scores(q: torch.Tensor, k: torch.Tensor, scale: float, one_query: bool) -> torch.Tensor:
    """q (G, R*T, D) · k (G, S, D)ᵀ, times `scale` after the product -> (G, R*T, S) in q's dtype (G = B*Hkv groups
    of R query heads sharing a KV head). For one query token in half precision the product runs in fp32 and is
    rounded once, after the scaling: a half-precision bmm this small takes oneDNN's slow path on CPU (~3x fp32)."""
    k_t = k.transpose(1, 2)  # (G, D, S)
    if one_query and q.dtype != torch.float32:
        return torch.bmm(q.float(), k_t.float()).mul_(scale).to(q.dtype)  # (G, R, S)
    return torch.bmm(q, k_t).mul_(scale)  # (G, R*T, S)


def grouped_scores(q: torch.Tensor, k_all: torch.Tensor, scale: float,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H, T, D) · k_all (B, Hkv, S, D) -> scores (B, H, T, S), scaled, -inf where `mask` (broadcast to
    (B, H, T, S): causal_mask's (T, S), a pad mask's (B, 1, T, S)) is True. GQA without copying K: the R query heads
    of each KV head are the rows of one product (attention_scores)."""
    batch, heads, new, head_dim = q.shape
    kv_heads, seen = k_all.shape[1], k_all.shape[2]
    groups = batch * kv_heads
    q_grouped = q.reshape(groups, heads // kv_heads * new, head_dim)  # (B*Hkv, R*T, D)
    scores = attention_scores(q_grouped, k_all.reshape(groups, seen, head_dim), scale, new == 1)  # (B*Hkv, R*T, S)
    return masked(scores.view(batch, heads, new, seen), mask)  # (B, H, T, S)


def masked(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """scores (B, H, T, S) with -inf, in place, where `mask` is True (exp(-inf) = 0: a hidden key adds nothing)."""
    return scores if mask is None else scores.masked_fill_(mask, float("-inf"))


def grouped_values(probs: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
    """probs (B, H, T, S) · v_all (B, Hkv, S, D) -> (B, H, T, D): the attention-weighted sum of values, the R query
    heads of each KV head as the rows of one product (attention_values)."""
    batch, heads, new, seen = probs.shape
    kv_heads, head_dim = v_all.shape[1], v_all.shape[3]
    groups = batch * kv_heads
    probs_grouped = probs.reshape(groups, heads // kv_heads * new, seen)  # (B*Hkv, R*T, S)
    out = attention_values(probs_grouped, v_all.reshape(groups, seen, head_dim), new == 1)  # (B*Hkv, R*T, D)
    return out.view(batch, heads, new, head_dim)  # (B, H, T, D)


def attention_values(probs: torch.Tensor, v: torch.Tensor, one_query: bool) -> torch.Tensor:
    """probs (G, R*T, S) · v (G, S, D) -> (G, R*T, D): the attention-weighted sum of values, in fp32 for one query
    token in half precision (as in attention_scores)."""
    if one_query and probs.dtype != torch.float32:
        return torch.bmm(probs.float(), v.float()).to(probs.dtype)  # (G, R, D)
    return torch.bmm(probs, v)  # (G, R*T, D)


def causal_mask(new: int, seen: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """(T, S) bool, True where query t (at position S - T + t) must not see key s: s > S - T + t (the future) or,
    with a sliding window W, s <= S - T + t - W (older than the window). The S keys may be a suffix of the
    cache (llmtrace.tracer.core.config.first_attended_position): positions count from its first key."""
    hidden = torch.ones(new, seen, dtype=torch.bool, device=device).triu_(seen - new + 1)
    if window is not None and seen > window:  # some query has keys older than its window
        hidden |= torch.ones(new, seen, dtype=torch.bool, device=device).tril_(seen - new - window)
    return hidden


def step_mask(new: int, seen: int, device: torch.device, window: int | None = None,
              pad_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """What a step of `new` tokens hides from its queries among the `seen` keys: causal_mask (T, S) when there is more
    than one new token, or'd with `pad_mask` (B, 1, T, S: left pads hidden from real queries) when given; None when
    nothing is hidden (one new token, no pads)."""
    mask = causal_mask(new, seen, device, window) if new > 1 else None  # (T, S)
    if pad_mask is not None:
        mask = pad_mask if mask is None else pad_mask | mask  # (B, 1, T, S)
    return mask


def softmax_fp32(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis computed in fp32, returned in the scores' dtype."""
    if scores.dtype == torch.float32:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise: the SwiGLU FFN's activation (the product is taken into silu's new tensor)."""
    return F.silu(gate).mul_(up)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up with gelu's tanh approximation (HF's gelu_pytorch_tanh): Gemma's FFN activation."""
    return F.gelu(gate, approximate="tanh").mul_(up)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap·tanh(logits / cap), as HF's Gemma3ForCausalLM soft-caps its final logits."""
    return torch.tanh(logits / cap).mul_(cap)


def route_top_k(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture of experts' router choice, as HF's routers make it: logits (N, E) -> the k chosen experts' weights
    (N, k) in fp32 and their indices (N, k) int64, largest weight first. Softmax over all E in fp32, the k largest
    kept, and where the model renormalises (Mixtral; Qwen3-MoE's norm_topk_prob) rescaled to sum 1; OLMoE keeps
    them as the softmax gave them. (Mixtral's paper writes softmax over the top-k logits: the same weights.)"""
    probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
    weights, experts = torch.topk(probs, top_k, dim=-1)  # (N, k) each
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def combine_experts(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """outputs (N, k, d) of each token's k experts, weights (N, k) fp32 -> (N, d): the weighted sum, in fp32 (HF
    multiplies each expert's output by its fp32 weight too), cast back to the outputs' dtype once."""
    return (outputs * weights.unsqueeze(-1)).sum(dim=1).to(outputs.dtype)


def shared_expert_add(routed: torch.Tensor, shared: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
    """routed (N, d), shared (N, d), logit (N, 1) -> (N, d): the routed experts' weighted sum plus the shared expert's
    output times sigmoid(logit), in the activations' dtype (as HF's Qwen2MoeSparseMoeBlock)."""
    return routed + torch.sigmoid(logit) * shared
