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
    module's weight and bias, or for a packed stage of the fused path its modules' together), as held: a matrix
    kept as the GGUF stores it (a module's `packed`, llmtrace.tracer.model.weight_formats) counts its stored bytes."""

    name: str
    layer: int | None
    kind: str
    weight_bytes: int  # bytes of its parameters, weight and bias, as held (0 for parameter-free stages)
    weight_row_bytes: float  # bytes of one row of its (first) weight as held: what an embedding lookup reads
    has_bias: bool = False  # a linear stage adds a bias to its product (one add per output element)
    weight_format: str = ""  # the weight's format as it runs: "fp32", "q4_1 (int4pack)"; "" when it has none
    # A mixture of experts' product (tracer/model/moe.py ExpertLinear): its weight stacks this many experts, and a
    # call multiplies by one of them, so it reads weight_bytes / experts
    experts: int = 1
    router_norm: str = ""  # a mixture of experts' route stage: config.ROUTER_NORMS, which its FLOPs depend on

    @classmethod
    def of(cls, name: str, layer: int | None, kind: str, modules: list[Any]) -> "StageModule":
        """The stage that runs `modules` (one, or a packed stage's members): their weights and biases together."""
        held = [_held(m) for m in modules if getattr(m, "weight", None) is not None]
        biases = [b for b in (getattr(m, "bias", None) for m in modules) if b is not None]
        # a stage whose vectors have other names (QK-norm's q_weight, k_weight): each read whole, as held
        vectors = [p for m in modules if getattr(m, "weight", None) is None for p in m.parameters(recurse=False)]
        total = sum(nbytes for nbytes, _, _ in held) + sum(b.numel() * b.element_size() for b in biases + vectors)
        row = held[0][1] if held else 0.0
        formats = "+".join(dict.fromkeys(fmt for _, _, fmt in held))
        return cls(name, layer, kind, total, row, bool(biases), formats, getattr(modules[0], "n_experts", 1),
                   getattr(modules[0], "router_norm", ""))


def _held(module: Any) -> tuple[int, float, str]:
    """(bytes, bytes per row, format label) of a module's weight as it is held and multiplied."""
    packed = getattr(module, "packed", None)
    if packed is not None:
        return packed.stored_bytes, packed.stored_bytes / packed.shape[0], packed.format.label
    held_as = getattr(module, "held_as", None)
    if held_as is not None:  # a dry run's meta matrix: as the run it stands for would hold it
        nbytes, label = held_as
        return nbytes, nbytes / module.weight.shape[0], label
    weight = module.weight
    name = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(str(weight.dtype).removeprefix("torch."),
                                                                      str(weight.dtype).removeprefix("torch."))
    return weight.numel() * weight.element_size(), weight[0].numel() * weight.element_size(), name


# Integer index tensors among a stage's arguments (contract.INDEX_ARGUMENTS, argument position by kind) are token
# ids and positions, int64. Every other tensor a stage takes or returns is an activation in the model's dtype (the
# model casts back after its fp32 norm and softmax), so the tracers keep shapes only and the dtypes come from here.
INDEX_ITEMSIZE = 8  # int64 token ids and positions
ROUTE_WEIGHT_ITEMSIZE = 4  # a router's k weights are fp32 whatever the activations (functional.route_top_k)

# A tensor as the cost model sees it: (shape, bytes per element).
Entry = tuple[tuple[int, ...], int]


@dataclass(frozen=True, slots=True)
class StageCost:
    """What one stage call costs (the StageRecord fields of the same names)."""

    matmul_flops: int
    elementwise_flops: int
    weight_bytes_read: int
    activation_bytes_read: int
    activation_bytes_written: int
    kv_bytes_read: int = 0
    kv_bytes_written: int = 0


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _nbytes(entry: Entry) -> int:
    return _numel(entry[0]) * entry[1]


def _rows(shape: tuple[int, ...]) -> int:
    """Token rows of an activation (..., dim): every dimension but the last."""
    return _numel(shape[:-1])


def stage_cost(stage: StageModule, inputs: list[Entry], outputs: list[Entry]) -> StageCost:
    """FLOPs and bytes of one stage call, from the shapes it saw.

    Bytes are what the stage must move at least: every input read once, every output written once, each weight
    read once (an embedding reads only the rows it looks up); cached K/V read by the attention products count as KV
    reads, the new K/V copied into the cache as KV writes.
    """
    kind = stage.kind
    weight_bytes = stage.weight_bytes
    read = sum(_nbytes(e) for e in inputs)
    written = sum(_nbytes(e) for e in outputs)
    out_shape = outputs[0][0]
    if kind in ("linear", "lm_head"):
        x = inputs[0][0]
        bias = ff.bias_add_flops(_rows(x), out_shape[-1]) if stage.has_bias else 0
        return StageCost(
            matmul_flops=ff.linear_flops(_rows(x), x[-1], out_shape[-1]),
            elementwise_flops=bias,
            weight_bytes_read=weight_bytes // stage.experts,  # an expert's product: its one matrix of the E stacked
            activation_bytes_read=read,
            activation_bytes_written=written,
        )
    if kind == "rmsnorm":
        x = inputs[0][0]
        return StageCost(
            matmul_flops=0,
            elementwise_flops=ff.rmsnorm_flops(_rows(x), x[-1]),
            weight_bytes_read=weight_bytes,
            activation_bytes_read=read,
            activation_bytes_written=written,
        )
    if kind == "qk_norm":  # an RMSNorm over each head's D values: q's H*B*T rows and k's Hkv*B*T
        return StageCost(
            matmul_flops=0,
            elementwise_flops=sum(ff.rmsnorm_flops(_rows(shape), shape[-1]) for shape, _ in inputs),
            weight_bytes_read=weight_bytes,
            activation_bytes_read=read,
            activation_bytes_written=written,
        )
    if kind == "embedding":
        ids = inputs[0][0]
        rows_read = int(_numel(ids) * stage.weight_row_bytes)
        return StageCost(
            matmul_flops=0,
            elementwise_flops=ff.embedding_flops(_numel(ids), out_shape[-1]),
            weight_bytes_read=rows_read,
            activation_bytes_read=read,
            activation_bytes_written=written,
        )
    if kind == "rope":
        (q, item), (k, _) = inputs[0], inputs[1]  # (B, T, H, D), (B, T, Hkv, D)
        flops = ff.rope_flops(_numel(q[:-2]), q[-2], k[-2], q[-1])
        # the cos and sin rows (T, D) of these positions; (B*T, D) when each row has its own (a left-padded batch)
        rows = _numel(inputs[2][0]) if len(inputs) > 2 else q[-3]
        tables = 2 * rows * q[-1] * item
        return StageCost(
            matmul_flops=0,
            elementwise_flops=flops,
            weight_bytes_read=0,
            activation_bytes_read=read + tables,
            activation_bytes_written=written,
        )
    if kind == "kv_cache":
        # forward(input_pos, k, v): the new keys and values are read and copied into the cache buffers;
        # the outputs are views of the live slice (no bytes move).
        new_kv = _nbytes(inputs[1]) + _nbytes(inputs[2])
        return StageCost(
            matmul_flops=0,
            elementwise_flops=0,
            weight_bytes_read=0,
            activation_bytes_read=read,
            activation_bytes_written=0,
            kv_bytes_written=new_kv,
        )
    if kind == "attention_scores":
        q, k_all = inputs[0], inputs[1]  # q (B, H, T, D), k_all (B, Hkv, S, D)
        b, h, t, s = out_shape
        matmul = ff.attention_scores_flops(b, h, t, s, q[0][-1])
        return StageCost(
            matmul_flops=matmul,
            elementwise_flops=ff.score_scale_flops(b, h, t, s),
            weight_bytes_read=0,
            activation_bytes_read=_nbytes(q),
            activation_bytes_written=written,
            kv_bytes_read=_nbytes(k_all),
        )
    if kind == "attention_values":
        probs, v_all = inputs[0], inputs[1]  # probs (B, H, T, S), v_all (B, Hkv, S, D)
        b, h, t, s = probs[0]
        matmul = ff.attention_values_flops(b, h, t, s, out_shape[-1])
        return StageCost(
            matmul_flops=matmul,
            elementwise_flops=0,
            weight_bytes_read=0,
            activation_bytes_read=_nbytes(probs),
            activation_bytes_written=written,
            kv_bytes_read=_nbytes(v_all),
        )
    if kind == "softmax":
        b, h, t, s = out_shape
        return StageCost(
            matmul_flops=0,
            elementwise_flops=ff.softmax_flops(b, h, t, s),
            weight_bytes_read=0,
            activation_bytes_read=read,
            activation_bytes_written=written,
        )
    if kind == "residual":
        return StageCost(
            matmul_flops=0,
            elementwise_flops=ff.residual_flops(_rows(out_shape), out_shape[-1]),
            weight_bytes_read=0,
            activation_bytes_read=read,
            activation_bytes_written=written,
        )
    if kind == "swiglu":
        return StageCost(
            matmul_flops=0,
            elementwise_flops=ff.swiglu_activation_flops(_rows(out_shape), out_shape[-1]),
            weight_bytes_read=0,
            activation_bytes_read=read,
            activation_bytes_written=written,
        )
    if kind == "route":
        # logits (N, E) in; the k weights (fp32) and expert indices (int64) out, whatever the activations' dtype
        (logits, _), (picked, _) = inputs[0], outputs[0]
        tokens, n_experts, top_k = _rows(logits), logits[-1], picked[-1]
        return StageCost(
            matmul_flops=0,
            elementwise_flops=ff.route_flops(tokens, n_experts, top_k, stage.router_norm == "renormalised"),
            weight_bytes_read=0,
            activation_bytes_read=read,
            activation_bytes_written=_numel(picked) * (ROUTE_WEIGHT_ITEMSIZE + INDEX_ITEMSIZE),
        )
    if kind == "expert_combine":
        (outs, item), (weights, _) = inputs[0], inputs[1]  # (N, k, d), (N, k) fp32
        return StageCost(
            matmul_flops=0,
            elementwise_flops=ff.expert_combine_flops(_numel(outs[:-2]), outs[-1], outs[-2]),
            weight_bytes_read=0,
            activation_bytes_read=_numel(outs) * item + _numel(weights) * ROUTE_WEIGHT_ITEMSIZE,
            activation_bytes_written=written,
        )
    raise ValueError(f"no cost model for stage kind {kind!r}")
