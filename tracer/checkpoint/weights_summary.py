"""What a checkpoint on disk really holds: parameter count and bytes per storage dtype, from headers only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from llmtrace.tracer.core.dtypes import DType, dtype_of_file_type
from llmtrace.tracer.checkpoint.gguf_header import GGUFHeader
from llmtrace.tracer.checkpoint.safetensors_header import SafetensorsCheckpoint


@dataclass(frozen=True, slots=True)
class DtypeShare:
    dtype: str  # as the file names it: "BF16", "Q4_1", "F32"
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
    return _summarize("gguf", (header.path,), ((t.type_name, t.n_elements, t.n_bytes) for t in header.tensors))
