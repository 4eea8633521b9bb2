"""What the native decode step reads (native/decode_step.c's StepPlan and StepLayer), built once per FusedPlan.

`StepDescription(plan)` describes a FusedPlan's model for the C step: every layer's matrices (the PackedWeights'
BlockMatrix descriptions), norm weights, biases, QK-norm weights, a mixture of experts' router and experts, the KV
cache tensor and its strides, each layer's RoPE tables and window, the scales; NotEligible (one line) where the C
step cannot run the model. It holds a reference to every tensor whose memory C reads. tracer/model/native_step.py
runs the step from it.

A partial rotary (Phi-4-mini) is the plan's `rotary`, the tables' width: RoPE turns that many values of each head.

Gemma 3's twists are the same plan's fields (decode_step.c's one layer loop reads them): its (1 + w) norms are
passed as the fp32 vector 1 + w the stage modules multiply by (functional.PlusOne), its norms after attention and
FFN as two more vectors a layer, GeGLU as a flag, the embedding's × √d and the final soft-cap as two numbers (0:
none), and each layer's own RoPE tables (the windowed layers' local base, the global layers' scaled one) and
sliding window (0 on the global layers).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from llmtrace.tracer.model.functional import rms_norm_floor
from llmtrace.tracer.model.weight_formats import PackedWeight, runs_blocks


class _Layer(ctypes.Structure):
    """decode_step.c's StepLayer."""

    _fields_ = [*((name, ctypes.c_void_p) for name in
                  ("wqkv", "wo", "w13", "w2", "attention_norm", "ffn_norm", "bqkv", "bo", "b13", "b2", "q_norm",
                   "k_norm", "router", "router_dense", "expert_w13", "expert_w2", "post_attention_norm",
                   "post_ffn_norm", "cos", "sin", "shared_w13", "shared_w2", "shared_gate")),
                ("window", ctypes.c_int64)]


class _Plan(ctypes.Structure):
    """decode_step.c's StepPlan."""

    _fields_ = [*((name, ctypes.c_int64) for name in
                  ("layers", "dim", "heads", "kv_heads", "head_dim", "ffn_dim", "vocab", "max_seq")),
                ("norm_floor", ctypes.c_float), ("scale", ctypes.c_float),
                ("layer", ctypes.c_void_p), ("final_norm", ctypes.c_void_p), ("head", ctypes.c_void_p),
                ("head_bias", ctypes.c_void_p), ("kv", ctypes.c_void_p), ("kv_layer", ctypes.c_int64),
                ("kv_head", ctypes.c_int64), ("scratch", ctypes.c_void_p), ("scratch_floats", ctypes.c_int64),
                ("embedding", ctypes.c_void_p), ("embedding_dense", ctypes.c_void_p),
                ("embedding_rows", ctypes.c_int64), ("qk_norm_floor", ctypes.c_float),
                *((name, ctypes.c_int64) for name in ("n_experts", "top_k", "renormalise", "qk_norm_whole")),
                ("qk_norm_floor_k", ctypes.c_float), ("embed_scale", ctypes.c_float), ("softcap", ctypes.c_float),
                ("gelu", ctypes.c_int64), ("rotary", ctypes.c_int64), ("shared_ffn_dim", ctypes.c_int64)]


class NotEligible(Exception):
    """Why a model's step cannot run natively (one line)."""


class StepDescription:
    """A FusedPlan's model as decode_step.c reads it (`plan`, a _Plan whose pointers stay valid while this object
    lives), with the sizes the step's caller needs: layers, vocab, dim, head_dim, top_k; and a mixture of experts'
    routed buffers, whose rows become each layer's Route.last (`routes`)."""

    def __init__(self, plan: Any) -> None:
        layers = plan.layers
        if not layers or plan.kv_rows is None:
            raise NotEligible("no layers, or the layers' KV caches are not one tensor")
        if plan.dtype != torch.float32:
            raise NotEligible(f"the model computes in {plan.dtype}, the native step in fp32")
        first, block = layers[0], plan.blocks[0]
        self.keep: list[Any] = []  # every tensor and description whose memory C reads
        self.dim, self.head_dim = first.attention_norm.weight.shape[0], first.head_dim
        self.vocab = plan.output.shape[0] if isinstance(plan.output, PackedWeight) else 0
        # the values of each head RoPE turns, the tables' width: the head's, or a partial rotary's first R
        self.rotary = block.attention.rope.rotary_dim
        if self.head_dim % 2 or self.rotary % 2 or not 0 < self.rotary <= self.head_dim:
            raise NotEligible("odd head dimension, or RoPE over an odd or too wide part of each head")
        self.whole = first.qk_whole is not None  # OLMoE's: over each token's whole q and whole k
        self.qk_norm = first.qk_weight is not None or self.whole  # Qwen3: every layer or none (one model's layers)
        self.post_norms = block.post_attention_norm is not None  # Gemma: every layer or none
        self.gelu = "gelu" in block.feed_forward._modules
        self.top_k = first.experts.top_k if first.experts is not None else 0
        # Qwen2-MoE's shared expert beside the routed ones (every layer or none): its width Fs, else 0
        shared = getattr(block.feed_forward, "shared_add", None) is not None
        self.shared_ffn = block.feed_forward.shared_w2.weight.shape[1] if shared else 0
        self.layers = len(layers)
        # a mixture of experts' choice in every layer, written by each step (llmt_decode_step's routed buffers)
        self.routed = torch.zeros(len(layers), max(self.top_k, 1), dtype=torch.int64)  # (L, k)
        self.routed_weights = torch.zeros(len(layers), max(self.top_k, 1), dtype=torch.float32)  # (L, k)
        self.routes: list[tuple[Any, tuple[torch.Tensor, torch.Tensor]]] = []  # (Route, its rows of the choice)
        kv = self._cache(plan.kv_rows, first)
        described = [self._layer(plan, index) for index in range(len(layers))]
        self._layers = (_Layer * len(layers))(*described)
        floor = _floor(first.attention_norm)
        self.plan = _Plan(len(layers), self.dim, first.heads, first.kv_heads, self.head_dim, first.ffn_dim,
                          self.vocab, kv.shape[2], floor, first.scale, ctypes.addressof(self._layers),
                          self._norm(plan.final_norm, floor), self._matrix(plan.output, (self.vocab, self.dim),
                                                                           "LM head"),
                          self._vector(plan.output_bias, self.vocab, "bias"), kv.data_ptr(), kv.stride(0),
                          kv.stride(1), None, 0)
        self._embed(plan.embedding)
        self._switches(plan, first)

    def _cache(self, kv: torch.Tensor, first: Any) -> torch.Tensor:
        """The (L, 2*Hkv, S_max, D) cache tensor, checked to be fp32 rows of D values on the CPU."""
        if kv.dtype != torch.float32 or kv.device.type != "cpu" or kv.shape[:2] != (self.layers, 2 * first.kv_heads) \
                or kv.shape[3] != self.head_dim or kv.stride(3) != 1 or kv.stride(2) != self.head_dim:
            raise NotEligible("the KV cache is not fp32 rows of D values on the CPU")
        self.keep.append(kv)
        return kv

    def _switches(self, plan: Any, first: Any) -> None:
        """The plan's scalars beyond the shapes: QK-norm's floors, the experts, Gemma's scale, soft-cap and GeGLU."""
        p = self.plan
        p.qk_norm_floor = float(first.qk_floor) if self.qk_norm else 0.0
        if self.whole:  # the keys' own floor, sqrt(Hkv*D * eps), as QKNorm takes it
            p.qk_norm_whole = 1
            p.qk_norm_floor_k = float(rms_norm_floor(first.kv_heads * self.head_dim, first.qk_whole.eps, "cpu"))
        if first.experts is not None:
            p.n_experts, p.top_k, p.renormalise = len(first.experts.down), self.top_k, int(first.experts.renormalise)
        if plan.embed_scale is not None:  # the fp32 constant EmbedScale multiplies by
            p.embed_scale = float(torch.tensor(plan.embed_scale.value, dtype=torch.float32))
        if plan.softcap is not None:
            p.softcap = plan.softcap.cap
        p.gelu = int(self.gelu)
        p.rotary = self.rotary
        p.shared_ffn_dim = self.shared_ffn

    def _layer(self, plan: Any, index: int) -> _Layer:
        """One PackedLayer (and its block's post-norms, RoPE tables and window) as decode_step.c reads it, checked
        against the first layer: the C step runs one shape, one norm epsilon and one set of stages in every layer."""
        layer, block, first = plan.layers[index], plan.blocks[index], plan.layers[0]
        shape = (layer.heads, layer.kv_heads, layer.head_dim, layer.ffn_dim, layer.scale)
        if shape != (first.heads, first.kv_heads, first.head_dim, first.ffn_dim, first.scale):
            raise NotEligible("layers of different shapes")
        if (layer.qk_weight is not None or layer.qk_whole is not None) != self.qk_norm \
                or (layer.qk_whole is not None) != self.whole:
            raise NotEligible("QK-norm in some layers only")
        if (block.post_attention_norm is not None) != self.post_norms:
            raise NotEligible("norms after attention and FFN in some layers only")
        moe, first_moe = layer.experts, first.experts
        if (moe is None) != (first_moe is None) or (moe is not None and (
                len(moe.down), moe.top_k, moe.renormalise) != (len(first_moe.down), first_moe.top_k,
                                                              first_moe.renormalise)):
            raise NotEligible("layers with different experts")
        shared = getattr(block.feed_forward, "shared_add", None) is not None
        if shared != (self.shared_ffn > 0) or (moe is None and shared):
            raise NotEligible("a shared expert in some layers only")
        if moe is not None:
            self.routes.append((moe.route, (self.routed_weights[index:index + 1], self.routed[index:index + 1])))
        floor = _floor(first.attention_norm)
        norms = [self._norm(n, floor) for n in (layer.attention_norm, layer.ffn_norm)]
        post = [self._norm(n, floor) if n is not None else None
                for n in (block.post_attention_norm, block.post_ffn_norm)]
        rope = block.attention.rope
        tables = [self._table(t, plan.kv_rows.shape[2]) for t in (rope.cos, rope.sin)]
        return _Layer(*self._products(layer), *norms, *self._biases(layer), *self._qk(layer),
                      *(self._experts(moe, layer.ffn_dim) if moe is not None else (None,) * 4), *post, *tables,
                      *(self._shared(layer, block.feed_forward) if shared else (None,) * 3), layer.window or 0)

    def _products(self, layer: Any) -> list[int | None]:
        """Q|K|V, wo, and gate|up, w2 (None, None for a mixture of experts) described."""
        heads, kv_heads, head_dim, ffn, dim = layer.heads, layer.kv_heads, layer.head_dim, layer.ffn_dim, self.dim
        return [self._matrix(layer.wqkv, ((heads + 2 * kv_heads) * head_dim, dim), "Q|K|V"),
                self._matrix(layer.wo, (dim, heads * head_dim), "wo"),
                *((None, None) if layer.experts is not None else (
                    self._matrix(layer.w13, (2 * ffn, dim), "gate|up"), self._matrix(layer.w2, (dim, ffn), "w2")))]

    def _biases(self, layer: Any) -> list[int | None]:
        rows = (layer.heads + 2 * layer.kv_heads) * layer.head_dim
        return [self._vector(b, size, "bias") for b, size in
                ((layer.bqkv, rows), (layer.bo, self.dim), (layer.b13, 2 * layer.ffn_dim), (layer.b2, self.dim))]

    def _qk(self, layer: Any) -> list[int | None]:
        """QK-norm's q and k weights: a head's (D,) each, the first and the last of the packed path's (H+Hkv, D)
        rows (Gemma's 1 + w already); OLMoE's whole-projection ones; or none."""
        if not self.qk_norm:
            return [None, None]
        if self.whole:
            whole = layer.qk_whole
            return [self._vector(whole.q_weight.detach(), layer.heads * self.head_dim, "QK-norm weight"),
                    self._vector(whole.k_weight.detach(), layer.kv_heads * self.head_dim, "QK-norm weight")]
        return [self._vector(layer.qk_weight[row].contiguous(), self.head_dim, "QK-norm weight")
                for row in (0, layer.heads)]

    def _norm(self, norm: Any, floor: float) -> int | None:
        """An RMSNorm's weight as C multiplies by it: w, or Gemma's 1 + w in fp32 (functional.rms_norm_plus_one's);
        its epsilon the model's one."""
        if _floor(norm) != floor:
            raise NotEligible("norms of different epsilons")
        weight = norm.weight.detach() if norm.plus_one is None else norm.plus_one.of(norm.weight)
        return self._vector(weight, self.dim, "norm")

    def _table(self, table: torch.Tensor | None, positions: int) -> int:
        """A layer's RoPE table (S_max, 1, R), fp32, contiguous, covering the cache's positions."""
        if table is None or table.dtype != torch.float32 or not table.is_contiguous() \
                or table.shape[-1] != self.rotary or table.shape[0] < positions:
            raise NotEligible("rope tables not contiguous fp32 over the cache's positions")
        self.keep.append(table)
        return table.data_ptr()

    def _embed(self, table: Any) -> None:
        """The embedding table (V, dim) into the plan: held as stored (the native kernel's rows) or dense fp32."""
        if isinstance(table, PackedWeight) and runs_blocks(table.format.kernel) and table.shape[1] == self.dim:
            self.plan.embedding = self._keep_matrix(table)
        elif isinstance(table, torch.Tensor) and table.dim() == 2 and table.shape[1] == self.dim:
            self.plan.embedding_dense = self._vector(table.reshape(-1), table.numel(), "embedding table")
        else:
            raise NotEligible("the embedding table is neither native blocks nor dense fp32")
        self.plan.embedding_rows = table.shape[0]

    def _experts(self, experts: Any, ffn: int) -> tuple[int | None, int | None, int, int]:
        """A mixture of experts' _Layer fields: (router described, router dense (E, dim) fp32, the E gate|up
        descriptions' addresses, the E down ones'), each expert's pointing at its rows of the file's blocks."""
        count, dim = len(experts.down), self.dim
        if isinstance(experts.router, PackedWeight):
            router, dense = self._matrix(experts.router, (count, dim), "the router"), None
        else:
            router, dense = None, self._vector(experts.router.reshape(-1), count * dim, "router")
        tables = []
        for name, weights, shape in (("an expert's gate|up", experts.gate_up, (2 * ffn, dim)),
                                     ("an expert's down", experts.down, (dim, ffn))):
            table = (ctypes.c_void_p * count)(*(self._matrix(w, shape, name) for w in weights))
            self.keep.append(table)
            tables.append(ctypes.addressof(table))
        return router, dense, tables[0], tables[1]

    def _shared(self, layer: Any, moe: Any) -> tuple[int, int, int | None]:
        """A shared expert's _Layer fields (Qwen2-MoE): its gate|up (2Fs, dim) and down (dim, Fs) described, its
        gate's (1, dim) weights as a dense fp32 (dim,) vector."""
        gate_up, down, logit = (layer.products[m][0] for m in (moe.shared_w1, moe.shared_w2, moe.shared_gate))
        if not isinstance(logit, torch.Tensor):
            raise NotEligible("the shared expert's gate is not a dense fp32 vector")
        return (self._matrix(gate_up, (2 * self.shared_ffn, self.dim), "the shared expert's gate|up"),
                self._matrix(down, (self.dim, self.shared_ffn), "the shared expert's down"),
                self._vector(logit.reshape(-1), self.dim, "shared expert gate"))

    def _matrix(self, weight: Any, shape: tuple[int, int], name: str) -> int:
        if not isinstance(weight, PackedWeight) or not runs_blocks(weight.format.kernel):
            raise NotEligible(f"{name} is not held for the native library's kernels (native, i8dot, i16dot)")
        if weight.shape != shape:
            raise NotEligible(f"{name} is {weight.shape}, the step expects {shape}")
        return self._keep_matrix(weight)

    def _keep_matrix(self, weight: PackedWeight) -> int:
        described = weight.native_matrix()
        self.keep.append(described)  # holds the row blocks' tensors and the C description
        return described.address

    def _vector(self, tensor: torch.Tensor | None, size: int, name: str) -> int | None:
        if tensor is None:
            return None
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous() \
                or tensor.shape != (size,):
            raise NotEligible(f"a {name} is not a contiguous fp32 ({size},) vector on the CPU")
        self.keep.append(tensor)
        return tensor.data_ptr()


def structure_sizes() -> tuple[int, int]:
    """The sizes of StepLayer and StepPlan as this module lays them out (the library's must be the same)."""
    return ctypes.sizeof(_Layer), ctypes.sizeof(_Plan)


def products(plan: Any) -> list[Any]:
    """Every matrix the step multiplies by: each layer's packed Q|K|V, wo, gate|up, w2 (a mixture of experts': every
    expert's gate|up and down; its router may be dense fp32), then the LM head."""
    return [w for layer, block in zip(plan.layers, plan.blocks) for w in (layer.wqkv, layer.wo, *(
        (layer.w13, layer.w2) if layer.experts is None else (*layer.experts.gate_up, *layer.experts.down)),
        *_shared_products(layer, block))] + [plan.output]


def _shared_products(layer: Any, block: Any) -> tuple[Any, ...]:
    """A shared expert's gate|up and down (Qwen2-MoE), or none."""
    moe = block.feed_forward
    if getattr(moe, "shared_add", None) is None:
        return ()
    return layer.products[moe.shared_w1][0], layer.products[moe.shared_w2][0]


def _floor(norm: Any) -> float:
    """An RMSNorm module's sqrt(dim * eps), as its forward takes it."""
    return float(norm.floor(norm.weight.device))
