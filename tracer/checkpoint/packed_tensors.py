"""Checkpoint tensors that hold several of the contract's matrices stacked by rows, split into them at the name map.

Phi-3 stores each layer's Q, K and V projections as one `qkv_proj` matrix and its gate and up projections as one
`gate_up_proj` (HF; llama.cpp's `phi3` files likewise as `attn_qkv` and a 2F-row `ffn_up`). A matrix's rows are
contiguous in both formats (row-major safetensors; GGUF rows of whole quantization blocks), so each member is the
byte range of its rows: the readers see the contract's tensors, views of the same bytes, and nothing downstream
(loaders, weight summaries, stored kernels) knows the file packed them. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

from llmtrace.tracer.core.contract import expected_shapes, ours_to_gguf, ours_to_hf
from llmtrace.tracer.core.errors import CheckpointError

if TYPE_CHECKING:
    from llmtrace.tracer.checkpoint.gguf_header import GGUFHeader
    from llmtrace.tracer.checkpoint.safetensors_header import SafetensorsTensor
    from llmtrace.tracer.core.config import ModelConfig


@dataclass(frozen=True, slots=True)
class PackedTensor:
    hf: str  # relative to "model.layers.{i}."
    gguf: str  # relative to "blk.{i}."
    members: tuple[str, ...]  # our tensor names relative to "layers.{i}.", in row order


PACKED: tuple[PackedTensor, ...] = (
    PackedTensor("self_attn.qkv_proj.weight", "attn_qkv.weight",
                 ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight")),
    PackedTensor("mlp.gate_up_proj.weight", "ffn_up.weight", ("feed_forward.w1.weight", "feed_forward.w3.weight")),
)
T = TypeVar("T")
# The GGUF architectures whose files pack them (their `ffn_up` is gate|up, not up alone).
GGUF_PACKING = frozenset({"phi3"})


def _members(packed: PackedTensor, layer: int, config: ModelConfig) -> list[tuple[str, int]]:
    """(our full name, rows) of each member of `packed` in `layer`, as the config shapes them."""
    shapes = expected_shapes(config)
    return [(name, shapes[name][0]) for name in (f"layers.{layer}.{m}" for m in packed.members)]


def split_safetensors(entries: dict[str, tuple[T, SafetensorsTensor]], config: ModelConfig,
                      where: str) -> dict[str, tuple[T, SafetensorsTensor]]:
    """`entries` (HF name -> (its file, tensor)) with each packed tensor replaced by its members under their HF
    names, in the same file."""
    out = dict(entries)
    for layer in range(config.n_layers):
        for packed in PACKED:
            name = f"model.layers.{layer}.{packed.hf}"
            if name not in out:
                continue
            file, entry = out.pop(name)
            members = _members(packed, layer, config)
            rows = sum(r for _, r in members)
            if len(entry.shape) != 2 or entry.shape[0] != rows:
                raise CheckpointError(f"{where}: {name} is {list(entry.shape)}, config.json wants {rows} rows ("
                                      f"{_stacked(members)} stacked)")
            row_bytes = (entry.end - entry.begin) // rows
            begin = entry.begin
            for ours, r in members:
                hf = ours_to_hf(ours)
                out[hf] = (file, replace(entry, name=hf, shape=(r, entry.shape[1]), begin=begin,
                                         end=begin + r * row_bytes))
                begin += r * row_bytes
    return out


def _stacked(members: list[tuple[str, int]]) -> str:
    return " + ".join(f"{name.split('.', 2)[2].removesuffix('.weight')} {rows}" for name, rows in members)


def split_gguf(header: GGUFHeader, config: ModelConfig) -> GGUFHeader:
    """`header` with each packed tensor of an architecture in GGUF_PACKING replaced by its members, each a tensor
    info at its rows' offset under the member's llama.cpp name."""
    if header.metadata.get("general.architecture") not in GGUF_PACKING:
        return header
    by_name = {t.name: t for t in header.tensors}
    split: dict[str, list] = {}
    for layer in range(config.n_layers):
        for packed in PACKED:
            name = f"blk.{layer}.{packed.gguf}"
            info = by_name.get(name)
            if info is None:
                continue
            members = _members(packed, layer, config)
            rows = sum(r for _, r in members)
            if len(info.shape) != 2 or info.shape[1] != rows:
                raise CheckpointError(f"{header.path}: tensor {name!r} has shape {info.shape}, the header's config "
                                      f"needs {rows} rows ({_stacked(members)} stacked); the file is corrupt")
            row_bytes = info.n_bytes // rows
            offset = info.offset
            split[name] = []
            for ours, r in members:
                split[name].append(replace(info, name=ours_to_gguf(ours), shape=(info.shape[0], r), offset=offset))
                offset += r * row_bytes
    if not split:
        return header
    tensors = tuple(m for t in header.tensors for m in split.get(t.name, (t,)))
    return replace(header, tensors=tensors)
