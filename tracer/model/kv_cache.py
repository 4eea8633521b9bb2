"""The per-layer KV cache: K and V buffers preallocated to max_seq, written by position, read as the live slice."""

from __future__ import annotations

import torch

from llmtrace.tracer.core.config import first_attended_position
from llmtrace.tracer.model.edit_watch import ForwardWatched


class KVCache(ForwardWatched):
    """K and V of one attention layer in one buffer `kv` (max_batch, 2*Hkv, max_seq, D): heads [0, Hkv) are K,
    [Hkv, 2*Hkv) are V, so the model's fused path stores both with one copy. `k_cache`/`v_cache` are views of it.

    `forward(input_pos, k, v)` writes the new keys/values (B, T, Hkv, D) at positions `input_pos` (T,) and returns
    the live slices (B, Hkv, S, D), S = positions written so far. Attention reads only that slice, so the work it
    runs grows with S, never with max_seq. With a sliding window W the slices start at the oldest position the
    new queries attend (llmtrace.tracer.core.config.first_attended_position), so S is at most T + W - 1 and a
    decode step reads W positions however long the context; `live_bytes` counts the last W positions only. The
    buffer itself is still allocated to max_seq (written by position, never rotated). Positions are written in order (prefill, then one token per decode step),
    so the write is a contiguous slice copy at the current length; `input_pos` is passed for the hooks to see.
    """

    def __init__(self, n_kv_heads: int, head_dim: int, window: int | None = None) -> None:
        super().__init__()
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.window = window
        self.length = 0  # positions written so far (S after the next forward is length + T)
        self.batch = 0  # batch size of the sequences in the cache
        # A non-persistent buffer: `.to(device)` moves it, `state_dict()` leaves it out.
        self.register_buffer("kv", None, persistent=False)

    def allocate(self, max_batch: int, max_seq: int, dtype: torch.dtype, device: torch.device | str,
                 buffer: torch.Tensor | None = None) -> None:
        """Zeroed K and V for `max_batch` sequences of `max_seq` positions; `buffer`, when given, is that zeroed
        (B_max, 2*Hkv, S_max, D) tensor already made (the model makes every layer's as a slice of one tensor:
        Transformer.setup_cache)."""
        shape = (max_batch, 2 * self.n_kv_heads, max_seq, self.head_dim)  # (B_max, 2*Hkv, S_max, D)
        if buffer is not None and (tuple(buffer.shape) != shape or buffer.dtype != dtype):
            raise ValueError(f"a KV buffer of {tuple(buffer.shape)} {buffer.dtype}, needs {shape} {dtype}")
        self.kv = torch.zeros(shape, dtype=dtype, device=device) if buffer is None else buffer
        self.reset()

    def reset(self) -> None:
        self.length = 0
        self.batch = 0

    @property
    def k_cache(self) -> torch.Tensor | None:
        return None if self.kv is None else self.kv[:, : self.n_kv_heads]  # (B_max, Hkv, S_max, D)

    @property
    def v_cache(self) -> torch.Tensor | None:
        return None if self.kv is None else self.kv[:, self.n_kv_heads :]  # (B_max, Hkv, S_max, D)

    @property
    def is_allocated(self) -> bool:
        return self.kv is not None

    @property
    def max_seq(self) -> int:
        return 0 if self.kv is None else self.kv.shape[2]

    @property
    def allocated_bytes(self) -> int:
        """Bytes reserved for K and V together, whatever is in use."""
        kv = self._buffers["kv"]  # not self.kv: nn.Module's lookup costs ~2 us, and every step's record reads this
        return 0 if kv is None else kv.numel() * kv.element_size()

    @property
    def live_bytes(self) -> int:
        """Bytes of K and V holding positions attention can still read: 2 * B * Hkv * S * D * bytes_per_element,
        S = positions written, or the last W of them under a sliding window."""
        kv = self._buffers["kv"]
        if kv is None:
            return 0
        held = self.length if self.window is None else min(self.length, self.window)
        return 2 * self.batch * self.n_kv_heads * held * self.head_dim * kv.element_size()

    def forward(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, new = k.shape[0], k.shape[1]
        start, end = self.length, self.length + new
        hkv = self.n_kv_heads
        self.kv[:batch, :hkv, start:end] = k.transpose(1, 2)  # (B, T, Hkv, D) -> (B, Hkv, T, D)
        self.kv[:batch, hkv:, start:end] = v.transpose(1, 2)  # (B, T, Hkv, D) -> (B, Hkv, T, D)
        self.length, self.batch = end, batch
        first = first_attended_position(end, new, self.window)
        live = self.kv[:batch, :, first:end]  # (B, 2*Hkv, S, D)
        return live[:, :hkv], live[:, hkv:]  # (B, Hkv, S, D) each

    def set_length(self, length: int, batch: int) -> None:
        """Positions written and sequences held, after a write that did not go through `forward` (the fused path
        writes every layer's positions through views of the one tensor all layers share). Plain ints set in the
        instance dict: nn.Module.__setattr__ costs ~2 us, 60 times a step."""
        self.__dict__["length"], self.__dict__["batch"] = length, batch

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the sequences `index` (B',) of the batch, moved to rows 0 .. B'-1 (their live positions copied;
        index_select copies first, so the rows may overlap their new places)."""
        live = self.kv[: self.batch, :, : self.length]  # (B, 2*Hkv, S, D)
        self.kv[: index.shape[0], :, : self.length] = live.index_select(0, index)  # (B', 2*Hkv, S, D)
        self.batch = int(index.shape[0])

    def extra_repr(self) -> str:
        window = f", window={self.window}" if self.window is not None else ""
        return f"n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, max_seq={self.max_seq}{window}"
