"""One rank's shard of a GGUF file, read as if it were a GGUF of the shard's shapes.

A tensor-parallel rank (tracer/model/tensor_parallel.py) holds 1/N of each split matrix. Rather than load the whole
file and slice it (a 7B Q4_0 file dequantized to fp32 is 27 GB per rank), `shard_header` describes a GGUF whose
tensors are this rank's pieces, in the file's own block layout, and `ShardReads` reads each piece's bytes from the
real file. The ordinary loader (tracer/load/gguf_loader.py) then loads that "file" with the shard's config as it
loads any GGUF: matrices held as stored for the same kernels (the weight arena, i8dot's interleaved rows, Q/K rows
put back in HF's order per head), the rest dequantized, every scale checked. What each rank reads and holds:

    wq, wk, wv, w1, w3   column-parallel: rows [r*N/tp, (r+1)*N/tp), whole rows of blocks, one contiguous range of
                         the file (whole heads: llama.cpp permutes Q/K rows within a head, so a head's rows stay
                         together); a bias, its values r*N/tp.. likewise
    wo, w2               row-parallel: every row's values [r*K/tp, (r+1)*K/tp), which must be whole blocks (a block's
                         one scale covers 32 or 256 values: a split inside one cannot be held as stored); the rows'
                         bytes are read whole through a scratch buffer and the rank's blocks of each kept; a bias is
                         rank 0's (zeros elsewhere: it is added once, after the sum)
    tok_embeddings,      vocab-parallel: rows [r*V', (r+1)*V'), V' = ceil(V / tp); the last slice padded with rows of
    output               zero bytes, which decode to zeros in every block format (a zero scale)
    norms                whole, on every rank

No weights cache entry is written for a shard (one per rank and N would each be a partial copy of the file).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace

import numpy as np

from llmtrace.tracer.checkpoint.gguf_header import GGUFHeader, GGUFTensorInfo
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import gguf_to_ours
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.core.ggml_types import GGML_TYPES
from llmtrace.tracer.load.gguf_source import Reader
from llmtrace.tracer.analytic.tensor_parallel import vocab_slice
from llmtrace.tracer.model.tensor_parallel import shard_config, valid_tp

# A mixture of experts' w1, w3 and w2 are split per expert as these (every expert's F/N columns a rank), a shared
# expert's (Qwen2-MoE) as the dense FFN's; the router and the shared expert's gate stay whole
COLUMN_PARALLEL = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3",
                   "feed_forward.shared_w1", "feed_forward.shared_w3")
ROW_PARALLEL = ("attention.wo", "feed_forward.w2", "feed_forward.shared_w2")
VOCAB_PARALLEL = ("tok_embeddings", "output")
_SCRATCH_BYTES = 4 << 20  # whole rows of a row-parallel matrix read at a time, the rank's blocks kept


def role_of(name: str) -> tuple[str, str]:
    """'layers.3.attention.wq.weight' -> ('attention.wq', 'weight'); 'output.weight' -> ('output', 'weight')."""
    parts = name.split(".")
    body = parts[2:] if parts[0] == "layers" else parts
    return ".".join(body[:-1]), body[-1]


@dataclass(frozen=True, slots=True)
class ShardSpan:
    """One shard tensor in the shard's "file": `rows` rows of `row_bytes` at offset `start`; row i (< `present`) is
    the file's bytes [source + i*stride, + row_bytes), the rows after are zeros."""

    start: int
    rows: int
    row_bytes: int
    source: int
    stride: int
    present: int
    joined: bool = False  # the same tensor as the span before it (a mixture of experts' next expert's rows)

    @property
    def end(self) -> int:
        return self.start + self.rows * self.row_bytes


def _block(info: GGUFTensorInfo) -> tuple[int, int]:
    _, block, block_bytes = GGML_TYPES[info.ggml_type]
    return block, block_bytes


def block_split_refusal(header: GGUFHeader, config: ModelConfig, tp: int) -> str:
    """"" when every row-parallel matrix of the file splits over `tp` ranks at block boundaries, else one line naming
    the first that does not and the --tp that do."""
    def splits(n: int) -> str | None:
        for info in header.tensors:
            name = gguf_to_ours(info.name)
            if name is None or len(info.shape) < 2 or role_of(name)[0] not in ROW_PARALLEL:
                continue
            block, _ = _block(info)
            if info.shape[0] % n or (info.shape[0] // n) % block:
                return f"{info.name} ({info.type_name}: {info.shape[0]} values a row in blocks of {block})"
        return None

    bad = splits(tp)
    if bad is None:
        return ""
    valid = ", ".join(str(n) for n in valid_tp(config) if splits(n) is None)
    return (f"--tp {tp} would split {bad} inside a block, which cannot be held as stored; use --tp {valid}, or "
            "--weights dense")


def shard_header(header: GGUFHeader, config: ModelConfig, rank: int,
                 tp: int) -> tuple[GGUFHeader, tuple[ShardSpan, ...]]:
    """The header of rank `rank`'s shard (its tensors' shapes and offsets in the shard's "file"; the file's path,
    metadata and identity) and where each tensor's bytes lie in the real file (for ShardReads). BadArgumentError
    (one line) when `tp` does not split the heads, or splits a row-parallel matrix inside a block."""
    shard_config(config, tp)  # the one-line error for an N that does not split the heads
    refusal = block_split_refusal(header, config, tp)
    if refusal:
        raise BadArgumentError(refusal)
    vocab_rows = vocab_slice(config, tp)
    tensors, spans, at = [], [], 0
    for info in sorted(header.tensors, key=lambda i: i.offset):  # the file's order: the loader reads in it
        name = gguf_to_ours(info.name)
        role, kind = role_of(name) if name is not None else ("", "")
        block, block_bytes = _block(info)
        cols, rows = info.shape[0], math.prod(info.shape[1:])  # a 3-D experts tensor: its E * N rows
        stride = cols // block * block_bytes
        base = header.data_offset + info.offset
        if role in COLUMN_PARALLEL and len(info.shape) > 2:  # (K, N, E): each expert's N/tp rows, a span each
            per = info.shape[1] // tp
            tensors.append(replace(info, shape=(cols, per, info.shape[2]), offset=at))
            for expert in range(info.shape[2]):
                source = base + (expert * info.shape[1] + rank * per) * stride
                spans.append(ShardSpan(at, per, stride, source, stride, per, joined=expert > 0))
                at += per * stride
            continue
        first, take, col0, width, present = 0, rows, 0, cols, rows
        if role in COLUMN_PARALLEL and len(info.shape) > 1:
            take = present = rows // tp
            first = rank * take
        elif role in COLUMN_PARALLEL or (role in ROW_PARALLEL and kind == "weight"):
            width = cols // tp  # a column bias (1-D: its values), or a row-parallel weight's values of each row
            col0 = rank * width
        elif role in ROW_PARALLEL:
            present = rows if rank == 0 else 0
        elif role in VOCAB_PARALLEL:
            first, take = rank * vocab_rows, vocab_rows
            present = max(0, min(vocab_rows, rows - first))
        row_bytes = width // block * block_bytes
        source = base + min(first, rows) * stride + col0 // block * block_bytes
        spans.append(ShardSpan(at, take, row_bytes, source, stride, present))
        shape = (width, take) if len(info.shape) == 2 else (width, *info.shape[1:]) if len(info.shape) > 2 else (width,)
        tensors.append(replace(info, shape=shape, offset=at))
        at += take * row_bytes
    return replace(header, tensors=tuple(tensors), data_offset=0, file_size=at), tuple(spans)


class ShardReads:
    """Reads of a shard's "file" (shard_header's offsets) from the real file: a Reader for the GGUF loader. Each read
    lies within one tensor (the loader reads a tensor, or whole rows of it, at a time), which may be several spans
    (a mixture of experts' column-parallel tensor: one an expert)."""

    def __init__(self, source: Reader, spans: tuple[ShardSpan, ...]) -> None:
        self.source, self.spans = source, spans
        self._starts = [s.start for s in spans]

    def read(self, start: int, n: int, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(n, dtype=np.uint8) if out is None else out.reshape(-1).view(np.uint8)
        if out.shape[0] != n:
            raise ValueError(f"a read of {n} bytes into {out.shape[0]}")
        index, done = bisect.bisect_right(self._starts, start) - 1, 0
        while True:  # a span's part at a time: a tensor split per expert is several spans, one after another
            span = self.spans[index]
            part = min(n - done, span.end - (start + done))
            self._span_read(span, start + done, part, out[done:done + part])
            done += part
            if done == n:
                return out
            if index + 1 == len(self.spans) or not self.spans[index + 1].joined:
                raise ValueError(f"a read of {n} bytes at {start} crosses a shard tensor's end ({span.end})")
            index += 1

    def _span_read(self, span: ShardSpan, start: int, n: int, out: np.ndarray) -> None:
        """`n` bytes at `start` of the shard's file, all within `span`, into `out`."""
        rel = start - span.start
        first, last = rel // span.row_bytes, -(-(rel + n) // span.row_bytes)
        if rel % span.row_bytes == 0 and n % span.row_bytes == 0:  # whole rows: straight into `out`
            self._rows(span, first, last, out.reshape(last - first, span.row_bytes))
            return
        rows = np.empty((last - first, span.row_bytes), dtype=np.uint8)
        self._rows(span, first, last, rows)
        skip = rel - first * span.row_bytes
        out[...] = rows.reshape(-1)[skip:skip + n]

    def _rows(self, span: ShardSpan, first: int, last: int, out: np.ndarray) -> None:
        """Rows first..last of `span` into `out` ((last - first, row_bytes) uint8, contiguous)."""
        real = max(first, min(last, span.present))
        out[real - first:] = 0  # the padding of the last vocabulary slice, a row-parallel bias past rank 0
        if real == first:
            return
        if span.stride == span.row_bytes:  # the rows lie one after another in the file
            self.source.read(span.source + first * span.stride, (real - first) * span.row_bytes,
                             out[:real - first])
            return
        per = max(1, _SCRATCH_BYTES // span.stride)
        scratch = np.empty(min(per, real - first) * span.stride, dtype=np.uint8)
        for row in range(first, real, per):
            k = min(per, real - row)
            length = (k - 1) * span.stride + span.row_bytes  # up to the last row's blocks of this rank
            self.source.read(span.source + row * span.stride, length, scratch[:length])
            rows = scratch[:k * span.stride].reshape(k, span.stride)
            out[row - first:row - first + k] = rows[:, :span.row_bytes]
