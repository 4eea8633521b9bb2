"""Stateless numerics shared by the model's stage modules and its fused path."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, normalised in fp32 and cast back before the weight (as HF does)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


def causal_mask(new: int, seen: int, device: torch.device) -> torch.Tensor:
    """(T, S) bool, True where query t (at position S - T + t) must not see key s (s > S - T + t)."""
    return torch.ones(new, seen, dtype=torch.bool, device=device).triu_(seen - new + 1)


def softmax_fp32(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis computed in fp32, returned in the scores' dtype."""
    if scores.dtype == torch.float32:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
