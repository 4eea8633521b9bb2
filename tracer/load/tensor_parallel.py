"""Weights for one rank of a tensor-parallel run: the whole checkpoint's tensors cut into rank `rank`'s slices
(the layout of tracer/model/tensor_parallel.py), and the rank's model loaded from them.

Each rank loads the whole checkpoint the ordinary way (memory-mapped safetensors, or the GGUF conversion cache) and
keeps copies of its slices only; the whole tensors are dropped when the slices are made. So a rank's resident weights
are 1/N of the model (plus the replicated norms), but the load reads the whole file on every rank.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import BF16, AutoDtype, DType
from llmtrace.tracer.load.loader import LoadedModel, load_model
from llmtrace.tracer.model.tensor_parallel import Collectives, build_meta_shard, shard_config, vocab_slice

COLUMN_PARALLEL = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROW_PARALLEL = ("attention.wo", "feed_forward.w2")
VOCAB_PARALLEL = ("tok_embeddings", "output")


def _role(name: str) -> tuple[str, str]:
    """'layers.3.attention.wq.weight' -> ('attention.wq', 'weight'); 'output.weight' -> ('output', 'weight')."""
    parts = name.split(".")
    body = parts[2:] if parts[0] == "layers" else parts
    return ".".join(body[:-1]), body[-1]


def _slice(tensor: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    size = tensor.shape[dim] // tp
    return tensor.narrow(dim, rank * size, size)


def _vocab_rows(tensor: torch.Tensor, config: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    """Rows [rank*V', (rank+1)*V') of a (V, ...) tensor, the last slice padded with zeros to V' rows."""
    rows = vocab_slice(config, tp)
    start = rank * rows
    taken = tensor[start : start + rows]
    if taken.shape[0] == rows:
        return taken
    pad = torch.zeros((rows - taken.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    return torch.cat([taken, pad])


def shard_state_dict(config: ModelConfig, state: dict[str, torch.Tensor], rank: int,
                     tp: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors (own copies, contiguous) of a whole checkpoint `state` in our naming."""
    shard_config(config, tp)  # the one-line error for an N that does not split the heads
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        role, kind = _role(name)
        if role in COLUMN_PARALLEL:
            piece = _slice(tensor, 0, rank, tp)  # output features: whole heads / FFN columns
        elif role in ROW_PARALLEL and kind == "weight":
            piece = _slice(tensor, 1, rank, tp)  # input features: the rows of this rank's heads / columns
        elif role in ROW_PARALLEL:
            piece = tensor if rank == 0 else torch.zeros_like(tensor)  # the bias is added once, after the sum
        elif role in VOCAB_PARALLEL:
            piece = _vocab_rows(tensor, config, rank, tp)
        else:
            piece = tensor  # norms: replicated
        out[name] = piece.clone() if tp > 1 else piece
    return out


def load_shard(spec: object, dtype: DType | AutoDtype, device: str, rank: int, tp: int, comm: Collectives,
               dry_run: bool = False) -> LoadedModel:
    """Rank `rank`'s LoadedModel: the tokenizer and the whole config as load_model gives them, the model a
    TensorParallelTransformer holding this rank's slices (on the meta device for a dry run: shapes only)."""
    start = time.perf_counter()
    if isinstance(dtype, AutoDtype) and torch.device(device).type == "cuda":
        dtype = BF16  # the whole model is loaded on the CPU, whose measured pick says nothing of the rank's GPU
    # dense: the ranks slice plain tensors (a matrix held as stored cannot be split by rows or columns)
    whole = load_model(spec, dtype=dtype, device="cpu", dry_run=dry_run, weights="dense")  # moved to `device` later
    config = whole.config
    shard_config(config, tp)
    values = next(whole.model.parameters()).dtype
    if dry_run:
        model = build_meta_shard(config, tp, rank, comm).to(values)
    else:
        state = shard_state_dict(config, whole.model.state_dict(), rank, tp)
        target = torch.device(device)
        if target.type != "cpu":
            state = {name: tensor.to(target) for name, tensor in state.items()}
        model = build_meta_shard(config, tp, rank, comm)
        model.load_weights(state)
        model.requires_grad_(False)
        model.eval()
    return replace(whole, model=model, load_seconds=time.perf_counter() - start,
                   weight_format=f"{whole.weight_format}, tensor-parallel shard {rank + 1}/{tp}")
