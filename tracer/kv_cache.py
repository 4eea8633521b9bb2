"""The per-layer KV cache: K and V buffers preallocated to max_seq, written by position, read as the live slice."""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """K and V of one attention layer, laid out (max_batch, Hkv, max_seq, D) as gpt-fast does.

    `forward(input_pos, k, v)` writes the new keys/values (B, T, Hkv, D) at positions `input_pos` (T,) and returns
    the live slices (B, Hkv, S, D), S = positions written so far. Attention reads only that slice, so the work it
    runs grows with S, never with max_seq. Positions are written in order (prefill, then one token per decode step),
    so the write is a contiguous slice copy at the current length.
    """

    def __init__(self, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.length = 0  # positions written so far (S after the next forward is length + T)
        self.batch = 0  # batch size of the sequences in the cache
        # Non-persistent buffers: `.to(device)` moves them, `state_dict()` leaves them out.
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def allocate(self, max_batch: int, max_seq: int, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (max_batch, self.n_kv_heads, max_seq, self.head_dim)  # (B_max, Hkv, S_max, D)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.reset()

    def reset(self) -> None:
        self.length = 0
        self.batch = 0

    @property
    def is_allocated(self) -> bool:
        return self.k_cache is not None

    @property
    def max_seq(self) -> int:
        return 0 if self.k_cache is None else self.k_cache.shape[2]

    @property
    def allocated_bytes(self) -> int:
        """Bytes reserved for K and V together, whatever is in use."""
        if self.k_cache is None:
            return 0
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    @property
    def live_bytes(self) -> int:
        """Bytes of K and V holding real positions: 2 * B * Hkv * S * D * bytes_per_element."""
        if self.k_cache is None:
            return 0
        return 2 * self.batch * self.n_kv_heads * self.length * self.head_dim * self.k_cache.element_size()

    def forward(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, new = k.shape[0], k.shape[1]
        start, end = self.length, self.length + new
        self.k_cache[:batch, :, start:end] = k.transpose(1, 2)  # (B, T, Hkv, D) -> (B, Hkv, T, D)
        self.v_cache[:batch, :, start:end] = v.transpose(1, 2)  # (B, T, Hkv, D) -> (B, Hkv, T, D)
        self.length, self.batch = end, batch
        return self.k_cache[:batch, :, :end], self.v_cache[:batch, :, :end]  # (B, Hkv, S, D) each

    def extra_repr(self) -> str:
        return f"n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, max_seq={self.max_seq}"
