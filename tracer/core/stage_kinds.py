"""The stage kinds of the contract (tracer/core/contract.py), each owning its formulas, written once: the shapes of
one call of it in a step, and its FLOPs from the shapes a call saw. Pure Python.

Three consumers read them: the run tracer's costs (tracer/trace/stage_cost.py, FLOPs from the shapes a stage module
saw or the packed path's marks stand for), the packed path's marks (tracer/trace/fused_marks.py, the shapes its
stages saw in a step of B, T, S) and the analytical estimate (tracer/analytic/estimate.py, FLOPs of each component
from the shapes of a step of the config). A new kind is declared here, with its shapes and its FLOPs, and the three
follow. The elementary formulas and their constants are tracer/core/flop_formulas.py's.

Shapes are in the stage modules' argument order (tracer/model/transformer.py): activations (B, T, dim), scores
(B, H, T, S), cached keys and values (B, Hkv, S, D), rows (B,) for the stages after the layers (the last position of
each sequence only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from llmtrace.tracer.core import flop_formulas as ff

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CallDims:
    """What the shapes of one call depend on: the step's B, T and S (the keys attended), the model's widths, and
    for a projection its (in, out) widths (a packed one's rows added up)."""

    batch: int
    new: int
    keys: int
    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_dim: int
    rows: Shape  # (B, T) inside a layer, (B,) for the final norm and the LM head
    per_row_positions: bool = False  # a left-padded batch: each row's RoPE positions (B, T), not one (T,)
    qk_norm_whole: bool = False  # OLMoE: QK-norm over each token's whole q (H·D) and k (Hkv·D)
    widths: tuple[int, int] = (0, 0)  # a projection's (in, out)
    experts: int = 1  # a mixture of experts: E experts, k a token (`top_k`)
    top_k: int = 1
    vocab: int = 0  # V: the logits' width (Gemma's soft-cap)
    rotary: int = 0  # R: the values of each head RoPE turns where a partial rotary turns part of it; 0: all D


Shapes = tuple[list[Shape], list[Shape]]
# (matmul FLOPs, elementwise FLOPs) of one call from its input and output shapes; `bias`: a projection adds its bias;
# `renormalised`: a route rescales its k weights to sum 1
Flops = Callable[[Sequence[Shape], Sequence[Shape], bool, bool], tuple[int, int]]


@dataclass(frozen=True, slots=True)
class Kind:
    name: str
    matmul: bool  # its FLOPs are GEMM FLOPs (exact, FlopCounterMode counts them); else elementwise estimates
    shapes: Callable[[CallDims], Shapes]
    flops: Flops
    index_argument: int | None = None  # position of an int64 argument (token ids, positions), else None
    tuple_output: bool = False  # its module returns a tuple of tensors (rope: q, k; kv_cache: k_all, v_all)


def _numel(shape: Shape) -> int:
    return math.prod(shape)


def _rows(shape: Shape) -> int:
    """Token rows of an activation (..., dim): every dimension but the last."""
    return _numel(shape[:-1])


def _positions(c: CallDims) -> Shape:
    return (c.batch, c.new) if c.per_row_positions else (c.new,)


def _heads(c: CallDims, whole: bool = False) -> tuple[Shape, Shape]:
    """q (B, T, H, D) and k (B, T, Hkv, D), as RoPE, the cache and QK-norm see them; `whole`: (B, T, H·D) and
    (B, T, Hkv·D), as OLMoE's QK-norm does, before the heads are split."""
    b, t, d = c.batch, c.new, c.head_dim
    if whole:
        return (b, t, c.heads * d), (b, t, c.kv_heads * d)
    return (b, t, c.heads, d), (b, t, c.kv_heads, d)


def _cached(c: CallDims) -> Shape:
    return (c.batch, c.kv_heads, c.keys, c.head_dim)


def _scores(c: CallDims) -> Shape:
    return (c.batch, c.heads, c.new, c.keys)


def _linear(i: Sequence[Shape], o: Sequence[Shape], bias: bool, _: bool) -> tuple[int, int]:
    x, y = i[0], o[0]
    return ff.linear_flops(_rows(x), x[-1], y[-1]), ff.bias_add_flops(_rows(x), y[-1]) if bias else 0


def _linear_shapes(c: CallDims) -> Shapes:
    return [(*c.rows, c.widths[0])], [(*c.rows, c.widths[1])]


def _rmsnorm_shapes(c: CallDims) -> Shapes:
    return [(*c.rows, c.dim)], [(*c.rows, c.dim)]


def _attention_scores(i: Sequence[Shape], o: Sequence[Shape], _: bool, __: bool) -> tuple[int, int]:
    b, h, t, s = o[0]  # q (B, H, T, D), k_all (B, Hkv, S, D) in: the product, then its scaling
    return ff.attention_scores_flops(b, h, t, s, i[0][-1]), ff.score_scale_flops(b, h, t, s)


def _attention_values(i: Sequence[Shape], o: Sequence[Shape], _: bool, __: bool) -> tuple[int, int]:
    b, h, t, s = i[0]  # probs (B, H, T, S), v_all (B, Hkv, S, D) in
    return ff.attention_values_flops(b, h, t, s, o[0][-1]), 0


def _elementwise(count: Callable[[Sequence[Shape], Sequence[Shape], bool], int]) -> Flops:
    return lambda i, o, bias, renormalised: (0, count(i, o, renormalised))


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("embedding", False, lambda c: ([(c.batch, c.new)], [(c.batch, c.new, c.dim)]),
         _elementwise(lambda i, o, _: ff.embedding_flops(_numel(i[0]), o[0][-1])), index_argument=0),
    Kind("rmsnorm", False, _rmsnorm_shapes, _elementwise(lambda i, o, _: ff.rmsnorm_flops(_rows(i[0]), i[0][-1]))),
    # an RMSNorm over each q and k head (D values; OLMoE's over the whole q and k): q, k in and out
    Kind("qk_norm", False, lambda c: (list(_heads(c, c.qk_norm_whole)), list(_heads(c, c.qk_norm_whole))),
         _elementwise(lambda i, o, _: sum(ff.rmsnorm_flops(_rows(shape), shape[-1]) for shape in i)),
         tuple_output=True),
    Kind("linear", True, _linear_shapes, _linear),
    Kind("rope", False, lambda c: ([*_heads(c), _positions(c)], list(_heads(c))),
         _elementwise(lambda i, o, _: ff.rope_flops(_numel(i[0][:-2]), i[0][-2], i[1][-2], i[0][-1])),
         index_argument=2, tuple_output=True),
    # forward(input_pos, k, v): the new K and V copied into the cache; out, views of the live keys and values
    Kind("kv_cache", False, lambda c: ([_positions(c), _heads(c)[1], _heads(c)[1]], [_cached(c), _cached(c)]),
         _elementwise(lambda i, o, _: 0), index_argument=0, tuple_output=True),
    Kind("attention_scores", True, lambda c: ([(c.batch, c.heads, c.new, c.head_dim), _cached(c)], [_scores(c)]),
         _attention_scores),
    Kind("softmax", False, lambda c: ([_scores(c)], [_scores(c)]),
         _elementwise(lambda i, o, _: ff.softmax_flops(*o[0]))),
    Kind("attention_values", True, lambda c: ([_scores(c), _cached(c)], [(c.batch, c.heads, c.new, c.head_dim)]),
         _attention_values),
    Kind("residual", False, lambda c: ([(c.batch, c.new, c.dim)] * 2, [(c.batch, c.new, c.dim)]),
         _elementwise(lambda i, o, _: ff.residual_flops(_rows(o[0]), o[0][-1]))),
    Kind("swiglu", False, lambda c: ([(c.batch, c.new, c.ffn_dim)] * 2, [(c.batch, c.new, c.ffn_dim)]),
         _elementwise(lambda i, o, _: ff.swiglu_activation_flops(_rows(o[0]), o[0][-1]))),
    Kind("geglu", False, lambda c: ([(c.batch, c.new, c.ffn_dim)] * 2, [(c.batch, c.new, c.ffn_dim)]),
         _elementwise(lambda i, o, _: ff.geglu_activation_flops(_rows(o[0]), o[0][-1]))),  # Gemma's gelu(gate)·up
    # x times a constant: Gemma's embedding rows times sqrt(dim)
    Kind("scale", False, lambda c: ([(c.batch, c.new, c.dim)], [(c.batch, c.new, c.dim)]),
         _elementwise(lambda i, o, _: ff.scale_flops(_rows(o[0]), o[0][-1]))),
    # c·tanh(x / c) on the last position's logits (Gemma's final soft-cap, where the config sets c)
    Kind("softcap", False, lambda c: ([(*c.rows, c.vocab)], [(*c.rows, c.vocab)]),
         _elementwise(lambda i, o, _: ff.softcap_flops(_rows(o[0]), o[0][-1]))),
    # A mixture of experts' router choice: logits (N, E) in, the k weights (N, k, fp32) and experts (N, k, int64) out
    Kind("route", False, lambda c: ([(c.batch * c.new, c.experts)], [(c.batch * c.new, c.top_k)] * 2),
         _elementwise(lambda i, o, renormalised: ff.route_flops(_rows(i[0]), i[0][-1], o[0][-1], renormalised)),
         tuple_output=True),
    # The k chosen experts' outputs (N, k, d) summed, each times its router weight (N, k): (N, d)
    Kind("expert_combine", False,
         lambda c: ([(c.batch * c.new, c.top_k, c.dim), (c.batch * c.new, c.top_k)], [(c.batch * c.new, c.dim)]),
         _elementwise(lambda i, o, _: ff.expert_combine_flops(_numel(i[0][:-2]), i[0][-1], i[0][-2]))),
    # A shared expert's output (N, d) times sigmoid of its gate's logit (N, 1), added to the routed sum (N, d)
    # (Qwen2-MoE): the routed sum, the shared output and the logit in, (N, d) out
    Kind("shared_expert_add", False,
         lambda c: ([(c.batch * c.new, c.dim)] * 2 + [(c.batch * c.new, 1)], [(c.batch * c.new, c.dim)]),
         _elementwise(lambda i, o, _: ff.shared_expert_add_flops(_rows(o[0]), o[0][-1]))),
    Kind("lm_head", True, _linear_shapes, _linear),
)}


def call_flops(kind: str, inputs: Sequence[Shape], outputs: Sequence[Shape], bias: bool = False,
               renormalised: bool = False, rotary: int = 0) -> tuple[int, int]:
    """(matmul, elementwise) FLOPs of one call of `kind` on these shapes. `rotary`: RoPE turns only the first
    `rotary` values of each head (a partial rotary; 0: all of them), and the values it passes through cost none."""
    found = KINDS.get(kind)
    if found is None:
        raise ValueError(f"no cost model for stage kind {kind!r}")
    if kind == "rope" and rotary:
        inputs = [(*shape[:-1], rotary) for shape in inputs[:2]] + list(inputs[2:])  # q, k as far as RoPE turns them
    return found.flops(inputs, outputs, bias, renormalised)


def step_flops(kind: str, dims: CallDims, bias: bool = False, renormalised: bool = False) -> tuple[int, int]:
    """(matmul, elementwise) FLOPs of one call of `kind` in a step of `dims`: its FLOPs on its shapes."""
    return call_flops(kind, *KINDS[kind].shapes(dims), bias, renormalised, dims.rotary)
