"""GGUF tensor data -> float32: every type the `gguf` package can dequantize, plus two measured fast paths.

`gguf.quants.dequantize` decodes every ggml type llama.cpp writes (F16/BF16, Q4_0...Q8_0, all K-quants, the IQ
types, TQ1_0/TQ2_0, MXFP4...). It is called with the tensor's rows as rows (it works on 16 rows at a time, so a
flat array of blocks would be much slower). Q4_0, Q4_1 and Q8_0 keep the hand-written numpy below: 1.3-2x faster
than gguf's, measured side by side (BENCHMARKS.md, "GGUF dequantization"), and they are the bundled model's
formats; the tests hold these fast paths bit-for-bit equal to `gguf.quants.dequantize`. F32 (a file's norms) is read as it
is, so a run that dequantizes nothing else never imports gguf. For F16 and BF16 gguf's
decoder was as fast as the hand-written numpy this module had, so that was removed.
"""

from __future__ import annotations

import numpy as np

from llmtrace.tracer.checkpoint.gguf_header import GGML_TYPES
from llmtrace.tracer.core.errors import UnsupportedModelError

# ggml type codes with special handling here (ggml.h enum ggml_type).
F32, Q4_0, Q4_1, Q8_0 = 0, 2, 3, 8


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
    """F32: the bytes are the values (what gguf returns too: a view)."""
    return raw.view("<f4")


_FAST_PATHS = {F32: _dequant_f32, Q4_0: _dequant_q4_0, Q4_1: _dequant_q4_1, Q8_0: _dequant_q8_0}
# Types every gguf this project accepts (pyproject: gguf>=0.10) decodes: checked without importing it. A default
# GGUF run dequantizes only its F32 norms, and `import gguf` costs a first run ~0.1-0.2 s (its metadata module
# imports yaml); the tests hold this set to gguf's own answer.
GGUF_DECODES = frozenset({1, 6, 7, 10, 11, 12, 13, 14, 30})  # F16, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16


def type_name(ggml_type: int) -> str:
    return GGML_TYPES[ggml_type][0] if ggml_type in GGML_TYPES else f"type code {ggml_type}"


def _gguf_type(ggml_type: int):  # noqa: ANN202 - a gguf.GGMLQuantizationType, imported lazily
    """gguf's enum member for a type it can dequantize, or None (tried on one zero block: the public API only)."""
    import gguf
    from gguf.quants import dequantize as gguf_dequantize

    try:
        qtype = gguf.GGMLQuantizationType(ggml_type)
        gguf_dequantize(np.zeros((1, GGML_TYPES[ggml_type][2]), dtype=np.uint8), qtype)
    except (ValueError, KeyError, NotImplementedError):
        return None
    return qtype


def check_decodable(ggml_type: int, tensor: str) -> None:
    """Raise UnsupportedModelError, with advice a user holding only this file can follow, unless it decodes."""
    if ggml_type in _FAST_PATHS or ggml_type in GGUF_DECODES or _gguf_type(ggml_type) is not None:
        return
    raise UnsupportedModelError(
        f"tensor {tensor!r} is stored as {type_name(ggml_type)}, which the gguf package ({_package_version('gguf')}) "
        "cannot decode; download another quantization of this model (Q4_K_M, Q8_0 or F16 GGUF) or its HF "
        "safetensors folder, or try a newer gguf (pip install -U gguf)"
    )


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "version unknown"


def dequantize(raw: np.ndarray, ggml_type: int, row_len: int, tensor: str = "tensor") -> np.ndarray:
    """Flat uint8 bytes of one tensor whose rows hold `row_len` values -> flat, writable float32 values.

    Types no decoder handles raise UnsupportedModelError (check_decodable).
    """
    if ggml_type in _FAST_PATHS:
        values = _FAST_PATHS[ggml_type](raw)
        return values if values.flags.writeable else values.copy()  # F32's view of a read-only map: copied
    import gguf
    from gguf.quants import dequantize as gguf_dequantize

    check_decodable(ggml_type, tensor)
    qtype = gguf.GGMLQuantizationType(ggml_type)

    _, block, block_bytes = GGML_TYPES[ggml_type]
    rows = raw.reshape(-1, row_len // block * block_bytes)  # (rows, bytes per row): gguf decodes 16 rows at a time
    values = np.asarray(gguf_dequantize(rows, qtype), dtype=np.float32).reshape(-1)
    # F32 comes back as a view of `raw`. The loader's are private buffers read for this tensor alone
    # (tracer/load/gguf_source.py), which the values may keep; a read-only map of a file (a benchmark's, a test's)
    # must not back a torch tensor: copy that one.
    return values if values.flags.writeable else values.copy()
