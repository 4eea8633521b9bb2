"""The number formats llmtrace knows, as one value type (`DType`), one alias table and one parser. Pure Python.

A dtype is parsed once, where it enters (the CLI's options, a file's type name, a trace's record), by `get_dtype`;
everything past that boundary takes a `DType`, never a string. torch's dtypes are reached through `torch_name`
(llmtrace.tracer.hardware.dtype_policy.torch_dtype), so nothing here imports torch.

Storage sizes are exact, block scales included. Block-quantized formats store `block_size` values plus one scale
per block along a row (llama.cpp's layout): int8 is Q8_0 (32 int8 values + one fp16 scale = 34 bytes per 32
values, 8.5 bits each) and int4 is Q4_0 (32 4-bit values + one fp16 scale = 18 bytes per 32 values, 4.5 bits
each). fp8 (e4m3) keeps one fp32 scale per tensor, which is negligible and not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.core.ggml_types import BLOCK_TYPES


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    value_bits: int  # bits of each stored value, scales excluded
    block_size: int = 1  # values that share one scale along a row (1 = no block scales)
    scale_bytes: int = 0  # bytes of the scale stored with each block
    description: str = ""
    aliases: tuple[str, ...] = ()  # other spellings the parser accepts (lower case)
    file_types: tuple[str, ...] = ()  # safetensors / ggml type names stored in exactly this layout
    torch_name: str | None = None  # torch.<torch_name> computes in this format; None: a storage format only

    def __str__(self) -> str:  # what --help shows as a default, and what messages print
        return self.name

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


FP32 = DType("fp32", 32, description="IEEE single precision", aliases=("float32", "f32", "float"),
             file_types=("F32",), torch_name="float32")
# tf32 is not a storage format: fp32 values multiplied on tensor cores with a 10-bit mantissa. It names a peak
# FLOP/s column of a hardware profile and a GEMM `llmtrace hardware --measure` can time; it stores as fp32.
TF32 = DType("tf32", 32, description="fp32 storage, tensor-core matmuls with a 10-bit mantissa",
             aliases=("tensorfloat32",), torch_name="float32")
BF16 = DType("bf16", 16, description="bfloat16", aliases=("bfloat16",), file_types=("BF16",), torch_name="bfloat16")
FP16 = DType("fp16", 16, description="IEEE half precision", aliases=("float16", "f16", "half"),
             file_types=("F16",), torch_name="float16")
FP8 = DType("fp8", 8, description="float8 e4m3, one per-tensor scale (not counted)",
            aliases=("float8", "fp8_e4m3", "f8_e4m3", "e4m3"), file_types=("F8_E4M3",))
INT8 = DType("int8", 8, block_size=32, scale_bytes=2, description="int8, fp16 scale per 32 values (Q8_0)",
             aliases=("q8_0", "i8"), file_types=("Q8_0",))
INT4 = DType("int4", 4, block_size=32, scale_bytes=2, description="int4, fp16 scale per 32 values (Q4_0)",
             aliases=("q4_0", "i4"), file_types=("Q4_0",))

# The storage formats llmtrace budgets weights and KV caches in, smallest bits last (the order tables show).
DTYPES: dict[str, DType] = {d.name: d for d in (FP32, BF16, FP16, FP8, INT8, INT4)}
# The formats torch computes in: what `run` accepts and what a model's parameters can be.
COMPUTE_DTYPES: tuple[DType, ...] = (FP32, BF16, FP16)



def _ggml_block_dtype(name: str, block: int, block_bytes: int) -> DType:
    """A GGUF block format with its exact size: the bits per value rounded down, the rest of the block as scales
    (Q4_K: 256 values in 144 B = 4-bit values + 16 B of scales and minimums; IQ2_XXS: 2-bit + 2 B)."""
    value_bits = block_bytes * 8 // block
    return DType(name.lower(), value_bits, block_size=block, scale_bytes=block_bytes - block * value_bits // 8,
                 description=f"GGUF {name}: {block_bytes} B per {block} values", file_types=(name,))


# GGUF's other block formats (Q4_0 and Q8_0 are int4 and int8 above): storage sizes for files that use them, by
# their lower-case names (q4_1, q4_k, iq4_xs...).
GGUF_DTYPES: dict[str, DType] = {
    name.lower(): _ggml_block_dtype(name, block, block_bytes)
    for name, block, block_bytes in BLOCK_TYPES if name not in ("Q4_0", "Q8_0")
}

# The one alias table: every name and alias of every format, lower case -> the format.
_BY_NAME: dict[str, DType] = {
    key: d for d in (FP32, TF32, BF16, FP16, FP8, INT8, INT4, *GGUF_DTYPES.values()) for key in (d.name, *d.aliases)
}
# Checkpoint type names -> the format with exactly that layout (safetensors' I8 has none: no entry).
_BY_FILE_TYPE: dict[str, DType] = {t: d for d in _BY_NAME.values() for t in d.file_types}


def get_dtype(name: str | DType, among: Iterable[DType] | None = None, refusal: str = "cannot use") -> DType:
    """The format called `name` (case-insensitive, aliases accepted), one of `among` (default: every storage format:
    DTYPES and GGUF_DTYPES); otherwise BadArgumentError, one line naming the choices ("<refusal> 'tf32'; choose one
    of ..." for a known format not among them). A DType passes through, after the same check."""
    if among is None:
        choices = (*DTYPES.values(), *GGUF_DTYPES.values())
        listed = f"{', '.join(DTYPES)} (or a GGUF block type: q4_1, q4_k, q6_k...)"
    else:
        choices = tuple(among)
        listed = ", ".join(d.name for d in choices)
    found = name if isinstance(name, DType) else _BY_NAME.get(name.strip().lower())
    if found is None or found not in choices:
        raise _not_one_of(name, found, refusal, listed)
    return found


def _not_one_of(name: str | DType, found: DType | None, refusal: str, listed: str) -> BadArgumentError:
    what = "unknown dtype" if found is None else refusal
    return BadArgumentError(f"{what} {str(name)!r}; choose one of {listed}")


def dense_name(torch_dtype: object) -> str:
    """A torch dtype's short name, as a dense weight's format says it ("fp32", "bf16", "fp16"; torch's own else)."""
    name = str(torch_dtype).removeprefix("torch.")
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(name, name)


def dtype_of_file_type(type_name: str) -> DType | None:
    """The format whose layout a checkpoint's tensor type has exactly ("BF16" is bf16, "Q8_0" int8, "Q4_K" q4_k), or
    None (safetensors' I8: no scales, no llmtrace format)."""
    return _BY_FILE_TYPE.get(type_name)


def activation_dtype_for(weights: DType) -> DType:
    """Activations (and by default the KV cache) stay in 16-bit when the weights are quantized; else match them."""
    return FP16 if weights.is_quantized else weights


class AutoDtype:
    """`--dtype auto`: the fastest compute format that keeps results close to fp32 on the device that runs, chosen
    by the engine (measured: llmtrace.tracer.load.kernel_pick) once the model and device are known. One instance, AUTO
    (a plain class: a dataclass costs the analytical commands' start-up a compile for one constant)."""

    __slots__ = ()
    name = "auto"

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return "AUTO"


AUTO = AutoDtype()


def get_compute_dtype(name: str | DType | AutoDtype) -> DType | AutoDtype:
    """`auto` or a format torch computes in (fp32, bf16, fp16): `run`'s --dtype, parsed by the same table."""
    if isinstance(name, AutoDtype) or (isinstance(name, str) and name.strip().lower() == AUTO.name):
        return AUTO
    found = name if isinstance(name, DType) else _BY_NAME.get(name.strip().lower())
    if found is None or found not in COMPUTE_DTYPES:
        raise _not_one_of(name, found, "cannot compute in", ", ".join([AUTO.name, *(d.name for d in COMPUTE_DTYPES)]))
    return found
