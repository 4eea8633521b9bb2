"""Rotary position embedding (RoPE): frequencies, Llama 3.1 frequency scaling, cos/sin tables and the rotation.

Layout: HF's half-split ("rotate_half") convention. A head vector x of size D is rotated as pairs
(x[i], x[i + D/2]) for i < D/2, by the angle pos * inv_freq[i]. HF safetensors checkpoints are stored for this
layout, so they load without a Q/K permutation; Meta's original checkpoints and llama.cpp's GGUF files use the
interleaved layout (x[2i], x[2i+1]) and their Q/K rows must be permuted on load (the GGUF loader does it).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llmtrace.tracer.core.config import ModelConfig, RopeScaling
from llmtrace.tracer.model.functional import rotate


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None, length: int = 0) -> torch.Tensor:
    """inv_freq[i] = theta ** (-2i / D) for i < D/2, in fp32 on the CPU; Llama 3.1 scaling applied when given.

    llama.cpp's `rope_freqs` (kind "freqs", a GGUF's Llama 3.1 scaling): 1 / (factor[i] * theta ** (2i / D)), as
    llama.cpp divides each frequency by its factor; its converter computed them by the Llama 3.1 rule below.

    LongRoPE (Phi-3's 128k models): 1 / (factor[i] * theta ** (2i / D)), the short factors for tables of up to the
    original context's positions and the long ones for `length` past it (transformers' _compute_longrope_parameters;
    llama.cpp picks by the context's size the same way, once: a run's tables are its cache's length).

    Llama 3.1 scaling (Meta's `apply_scaling`, HF `_compute_llama3_parameters`): wavelengths longer than
    original_max_position / low_freq_factor are divided by `factor`; shorter than original / high_freq_factor are
    kept; in between, a linear blend in 1/wavelength.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    if scaling is not None and scaling.kind in ("longrope", "freqs"):
        factors = scaling.freq_factors if scaling.kind == "freqs" else \
            scaling.long_factor if length > scaling.original_max_position else scaling.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":  # every frequency divided by the factor (HF's 'linear' rope type: Gemma 3's global)
        return inv_freq / scaling.factor
    low_freq_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_tables(
    config: ModelConfig, max_seq: int, dtype: torch.dtype, device: torch.device | str, layer: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed-sin tables, each (max_seq, 1, R), computed in fp32 and cast to `dtype` (as HF does): the
    config's RoPE base and scaling, or with `layer` that layer's (config.layer_rope: Gemma 3's windowed layers turn
    by their own base). R is the values of a head RoPE turns (config.rotary_dim): the head's D, or under partial
    rotary its first R, whose frequencies are θ^(-2i/R) (transformers' dim = head_dim · partial_rotary_factor);
    `rotate` passes the other D - R through.

    sin is stored as [-sin, +sin] over the two halves so that rotate_half(x) * sin == roll(x, D/2) * signed_sin,
    which turns the rotation into three tensor ops (mul, roll, addcmul). LongRoPE's tables (`rope_inv_freq`: its
    factors chosen by `max_seq`) are times its attention factor, in fp32 before the cast, as transformers' are.
    """
    theta, scaling = (config.rope_theta, config.rope_scaling) if layer is None else config.layer_rope(layer)
    rotary = config.rotary_dim  # R = D, or the first R values of each head (partial rotary: Phi-4-mini)
    inv_freq = rope_inv_freq(rotary, theta, scaling, max_seq)
    positions = torch.arange(max_seq, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # (max_seq, R/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (max_seq, R)
    sin = angles.sin()
    sin[:, :rotary // 2].neg_()
    cos = angles.cos()
    if scaling is not None and scaling.kind == "longrope" and scaling.attention_factor != 1.0:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    shape = (max_seq, 1, rotary)  # a broadcast axis for the heads of (B, T, H, D)
    return cos.view(shape).to(device=device, dtype=dtype), sin.view(shape).to(device=device, dtype=dtype)


class RotaryEmbedding(nn.Module):
    """Rotates q (B, T, H, D) and k (B, T, Hkv, D) by their absolute positions `input_pos` (T,): the first
    `rotary_dim` values of each head (all D, or a partial rotary's R), the rest passed through.

    The tables are plain attributes shared by every layer (one copy per model, not 30), installed by
    `Transformer` through `set_tables` when the cache is set up or a longer sequence needs them.
    """

    def __init__(self, head_dim: int, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim  # R: its FLOPs' width (stage_cost)
        self.cos: torch.Tensor | None = None  # (max_seq, 1, R)
        self.sin: torch.Tensor | None = None  # (max_seq, 1, R), first half negated
        self.positions: torch.Tensor | None = None  # arange(max_seq): the model passes slices of it as input_pos

    def set_tables(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        self.cos, self.sin, self.positions = cos, sin, positions

    def forward(self, q: torch.Tensor, k: torch.Tensor, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`input_pos` (T,), or (B, T) for rows with their own positions (a left-padded batch)."""
        cos, sin = self.angles(input_pos)
        return rotate(q, cos, sin), rotate(k, cos, sin)  # (B, T, H, D), (B, T, Hkv, D)

    def angles(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables' rows of `input_pos`: (T, 1, R) each, (B, T, 1, R) for rows with their own positions."""
        if self.positions is not None and input_pos._base is self.positions and input_pos.is_contiguous():
            # A slice of arange(max_seq) starts at its own value: narrow the tables (a view) instead of gathering.
            start, new = input_pos.storage_offset(), input_pos.shape[0]
            return self.cos.narrow(0, start, new), self.sin.narrow(0, start, new)
        return self.cos[input_pos], self.sin[input_pos]  # broadcast over batch and heads

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}" + (f", rotary_dim={self.rotary_dim}" if self.rotary_dim != self.head_dim
                                               else "")
