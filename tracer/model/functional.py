"""Stateless numerics shared by the model's stage modules and its fused path."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
