"""Parameter counts of a LLaMA-family model from its config, and the bytes its weights take in each dtype.

The tensors are the contract's (tracer/core/contract.py, Meta's names): tok_embeddings (V x d); per layer
attention_norm (d), wq (H*D x d), wk and wv (Hkv*D x d) with their biases (H*D, Hkv*D) when the config has
them, wo (d x H*D) and its bias (d) likewise, ffn_norm (d), w1 and w3 (F x d), w2 (d x F); final norm (d);
output (V x d), which is the embedding matrix itself when the model ties them, and is then counted once.

A mixture of experts (config.moe: E experts, k per token) holds E copies of w1, w2, w3 (each F the expert's size)
and a router (E x d) per layer, and Qwen2-MoE a shared expert (w1, w3 of Fs x d, w2 of d x Fs) and its gate (1 x d)
that every token runs; a token's pass uses k of the copies, so its active parameters are the total less (E - k)
experts a layer. Mixtral-8x7B's published 46.7 B total, 12.9 B active come out of this (tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmtrace.tracer.core import contract
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import DTYPES, FP32, DType


# Output records, read field by field and through asdict(): eq=False and repr=False spare compiling __eq__,
# __hash__ and __repr__ for each at import, which the analytical commands (answering in a blink) feel.
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ParamCount:
    embedding: int  # V * d
    attention_per_layer: int  # wq + wk + wv + wo (and their biases, where the config has them)
    ffn_per_layer: int  # w1 + w2 + w3 of every expert, the router (d x E) and a shared expert with its gate
    norms_per_layer: int  # attention_norm + ffn_norm
    per_layer: int
    layers: int  # per_layer * n_layers
    final_norm: int
    lm_head: int  # 0 when tied to the embedding
    tied: bool
    total: int
    non_embedding: int  # total minus the embedding table (the LM head stays when it is a separate matrix)
    n_experts: int  # E, 1 for a dense FFN
    experts_per_token: int  # k, 1 for a dense FFN
    expert_per_layer: int  # one expert's w1 + w2 + w3 (the whole FFN when dense)
    router_per_layer: int  # d x E, 0 for a dense FFN
    active: int  # what one token's forward pass multiplies by: total less (E - k) experts in every layer


def _tensors(config: ModelConfig) -> list[tuple[contract.TensorSpec, tuple[int, ...], int]]:
    """(declaration, shape, how many) of every tensor the config's checkpoint holds (layer tensors once per layer)."""
    return [(t, contract.shape_of(t, config), config.n_layers if spec.in_layer else 1)
            for spec in contract.staged_stages(config) for t in contract.stage_tensors(spec, config)]


def experts(config: ModelConfig) -> tuple[int, int]:
    """(E, k): experts per layer and per token; (1, 1) for a dense FFN."""
    return (1, 1) if config.moe is None else (config.moe.n_experts, config.moe.experts_per_token)


def count_params(config: ModelConfig) -> ParamCount:
    groups = {"embedding": 0, "attention": 0, "ffn": 0, "router": 0, "shared_expert": 0, "norm": 0, "final_norm": 0,
              "lm_head": 0}
    for tensor, shape, _ in _tensors(config):  # layer groups per layer, the others once; the FFN one expert's
        groups[tensor.group] += math.prod(shape)
    n_experts, top_k = experts(config)
    router = groups["router"]  # the contract's feed_forward.router (E x d), present with a mixture of experts
    ffn = n_experts * groups["ffn"] + router + groups["shared_expert"]  # Qwen2-MoE's shared expert and its gate
    per_layer = groups["attention"] + ffn + groups["norm"]
    layers = per_layer * config.n_layers
    total = groups["embedding"] + layers + groups["final_norm"] + groups["lm_head"]
    return ParamCount(
        embedding=groups["embedding"], attention_per_layer=groups["attention"], ffn_per_layer=ffn,
        norms_per_layer=groups["norm"], per_layer=per_layer, layers=layers, final_norm=groups["final_norm"],
        lm_head=groups["lm_head"], tied=config.tie_embeddings, total=total, non_embedding=total - groups["embedding"],
        n_experts=n_experts, experts_per_token=top_k, expert_per_layer=groups["ffn"], router_per_layer=router,
        active=total - (n_experts - top_k) * groups["ffn"] * config.n_layers,
    )


def norm_dtype_for(weights: DType) -> DType:
    """Norm vectors stay in fp32 beside quantized matrices (as llama.cpp stores them), else match the weights."""
    return FP32 if weights.is_quantized else weights


def _copies(tensor: contract.TensorSpec, config: ModelConfig) -> int:
    """How many of a declared tensor each layer holds: E of an FFN tensor in a mixture of experts, else one."""
    return experts(config)[0] if tensor.group == "ffn" else 1


def weight_bytes(config: ModelConfig, dtype: DType) -> int:
    """Bytes of all weights with every matrix in `dtype` (block scales included; every expert's and the router's,
    which the contract declares)
    and vectors (norms, biases) per norm_dtype_for."""
    tensors = _tensors(config)
    matrices = sum(count * _copies(t, config) * dtype.matrix_bytes(*shape) for t, shape, count in tensors
                   if len(shape) == 2)
    vector_values = sum(count * _copies(t, config) * shape[0] for t, shape, count in tensors if len(shape) == 1)
    return matrices + norm_dtype_for(dtype).matrix_bytes(1, vector_values)


def weight_bytes_by_dtype(config: ModelConfig) -> dict[str, int]:
    """weight_bytes for every dtype llmtrace knows, fp32 to int4."""
    return {name: weight_bytes(config, dtype) for name, dtype in DTYPES.items()}
