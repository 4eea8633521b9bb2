"""The KV caches: each layer's K and V buffers preallocated to max_seq, written by position, read as the live slice
(KVCache), and a model's set of them with the rope tables its layers share (ModelCaches)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from llmtrace.tracer.core.config import first_attended_position
from llmtrace.tracer.core.errors import BadArgumentError, HardwareError
from llmtrace.tracer.hardware.memory import available_memory_bytes
from llmtrace.tracer.model.rope import rope_tables


class CacheFill:
    """Positions written and sequences held, by every layer's cache of one model at once: a step writes all layers or,
    failing, none, so one object holds the count, set once when the step is done (Transformer._cached_step,
    FusedPlan), read as each cache's `length` and `batch`."""

    __slots__ = ("batch", "length")

    def __init__(self) -> None:
        self.length = 0  # positions written so far (S after the next forward is length + T)
        self.batch = 0  # batch size of the sequences in the cache


class KVCache(nn.Module):
    """K and V of one attention layer in one buffer `kv` (max_batch, 2*Hkv, max_seq, D): heads [0, Hkv) are K,
    [Hkv, 2*Hkv) are V, so the model's fused path stores both with one copy.

    `forward(input_pos, k, v)` writes the new keys/values (B, T, Hkv, D) at positions `input_pos` (T,) and returns
    the live slices (B, Hkv, S, D), S = positions written so far. Attention reads only that slice, so the work it
    runs grows with S, never with max_seq. With a sliding window W the slices start at the oldest position the
    new queries attend (llmtrace.tracer.core.config.first_attended_position), so S is at most T + W - 1 and a
    decode step reads W positions however long the context; `live_bytes` counts the last W positions only. The
    buffer itself is still allocated to max_seq (written by position, never rotated). Positions are written in order
    (prefill, then one token per decode step), so the write is a contiguous slice copy at the current length;
    `input_pos` is passed for the hooks to see. The length moves when the step is done, in `fill` (CacheFill), which
    the model shares among its layers' caches.
    """

    def __init__(self, n_kv_heads: int, head_dim: int, window: int | None = None) -> None:
        super().__init__()
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.window = window
        self.fill = CacheFill()  # the model's, shared by every layer's cache (Transformer.setup_cache)
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
        self.fill.length = self.fill.batch = 0

    @property
    def length(self) -> int:
        return self.fill.length

    @property
    def batch(self) -> int:
        return self.fill.batch

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
        start = self.fill.length
        end = start + new
        hkv = self.n_kv_heads
        self.kv[:batch, :hkv, start:end] = k.transpose(1, 2)  # (B, T, Hkv, D) -> (B, Hkv, T, D)
        self.kv[:batch, hkv:, start:end] = v.transpose(1, 2)  # (B, T, Hkv, D) -> (B, Hkv, T, D)
        first = first_attended_position(end, new, self.window)
        live = self.kv[:batch, :, first:end]  # (B, 2*Hkv, S, D)
        return live[:, :hkv], live[:, hkv:]  # (B, Hkv, S, D) each

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the sequences `index` (B',) of the batch, moved to rows 0 .. B'-1 (their live positions copied;
        index_select copies first, so the rows may overlap their new places). The model sets the fill's batch once
        every layer's rows moved."""
        live = self.kv[: self.batch, :, : self.length]  # (B, 2*Hkv, S, D)
        self.kv[: index.shape[0], :, : self.length] = live.index_select(0, index)  # (B', 2*Hkv, S, D)

    def extra_repr(self) -> str:
        window = f", window={self.window}" if self.window is not None else ""
        return f"n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, max_seq={self.max_seq}{window}"


class ModelCaches(nn.Module):
    """A Transformer's KV caches (one per layer, in one tensor when their shapes agree) and the rope tables every
    layer shares: what a step reads besides the weights. Reads the model's `config`, `layers` and dense final `norm`."""

    config: Any
    layers: nn.ModuleList
    norm: nn.Module

    def __init__(self) -> None:
        super().__init__()
        self.fill = CacheFill()  # positions and sequences in every layer's cache (shared with them by setup_cache)
        self._positions: torch.Tensor | None = None  # arange(max_seq) on the model's device; input_pos slices it
        self._rope_key: tuple[int, torch.device, torch.dtype, bool] | None = None  # (length, device, dtype, long)
        self._rope_cos: torch.Tensor | None = None  # (max_seq, 1, R), shared with every layer's RotaryEmbedding
        self._rope_sin: torch.Tensor | None = None
        self._layer_tables: list[tuple[torch.Tensor, torch.Tensor]] = []  # each layer's (cos, sin): its RoPE base's
        # (L, B_max, 2*Hkv, S_max, D): every layer's KV cache buffer is one slice of it (setup_cache), so the fused
        # path's one-token step takes all layers' write positions and live keys/values in a few views per step.
        self._kv_all: torch.Tensor | None = None
        self._caches: list[KVCache] | None = None  # every layer's cache, listed by setup_cache
        # (B,) left pads of each cached sequence when a batch of prompts of different lengths was prefilled
        # (`prefill(tokens, pad)`), None when no row has any.
        self._pad: torch.Tensor | None = None

    @property
    def pos(self) -> int:
        """Tokens already in the KV cache (the position the next token will take)."""
        return self.fill.length

    def setup_cache(self, max_batch: int, max_seq: int) -> None:
        """Allocate every layer's KV cache for `max_batch` sequences of up to `max_seq` tokens; resets `pos`."""
        if max_batch <= 0 or max_seq <= 0:
            raise BadArgumentError(f"cache size must be positive, got max_batch={max_batch}, max_seq={max_seq}")
        if max_seq > self.config.max_seq_len:
            raise BadArgumentError(
                f"max_seq {max_seq} exceeds the model's context length {self.config.max_seq_len}; ask for fewer tokens"
            )
        weight = self.norm.weight  # always dense, in the model's dtype (a stored embedding is a meta placeholder)
        if weight.device.type == "cpu":
            need = 2 * self.config.n_layers * max_batch * max_seq * self.config.kv_dim * weight.element_size()
            free = available_memory_bytes()
            if free is not None and need > free * 0.9:
                raise HardwareError(
                    f"a KV cache for {max_seq:,} positions needs {need / 1e9:,.1f} GB, this machine has "
                    f"{free / 1e9:,.1f} GB free; ask for fewer --max-new-tokens or a shorter prompt")
        caches = self._caches = [layer.attention.kv_cache for layer in self.layers]
        heads = {(cache.n_kv_heads, cache.head_dim) for cache in caches}
        self._kv_all = None
        if len(heads) == 1:  # every layer's cache is one slice of a single tensor (FusedPlan reads them together)
            (kv_heads, head_dim), = heads
            self._kv_all = torch.zeros((len(caches), max_batch, 2 * kv_heads, max_seq, head_dim),
                                       dtype=weight.dtype, device=weight.device)  # (L, B_max, 2*Hkv, S_max, D)
        for index, cache in enumerate(caches):
            cache.fill = self.fill
            buffer = None if self._kv_all is None else self._kv_all[index]  # (B_max, 2*Hkv, S_max, D)
            cache.allocate(max_batch, max_seq, weight.dtype, weight.device, buffer)
        self._ensure_rope(max_seq)
        for layer, tables in zip(self.layers, self._layer_tables):  # a layer replaced since they were made has none
            layer.attention.rope.set_tables(*tables, self._positions)
        self.reset_cache()

    def reset_cache(self) -> None:
        """Forget the cached sequence (buffers stay allocated)."""
        self.fill.length = self.fill.batch = 0
        self._pad = None

    def _kv_caches(self) -> list[KVCache]:
        """Every layer's KVCache, in order: the list setup_cache made (read a few times per step, where nn.Module's
        attribute lookups cost ~2 us each: layer.attention.kv_cache, ~120 us a step), else looked up."""
        caches = self._caches
        return caches if caches is not None else [layer.attention.kv_cache for layer in self.layers]

    def packed_off_reason(self) -> str:
        """"" when the packed and native backends (tracer/model/fused.py) may run this model's cached steps, else why
        only the stage modules can (a tensor-parallel shard says its own)."""
        caches = self._kv_caches()
        return "" if caches and caches[0].is_allocated else "the KV cache is not set up"

    @property
    def batch(self) -> int:
        """Sequences in the cache (0 before the first prefill)."""
        return self.fill.batch

    @property
    def pads(self) -> tuple[int, ...]:
        """Left pads of each cached sequence (all 0 unless prompts of different lengths were prefilled together)."""
        if self._pad is None:
            return (0,) * self.batch
        return tuple(int(p) for p in self._pad.tolist())

    def keep_rows(self, rows: list[int]) -> None:
        """Compact the batch to the sequences `rows` (indices into the current batch, ascending): each layer's cache
        copies those rows' live positions to the front of its buffer, so the next step runs on len(rows) rows only.
        A finished sequence leaves the batch this way and costs nothing more."""
        if not rows or list(rows) != sorted(set(rows)) or rows[-1] >= self.batch:
            raise BadArgumentError(f"keep_rows takes ascending row indices below the batch of {self.batch}, got {rows}")
        if len(rows) == self.batch:
            return
        # on the caches' device: the dense final norm's (a table held as stored leaves a meta placeholder, and a
        # meta index made index_select return uninitialised rows without a word)
        index = torch.tensor(rows, dtype=torch.long, device=self.norm.weight.device)  # (B',)
        for cache in self._kv_caches():
            cache.keep_rows(index)
        self.fill.batch = len(rows)
        if self._pad is not None:
            pad = self._pad.index_select(0, index)  # (B',)
            self._pad = pad if bool(pad.any()) else None

    @property
    def kv_bytes_per_position(self) -> int:
        """K and V bytes one position of one sequence holds in the caches of all layers together."""
        return sum(2 * c.n_kv_heads * c.head_dim * c.kv.element_size() for c in self._kv_caches() if c.kv is not None)

    @property
    def kv_allocated_bytes(self) -> int:
        return sum(cache.allocated_bytes for cache in self._kv_caches())

    @property
    def kv_live_bytes(self) -> int:
        """Bytes of K and V attention can still read, over every layer (a packed or native backend reads the same
        from its plan's plain values: FusedPlan.kv_live_bytes)."""
        return sum(cache.live_bytes for cache in self._kv_caches())

    def _ensure_rope(self, length: int) -> None:
        """Share one cos/sin table of at least `length` positions among every layer's RotaryEmbedding (LongRoPE's of
        exactly the factors `length` positions take: its short ones up to the original context, the long past it)."""
        weight = self.norm.weight
        key = self._rope_key
        scaling = self.config.rope_scaling
        long = scaling is not None and scaling.kind == "longrope" and length > scaling.original_max_position
        if key is not None and key[0] >= length and key[1:] == (weight.device, weight.dtype, long):
            return
        cos, sin = rope_tables(self.config, length, weight.dtype, weight.device)
        self._positions = torch.arange(length, device=weight.device)
        # Gemma 3: the windowed layers turn by their own base (config.layer_rope); one table per distinct base
        tables = {(self.config.rope_theta, self.config.rope_scaling): (cos, sin)}
        for index, layer in enumerate(self.layers):
            key = self.config.layer_rope(index)
            if key not in tables:
                tables[key] = rope_tables(self.config, length, weight.dtype, weight.device, index)
            layer.attention.rope.set_tables(*tables[key], self._positions)
        self._layer_tables = [tables[self.config.layer_rope(i)] for i in range(len(self.layers))]
        self._rope_cos, self._rope_sin = cos, sin
        self._rope_key = (length, weight.device, weight.dtype, long)

    @contextmanager
    def rope_for_pass(self, length: int) -> Iterator[torch.Tensor]:
        """Positions 0..length-1 (length,) with tables for a cache-free pass of `length` positions, and the cache's
        tables put back after it: LongRoPE's differ by length, and the next cached step must find its own."""
        held = self._rope_key
        self._ensure_rope(length)
        try:
            yield self._positions[:length]
        finally:
            if held is not None:
                self._ensure_rope(held[0])

    def rope_tables(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The cos and signed-sin tables (S_max, 1, R) every layer's RotaryEmbedding shares (with Gemma 3's windowed
        layers' own base, those of its global layers)."""
        return self._rope_cos, self._rope_sin

    def _pad_step(self, index: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a step over the cache indices `index` (T,) of left-padded rows: each row's positions (B, T), counted
        from its first real token (pads at 0, never seen), and the pad mask (B, 1, T, S) hiding the pad keys among
        the S keys the step reads from every real query. A pad query may see earlier pads (only pads): its softmax
        stays finite, and no real row ever reads what it computes."""
        pad = self._pad  # (B,)
        positions = (index.unsqueeze(0) - pad.unsqueeze(1)).clamp_(min=0)  # (B, T)
        # where the layers' windows differ the mask covers a full layer's keys; a windowed layer takes its last S
        # (AttentionScores)
        window = None if self.config.mixed_windows else self.config.sliding_window
        first = first_attended_position(end, index.shape[0], window)
        keys = torch.arange(first, end, device=index.device)  # (S,) cache indices the step reads
        key_is_pad = keys.unsqueeze(0) < pad.unsqueeze(1)  # (B, S)
        query_is_real = index.unsqueeze(0) >= pad.unsqueeze(1)  # (B, T)
        hidden = (query_is_real.unsqueeze(2) & key_is_pad.unsqueeze(1)).unsqueeze(1)  # (B, 1, T, S)
        return positions, hidden
