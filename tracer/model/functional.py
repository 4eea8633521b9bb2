"""Stateless numerics shared by the model's stage modules and its fused path: both call these, so both round the
same way (the way HF transformers' eager LlamaForCausalLM does)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from llmtrace.tracer.model.weight_formats import PackedWeight


def rms_norm_floor(dim: int, eps: float, device: torch.device | str) -> torch.Tensor:
    """sqrt(dim * eps) as an fp32 scalar tensor on `device`: `rms_norm`'s floor."""
    return torch.tensor((dim * eps) ** 0.5, dtype=torch.float32, device=device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, normalised in fp32 and cast back before the weight (as HF does).

    `floor` is sqrt(dim * eps) as an fp32 scalar tensor: sqrt(mean(x^2) + eps) == hypot(||x||, floor) / sqrt(dim),
    five small ops where F.rms_norm's CPU kernel costs twice as long on one token (BENCHMARKS.md, "Model speed").
    """
    dim = x.shape[-1]
    rms = torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32), floor).mul_(dim**-0.5)
    if x.dtype == torch.float32:
        return torch.div(x, rms).mul_(weight)
    return torch.div(x, rms).to(x.dtype).mul_(weight)


def matvec(weight: torch.Tensor, vector: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """weight @ vector (+ bias): torch.mv, or mm while a TorchDispatchMode is active (FlopCounterMode counts mm,
    not mv), so what a FLOP counter sees is the product that runs. The bias is added to the product's result."""
    if torch._C._len_torch_dispatch_stack():
        out = torch.mm(weight, vector.view(-1, 1)).view(-1)
    else:
        out = torch.mv(weight, vector)
    return out if bias is None else out.add_(bias)


def matvec_mm(weight: torch.Tensor, vector: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """weight @ vector (+ bias) through mm, as a (1, in) @ (in, out) product: for some dtypes on some CPUs faster than
    torch.mv (fp16 on AVX2), for others slower (bf16 with AVX-512); which is measured (tracer/load/kernel_pick.py)."""
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


def attention_scores(q: torch.Tensor, k: torch.Tensor, scale: float, one_query: bool) -> torch.Tensor:
    """q (G, R*T, D) · k (G, S, D)ᵀ, times `scale` after the product -> (G, R*T, S) in q's dtype (G = B*Hkv groups
    of R query heads sharing a KV head). For one query token in half precision the product runs in fp32 and is
    rounded once, after the scaling: a half-precision bmm this small takes oneDNN's slow path on CPU (~3x fp32)."""
    return attention_scores_t(q, k.transpose(1, 2), scale, one_query)


def attention_scores_t(q: torch.Tensor, k_t: torch.Tensor, scale: float, one_query: bool) -> torch.Tensor:
    """attention_scores with the keys already transposed: k_t (G, D, S) (the fused path's one-token step makes
    every layer's in one op)."""
    if one_query and q.dtype != torch.float32:
        return torch.bmm(q.float(), k_t.float()).mul_(scale).to(q.dtype)  # (G, R, S)
    return torch.bmm(q, k_t).mul_(scale)  # (G, R*T, S)


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


def softmax_fp32(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis computed in fp32, returned in the scores' dtype."""
    if scores.dtype == torch.float32:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
