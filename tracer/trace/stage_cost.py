"""What one stage call costs, from the shapes it saw: FLOPs (by the formulas of tracer/analytic/flop_formulas.py, the same
the analytical estimate uses) and the bytes it must move. Shared by both ways of tracing (tracer/trace/hooks.py on the
stage modules, tracer/trace/fused_marks.py on the fused path)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from llmtrace.tracer.analytic import flop_formulas as ff


@dataclass(frozen=True, slots=True)
class StageModule:
    """One traced stage: its stable name, layer, kind and the parameter sizes the byte counts need (a stage
    module's weight and bias, or for a packed stage of the fused path its modules' together)."""

    name: str
    layer: int | None
    kind: str
    weight_numel: int  # elements of its parameters, weight and bias (0 for parameter-free stages)
    weight_itemsize: int
    has_bias: bool = False  # a linear stage adds a bias to its product (one add per output element)

    @classmethod
    def of(cls, name: str, layer: int | None, kind: str, modules: list[Any]) -> "StageModule":
        """The stage that runs `modules` (one, or a packed stage's members): their weights and biases together."""
        weights = [w for w in (getattr(m, "weight", None) for m in modules) if w is not None]
        biases = [b for b in (getattr(m, "bias", None) for m in modules) if b is not None]
        numel = sum(t.numel() for t in weights + biases)
        return cls(name, layer, kind, numel, weights[0].element_size() if weights else 0, bool(biases))


# Integer index tensors among a stage's arguments (contract.INDEX_ARGUMENTS, argument position by kind) are token
# ids and positions, int64. Every other tensor a stage takes or returns is an activation in the model's dtype (the
# model casts back after its fp32 norm and softmax), so the tracers keep shapes only and the dtypes come from here.
INDEX_ITEMSIZE = 8  # int64 token ids and positions

# A tensor as the cost model sees it: (shape, bytes per element).
Entry = tuple[tuple[int, ...], int]


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _nbytes(entry: Entry) -> int:
    return _numel(entry[0]) * entry[1]


def _rows(shape: tuple[int, ...]) -> int:
    """Token rows of an activation (..., dim): every dimension but the last."""
    return _numel(shape[:-1])


def stage_cost(stage: StageModule, inputs: list[Entry], outputs: list[Entry]) -> tuple[int, int, int, int, int, int, int]:
    """(matmul FLOPs, elementwise FLOPs, weight bytes read, activation bytes read, activation bytes written,
    KV bytes read, KV bytes written) of one stage call, from the shapes it saw.

    Bytes are what the stage must move at least: every input read once, every output written once, each weight
    read once (an embedding reads only the rows it looks up); cached K/V read by the attention products count as KV
    reads, the new K/V copied into the cache as KV writes.
    """
    kind = stage.kind
    weight_bytes = stage.weight_numel * stage.weight_itemsize
    read = sum(_nbytes(e) for e in inputs)
    written = sum(_nbytes(e) for e in outputs)
    out_shape = outputs[0][0]
    if kind in ("linear", "lm_head"):
        x = inputs[0][0]
        bias = ff.bias_add_flops(_rows(x), out_shape[-1]) if stage.has_bias else 0
        return ff.linear_flops(_rows(x), x[-1], out_shape[-1]), bias, weight_bytes, read, written, 0, 0
    if kind == "rmsnorm":
        x = inputs[0][0]
        return 0, ff.rmsnorm_flops(_rows(x), x[-1]), weight_bytes, read, written, 0, 0
    if kind == "embedding":
        ids = inputs[0][0]
        rows_read = _numel(ids) * out_shape[-1] * stage.weight_itemsize
        return 0, ff.embedding_flops(_numel(ids), out_shape[-1]), rows_read, read, written, 0, 0
    if kind == "rope":
        (q, item), (k, _) = inputs[0], inputs[1]  # (B, T, H, D), (B, T, Hkv, D)
        flops = ff.rope_flops(_numel(q[:-2]), q[-2], k[-2], q[-1])
        tables = 2 * q[-3] * q[-1] * item  # the cos and sin rows (T, D) of these positions
        return 0, flops, 0, read + tables, written, 0, 0
    if kind == "kv_cache":
        # forward(input_pos, k, v): the new keys and values are read and copied into the cache buffers;
        # the outputs are views of the live slice (no bytes move).
        new_kv = _nbytes(inputs[1]) + _nbytes(inputs[2])
        return 0, 0, 0, read, 0, 0, new_kv
    if kind == "attention_scores":
        q, k_all = inputs[0], inputs[1]  # q (B, H, T, D), k_all (B, Hkv, S, D)
        b, h, t, s = out_shape
        matmul = ff.attention_scores_flops(b, h, t, s, q[0][-1])
        return matmul, ff.score_scale_flops(b, h, t, s), 0, _nbytes(q), written, _nbytes(k_all), 0
    if kind == "attention_values":
        probs, v_all = inputs[0], inputs[1]  # probs (B, H, T, S), v_all (B, Hkv, S, D)
        b, h, t, s = probs[0]
        matmul = ff.attention_values_flops(b, h, t, s, out_shape[-1])
        return matmul, 0, 0, _nbytes(probs), written, _nbytes(v_all), 0
    if kind == "softmax":
        b, h, t, s = out_shape
        return 0, ff.softmax_flops(b, h, t, s), 0, read, written, 0, 0
    if kind == "residual":
        return 0, ff.residual_flops(_rows(out_shape), out_shape[-1]), 0, read, written, 0, 0
    if kind == "swiglu":
        return 0, ff.swiglu_activation_flops(_rows(out_shape), out_shape[-1]), 0, read, written, 0, 0
    raise ValueError(f"no cost model for stage kind {kind!r}")
