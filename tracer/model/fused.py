"""The model's fused path: the same math as the stage modules, in about half the tensor operations.

Decode on a CPU is a stream of small operations between weight-streaming matrix-vector products, and each small
operation after a product that has flushed the caches costs several microseconds; per-token time is mostly
their count. So when nothing watches the stage modules, `Transformer.prefill`/`decode_one` run this instead:
- wq|wk|wv and w1|w3 are packed as row blocks of one tensor each (the parameters become views of it: no extra
  memory), so Q, K, V come from one matmul and gate, up from another;
- q and k are rotated together, in place, with 1/sqrt(D) folded into q's rows of the cos/sin tables;
- K and V reach the cache in one copy (the cache keeps them in one buffer);
- RMSNorm is 4 small ops: x / hypot(||x||, sqrt(dim*eps)) * (w*sqrt(dim)), equal in real arithmetic to
  x / sqrt(mean(x^2) + eps) * w.
Tests check it against the stage-by-stage path and HF transformers. The plan records which parameter objects (and
their in-place version counters) it read; `valid()` notices a reload, a `.to()` or an in-place weight edit.

The path is instrumented from inside: it calls `mark()` after each of its stages (the order of
llmtrace.tracer.core.contract.fused_stages: its stages with Q|K|V and gate|up packed),
which costs one no-op call when nothing traces and one clock read when tracer/trace/fused_marks.py does. So a traced
run executes exactly the untraced run's tensor ops. Each stage keeps its own ops for that reason (the residual
adds are not folded into the output products: addmm and mm + add_ measured equal).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmtrace.tracer.core.config import first_attended_position
from llmtrace.tracer.model.functional import causal_mask, softmax_fp32

if TYPE_CHECKING:
    from llmtrace.tracer.model.transformer import RMSNorm, Transformer, TransformerBlock

Mark = Callable[[], None]

def no_mark() -> None:
    """The mark of an untraced run."""


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
        self.kv_row = attn.kv_cache.kv[0]  # (2*Hkv, S_max, D): the first sequence's K|V of (B_max, 2*Hkv, S_max, D)
        self.heads, self.kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.rep = self.heads // self.kv_heads
        self.attention_norm, self.ffn_norm = FusedNorm(layer.attention_norm), FusedNorm(layer.ffn_norm)
        self.wqkv = _packed_rows(attn.wq.weight, attn.wv.weight)  # ((H+2Hkv)*D, dim)
        self.bqkv = None if attn.wq.bias is None else _packed_rows(attn.wq.bias, attn.wv.bias)  # ((H+2Hkv)*D,)
        self.wo = attn.wo.weight.detach()  # (dim, H*D)
        self.bo = None if attn.wo.bias is None else attn.wo.bias.detach()  # (dim,)
        self.w13 = _packed_rows(ffn.w1.weight, ffn.w3.weight)  # (2F, dim)
        self.b13 = None if ffn.w1.bias is None else _packed_rows(ffn.w1.bias, ffn.w3.bias)  # (2F,)
        self.w2 = ffn.w2.weight.detach()  # (dim, F)
        self.b2 = None if ffn.w2.bias is None else ffn.w2.bias.detach()  # (dim,)
        self.ffn_dim = self.w2.shape[1]

    def decode_one(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: int,
                   mark: Mark = no_mark) -> torch.Tensor:
        """One token of one sequence: x (dim,) at position `pos`; cos, sin (H+Hkv, D). Matrix-vector products
        (mv): for bf16 on CPU they run about twice as fast as the same product through mm. `mark()` after each
        layer stage of contract.fused_stages."""
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        h = self.attention_norm(x)  # (dim,)
        mark()
        qkv = matvec(self.wqkv, h, self.bqkv).view(heads + 2 * kv_heads, head_dim)  # (H+2Hkv, D)
        mark()
        qk = qkv[: heads + kv_heads]  # (H+Hkv, D), a view
        torch.addcmul(qk * cos, qk.roll(head_dim // 2, dims=-1), sin, out=qk)  # RoPE (and q's scale) in place
        mark()
        self.kv_row.select(1, pos).copy_(qkv[heads:])  # K and V heads (2Hkv, D) at position pos
        first = first_attended_position(pos + 1, 1, self.cache.window)  # 0, or the window's oldest key
        live = self.kv_row.narrow(1, first, pos + 1 - first)  # (2Hkv, S, D)
        mark()
        q = qk[:heads].view(kv_heads, self.rep, head_dim)  # (Hkv, R, D)
        keys, values = live[:kv_heads], live[kv_heads:]  # (Hkv, S, D) each
        if x.dtype != torch.float32:  # small bf16/fp16 bmm go through oneDNN at ~80 us each; in fp32 a few
            q, keys = q.float(), keys.float()
        scores = torch.bmm(q, keys.transpose(1, 2))  # (Hkv, R, S), already scaled by 1/sqrt(D)
        mark()
        probs = torch.softmax(scores, dim=-1)  # (Hkv, R, S)
        mark()
        out = torch.bmm(probs, values.to(probs.dtype)).view(-1).to(x.dtype)  # (H*D,)
        mark()
        attended = matvec(self.wo, out, self.bo)  # wo(attention): (dim,)
        mark()
        x = attended.add_(x)  # the residual stream
        mark()
        h = self.ffn_norm(x)  # (dim,)
        mark()
        gate_up = matvec(self.w13, h, self.b13)  # (2F,)
        mark()
        act = F.silu(gate_up[: self.ffn_dim]).mul_(gate_up[self.ffn_dim :])  # silu(gate) * up: (F,)
        mark()
        down = matvec(self.w2, act, self.b2)  # (dim,)
        mark()
        x = down.add_(x)
        mark()
        return x

    def forward(self, x: torch.Tensor, batch: int, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, mark: Mark = no_mark) -> torch.Tensor:
        """Any batch and length: x (B*T, dim); cos, sin (T, H+Hkv, D); mask (T, S) or None when T == 1.
        `mark()` after each layer stage of contract.fused_stages."""
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        new = x.shape[0] // batch
        groups = batch * kv_heads
        h = self.attention_norm(x)  # (B*T, dim)
        mark()
        qkv = linear(h, self.wqkv, self.bqkv).view(batch, new, heads + 2 * kv_heads, head_dim)  # (B, T, H+2Hkv, D)
        mark()
        qk = qkv[:, :, : heads + kv_heads]  # (B, T, H+Hkv, D), a view
        torch.addcmul(qk * cos, qk.roll(head_dim // 2, dims=-1), sin, out=qk)  # RoPE (and q's scale) in place
        mark()
        live = self.cache.append(qkv[:, :, heads:])  # (B, 2*Hkv, S, D)
        mark()
        seen = live.shape[2]
        k_all = live[:, :kv_heads].reshape(groups, seen, head_dim)  # (B*Hkv, S, D)
        q = qkv[:, :, :heads].transpose(1, 2).reshape(groups, self.rep * new, head_dim)  # (B*Hkv, R*T, D)
        scores = torch.bmm(q, k_all.transpose(1, 2))  # (B*Hkv, R*T, S), already scaled by 1/sqrt(D)
        if mask is not None:
            scores.view(batch, heads, new, seen).masked_fill_(mask, float("-inf"))
        mark()
        probs = softmax_fp32(scores)  # (B*Hkv, R*T, S)
        mark()
        v_all = live[:, kv_heads:].reshape(groups, seen, head_dim)  # (B*Hkv, S, D)
        out = torch.bmm(probs, v_all)  # (B*Hkv, R*T, D)
        out = out.view(batch, heads, new, head_dim).transpose(1, 2).reshape(batch * new, heads * head_dim)  # (B*T, H*D)
        mark()
        attended = linear(out, self.wo, self.bo)  # wo(attention): (B*T, dim)
        mark()
        x = attended.add_(x)  # the residual stream
        mark()
        h = self.ffn_norm(x)  # (B*T, dim)
        mark()
        gate, up = linear(h, self.w13, self.b13).chunk(2, dim=-1)  # (B*T, F) each
        mark()
        act = F.silu(gate).mul_(up)  # (B*T, F)
        mark()
        down = linear(act, self.w2, self.b2)  # (B*T, dim)
        mark()
        x = down.add_(x)
        mark()
        return x


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
        self.output_bias = None if model.output.bias is None else model.output.bias.detach()  # (V,)
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

    def step(self, tokens: torch.Tensor, start: int, mark: Mark = no_mark) -> torch.Tensor:
        """tokens (B, T) at positions start..start+T-1 -> logits (B, V) of the last position; fills the caches.

        `mark()` once before the embedding, then after each stage of contract.fused_stages (the layer stages once
        per layer)."""
        batch, new = tokens.shape
        cos = self.cos[start : start + new] * self.qk_scale  # (T, H+Hkv, D): q's rows carry 1/sqrt(D)
        sin = self.sin[start : start + new] * self.qk_scale  # (T, H+Hkv, D)
        one_token = batch * new == 1 and self.caches[0].kv.shape[0] == 1
        window = self.caches[0].window
        seen = start + new - first_attended_position(start + new, new, window)  # keys the caches' slices hold
        mask = causal_mask(new, seen, tokens.device, window) if new > 1 else None  # (T, S)
        mark()
        x = F.embedding(tokens.reshape(-1), self.embedding)  # (B*T, dim)
        mark()
        if one_token:
            cos, sin, x = cos[0], sin[0], x[0]  # (H+Hkv, D), (H+Hkv, D), (dim,)
            for layer in self.layers:
                x = layer.decode_one(x, cos, sin, start, mark)
            for cache in self.caches:
                cache.__dict__["length"], cache.__dict__["batch"] = start + 1, 1  # plain attributes, no hooks
            h = self.final_norm(x).view(1, -1)  # (1, dim)
        else:
            for layer in self.layers:
                x = layer.forward(x, batch, cos, sin, mask, mark)
            h = self.final_norm(x.view(batch, new, -1)[:, -1])  # (B, dim): the last position only
        mark()
        if h.shape[0] > 1:
            logits = linear(h, self.output, self.output_bias)  # (B, V)
        else:
            logits = matvec(self.output, h[0], self.output_bias).view(1, -1)  # (1, V)
        mark()
        return logits


def matvec(weight: torch.Tensor, vector: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """weight @ vector (+ bias): torch.mv, or mm while a TorchDispatchMode is active (FlopCounterMode counts mm,
    not mv), so what a FLOP counter sees is the product that runs. The bias is added to the product's result."""
    if torch._C._len_torch_dispatch_stack():
        out = torch.mm(weight, vector.view(-1, 1)).view(-1)
    else:
        out = torch.mv(weight, vector)
    return out if bias is None else out.add_(bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (N, in) @ weightᵀ (+ bias) -> (N, out), as F.linear computes it for the stage modules (addmm with a bias)."""
    return torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())


def watched(modules: list[nn.Module]) -> bool:
    """Whether any forward hook observes the modules, global or per-module. (An instance-level forward wrapper
    registers no hook; `Transformer.fusable` looks for those itself, on every call.)"""
    from torch.nn.modules import module as module_globals

    if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _pack(*linears: nn.Linear) -> None:
    """Concatenate the linears' weights (and biases, when they have them) by rows and make each parameter a view
    of its block of the result."""
    for attribute in ("weight", "bias"):
        params = [getattr(linear, attribute) for linear in linears]
        if params[0] is None:
            continue
        packed = torch.cat([p.detach() for p in params], dim=0)
        row = 0
        for linear, param in zip(linears, params):
            rows = param.shape[0]
            setattr(linear, attribute, nn.Parameter(packed[row : row + rows], requires_grad=param.requires_grad))
            row += rows


def _packed(*linears: nn.Linear) -> bool:
    """Whether the linears' weights (and biases) are consecutive row blocks of one storage, each contiguous."""
    return all(_consecutive([getattr(linear, attribute) for linear in linears])
               for attribute in ("weight", "bias") if getattr(linears[0], attribute) is not None)


def _consecutive(tensors: list[torch.Tensor]) -> bool:
    if not all(t.is_contiguous() for t in tensors):
        return False
    base = tensors[0].untyped_storage().data_ptr()
    expected = tensors[0].data_ptr()
    for t in tensors:
        if t.untyped_storage().data_ptr() != base or t.data_ptr() != expected:
            return False
        expected += t.numel() * t.element_size()
    return True


def _packed_rows(first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The (rows, ...) tensor spanning packed parameters from `first` to `last`: a view, no copy."""
    t = first.detach()
    row_numel = t[0].numel() if t.dim() > 1 else 1
    rows = (last.data_ptr() - t.data_ptr()) // (t.element_size() * row_numel) + last.shape[0]
    return torch.as_strided(t, (rows, *t.shape[1:]), t.stride())
