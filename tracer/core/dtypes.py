"""Storage size of the number formats llmtrace budgets for: exact bytes, block scales included. Pure Python.

Block-quantized formats store `block_size` values plus one scale per block along a row (llama.cpp's layout):
int8 is Q8_0 (32 int8 values + one fp16 scale = 34 bytes per 32 values, 8.5 bits each) and int4 is Q4_0
(32 4-bit values + one fp16 scale = 18 bytes per 32 values, 4.5 bits each). fp8 (e4m3) keeps one fp32 scale
per tensor, which is negligible and not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.core.ggml_types import BLOCK_TYPES


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    value_bits: int  # bits of each stored value, scales excluded
    block_size: int = 1  # values that share one scale along a row (1 = no block scales)
    scale_bytes: int = 0  # bytes of the scale stored with each block
    description: str = ""

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.value_bits // 8 + self.scale_bytes

    @property
    def bits_per_value(self) -> float:
        """Average storage bits per value, scales included (int4: 4.5)."""
        return self.block_bytes * 8 / self.block_size

    @property
    def bytes_per_value(self) -> float:
        return self.block_bytes / self.block_size

    @property
    def is_quantized(self) -> bool:
        """Integer or fp8 storage: llama.cpp and most runtimes keep norm vectors in fp32 beside such matrices."""
        return self.value_bits <= 8

    def row_bytes(self, n_values: int) -> int:
        """Bytes of one row of `n_values`; a partial last block still stores a whole block."""
        blocks = -(-n_values // self.block_size)
        return blocks * self.block_bytes

    def matrix_bytes(self, rows: int, cols: int) -> int:
        """Bytes of a rows x cols matrix quantized along its rows (the input dimension of a linear layer)."""
        return rows * self.row_bytes(cols)


FP32 = DType("fp32", 32, description="IEEE single precision")
BF16 = DType("bf16", 16, description="bfloat16")
FP16 = DType("fp16", 16, description="IEEE half precision")
FP8 = DType("fp8", 8, description="float8 e4m3, one per-tensor scale (not counted)")
INT8 = DType("int8", 8, block_size=32, scale_bytes=2, description="int8, fp16 scale per 32 values (Q8_0)")
INT4 = DType("int4", 4, block_size=32, scale_bytes=2, description="int4, fp16 scale per 32 values (Q4_0)")

DTYPES: dict[str, DType] = {d.name: d for d in (FP32, BF16, FP16, FP8, INT8, INT4)}


def _ggml_block_dtype(name: str, block: int, block_bytes: int) -> DType:
    """A GGUF block format with its exact size: the bits per value rounded down, the rest of the block as scales
    (Q4_K: 256 values in 144 B = 4-bit values + 16 B of scales and minimums; IQ2_XXS: 2-bit + 2 B)."""
    value_bits = block_bytes * 8 // block
    return DType(name.lower(), value_bits, block_size=block, scale_bytes=block_bytes - block * value_bits // 8,
                 description=f"GGUF {name}: {block_bytes} B per {block} values")


# GGUF's other block formats (Q4_0 and Q8_0 are int4 and int8 above): storage sizes for files that use them.
GGUF_DTYPES: dict[str, DType] = {
    name.lower(): _ggml_block_dtype(name, block, block_bytes)
    for name, block, block_bytes in BLOCK_TYPES if name not in ("Q4_0", "Q8_0")
}

_ALIASES: dict[str, str] = {
    "float32": "fp32", "f32": "fp32", "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16", "f16": "fp16", "half": "fp16",
    "float8": "fp8", "fp8_e4m3": "fp8", "e4m3": "fp8",
    "q8_0": "int8", "i8": "int8",
    "q4_0": "int4", "i4": "int4",
}


def get_dtype(name: str) -> DType:
    """The dtype called `name` (case-insensitive, common aliases accepted), or a one-line error listing the choices."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in DTYPES:
        return DTYPES[key]
    if key in GGUF_DTYPES:
        return GGUF_DTYPES[key]
    raise BadArgumentError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)} (or a GGUF type: q4_k, q5_k...)")


def activation_dtype_for(weights: DType) -> DType:
    """Activations (and by default the KV cache) stay in 16-bit when the weights are quantized; else match them."""
    return FP16 if weights.is_quantized else weights
