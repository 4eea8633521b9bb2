"""Weights for one rank of a tensor-parallel run (the layout of tracer/model/tensor_parallel.py), and the rank's model
loaded from them.

A GGUF: the rank reads only its shard of each matrix (tracer/load/gguf_shard.py) and holds it as a single-process
run would hold the whole matrix: the same kernels (loader.plan_load decides them as load_model does: the default
table, `--weights`), as stored, so a rank's resident weights are its shard's stored bytes. A shard never touches
the weights cache.

An HF folder: the rank maps the safetensors files (nothing read yet), copies out its slice of each tensor in the
compute dtype and gives the map's pages of that tensor back at once (tracer/load/mapped_pages.py), so its resident
memory grows by its shard alone, never by the whole model (a bf16 7B folder: ~6.7 GB a rank under --tp 2, not 13.5).

Random weights, or a GGUF dequantized (--weights dense) whose split falls inside a block: the rank loads the whole
model the ordinary way and keeps copies of its slices only (`shard_state_dict`); the whole tensors are dropped when
the slices are made.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from llmtrace.tracer.checkpoint.gguf_tokenizer import tokenizer_from_gguf
from llmtrace.tracer.checkpoint.resolve import HF, ModelSource, ResolvedModel
from llmtrace.tracer.checkpoint.tokenizer import load_tokenizer
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import BF16, AutoDtype, DType, dense_name
from llmtrace.tracer.core.contract import per_expert, tensor_of
from llmtrace.tracer.hardware.dtype_policy import torch_dtype
from llmtrace.tracer.load import mapped_pages
from llmtrace.tracer.load.dry_weights import hold_as_stored
from llmtrace.tracer.load.gguf_loader import load_gguf_stored, load_gguf_weights, quantization_summary
from llmtrace.tracer.load.gguf_shard import (COLUMN_PARALLEL, ROW_PARALLEL, VOCAB_PARALLEL, ShardReads, ShardSpan,
                                             block_split_refusal, role_of, shard_header)
from llmtrace.tracer.load.gguf_source import GGUFSource
from llmtrace.tracer.load.hf_loader import mapped_views
from llmtrace.tracer.load.loader import LoadedModel, LoadPlan, load_model, plan_load
from llmtrace.tracer.load.memory_fit import check_fits, weights_held
from llmtrace.tracer.load.stored_weights import STORED, WeightsRequest, kernel_plan
from llmtrace.tracer.analytic.tensor_parallel import vocab_slice
from llmtrace.tracer.model.tensor_parallel import Collectives, build_meta_shard, shard_config


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


def shard_tensor(config: ModelConfig, name: str, tensor: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s piece of the whole tensor `name` (our naming): a view where it can be one (a copy only for the
    padded last vocabulary slice and a row-parallel bias past rank 0)."""
    role, kind = role_of(name)
    experts = int(per_expert(tensor_of(name), config))  # a mixture of experts' (E, ...) stack: each expert split
    if role in COLUMN_PARALLEL:
        return _slice(tensor, experts, rank, tp)  # output features: whole heads / FFN columns
    if role in ROW_PARALLEL and kind == "weight":
        return _slice(tensor, 1 + experts, rank, tp)  # input features: the rows of this rank's heads / columns
    if role in ROW_PARALLEL:
        return tensor if rank == 0 else torch.zeros_like(tensor)  # the bias is added once, after the sum
    if role in VOCAB_PARALLEL:
        return _vocab_rows(tensor, config, rank, tp)
    return tensor  # norms: replicated


def shard_state_dict(config: ModelConfig, state: dict[str, torch.Tensor], rank: int,
                     tp: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors (own copies, contiguous) of a whole checkpoint `state` in our naming."""
    shard_config(config, tp)  # the one-line error for an N that does not split the heads
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        piece = shard_tensor(config, name, tensor, rank, tp)
        out[name] = piece.clone() if tp > 1 else piece
    return out


def hf_shard_state_dict(folder: str | Path, config: ModelConfig, dtype: torch.dtype, rank: int,
                        tp: int) -> tuple[dict[str, torch.Tensor], str]:
    """(rank `rank`'s tensors of an HF folder, in `dtype` on the CPU; the files' dtypes, "bf16+fp32"), read from its
    mapped files a tensor at a time: each piece copied out (contiguous), then the map's pages of that tensor given
    back, so that no more than one whole tensor's pages are resident beside the shard at any time."""
    shard_config(config, tp)
    out: dict[str, torch.Tensor] = {}
    stored: set[str] = set()
    for name, parts in mapped_views(folder, config).items():
        whole = torch.stack([view for view, _, _, _ in parts]) if per_expert(tensor_of(name), config) \
            else parts[0][0]
        stored.add(dense_name(whole.dtype))
        piece = shard_tensor(config, name, whole, rank, tp)
        out[name] = torch.empty(piece.shape, dtype=dtype).copy_(piece)
        del whole, piece
        for _, mapped, at, nbytes in parts:
            mapped_pages.release(mapped, at, nbytes)
    return out, "+".join(sorted(stored))


def shard_of(resolved: ResolvedModel, rank: int, tp: int) -> tuple[ResolvedModel, tuple[ShardSpan, ...]]:
    """A GGUF `resolved` as rank `rank`'s shard: its config and header those of the shard (so memory_fit and the
    loader size and load the shard), and the spans ShardReads needs (given the file opened)."""
    assert resolved.gguf_header is not None
    header, spans = shard_header(resolved.gguf_header, resolved.config, rank, tp)
    return replace(resolved, config=shard_config(resolved.config, tp), gguf_header=header), spans


def shard_bytes(plan: LoadPlan, rank: int, tp: int) -> int:
    """The bytes rank `rank` holds for its weights as `plan` loads them (memory_fit's count for its shard: a GGUF's
    as stored, an HF folder's in the compute dtype)."""
    if plan.resolved.gguf_header is None:
        return weights_held(replace(plan.resolved, config=shard_config(plan.resolved.config, tp)), plan.weights,
                            plan.compute)[0]
    shard, _ = shard_of(plan.resolved, rank, tp)
    return weights_held(shard, plan.weights, plan.compute)[0]


def load_shard(spec: ModelSource | str | None, dtype: DType | AutoDtype, device: str, rank: int, tp: int,
               comm: Collectives, dry_run: bool = False, weights: str | WeightsRequest | None = None) -> LoadedModel:
    """Rank `rank`'s LoadedModel: the tokenizer, the whole config and the kernels as load_model gives them, the model
    a TensorParallelTransformer holding this rank's slices (on the meta device for a dry run: shapes only).
    `weights`: --weights as typed (a GGUF's shard is held as it asks; other checkpoints are dense)."""
    start = time.perf_counter()
    if isinstance(dtype, AutoDtype) and torch.device(device).type == "cuda":
        dtype = BF16  # the default table's CPU kernels say nothing of the rank's GPU
    plan = plan_load(spec, dtype, device, dry_run=dry_run, weights=weights)
    header = plan.resolved.gguf_header
    if header is not None and (plan.weights.mode == STORED or not block_split_refusal(header, plan.resolved.config,
                                                                                       tp)):
        return _gguf_shard(start, plan, rank, tp, comm, dry_run)
    if plan.resolved.kind == HF and not dry_run:
        return _hf_shard(start, plan, rank, tp, comm)
    # dense (a GGUF dequantized whose split falls inside a block too): the ranks slice plain tensors
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


def _gguf_shard(start: float, plan: LoadPlan, rank: int, tp: int, comm: Collectives, dry_run: bool) -> LoadedModel:
    """A GGUF's shard read and held as `plan` holds the whole file (see the module docstring)."""
    resolved, choice, compute = plan.resolved, plan.weights, plan.compute
    header = resolved.gguf_header
    assert header is not None
    shard, spans = shard_of(resolved, rank, tp)
    local = shard.config
    values = torch_dtype(compute)
    stored = choice.mode == STORED and choice.kernel is not None
    kernels = kernel_plan(choice.kernel) if stored else {}
    quantization = quantization_summary(header)
    fmt = (f"GGUF {quantization} as stored ({choice.kernel}) · {compute.name} activations" if stored
           else f"GGUF {quantization} -> {compute.name}")
    model = build_meta_shard(resolved.config, tp, rank, comm)
    if dry_run:
        model = model.to(values)  # meta: a dtype change costs nothing
        if stored:
            hold_as_stored(model, shard.gguf_header, kernels)  # type: ignore[arg-type]
        fmt = f"dry run (meta device) · {fmt}"
    else:
        if plan.target.type == "cpu":  # refused in one line before a byte is read
            name = Path(header.path).name
            how = f"as stored ({choice.kernel})" if stored else f"dequantized to {compute.name}"
            check_fits(shard, choice, compute, f"rank {rank}'s shard (1/{tp}) of {name} {how}")
        with GGUFSource(header) as source:
            reads = ShardReads(source, spans)
            sheader = shard.gguf_header
            assert sheader is not None
            if stored:
                dense, packed = load_gguf_stored(sheader, local, values, kernels, reads)
            else:
                dense, packed = load_gguf_weights(sheader, local, values, reads).state_dict, {}
            source.check_unchanged()  # rewritten in place while read: what was loaded may mix two versions
        if plan.target.type != "cpu":
            dense = {n: t.to(plan.target) for n, t in dense.items()}
            packed = {n: w.to(plan.target) for n, w in packed.items()}
        model.load_stored(dense, packed)
        model.requires_grad_(False)
        model.eval()
    return LoadedModel(config=resolved.config, model=model, tokenizer=tokenizer_from_gguf(header),
                       source=resolved.source.origin or str(header.path), load_seconds=time.perf_counter() - start,
                       weight_format=f"{fmt}, tensor-parallel shard {rank + 1}/{tp}", kernels=plan.kernels,
                       kernel_note=plan.note, weights=choice)


def _hf_shard(start: float, plan: LoadPlan, rank: int, tp: int, comm: Collectives) -> LoadedModel:
    """An HF folder's shard read as hf_shard_state_dict reads it; the tokenizer, kernels and source as load_model
    gives them from the same plan."""
    resolved, compute = plan.resolved, plan.compute
    if plan.target.type == "cpu":  # refused in one line before a byte is read
        name = Path(resolved.path).name if resolved.path is not None else resolved.config.name
        check_fits(replace(resolved, config=shard_config(resolved.config, tp)), plan.weights, compute,
                   f"rank {rank}'s shard (1/{tp}) of {name} in {compute.name}")
    state, stored = hf_shard_state_dict(resolved.source.path, resolved.config, torch_dtype(compute), rank, tp)
    if plan.target.type != "cpu":
        state = {n: t.to(plan.target) for n, t in state.items()}
    model = build_meta_shard(resolved.config, tp, rank, comm)
    model.load_weights(state)
    model.requires_grad_(False)
    model.eval()
    return LoadedModel(config=resolved.config, model=model, tokenizer=load_tokenizer(resolved.source.path),
                       source=resolved.source.origin or str(resolved.source.path),
                       load_seconds=time.perf_counter() - start,
                       weight_format=f"safetensors {stored} -> {compute.name}, tensor-parallel shard {rank + 1}/{tp}",
                       kernels=plan.kernels, kernel_note=plan.note, weights=plan.weights)
