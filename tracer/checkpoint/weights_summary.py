"""What a checkpoint on disk really holds: parameter count and bytes per storage dtype, from headers only."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterable

from llmtrace.tracer.checkpoint.gguf_header import GGUFHeader
from llmtrace.tracer.checkpoint.safetensors_header import SafetensorsCheckpoint
from llmtrace.tracer.core.dtypes import DType, dtype_of_file_type


@dataclass(frozen=True, slots=True)
class DtypeShare:
    dtype: str  # as the file names it: "BF16", "Q4_1", "F32"
    params: int
    bytes: int
    tensors: int


@dataclass(frozen=True, slots=True)
class TensorShare:
    """One tensor of the model contract summed over the layers, as the file stores it (a Q4_K_M file keeps
    ffn_down in Q6_K in some layers and Q4_K in the others)."""

    name: str  # the contract's name, inside a layer or at the top: "attention.wq.weight", "tok_embeddings.weight"
    dtypes: str  # the file's types for it, most values first: "Q4_K+Q6_K"
    params: int
    bytes: int
    tensors: int


@dataclass(frozen=True, slots=True)
class WeightsSummary:
    format: str  # "safetensors" | "gguf"
    files: tuple[str, ...]
    n_tensors: int
    n_params: int
    total_bytes: int
    by_dtype: tuple[DtypeShare, ...]  # largest share first
    by_tensor: tuple[TensorShare, ...] = ()  # GGUF: each contract tensor as stored (empty for safetensors)

    @property
    def stored(self) -> tuple[tuple[str, int, int], ...]:
        """(contract tensor name, bytes, values) of each tensor as the file stores it, for the estimate."""
        return tuple((t.name, t.bytes, t.params) for t in self.by_tensor)

    @property
    def main_dtype(self) -> str:
        return self.by_dtype[0].dtype if self.by_dtype else "-"

    @property
    def llmtrace_dtype(self) -> DType | None:
        """The format whose layout the main dtype has exactly (Q8_0 is int8, Q4_1 is q4_1, Q4_K is q4_k), None when
        none does."""
        return dtype_of_file_type(self.main_dtype)


def _summarize(fmt: str, files: tuple[str, ...], rows: Iterable[tuple[str, int, int]]) -> WeightsSummary:
    shares: dict[str, list[int]] = {}
    n_tensors = 0
    for dtype, params, n_bytes in rows:
        acc = shares.setdefault(dtype, [0, 0, 0])
        acc[0] += params
        acc[1] += n_bytes
        acc[2] += 1
        n_tensors += 1
    by_dtype = tuple(sorted((DtypeShare(k, *v) for k, v in shares.items()), key=lambda s: -s.params))
    return WeightsSummary(
        format=fmt, files=files, n_tensors=n_tensors, n_params=sum(s.params for s in by_dtype),
        total_bytes=sum(s.bytes for s in by_dtype), by_dtype=by_dtype,
    )


# Buffers some older HF checkpoints saved beside the weights; they are not parameters.
_NOT_PARAMETERS = ("rotary_emb.inv_freq",)


def summarize_safetensors(ckpt: SafetensorsCheckpoint) -> WeightsSummary:
    rows = ((t.dtype, t.n_elements, t.n_bytes) for t in ckpt.tensors if not t.name.endswith(_NOT_PARAMETERS))
    return _summarize("safetensors", ckpt.files, rows)


def summarize_gguf(header: GGUFHeader) -> WeightsSummary:
    summary = _summarize("gguf", (header.path,), ((t.type_name, t.n_elements, t.n_bytes) for t in header.tensors))
    return replace(summary, by_tensor=_by_tensor(header))


def _by_tensor(header: GGUFHeader) -> tuple[TensorShare, ...]:
    """Bytes and values of each contract tensor over all layers, with the types they are stored in."""
    from llmtrace.tracer.core.contract import gguf_to_ours

    acc: dict[str, list] = {}
    for info in header.tensors:
        ours = gguf_to_ours(info.name)
        if ours is None:
            continue
        name = _LAYER_PREFIX.sub("", ours)
        entry = acc.setdefault(name, [{}, 0, 0, 0])
        entry[0][info.type_name] = entry[0].get(info.type_name, 0) + info.n_elements
        entry[1] += info.n_elements
        entry[2] += info.n_bytes
        entry[3] += 1
    return tuple(
        TensorShare(name, "+".join(sorted(types, key=lambda t: -types[t])), params, n_bytes, count)
        for name, (types, params, n_bytes, count) in acc.items()
    )


_LAYER_PREFIX = re.compile(r"^layers\.\d+\.")
