"""One rank's share of a tensor-parallel model (Megatron-LM's split, Shoeybi et al. 2019, section 3).

Each of N ranks holds a Transformer built from `shard_config(config, N)`: the same module tree and stage names as the
whole model, with the split dimensions divided by N, so the stage modules, the KV cache and the tracer all see this
rank's shapes and count this rank's FLOPs and bytes:

    wq, wk, wv, w1, w3   column-parallel: H/N query heads, Hkv/N KV heads, F/N FFN columns per rank (contiguous
                         slices; query head h of a rank still reads KV head h // R of the same rank)
    wo, w2               row-parallel: each rank multiplies its own heads' / columns' rows, then an all-reduce
                         (sum) of the (B, T, dim) partial outputs; a bias is added once (rank 0 holds it, the others
                         hold zeros)
    a mixture of experts every expert's w1, w3 and w2 split as the dense FFN's (each rank F/N of every expert's
                         columns), the router whole on every rank (each routes every token alike), the weighted sum
                         of the partial outputs summed by the one all-reduce after the FFN; a shared expert (Qwen2-MoE)
                         split alike, its gate's logit whole, σ(logit)·partial added before that all-reduce
    tok_embeddings       vocab-parallel: rank r holds rows [r*V', (r+1)*V'), V' = ceil(V / N); an id outside the
                         slice looks up zeros, and an all-reduce (sum) gives every rank the full (B, T, dim) rows
    output (LM head)     vocab-parallel: rank r computes its V' logits; an all-gather along the vocabulary gives
                         every rank the whole (B, V) row (so every rank samples the same token with the same seed);
                         when N does not divide V the last slice is padded with zero rows, whose logits are dropped
    norms, residuals     replicated: every rank computes them on the whole hidden vector

So each forward makes two all-reduces per layer (after wo and after w2: the stage modules' own TransformerBlock,
given the group's all-reduce), one after the embedding and one all-gather after the LM head. The collectives go through a `Collectives` object (the
trace layer's tracer/trace/collectives.py times and records each one); this module only says where they happen.
A matrix may be held as a GGUF stores it (a Linear's or the embedding's `packed`, tracer/model/weight_formats.py):
its shard is then whole blocks of the file (tracer/load/gguf_shard.py: a row-parallel split falls on block
boundaries), multiplied by the same kernel a single-process run would use.
The fused fast path (tracer/model/fused.py) has no tensor-parallel variant: a sharded model always runs stage by stage.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llmtrace.tracer.analytic.tensor_parallel import tp_sizes, vocab_slice
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.model.transformer import Embedding, Transformer, TransformerBlock

ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"


class Collectives(Protocol):
    """What a sharded model asks of its process group; `after` names the stage whose output is exchanged."""

    rank: int
    world: int

    def all_reduce(self, x: torch.Tensor, layer: int | None, after: str) -> torch.Tensor:
        """The element-wise sum of `x` over every rank (may work in place)."""

    def all_gather(self, x: torch.Tensor, layer: int | None, after: str) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dimension, in rank order."""


def valid_tp(config: ModelConfig) -> list[int]:
    """Every N this model splits over: 1 and each N > 1 dividing its query heads, KV heads and FFN width."""
    return [1, *tp_sizes(config)]


def check_tp_split(config: ModelConfig, tp: int) -> None:
    """A one-line BadArgumentError unless each of `tp` ranks can hold whole heads and an equal FFN slice."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise BadArgumentError(f"--tp must be an integer >= 1, got {tp!r}")
    parts = (("KV heads", config.n_kv_heads), ("query heads", config.n_heads), ("FFN width", config.ffn_dim),
             ("shared expert width", config.shared_expert_dim or 0))
    for what, value in parts:
        if value % tp:
            valid = ", ".join(map(str, valid_tp(config)))
            raise BadArgumentError(f"--tp {tp} does not divide {config.name}'s {value} {what} (each rank needs whole "
                                   f"heads); use --tp {valid}")


def shard_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config one rank's Transformer is built from: heads, KV heads, FFN width (each expert's, in a mixture of
    experts, and a shared expert's) and vocabulary divided by `tp`, head_dim given explicitly (dim stays whole: the
    residual stream is replicated; a router is whole on every rank, so every rank routes every token alike)."""
    check_tp_split(config, tp)
    if tp == 1:
        return config
    return replace(config, name=f"{config.name} [1/{tp} shard]", n_heads=config.n_heads // tp,
                   n_kv_heads=config.n_kv_heads // tp, ffn_dim=config.ffn_dim // tp,
                   shared_expert_dim=config.shared_expert_dim // tp if config.shared_expert_dim else None,
                   vocab_size=vocab_slice(config, tp), explicit_head_dim=config.head_dim)


class VocabParallelEmbedding(Embedding):
    """This rank's rows [start, start + rows) of the embedding table; any other id looks up a zero row (the
    all-reduce after it fills those in from the rank that holds them). Same parameter name as nn.Embedding; the
    table may be held as stored (`packed`, as the whole model's Embedding)."""

    def __init__(self, rows: int, dim: int, start: int, vocab_size: int) -> None:
        super().__init__(rows, dim, _weight=torch.empty(rows, dim))
        self.start = start
        self.real_rows = max(0, min(rows, vocab_size - start))  # the padded tail of the last slice is never looked up

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # (B, T)
        outside = (local < 0) | (local >= self.real_rows)  # (B, T)
        safe = local.masked_fill(outside, 0)
        rows = self.packed.rows(safe, self.compute_dtype) if self.packed is not None else \
            F.embedding(safe, self.weight)  # (B, T, dim)
        return rows.masked_fill_(outside.unsqueeze(-1), 0.0)

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.start + self.real_rows - 1}, dim={self.embedding_dim}"


class TensorParallelTransformer(Transformer):
    """Rank `rank` of `tp`: a Transformer of `shard_config(config, tp)` whose blocks, embedding and LM head exchange
    through `comm`. Build on the meta device and load a shard (tracer/load/tensor_parallel.py)."""

    def __init__(self, config: ModelConfig, tp: int, rank: int, comm: Collectives) -> None:
        local = shard_config(config, tp)
        super().__init__(local)
        self.full_config = config
        self.tp, self.rank, self.comm = tp, rank, comm
        self.layers = nn.ModuleList(TransformerBlock(local, i, comm.all_reduce) for i in range(local.n_layers))
        self.tok_embeddings = VocabParallelEmbedding(local.vocab_size, local.dim, rank * local.vocab_size,
                                                     config.vocab_size)
        if local.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.tok_embeddings(tokens), None, "tok_embeddings")  # (B, T, dim)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        local = self.output(self.norm(x))  # (..., V'): this rank's slice of the vocabulary
        whole = self.comm.all_gather(local, None, "output")  # (..., N*V')
        return whole[..., : self.full_config.vocab_size]  # (..., V): the padding of the last slice dropped

    def packed_off_reason(self) -> str:
        """The packed path and the native step multiply whole matrices, with no collectives: a shard never runs
        them."""
        return "a tensor-parallel shard runs stage by stage (the native decode step has no sharded variant)"


def build_meta_shard(config: ModelConfig, tp: int, rank: int, comm: Collectives) -> TensorParallelTransformer:
    """Rank `rank`'s model on the meta device: every shape, no memory (a dry run, or a shell to load a shard into)."""
    with torch.device("meta"):
        return TensorParallelTransformer(config, tp, rank, comm)
