"""The QK-norm stage (Qwen3): every query and key head RMS-normalised over its D values, after the Q and K
projections and before RoPE, with one weight vector (D,) for all query heads and one for all key heads (HF
Qwen3Attention's q_norm and k_norm). It keeps attention logits bounded as the model scales: the scores are then
dot products of vectors of bounded length, whatever the projections' magnitudes.

A stage of its own (contract: "attention.qk_norm", kind "qk_norm"), so the trace, its FLOPs and bytes and the
staged view show it. The math is functional.rms_norm's, the same as the block's norms (fp32 normalisation, cast
back before the weight), applied over the last axis of the (..., heads, D) tensors."""

from __future__ import annotations

import torch
from torch import nn

from llmtrace.tracer.model.functional import PlusOne, rms_norm, rms_norm_floor, rms_norm_plus_one


class QKNorm(nn.Module):
    """q (B, T, H, D), k (B, T, Hkv, D) -> the same shapes, each head normalised over D and times its weight."""

    def __init__(self, head_dim: int, eps: float, k_dim: int | None = None, plus_one: bool = False) -> None:
        super().__init__()
        self.eps = eps
        # Gemma 3: (1 + w) norms (functional.rms_norm_plus_one), the fp32 1 + w of each weight kept until it changes
        self.plus_one = (PlusOne(), PlusOne()) if plus_one else None
        # `k_dim`: the keys' width where it is not the queries' (OLMoE normalises each token's whole q, H·D wide,
        # and whole k, Hkv·D wide, before they are split into heads: config.qk_norm_whole)
        self.q_weight = nn.Parameter(torch.ones(head_dim))
        self.k_weight = nn.Parameter(torch.ones(head_dim if k_dim is None else k_dim))
        self._floor: torch.Tensor | None = None  # sqrt(D * eps), fp32, on the weights' device (made on first use)
        self._k_floor: torch.Tensor | None = None  # the keys' own, where their width differs

    def floor(self, device: torch.device) -> torch.Tensor:
        """sqrt(D * eps) as functional.rms_norm takes it (the packed path takes it from here too)."""
        floor = self._floor
        if floor is None or floor.device != device:
            floor = self._floor = rms_norm_floor(self.q_weight.shape[0], self.eps, device)
        return floor

    def k_floor(self, device: torch.device) -> torch.Tensor:
        """The keys' floor: the queries' unless their widths differ (OLMoE's whole projections)."""
        if self.k_weight.shape[0] == self.q_weight.shape[0]:
            return self.floor(device)
        k_floor = self._k_floor
        if k_floor is None or k_floor.device != device:
            k_floor = self._k_floor = rms_norm_floor(self.k_weight.shape[0], self.eps, device)
        return k_floor

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        floor, k_floor = self.floor(q.device), self.k_floor(q.device)
        if self.plus_one is not None:
            q_shift, k_shift = self.plus_one
            return (rms_norm_plus_one(q, q_shift.of(self.q_weight), floor),
                    rms_norm_plus_one(k, k_shift.of(self.k_weight), k_floor))
        return rms_norm(q, self.q_weight, floor), rms_norm(k, self.k_weight, k_floor)

    def extra_repr(self) -> str:
        plus = ", 1 + w" if self.plus_one is not None else ""
        return f"head_dim={self.q_weight.shape[0]}, eps={self.eps}{plus}"
