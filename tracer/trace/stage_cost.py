"""What one stage call costs, from the shapes it saw: FLOPs (by its kind's formula, tracer/core/stage_kinds.py, the
one the analytical estimate reads) and the bytes it must move. Shared by both ways of tracing (tracer/trace/hooks.py on the
stage modules, tracer/trace/fused_marks.py on the fused path)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from llmtrace.tracer.core.dtypes import dense_name
from llmtrace.tracer.core.stage_kinds import call_flops


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
    rotary: int = 0  # a RoPE stage's: the values of each head it turns (its module's rotary_dim), which its FLOPs count

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
                   getattr(modules[0], "router_norm", ""), getattr(modules[0], "rotary_dim", 0))


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
    return weight.numel() * weight.element_size(), weight[0].numel() * weight.element_size(), dense_name(weight.dtype)


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


def stage_cost(stage: StageModule, inputs: list[Entry], outputs: list[Entry]) -> StageCost:
    """FLOPs and bytes of one stage call, from the shapes it saw: FLOPs by its kind's formula (stage_kinds.call_flops,
    the one the packed path's marks and the estimate read).

    Bytes are what the stage must move at least: every input read once, every output written once, each weight
    read once (an embedding reads only the rows it looks up); cached K/V read by the attention products count as KV
    reads, the new K/V copied into the cache as KV writes.
    """
    kind = stage.kind
    matmul, elementwise = call_flops(kind, [shape for shape, _ in inputs], [shape for shape, _ in outputs],
                                     stage.has_bias, stage.router_norm == "renormalised", stage.rotary)
    weight_bytes, kv_read, kv_written = 0, 0, 0
    read = sum(_nbytes(e) for e in inputs)
    written = sum(_nbytes(e) for e in outputs)
    if kind in ("linear", "lm_head"):
        weight_bytes = stage.weight_bytes // stage.experts  # an expert's product: its one matrix of the E stacked
    elif kind in ("rmsnorm", "qk_norm"):
        weight_bytes = stage.weight_bytes
    elif kind == "embedding":
        weight_bytes = int(_numel(inputs[0][0]) * stage.weight_row_bytes)  # the rows it looks up
    elif kind == "rope":
        (q, item) = inputs[0]  # (B, T, H, D)
        # the cos and sin rows (T, R) of these positions; (B*T, R) when each row has its own (a left-padded batch);
        # R = D, or a partial rotary's part of it
        rows = _numel(inputs[2][0]) if len(inputs) > 2 else q[-3]
        read += 2 * rows * (stage.rotary or q[-1]) * item
    elif kind == "kv_cache":
        # forward(input_pos, k, v): the new keys and values are read and copied into the cache buffers;
        # the outputs are views of the live slice (no bytes move).
        kv_written, written = _nbytes(inputs[1]) + _nbytes(inputs[2]), 0
    elif kind in ("attention_scores", "attention_values"):
        # q (B, H, T, D) or probs (B, H, T, S) read as activations; k_all or v_all (B, Hkv, S, D) as the cache
        read, kv_read = _nbytes(inputs[0]), _nbytes(inputs[1])
    elif kind == "route":
        # the k weights (fp32) and expert indices (int64) out, whatever the activations' dtype
        written = _numel(outputs[0][0]) * (ROUTE_WEIGHT_ITEMSIZE + INDEX_ITEMSIZE)
    elif kind == "expert_combine":
        (outs, item), (weights, _) = inputs[0], inputs[1]  # (N, k, d), (N, k) fp32
        read = _numel(outs) * item + _numel(weights) * ROUTE_WEIGHT_ITEMSIZE
    return StageCost(matmul, elementwise, weight_bytes, read, written, kv_read, kv_written)
