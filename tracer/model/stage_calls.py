"""How the one layer definition calls its stages.

TransformerBlock, Attention, FeedForward and MixtureOfExperts (tracer/model/transformer.py, moe.py) each write their
stages once, in order, as calls on a `run` argument, which says how a stage runs:
- HOOKED (here): each stage module called as a module, so its hooks and the tracer's wrappers see it; Q, K, V,
  gate and up are products of their own. The reference, and the route everything that watches the modules takes.
- a packed step (tracer/model/fused.py's PackedStep, one per layer and step, built per run from the model as it
  stands): Q|K|V and gate|up one product each whose outputs are views, q and k normalised and rotated together in
  place, K|V written to the cache in one copy, each stage called past its hooks and marked after it.
Both runs offer the same calls: `call` (a stage module), `enter` (a sub-block: Attention, the FFN), the products
(`qkv`; `pair`: gate and up; `product`: any other, an expert's by its index) and the stages a packed step runs on
its own views (`qk_norm`, `rope`, `cache`, `scores`, `residual`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Hooked:
    """The stage modules called as modules (their hooks run)."""

    __slots__ = ()

    def call(self, module: nn.Module, *args: Any) -> Any:
        return module(*args)

    enter = rope = cache = scores = residual = product = call

    def pair(self, first: nn.Module, second: nn.Module, x: torch.Tensor,
             *expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """gate, up: two products (`expert`'s, for a mixture of experts)."""
        return first(x, *expert), second(x, *expert)

    def qkv(self, attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, dim) -> q (B, T, H, D), k and v (B, T, Hkv, D): three products. OLMoE's QK-norm over the whole
        projections (config.qk_norm_whole) runs on q and k before v's product and before the heads are split."""
        batch, new = x.shape[:2]
        q, k = attn.wq(x), attn.wk(x)  # (B, T, H*D), (B, T, Hkv*D)
        if attn.qk_norm_whole:
            q, k = attn.qk_norm(q, k)
        v = attn.wv(x)  # (B, T, Hkv*D)
        heads, kv_heads, head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        return (q.view(batch, new, heads, head_dim), k.view(batch, new, kv_heads, head_dim),
                v.view(batch, new, kv_heads, head_dim))

    def qk_norm(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's per head (OLMoE's whole-projection norm ran in `qkv`)."""
        return (q, k) if attn.qk_norm_whole else attn.qk_norm(q, k)


HOOKED = Hooked()
