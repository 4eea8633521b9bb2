"""Weights from a GGUF file: dequantized to fp32, renamed to Meta's names, Q/K rows put back in HF's RoPE layout.

The descriptors come from `llmtrace.tracer.checkpoint.gguf_header` (pure Python, 0.1 s for the bundled file; `gguf.GGUFReader` spends
seconds decoding every vocabulary string as a numpy array). The data section is a numpy memmap, so only the bytes of
the tensor being converted are paged in. The block decoders below are vectorised numpy, checked bit-for-bit
against `gguf.quants.dequantize` in the tests and about 3x faster than it (BENCHMARKS.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.errors import CheckpointError, FileFormatError, UnsupportedModelError
from llmtrace.tracer.checkpoint.gguf_header import GGML_TYPES, GGUFHeader, GGUFTensorInfo, read_gguf_header
from llmtrace.tracer.model.transformer import expected_shapes
from llmtrace.tracer.checkpoint.resolve import config_from_gguf_header

# llama.cpp tensor names (llama-arch.cpp, LLM_ARCH_LLAMA) -> Meta's names (llama/model.py), as TEAM.md fixes them.
_GLOBAL_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
_LAYER_NAMES = {
    "attn_norm": "attention_norm",
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")
# Derived data llama.cpp writes for Llama 3.1 rope scaling; the model computes the same from the config.
_IGNORED = {"rope_freqs.weight"}

# ggml type codes this loader decodes (ggml.h enum ggml_type).
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
SUPPORTED_TYPES = {F32: "F32", F16: "F16", BF16: "BF16", Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_1: "Q4_1"}


def meta_name(gguf_name: str) -> str | None:
    """Meta-style name for a llama.cpp tensor name, or None when the name is not one a LLaMA model has."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    return None


# ---- block decoders: flat uint8 bytes -> flat float32 ---------------------------------------------------------


def _scales(blocks: np.ndarray, start: int, count: int) -> np.ndarray:
    """`count` fp16 scalars per block from byte `start`, as float32 (n_blocks, count)."""
    return np.ascontiguousarray(blocks[:, start:start + 2 * count]).view("<f2").astype(np.float32)


def _nibbles(quants: np.ndarray) -> np.ndarray:
    """16 packed bytes per block -> 32 values: low nibbles are elements 0-15, high nibbles 16-31 (ggml's layout)."""
    out = np.empty((quants.shape[0], 32), dtype=np.float32)
    np.bitwise_and(quants, 0x0F, out=out[:, :16], casting="unsafe")
    np.right_shift(quants, 4, out=out[:, 16:], casting="unsafe")
    return out


def _dequant_q4_1(raw: np.ndarray) -> np.ndarray:
    """block_q4_1: fp16 d, fp16 m, 16 bytes of nibbles q; x = d * q + m."""
    blocks = raw.reshape(-1, 20)
    dm = _scales(blocks, 0, 2)  # (n_blocks, 2): d, m
    out = _nibbles(blocks[:, 4:])
    out *= dm[:, 0:1]
    out += dm[:, 1:2]
    return out.reshape(-1)


def _dequant_q4_0(raw: np.ndarray) -> np.ndarray:
    """block_q4_0: fp16 d, 16 bytes of nibbles q; x = d * (q - 8)."""
    blocks = raw.reshape(-1, 18)
    d = _scales(blocks, 0, 1)
    out = _nibbles(blocks[:, 2:])
    out -= 8.0
    out *= d
    return out.reshape(-1)


def _dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    """block_q8_0: fp16 d, 32 signed bytes q; x = d * q."""
    blocks = raw.reshape(-1, 34)
    d = _scales(blocks, 0, 1)
    out = blocks[:, 2:].view(np.int8).astype(np.float32)
    out *= d
    return out.reshape(-1)


def _dequant_f32(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f4").copy()  # a copy: the memmap is read-only and must not back a torch tensor


def _dequant_f16(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f2").astype(np.float32)


def _dequant_bf16(raw: np.ndarray) -> np.ndarray:
    """bf16 is the top half of an fp32: shift the 16 bits up."""
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)


_DECODERS = {F32: _dequant_f32, F16: _dequant_f16, BF16: _dequant_bf16, Q8_0: _dequant_q8_0,
             Q4_0: _dequant_q4_0, Q4_1: _dequant_q4_1}


def dequantize(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """Flat uint8 bytes of one tensor -> flat float32 values. Unsupported types raise UnsupportedModelError."""
    if ggml_type not in _DECODERS:
        name = GGML_TYPES.get(ggml_type, (f"type {ggml_type}", 0, 0))[0]
        raise UnsupportedModelError(
            f"unsupported quantization {name}; llmtrace reads {', '.join(SUPPORTED_TYPES.values())} "
            "(re-quantize with llama.cpp's llama-quantize, e.g. to Q8_0, or pass an HF model folder)"
        )
    return _DECODERS[ggml_type](raw)


# ---- Q/K row order --------------------------------------------------------------------------------------------


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `permute`), giving HF's rotate_half layout.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3)...; HF rotates (x_i, x_{i+D/2}). The converter interleaves
    each head's two halves: reshape(H, 2, D/2, in).swapaxes(1, 2). The inverse reads the rows as (H, D/2, 2, in)
    and swaps back.
    """
    rows, cols = weight.shape
    head_dim = rows // n_heads
    per_head = weight.reshape(n_heads, head_dim // 2, 2, cols)  # (H, D/2, 2, in): interleaved pairs
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(rows, cols)  # (H*D, in): halves per head


# ---- the file --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GGUFWeights:
    """A GGUF file's config and state dict under Meta's names (no output.weight when tied)."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    quantization: str  # e.g. "Q4_1+Q8_0": the quantized types found, most common first
    header: GGUFHeader


def read_header(path: str | Path) -> GGUFHeader:
    """The full header, vocabulary included (read once, shared by the config, the weights and the tokenizer)."""
    return read_gguf_header(path, decode_arrays=True)


def quantization_summary(header: GGUFHeader) -> str:
    """The tensor types of the file's matrices, most common first ("Q4_1+Q8_0"); 1-D norms are left out."""
    counts: dict[str, int] = {}
    for info in header.tensors:
        if len(info.shape) > 1:
            counts[info.type_name] = counts.get(info.type_name, 0) + 1
    return "+".join(sorted(counts, key=lambda name: -counts[name])) or "F32"


def _plan(header: GGUFHeader, config: ModelConfig) -> dict[str, GGUFTensorInfo]:
    """Map each expected Meta name to its descriptor; name what is missing, unexpected or mis-shaped."""
    path = header.path
    by_meta: dict[str, GGUFTensorInfo] = {}
    unexpected = []
    for info in header.tensors:
        name = meta_name(info.name)
        if name is None:
            if info.name not in _IGNORED:
                unexpected.append(info.name)
            continue
        by_meta[name] = info
    expected = expected_shapes(config)
    if config.tie_embeddings:
        by_meta.pop("output.weight", None)  # never present when tied (resolve decides tying from its absence)
    missing = [name for name in expected if name not in by_meta]
    unexpected += [by_meta[name].name for name in by_meta if name not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {_first(missing)}")
        if unexpected:
            parts.append(f"unexpected {_first(unexpected)}")
        raise CheckpointError(f"{path}: tensors do not match the LLaMA config in its header: {'; '.join(parts)}")
    for name, shape in expected.items():
        info = by_meta[name]
        if info.torch_shape != shape:
            raise CheckpointError(
                f"{path}: tensor {info.name!r} has shape {info.torch_shape}, the header's config needs {shape}; "
                "the file is corrupt or not a LLaMA model"
            )
        if info.ggml_type not in _DECODERS:
            dequantize(np.empty(0, np.uint8), info.ggml_type)  # raises UnsupportedModelError
        block = GGML_TYPES[info.ggml_type][1]
        if info.shape[0] % block:
            raise FileFormatError(f"{path}: tensor {info.name!r} rows of {info.shape[0]} are not whole {block}-blocks")
    return {name: by_meta[name] for name in expected}


def _first(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_gguf_weights(path: str | Path, header: GGUFHeader | None = None,
                      dtype: torch.dtype = torch.float32) -> GGUFWeights:
    """Read, dequantize and rename every tensor of a LLaMA GGUF file; Q/K in HF's rotate_half layout.

    Values are decoded in fp32 and each tensor is cast to `dtype` as soon as it is decoded, so the peak memory is
    the result plus one fp32 tensor.
    """
    header = header if header is not None else read_header(path)
    config = config_from_gguf_header(header)
    plan = _plan(header, config)
    try:
        data = np.memmap(header.path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise FileFormatError(f"{header.path}: cannot map the tensor data ({exc}); check the file") from exc
    if data.shape[0] != header.file_size:
        raise FileFormatError(f"{header.path}: file changed size while loading; try again")
    state: dict[str, torch.Tensor] = {}
    for name, info in plan.items():
        start = header.data_offset + info.offset
        values = dequantize(data[start:start + info.n_bytes], info.ggml_type)
        if not np.isfinite(values).all():
            raise FileFormatError(f"{header.path}: tensor {info.name!r} holds NaN or infinite values; the file is corrupt")
        matrix = values.reshape(info.torch_shape)
        if name.endswith("attention.wq.weight"):
            matrix = unpermute_rope_rows(matrix, config.n_heads)
        elif name.endswith("attention.wk.weight"):
            matrix = unpermute_rope_rows(matrix, config.n_kv_heads)
        tensor = torch.from_numpy(matrix)
        state[name] = tensor if dtype == torch.float32 else tensor.to(dtype)
    del data
    return GGUFWeights(config=config, state_dict=state, quantization=quantization_summary(header), header=header)
