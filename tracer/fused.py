"""The model's fused path: the same math as the stage modules, in about half the tensor operations.

Decode on a CPU is a stream of small operations between weight-streaming matrix-vector products, and each small
operation after a product that has flushed the caches costs several microseconds; per-token time is mostly
their count. So when nothing watches the stage modules, `Transformer.prefill`/`decode_one` run this instead:
- wq|wk|wv and w1|w3 are packed as row blocks of one tensor each (the parameters become views of it: no extra
  memory), so Q, K, V come from one matmul and gate, up from another;
- q and k are rotated together, in place, with 1/sqrt(D) folded into q's rows of the cos/sin tables;
- K and V reach the cache in one copy (the cache keeps them in one buffer);
- the residual adds ride in the output matmuls (addmm);
- RMSNorm is 4 small ops: x / hypot(||x||, sqrt(dim*eps)) * (w*sqrt(dim)), equal in real arithmetic to
  x / sqrt(mean(x^2) + eps) * w.
Tests check it against the stage-by-stage path and HF transformers. The plan records which parameter objects (and
their in-place version counters) it read; `valid()` notices a reload, a `.to()` or an in-place weight edit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tracer.functional import causal_mask, softmax_fp32

if TYPE_CHECKING:
    from tracer.model import RMSNorm, Transformer, TransformerBlock


class FusedNorm:
    """An RMSNorm in 4 ops (5 for bf16/fp16, normalised in fp32 as HF does):
    x / hypot(||x||, sqrt(dim*eps)) * (w*sqrt(dim)) == x / sqrt(mean(x^2) + eps) * w in real arithmetic."""

    __slots__ = ("floor", "scaled_weight")

    def __init__(self, module: RMSNorm) -> None:
        dim = module.weight.shape[0]
        self.floor = torch.full((), (dim * module.eps) ** 0.5, dtype=torch.float32, device=module.weight.device)
        self.scaled_weight = module.weight.detach().float() * dim**0.5  # (dim,), fp32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)  # sqrt(sum x^2), fp32
        if x.dtype == torch.float32:
            return torch.div(x, torch.hypot(norm, self.floor)).mul_(self.scaled_weight)
        return torch.div(x, torch.hypot(norm, self.floor)).mul_(self.scaled_weight).to(x.dtype)


class FusedLayer:
    """One transformer block on the fused path: its norms, views of its packed weights, its KV cache."""

    def __init__(self, layer: TransformerBlock) -> None:
        attn, ffn = layer.attention, layer.feed_forward
        self.cache = attn.kv_cache
        self.kv = attn.kv_cache.kv  # (B_max, 2*Hkv, S_max, D)
        self.kv_row = self.kv[0]  # (2*Hkv, S_max, D): the first sequence's K|V, a view
        self.heads, self.kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.rep = self.heads // self.kv_heads
        self.attention_norm, self.ffn_norm = FusedNorm(layer.attention_norm), FusedNorm(layer.ffn_norm)
        self.wqkv = _packed_rows(attn.wq, attn.wv)  # ((H+2Hkv)*D, dim)
        self.wo = attn.wo.weight.detach()  # (dim, H*D)
        self.w13 = _packed_rows(ffn.w1, ffn.w3)  # (2F, dim)
        self.w2 = ffn.w2.weight.detach()  # (dim, F)
        self.ffn_dim = self.w2.shape[1]

    def decode_one(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: int) -> torch.Tensor:
        """One token of one sequence: x (dim,) at position `pos`; cos, sin (H+Hkv, D). Matrix-vector products
        (mv, addmv): for bf16 on CPU they run about twice as fast as the same product through mm."""
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        qkv = torch.mv(self.wqkv, self.attention_norm(x)).view(heads + 2 * kv_heads, head_dim)  # (H+2Hkv, D)
        qk = qkv[: heads + kv_heads]  # (H+Hkv, D), a view
        torch.addcmul(qk * cos, qk.roll(head_dim // 2, dims=-1), sin, out=qk)  # RoPE (and q's scale) in place
        self.kv_row.select(1, pos).copy_(qkv[heads:])  # K and V heads (2Hkv, D) at position pos
        live = self.kv_row.narrow(1, 0, pos + 1)  # (2Hkv, S, D)
        q = qk[:heads].view(kv_heads, self.rep, head_dim)  # (Hkv, R, D)
        if x.dtype == torch.float32:
            scores = torch.bmm(q, live[:kv_heads].transpose(1, 2))  # (Hkv, R, S)
            out = torch.bmm(torch.softmax(scores, dim=-1), live[kv_heads:]).view(-1)  # (H*D,)
        else:  # small bf16/fp16 bmm go through oneDNN at ~80 us each; in fp32 they take a few
            live = live.float()
            scores = torch.bmm(q.float(), live[:kv_heads].transpose(1, 2))  # (Hkv, R, S)
            out = torch.bmm(torch.softmax(scores, dim=-1), live[kv_heads:]).view(-1).to(x.dtype)  # (H*D,)
        x = _add_mv(x, self.wo, out)  # x + wo(attention): (dim,)
        gate_up = torch.mv(self.w13, self.ffn_norm(x))  # (2F,)
        act = F.silu(gate_up[: self.ffn_dim]).mul_(gate_up[self.ffn_dim :])  # silu(gate) * up: (F,)
        return _add_mv(x, self.w2, act)  # x + w2(act): (dim,)

    def forward(self, x: torch.Tensor, batch: int, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Any batch and length: x (B*T, dim); cos, sin (T, H+Hkv, D); mask (T, S) or None when T == 1."""
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        new = x.shape[0] // batch
        groups = batch * kv_heads
        qkv = torch.mm(self.attention_norm(x), self.wqkv.t())  # (B*T, (H+2Hkv)*D)
        qkv = qkv.view(batch, new, heads + 2 * kv_heads, head_dim)  # (B, T, H+2Hkv, D)
        qk = qkv[:, :, : heads + kv_heads]  # (B, T, H+Hkv, D), a view
        torch.addcmul(qk * cos, qk.roll(head_dim // 2, dims=-1), sin, out=qk)  # RoPE (and q's scale) in place
        live = self.cache.append(qkv[:, :, heads:])  # (B, 2*Hkv, S, D)
        seen = live.shape[2]
        k_all = live[:, :kv_heads].reshape(groups, seen, head_dim)  # (B*Hkv, S, D)
        v_all = live[:, kv_heads:].reshape(groups, seen, head_dim)  # (B*Hkv, S, D)
        q = qkv[:, :, :heads].transpose(1, 2).reshape(groups, self.rep * new, head_dim)  # (B*Hkv, R*T, D)
        scores = torch.bmm(q, k_all.transpose(1, 2))  # (B*Hkv, R*T, S), already scaled by 1/sqrt(D)
        if mask is not None:
            scores.view(batch, heads, new, seen).masked_fill_(mask, float("-inf"))
        out = torch.bmm(softmax_fp32(scores), v_all)  # (B*Hkv, R*T, D)
        out = out.view(batch, heads, new, head_dim).transpose(1, 2).reshape(batch * new, heads * head_dim)  # (B*T, H*D)
        x = torch.addmm(x, out, self.wo.t())  # x + wo(attention): (B*T, dim)
        gate, up = torch.mm(self.ffn_norm(x), self.w13.t()).chunk(2, dim=-1)  # (B*T, F) each
        return torch.addmm(x, F.silu(gate).mul_(up), self.w2.t())  # x + w2(silu(gate) * up): (B*T, dim)


class FusedPlan:
    """Everything the fused path reads, built once by `Transformer.setup_cache` (which packs the projections)."""

    def __init__(self, model: Transformer) -> None:
        for layer in model.layers:
            attn, ffn = layer.attention, layer.feed_forward
            if not _packed(attn.wq, attn.wk, attn.wv):
                _pack(attn.wq, attn.wk, attn.wv)
            if not _packed(ffn.w1, ffn.w3):
                _pack(ffn.w1, ffn.w3)
        self.layers = [FusedLayer(layer) for layer in model.layers]
        self.caches = [layer.attention.kv_cache for layer in model.layers]
        self.embedding, self.output = model.tok_embeddings.weight.detach(), model.output.weight.detach()
        self.final_norm = FusedNorm(model.norm)
        self.cos, self.sin = model.rope_tables()  # (S_max, 1, D) each
        config, weight = model.config, model.tok_embeddings.weight
        scale = torch.ones(config.n_heads + config.n_kv_heads, 1, dtype=weight.dtype, device=weight.device)
        scale[: config.n_heads] = config.head_dim**-0.5
        self.qk_scale = scale  # (H+Hkv, 1): 1/sqrt(D) on q's heads, 1 on k's
        # Parameters must stay the same objects, unmodified in place (their version counters); buffers (the KV
        # caches, written every step) the same objects.
        self._params = [
            (m._parameters, n, t, t._version)
            for m in model.modules()
            for n, t in m._parameters.items()
            if t is not None
        ]
        self._buffers = [(m._buffers, n, t) for m in model.modules() for n, t in m._buffers.items() if t is not None]

    def valid(self, model: Transformer) -> bool:
        """Whether the plan still describes the model: same rope tables, parameters and buffers."""
        cos, sin = model.rope_tables()
        if cos is not self.cos or sin is not self.sin:
            return False
        for owner, name, tensor, version in self._params:
            if owner.get(name) is not tensor or tensor._version != version:
                return False
        return all(owner.get(name) is tensor for owner, name, tensor in self._buffers)

    def step(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """tokens (B, T) at positions start..start+T-1 -> logits (B, V) of the last position; fills the caches."""
        batch, new = tokens.shape
        cos = self.cos[start : start + new] * self.qk_scale  # (T, H+Hkv, D): q's rows carry 1/sqrt(D)
        sin = self.sin[start : start + new] * self.qk_scale  # (T, H+Hkv, D)
        x = F.embedding(tokens.reshape(-1), self.embedding)  # (B*T, dim)
        if batch * new == 1 and self.caches[0].kv.shape[0] == 1:
            cos, sin = cos[0], sin[0]  # (H+Hkv, D)
            x = x[0]  # (dim,)
            for layer in self.layers:
                x = layer.decode_one(x, cos, sin, start)
            for cache in self.caches:
                cache.__dict__["length"], cache.__dict__["batch"] = start + 1, 1  # plain attributes, no hooks
            return torch.mv(self.output, self.final_norm(x)).view(1, -1)  # (1, V)
        mask = causal_mask(new, start + new, tokens.device) if new > 1 else None  # (T, S)
        for layer in self.layers:
            x = layer.forward(x, batch, cos, sin, mask)
        last = x.view(batch, new, -1)[:, -1]  # (B, dim): the last position only
        return torch.mm(self.final_norm(last), self.output.t())  # (B, V)


def _add_mv(x: torch.Tensor, weight: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """x + weight @ vector. One addmv in fp32; for bf16/fp16 mv then add_, because half-precision addmv takes a
    slow generic kernel on CPUs without AVX-512 BF16 (10x slower than mv on AVX2; equal with it)."""
    if x.dtype == torch.float32:
        return torch.addmv(x, weight, vector)
    return torch.mv(weight, vector).add_(x)


def watched(modules: list[nn.Module]) -> bool:
    """Whether any forward hook observes the modules, global or per-module. (An instance-level forward wrapper
    registers no hook; `Transformer.fusable` looks for those itself, on every call.)"""
    from torch.nn.modules import module as module_globals

    if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _pack(*linears: nn.Linear) -> None:
    """Concatenate the linears' weights by rows and make each weight a view of its block of the result."""
    weights = [linear.weight for linear in linears]
    packed = torch.cat([w.detach() for w in weights], dim=0)
    row = 0
    for linear, weight in zip(linears, weights):
        rows = weight.shape[0]
        linear.weight = nn.Parameter(packed[row : row + rows], requires_grad=weight.requires_grad)
        row += rows


def _packed(*linears: nn.Linear) -> bool:
    """Whether the linears' weights are consecutive row blocks of one storage, each contiguous."""
    weights = [linear.weight for linear in linears]
    if not all(w.is_contiguous() for w in weights):
        return False
    base = weights[0].untyped_storage().data_ptr()
    expected = weights[0].data_ptr()
    for w in weights:
        if w.untyped_storage().data_ptr() != base or w.data_ptr() != expected:
            return False
        expected += w.numel() * w.element_size()
    return True


def _packed_rows(first: nn.Linear, last: nn.Linear) -> torch.Tensor:
    """The (rows, in) tensor spanning packed linears from `first` to `last`: a view, no copy."""
    w = first.weight.detach()
    rows = (last.weight.data_ptr() - w.data_ptr()) // (w.element_size() * w.shape[1]) + last.weight.shape[0]
    return torch.as_strided(w, (rows, w.shape[1]), (w.shape[1], 1))
