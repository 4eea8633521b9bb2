"""Parameter counts of a LLaMA-family model from its config, and the bytes its weights take in each dtype.

Tensors (Meta's names): tok_embeddings (V x d); per layer attention_norm (d), wq (H*D x d), wk and wv (Hkv*D x d),
wo (d x H*D), ffn_norm (d), w1 and w3 (F x d), w2 (d x F); final norm (d); output (V x d), which is the
embedding matrix itself when the model ties them, and is then counted once.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import DTYPES, FP32, DType


# Output records, read field by field and through asdict(): eq=False and repr=False spare compiling __eq__,
# __hash__ and __repr__ for each at import, which the analytical commands (answering in a blink) feel.
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ParamCount:
    embedding: int  # V * d
    attention_per_layer: int  # wq + wk + wv + wo
    ffn_per_layer: int  # w1 + w2 + w3
    norms_per_layer: int  # attention_norm + ffn_norm
    per_layer: int
    layers: int  # per_layer * n_layers
    final_norm: int
    lm_head: int  # 0 when tied to the embedding
    tied: bool
    total: int
    non_embedding: int  # total minus the embedding table (the LM head stays when it is a separate matrix)


def count_params(config: ModelConfig) -> ParamCount:
    d, q, kv, f = config.dim, config.q_dim, config.kv_dim, config.ffn_dim
    embedding = config.vocab_size * d
    attention = d * q + 2 * d * kv + q * d
    ffn = 3 * d * f
    norms = 2 * d
    per_layer = attention + ffn + norms
    layers = per_layer * config.n_layers
    lm_head = 0 if config.tie_embeddings else config.vocab_size * d
    total = embedding + layers + d + lm_head
    return ParamCount(
        embedding=embedding, attention_per_layer=attention, ffn_per_layer=ffn, norms_per_layer=norms,
        per_layer=per_layer, layers=layers, final_norm=d, lm_head=lm_head, tied=config.tie_embeddings,
        total=total, non_embedding=total - embedding,
    )


def _matrices(config: ModelConfig) -> list[tuple[int, int, int]]:
    """(rows, cols, how many) of every weight matrix, rows = output features, cols = input features."""
    d, q, kv, f, n = config.dim, config.q_dim, config.kv_dim, config.ffn_dim, config.n_layers
    mats = [(config.vocab_size, d, 1), (q, d, n), (kv, d, 2 * n), (d, q, n), (f, d, 2 * n), (d, f, n)]
    if not config.tie_embeddings:
        mats.append((config.vocab_size, d, 1))
    return mats


def norm_dtype_for(weights: DType) -> DType:
    """Norm vectors stay in fp32 beside quantized matrices (as llama.cpp stores them), else match the weights."""
    return FP32 if weights.is_quantized else weights


def weight_bytes(config: ModelConfig, dtype: DType) -> int:
    """Bytes of all weights with every matrix in `dtype` (block scales included) and norm vectors per norm_dtype_for."""
    matrices = sum(count * dtype.matrix_bytes(rows, cols) for rows, cols, count in _matrices(config))
    norm_values = config.dim * (2 * config.n_layers + 1)
    return matrices + norm_dtype_for(dtype).matrix_bytes(1, norm_values)


def weight_bytes_by_dtype(config: ModelConfig) -> dict[str, int]:
    """weight_bytes for every dtype llmtrace knows, fp32 to int4."""
    return {name: weight_bytes(config, dtype) for name, dtype in DTYPES.items()}
