"""A config's key dimensions as one record: the first fields of every record that describes a model
(`llmtrace models --json` rows, the `model` of `llmtrace flops --json`). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; only read by type checkers here

    from llmtrace.tracer.core.config import ModelConfig


# Output records, read field by field and through asdict(): eq=False and repr=False spare compiling __eq__,
# __hash__ and __repr__ for each at import, which the analytical commands (answering in a blink) feel.
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ModelDims:
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

    @classmethod
    def of(cls, cfg: ModelConfig, **extra: Any) -> Self:
        """The record of `cfg`; `extra` fills the fields a subclass adds after these."""
        return cls(cfg.name, cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                   cfg.ffn_dim, cfg.max_seq_len, cfg.tie_embeddings, **extra)
