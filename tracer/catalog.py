"""The preset catalogue as records: key dimensions, parameter count and KV bytes per token of every preset."""

from __future__ import annotations

from dataclasses import dataclass

from tracer.dtypes import DType
from tracer.kvmem import kv_bytes_per_token
from tracer.params import count_params, weight_bytes
from tracer.presets import PRESETS

MODELS_SCHEMA = "llmtrace.models/1"


# Output records, read field by field and through asdict(): eq=False and repr=False spare compiling __eq__,
# __hash__ and __repr__ for each at import, which the analytical commands (answering in a blink) feel.
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ModelRow:
    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    max_seq_len: int
    tie_embeddings: bool
    params: int
    weight_bytes: int  # all weights in the chosen dtype
    kv_bytes_per_token: int  # one position, all layers, one sequence, in the chosen dtype


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ModelsReport:
    schema: str
    dtype: str
    models: tuple[ModelRow, ...]


def models_report(dtype: DType) -> ModelsReport:
    rows = tuple(
        ModelRow(
            name=c.name, vocab_size=c.vocab_size, dim=c.dim, n_layers=c.n_layers, n_heads=c.n_heads,
            n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, ffn_dim=c.ffn_dim, max_seq_len=c.max_seq_len,
            tie_embeddings=c.tie_embeddings, params=count_params(c).total, weight_bytes=weight_bytes(c, dtype),
            kv_bytes_per_token=kv_bytes_per_token(c, dtype),
        )
        for c in PRESETS.values()
    )
    return ModelsReport(schema=MODELS_SCHEMA, dtype=dtype.name, models=rows)
