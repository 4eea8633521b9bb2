"""How a weight matrix is held and multiplied as GGUF stores it (4- or 8-bit blocks); a dense (fp32/fp16/bf16) one is
a plain tensor, which functional.project multiplies with torch.mv (one token) or F.linear.

The one call every stored product goes through is `PackedWeight.__call__`: `weight(x)` is `x @ W.T` for x (..., K) of
any float dtype, returning (..., N) in x's dtype, whatever the format. So the model, the fused path and a measurement
of the machine's kernels (issue 12, item 2) all time and run the same thing.

Formats (WeightFormat, frozen; `name` is stable and goes into traces):
- "q4_0", "q4_1", "q4_k" (GGUF Q4_0, Q4_1, Q4_K): 4-bit values q in 0..15 with one scale and one zero per 32
  values along K, value = (q - 8) * scale + zero, which is torch's int4 weight-only layout (group size 32):
    Q4_0  d*(q-8)               scale d,     zero 0
    Q4_1  d*q + m               scale d,     zero m + 8d
    Q4_K  d*sc*q - dmin*m       scale d*sc,  zero 8*d*sc - dmin*m   (per 32-value sub-block of a 256 super-block)
  The scale and zero are computed in fp32 from the file's fp16 fields (d*sc is exact: 11-bit times 6-bit).
- "q8_0" (GGUF Q8_0): int8 q with one fp16 scale d per 32 values, value = d*q.
- "q5_0", "q5_1", "q5_k", "q6_k" (GGUF Q5_0, Q5_1, Q5_K, Q6_K): only the "native" kernel runs them (the rest of a
  Q4_K_M or Q5_K_M file, so such files run wholly as stored).

Kernels (the `kernel` field; what runs the product):
- "native": llmtrace's own C kernel (llmtrace.tracer.model.native_kernel, compiled on first use) over the GGUF's
  block bytes as the file holds them: each block dequantized in registers to exactly gguf.quants.dequantize's
  values and multiplied with fp32 activations in fp32 (other activation dtypes are cast to fp32 and back). Every
  format above. Listed first by `stored_kernels` when it can be built here; when it cannot (no C compiler), the
  reason is `native_kernel.unavailable_reason()` and the other kernels remain.
- "i8dot": the same C library's integer kernel (native_kernel; native/int8_dot.c) over the same block bytes: the
  activations rounded to int8 per 32 values (scale max|x|/127, round to nearest), then integer dot products with the
  blocks' codes and one multiply-add with the two scales per block, as llama.cpp's CPU kernels do: ~2.5x fewer
  instructions per block than "native", so a one-token product streams at the memory's pace instead of the core's.
  NOT exact: each activation moves by up to half its block's step, so a product's error is at most
  sum over blocks of (max|x|/254) * sum|w|. Its precision is not declared (kernel_choice.KERNEL_BITS): the kernel
  choice's accuracy probe admits it per matrix format, so a Q4 model's matrices may run it while a Q8_0 LM head,
  which needs 11 significand bits, goes to "i16dot" or "native" (a per-type plan "Q4_1:i8dot,Q8_0:i16dot"). Listed
  before "native" (fastest known first): a per-type plan takes, for each type, the first kernel the probe accepts.
- "i16dot" (Q8_0 and Q6_K): the same library's int16 kernel (native/int16_dot.c): the activations rounded to int16 per
  32 values (scale max|x|/32767, round to nearest even), the blocks' codes (Q8_0's int8, Q6_K's 6 bits - 32) widened to
  int16 and multiplied with them into exact int32 sums (vpmaddwd), one fp32 multiply-add with the scales per block (per
  16 values for Q6_K): ~10 instructions per 32 Q8_0 values where "native" takes ~18. NOT exact either, but 258x closer
  than i8dot: a product's error is at most sum over blocks of (max|x|/65534) * sum|w|. It too declares no precision: the
  probe admits it per format (a Q8_0 matrix's 11 bits, a Q6_K one's 9, on the model's own matrices). Listed between
  "i8dot" and "native".
- "int4pack": torch's int4 weight-only kernel, run in bf16 (the scales and zeros are rounded to bf16, the activations
  cast to bf16 and the result cast back): on the CPU _weight_int4pack_mm_for_cpu over
  _convert_weight_to_int4pack_for_cpu's layout, on CUDA _weight_int4pack_mm over _convert_weight_to_int4pack's
  (INT4_OPS: the two differ only in how the codes are handed to the repacking op; the scale/zero table above holds
  for both). Q8_0 goes through it as two 4-bit planes (hi and lo nibble of q + 128) side by side along K.
- "blocks": the blocks dequantized to x's dtype right before the product, in row tiles that stay in cache, so
  memory traffic is the stored bytes (plus the tile, which stays in L2).
- "dense": no PackedWeight: --weights' name for matrices dequantized to plain tensors (torch.mv / F.linear).

Devices: the native library's kernels run on the CPU only (C over host memory); the torch kernels ("int4pack",
"blocks", "dense") on the CPU and CUDA (TORCH_KERNEL_DEVICES), the same code on both but for INT4_OPS' one entry
per device. `PackedWeight.to(device)` moves a torch kernel's weight (its int4 layout is made on first use there).

`pack_gguf(rows, ggml_type, kernel)` turns a GGUF tensor's raw blocks (N rows of K values each) into a
PackedWeight; `stored_kernels(ggml_type)` says which kernels can run a ggml type as stored (empty: dequantize it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F

from llmtrace.tracer.core.errors import HardwareError
from llmtrace.tracer.core.ggml_types import GGML_TYPES
from llmtrace.tracer.model import native_kernel

GROUP = 32  # values per scale along K, for every block format here

# ggml type codes (ggml.h enum ggml_type)
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0, _Q4_K, _Q5_K, _Q6_K = 2, 3, 6, 7, 8, 12, 13, 14

NATIVE, I8DOT, I16DOT, INT4PACK, BLOCKS, DENSE = "native", "i8dot", "i16dot", "int4pack", "blocks", "dense"
# The native library's kernels: the file's block bytes held as they are (rows of "blocks"), multiplied in C.
BLOCK_KERNELS = (I8DOT, I16DOT, NATIVE)
# Every stored kernel, fastest known first: stored_kernels lists a type's in this order
STORED_KERNELS = (I8DOT, I16DOT, NATIVE, INT4PACK, BLOCKS)
# How each of the native library's kernels takes the activations (a row block's description in C)
_ACTIVATIONS = {NATIVE: native_kernel.EXACT_X, I8DOT: native_kernel.INT8_X, I16DOT: native_kernel.INT16_X}


def reads_groups(ggml_type: int, activations: int) -> bool:
    """Whether a row block's products read its rows interleaved in sixteens (native_kernel.GROUP_ROWS): i8dot's
    (activations native_kernel.INT8_X) Q4_0 and Q4_1 (native/int8_groups.c), in a library built with the AVX2 kernels
    (the portable C loops read the rows as they are, so no copy is made for them)."""
    return activations == native_kernel.INT8_X and ggml_type in native_kernel.GROUPED_TYPES \
        and native_kernel.library().avx2


def runs_blocks(kernel: str) -> bool:
    """Whether a format's kernel is the native library's over the file's blocks: "native", "i8dot", "i16dot", or row
    blocks stacked from several ("i8dot+native": a Q4_K_M file's Q4_K rows on i8dot beside its Q6_K rows on native)."""
    return all(part in BLOCK_KERNELS for part in kernel.split("+"))


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """How one weight matrix is held and which kernel multiplies it.

    name: "fp32", "fp16", "bf16" (dense) or "q4_0", "q4_1", "q4_k", "q8_0", "q5_0", "q5_1", "q5_k", "q6_k" (as the
    GGUF stores it); kernel: "dense", "native", "i8dot", "i16dot", "int4pack" or "blocks" ("i8dot+native" for row
    blocks stacked from several); stored: the file's type name ("Q4_1",
    "F16"...) or "" for a dense
    tensor not read from a GGUF; stored_bits: bits per value as stored (Q4_1 5.0, Q4_K 4.5, fp32 32).
    """

    name: str
    kernel: str
    stored: str = ""
    stored_bits: float = 0.0

    @property
    def label(self) -> str:
        """For one-line displays: "q4_1 (int4pack)", "fp32"."""
        return self.name if self.kernel == DENSE else f"{self.name} ({self.kernel})"


_BITS = {name: block_bytes * 8 / block for name, block, block_bytes in GGML_TYPES.values()}
_BY_TYPE = {_Q4_0: "q4_0", _Q4_1: "q4_1", _Q4_K: "q4_k", _Q8_0: "q8_0", _Q5_0: "q5_0", _Q5_1: "q5_1",
            _Q5_K: "q5_k", _Q6_K: "q6_k"}
_CODES = {name: code for code, (name, _, _) in GGML_TYPES.items()}  # "Q4_1" -> 3
_TORCH_TYPES = (_Q4_0, _Q4_1, _Q4_K, _Q8_0)  # what "int4pack" and "blocks" run


# Where each kernel runs: llmtrace's C library reads host memory; torch's kernels wherever the project runs torch
# (the CPU and CUDA: the devices --device offers that a measurement times, tracer/load/kernel_pick.py)
TORCH_KERNEL_DEVICES = ("cpu", "cuda")


def runs_on(kernel: str, device_type: str) -> bool:
    """Whether `kernel` (one kernel's name) multiplies on a device of `device_type` ("cpu", "cuda", ...): a dense
    product on any device torch runs."""
    if kernel == DENSE:
        return True
    return device_type == "cpu" if kernel in BLOCK_KERNELS else device_type in TORCH_KERNEL_DEVICES


def device_refusal(kernels: Iterable[str], device_type: str) -> str:
    """"" when every kernel named runs on `device_type`, else one line naming the first that does not and what to
    use instead there (the loader's refusal of a --weights plan, and PackedWeight.to's)."""
    for kernel in kernels:
        if runs_on(kernel, device_type):
            continue
        usable = [k for k in (INT4PACK, BLOCKS, DENSE) if runs_on(k, device_type)]
        instead = f"{', '.join(usable[:-1])} or {usable[-1]}" if len(usable) > 1 else usable[0]
        what = ("is llmtrace's C library, which runs on the CPU only" if kernel in BLOCK_KERNELS
                else f"runs on {' and '.join(TORCH_KERNEL_DEVICES)} only")
        return f"the {kernel} kernel {what}; on {device_type} use --weights {instead}"
    return ""


def stored_kernels(ggml_type: int, device_type: str = "cpu") -> tuple[str, ...]:
    """The kernels that multiply a ggml type as stored on a `device_type` device, fastest-known first; () when it
    must be dequantized. "i8dot", "i16dot" (Q8_0, Q6_K) and "native" are listed only on the CPU and when the library
    can be built here (asking builds it once: a second)."""
    kernels = []
    if ggml_type in native_kernel.TYPES and device_type == "cpu" and native_kernel.available():
        kernels = [I8DOT, I16DOT, NATIVE] if ggml_type in native_kernel.INT16_TYPES else [I8DOT, NATIVE]
    if ggml_type in _TORCH_TYPES and device_type in TORCH_KERNEL_DEVICES:
        kernels += [INT4PACK, BLOCKS]
    return tuple(kernels)


# ---- torch's int4 kernel, per device ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Int4Ops:
    """torch's int4 weight-only kernel on one device type. Both devices' kernels compute
    sum over k of x[m, k] * ((q[n, k] - 8) * scale + zero), scale and zero per 32 values along K, from
    scales_and_zeros (K/32, N', 2) bf16 and bf16 activations (M, K) -> (M, N'); they differ in how the (N, K) codes
    q (0..15) are handed to the repacking op (`codes`), in how many rows the packing rounds N to (`row_multiple`: the
    result's columns past N are sliced off) and in the repacking op's tiling argument (`inner_k_tiles`, from K)."""

    codes: Callable[[torch.Tensor], torch.Tensor]  # (N', K) int32 codes -> the repacking op's input
    convert: Callable[[torch.Tensor, int], torch.Tensor]  # (that input, inner_k_tiles) -> the kernel's layout
    mm: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]  # (x, layout, 32, scales and zeros)
    row_multiple: int
    inner_k_tiles: Callable[[int], int]  # K -> the tiling argument


def _high_nibble_first(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes -> (N, K/2) uint8, byte j = codes[2j] << 4 | codes[2j+1]: what the CUDA repacking op reads
    (int4mm.cu's matrix_to_m16n8k16_Bint4_layout takes byte j's high nibble as value 2j; PyTorch's test_linalg
    _group_quantize_tensor packs `out[::, ::2] << 4 | out[::, 1::2]` for every device but the CPU)."""
    return (codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8)


def _cuda_inner_k_tiles(k: int) -> int:
    """The widest tiling the CUDA op takes for K: it accepts 2, 4 or 8 k-tiles of 16 per packed word group and needs
    K a multiple of that times 16 (int4mm.cu: `isEvenDivisor(in.size(1) * 2, innerKTiles * kKTileSize)`); 8 makes
    the kernel's loads 16 bytes wide. K is always a multiple of 32 here (GROUP), so 2 always fits."""
    return next(tiles for tiles in (8, 4, 2) if k % (tiles * 16) == 0)


# The two ops per device (PyTorch aten/src/ATen/native/cuda/int4mm.cu, torch/_meta_registrations.py, checked against
# torch 2.13's meta functions): CPU: _convert_weight_to_int4pack_for_cpu(int32 (N, K), 1) -> uint8 (N, K/2), and
# _weight_int4pack_mm_for_cpu -> (M, N). CUDA: _convert_weight_to_int4pack(uint8 (N, K/2), t) -> int32
# (N/8, K/(16t), 32, t/2), and _weight_int4pack_mm(x bf16 (M, K) contiguous, that, 32, scales_and_zeros bf16
# (K/32, 8*ceil(N/8), 2)) -> bf16 (M, 8*ceil(N/8)); its kernel dequantizes (bf16(q) - 8) * scale + zero with bf16
# fma (the "int4 value in [-8, 7]" of BLayout_TC_int4), and is built for sm_80 and later only.
INT4_OPS = {
    "cpu": Int4Ops(codes=lambda codes: codes, convert=torch.ops.aten._convert_weight_to_int4pack_for_cpu,
                   mm=torch.ops.aten._weight_int4pack_mm_for_cpu, row_multiple=16, inner_k_tiles=lambda k: 1),
    "cuda": Int4Ops(codes=_high_nibble_first, convert=torch.ops.aten._convert_weight_to_int4pack,
                    mm=torch.ops.aten._weight_int4pack_mm, row_multiple=16,  # 8 on NVIDIA; ROCm's repack tiles 16
                    inner_k_tiles=_cuda_inner_k_tiles),
}


def int4_refusal(device: torch.device) -> str:
    """"" when torch's int4 kernel runs on `device`, else why not, in one line: a device without INT4_OPS, or a GPU
    older than the kernel (int4mm.cu compiles it for __CUDA_ARCH__ >= 800 only, and fails at run time below)."""
    if device.type not in INT4_OPS:
        return device_refusal([INT4PACK], device.type)
    major, minor = torch.cuda.get_device_capability(device) if device.type == "cuda" else (8, 0)
    if (major, minor) < (8, 0):
        return (f"the int4pack kernel needs a GPU of compute capability 8.0 or later (PyTorch builds it for those "
                f"only), this one is {major}.{minor}; use --weights blocks or dense")
    return ""


def runs_here(kernel: str, device: torch.device) -> bool:
    """Whether `kernel` multiplies on this very device: runs_on its kind, and int4pack only on a GPU new enough."""
    return runs_on(kernel, device.type) and (kernel != INT4PACK or not int4_refusal(device))


def int4_ops(device: torch.device) -> Int4Ops:
    """The int4 kernel's ops for tensors on `device`; HardwareError where it does not run (int4_refusal)."""
    refusal = int4_refusal(device)
    if refusal:
        raise HardwareError(refusal)
    return INT4_OPS[device.type]


def int4_layout(codes_of: Callable[[int, int], torch.Tensor], rows: int, scale: torch.Tensor, zero: torch.Tensor,
                ops: Int4Ops) -> tuple[torch.Tensor, torch.Tensor]:
    """The N = `rows` rows' codes (codes_of(start, stop): int32 (stop - start, K), 0..15) and (N, K/32) fp32 scales
    and zeros -> (the kernel's layout, scales_and_zeros (K/32, N', 2) bf16), N' = N rounded up to ops.row_multiple
    with zero rows (the kernels take no ragged N). The codes are widened to int32 a few MB of rows at a time: for an
    LM head of 128k rows whole they would take GBs of a GPU's memory just to be packed into half a byte each."""
    k = scale.shape[1] * GROUP
    step = max(1, _CODE_VALUES // k)
    handed = torch.cat([ops.codes(codes_of(start, min(rows, start + step))) for start in range(0, rows, step)])
    pad = -rows % ops.row_multiple
    packed = ops.convert(F.pad(handed, (0, 0, 0, pad)).contiguous(), ops.inner_k_tiles(k))
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1)  # (K/32, N, 2)
    return packed, F.pad(scales_zeros, (0, 0, 0, pad)).to(torch.bfloat16).contiguous()


_CODE_VALUES = 1 << 22  # codes widened to int32 at once by int4_layout: 16 MB


def int4_product(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, rows: int, ops: Int4Ops
                 ) -> torch.Tensor:
    """x (M, K) bf16 -> x @ W.T (M, rows) bf16 through the kernel (its padding rows sliced off)."""
    out = ops.mm(x.contiguous(), packed, GROUP, scales_zeros)  # (M, N')
    return out[:, :rows] if out.shape[1] != rows else out


def int4_prepared(name: str, tensors: dict[str, torch.Tensor], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A "q4_*" or "q8_0" weight's tensors (PackedWeight's) in the int4 kernel's layout for their device
    (int4_layout). Q8_0 becomes two 4-bit planes side by side along K (K' = 2K): u = q + 128 = 16*hi + lo, and
    d*q = (hi - 8)*16d + ((lo - 8)*d + 8d)."""
    if name == "q8_0":
        q = tensors["int8"]  # (N, K)

        def codes_of(start: int, stop: int) -> torch.Tensor:  # (rows, 2K): the high planes, then the low
            u = q[start:stop].to(torch.int32) + 128  # 0..255
            return torch.cat([u >> 4, u & 0x0F], dim=1)

        d = tensors["scale"]  # (N, K/32)
        scale = torch.cat([16.0 * d, d], dim=1)
        zero = torch.cat([torch.zeros_like(d), 8.0 * d], dim=1)
    else:
        nibbles = tensors["nibbles"]  # (N, K/2)

        def codes_of(start: int, stop: int) -> torch.Tensor:  # (rows, K), 0..15
            return unpack_nibbles(nibbles[start:stop]).to(torch.int32)

        scale, zero = tensors["scale"], tensors["zero"]
    return int4_layout(codes_of, rows, scale, zero, int4_ops(scale.device))


# ---- the weight ------------------------------------------------------------------------------------------------


class PackedWeight:
    """One (N, K) weight matrix in a WeightFormat; `weight(x)` = x @ W.T.

    `tensors` are what the format is made of (what a cache stores and restores with `from_tensors`):
      dense:    {"weight": (N, K)}
      4-bit:    {"nibbles": (N, K/2) uint8, byte j of a row holds k = 2j (low) and 2j+1 (high),
                 "scale": (N, K/32) fp32, "zero": (N, K/32) fp32}
      q8_0:     {"int8": (N, K) int8, "scale": (N, K/32) fp32}
      native:   {"blocks": (N, bytes per row) uint8}: the file's own blocks of each row, unconverted (loaded from a
                GGUF: read into the weight arena); row blocks stacked by concat_rows keep each member's:
                {"blocks.0.Q4_K": ..., "blocks.1.Q6_K": ...}
      i8dot Q4_0/Q4_1 held in place: {"groups": (N, bytes per row) uint8}, the same bytes with every whole group of
                sixteen rows interleaved (native/int8_groups.c's order, what its products read) and the rows after the
                last whole group as stored; stacked: "groups.<i>.<type name>"
    `stored_bytes` is what the GGUF holds for this matrix (the bytes a product reads as stored).
    An i8dot Q4_0/Q4_1 row block's products read its rows interleaved in groups of sixteen (native_kernel.interleave).
    The loader holds such a matrix once, in that order ("groups": issue 31, the rows beside their copy held a 7B
    Q4_0 model twice); what needs its rows as stored (dequantize, rows, finite_scales) gathers them from their
    groups (native_kernel.group_rows). A "blocks" one (pack_gguf's rows, as tests and tools make them) gets its
    interleaved copy on its first product, held beside the rows.
    """

    __slots__ = ("format", "shape", "tensors", "stored_bytes", "_prepared", "row_blocks")

    def __init__(self, fmt: WeightFormat, shape: tuple[int, int], tensors: dict[str, torch.Tensor],
                 stored_bytes: int, parts: tuple[tuple[int, torch.Tensor], ...] | None = None,
                 activations: tuple[int, ...] | None = None,
                 groups: tuple[torch.Tensor | None, ...] | None = None) -> None:
        self.format = fmt
        self.shape = (int(shape[0]), int(shape[1]))
        self.tensors = tensors
        self.stored_bytes = int(stored_bytes)
        self._prepared: tuple[torch.Tensor, torch.Tensor] | None = None  # the int4 kernel's layout, made once
        # the native library's side of the matrix (its row blocks), for the kernels that run the file's blocks
        self.row_blocks = RowBlocks(fmt, self.shape[1], tensors, parts, activations, groups) \
            if runs_blocks(fmt.kernel) else None

    @classmethod
    def from_tensors(cls, fmt: WeightFormat, shape: tuple[int, int], tensors: dict[str, torch.Tensor],
                     stored_bytes: int) -> PackedWeight:
        """Rebuild from `tensors` (e.g. a cache entry), checking each one's shape and dtype."""
        expected = _layout(fmt, shape)
        if set(tensors) != set(expected):
            raise ValueError(f"{fmt.name} weight needs tensors {sorted(expected)}, got {sorted(tensors)}")
        for key, (want_shape, want_dtype) in expected.items():
            t = tensors[key]
            if tuple(t.shape) != want_shape or (want_dtype is not None and t.dtype != want_dtype):
                raise ValueError(f"{fmt.name} {key}: {tuple(t.shape)} {t.dtype}, needs {want_shape} {want_dtype}")
        return cls(fmt, shape, tensors, stored_bytes)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the products' inputs it was made for: fp32 (any float works)."""
        return torch.float32

    @property
    def device(self) -> torch.device:
        """Where its tensors are (all on one device)."""
        return next(iter(self.tensors.values())).device

    @property
    def resident_bytes(self) -> int:
        """Bytes held in memory for it: the canonical tensors plus the kernel's layout once made (the int4 kernel's,
        the i8dot decode kernel's interleaved rows)."""
        prepared = sum(t.nbytes for t in self._prepared) if self._prepared is not None else 0
        grouped = self.row_blocks.copies_bytes if self.row_blocks is not None else 0
        return sum(t.nbytes for t in self.tensors.values()) + prepared + grouped

    def __repr__(self) -> str:
        return f"PackedWeight({self.format.label}, shape={self.shape}, stored_bytes={self.stored_bytes:,})"

    def to(self, device: str | torch.device) -> PackedWeight:
        """This weight on `device`: a new PackedWeight of its tensors moved there (the int4 kernel's layout is made
        on its first product there: the layouts differ by device). The native library's kernels stay on the CPU
        (this weight itself); HardwareError for any other device, naming the kernel."""
        target = torch.device(device)
        refusal = device_refusal(self.format.kernel.split("+"), target.type)
        if refusal:
            raise HardwareError(refusal)
        if runs_blocks(self.format.kernel):
            return self
        return PackedWeight(self.format, self.shape, {k: t.to(target) for k, t in self.tensors.items()},
                            self.stored_bytes)

    # ---- the product -----------------------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> x @ W.T (..., N), in x's dtype."""
        kernel = self.format.kernel
        if runs_blocks(kernel):  # any leading shape as it is (the decode step's products are ~10 us: no reshapes)
            out = native_kernel.matmul(self.row_blocks.native or self.row_blocks.matrix(), x)  # (..., N) fp32
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.shape[1])  # (M, K)
        if kernel == INT4PACK:
            out = self._int4pack(flat)
        else:
            out = self._blocks(flat)
        return out.view(*lead, self.shape[0])

    def native_matrix(self) -> native_kernel.BlockMatrix:
        """The native kernel's description of this matrix (made once): what its products, and the native decode
        step (tracer/model/native_step.py), pass to C; each row block says its kernel (i8dot, i16dot or native)."""
        if self.row_blocks is None:
            raise ValueError(f"{self.format.label} is not held for the native library's kernels")
        return self.row_blocks.matrix()

    def _int4pack(self, x: torch.Tensor) -> torch.Tensor:
        """The int4 kernel in bf16, its fast dtype (fp16 and fp32 activations take a path ~10x slower on CPU,
        BENCHMARKS.md "Stored-precision products"); the result is cast back to x's dtype."""
        packed, scales_zeros = self._prepare()
        xb = x.to(torch.bfloat16)
        if self.format.name == "q8_0":
            xb = torch.cat([xb, xb], dim=1)  # (M, 2K): the high plane's columns, then the low plane's
        # the ops of the device the layout was made for (_prepare checked it then: no capability query a product)
        out = int4_product(xb, packed, scales_zeros, self.shape[0], INT4_OPS[packed.device.type])  # (M, N)
        return out.to(x.dtype) if x.dtype != torch.bfloat16 else out.contiguous()

    def _prepare(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int4 kernel's layout for the device the tensors are on, made once (int4_prepared)."""
        if self._prepared is None:
            self._prepared = int4_prepared(self.format.name, self.tensors, self.shape[0])
        return self._prepared

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.shape[0]
        tile = max(1, (_TILE_VALUES if x.device.type == "cpu" else _DEVICE_TILE_VALUES) // self.shape[1])
        if tile >= rows:
            return F.linear(x, self.dequantize(x.dtype))
        out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
        for start in range(0, rows, tile):
            stop = min(rows, start + tile)
            torch.matmul(x, self.dequantize(x.dtype, start, stop).t(), out=out[:, start:stop])
        return out

    # ---- values ----------------------------------------------------------------------------------------------

    def dequantize(self, dtype: torch.dtype = torch.float32, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start..stop of W as `dtype` (N', K): computed in fp32 as the formula above, then cast."""
        stop = self.shape[0] if stop is None else stop
        if self.row_blocks is not None:  # the exact values, whichever kernel multiplies them
            values = self.row_blocks.values(start, stop)
            return values if dtype == torch.float32 else values.to(dtype)
        scale = self.tensors["scale"][start:stop].unsqueeze(-1)  # (N', K/32, 1)
        if self.format.name == "q8_0":
            q = self.tensors["int8"][start:stop].view(stop - start, -1, GROUP).to(torch.float32)  # (N', K/32, 32)
            values = q.mul_(scale)
        else:
            q = unpack_nibbles(self.tensors["nibbles"][start:stop]).view(stop - start, -1, GROUP)
            values = q.to(torch.float32).sub_(8.0).mul_(scale).add_(self.tensors["zero"][start:stop].unsqueeze(-1))
        values = values.view(stop - start, self.shape[1])
        return values if dtype == torch.float32 else values.to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows `ids` (any shape) of W as `dtype`: (..., K); an embedding lookup of a stored table."""
        flat = ids.reshape(-1)
        if self.row_blocks is not None:  # exact rows (an embedding lookup rounds nothing)
            return self.row_blocks.rows(flat).view(*ids.shape, self.shape[1]).to(dtype)
        picked = {key: t.index_select(0, flat) for key, t in self.tensors.items()}
        part = PackedWeight(self.format, (flat.numel(), self.shape[1]), picked, 0)
        return part.dequantize(dtype).view(*ids.shape, self.shape[1])


class RowBlocks:
    """A matrix as the native library's kernels hold it: its row blocks, each (ggml type code, the file's bytes of
    its rows), with how its products take the activations (native_kernel.EXACT_X, INT8_X, INT16_X: its kernel),
    whether it is held interleaved in place ("groups" rather than "blocks") and its interleaved copy for the i8dot
    decode kernel (None until native_matrix makes any it reads; a block held in place is its own copy: its whole
    groups' bytes); and C's description of them all, made once (`native`)."""

    __slots__ = ("parts", "in_place", "activations", "groups", "width", "native")

    def __init__(self, fmt: WeightFormat, width: int, tensors: dict[str, torch.Tensor],
                 parts: tuple[tuple[int, torch.Tensor], ...] | None = None, activations: tuple[int, ...] | None = None,
                 groups: tuple[torch.Tensor | None, ...] | None = None) -> None:
        # "blocks"/"groups", or stacked "blocks.<i>.<type name>"/"groups.<i>.<type name>" in the order of their index
        if len(tensors) == 1 and next(iter(tensors)) in ("blocks", "groups"):
            key, t = next(iter(tensors.items()))
            keyed = ((key, _CODES[fmt.stored], t),)
        else:
            stacked = sorted(tensors.items(), key=lambda kv: int(kv[0].split(".")[1]))
            keyed = tuple((key.split(".")[0], _CODES[key.split(".")[2]], t) for key, t in stacked)
        self.width = width
        self.parts = parts if parts is not None else tuple((code, t) for _, code, t in keyed)
        self.in_place = tuple(key == "groups" for key, _, _ in keyed)
        self.activations = activations if activations is not None else (
            (_ACTIVATIONS.get(fmt.kernel, native_kernel.EXACT_X),) * len(self.parts))
        self.groups = tuple(
            blocks.view(-1)[:native_kernel.grouped_bytes(code, blocks.shape[0], width)] if held else grouped
            for (code, blocks), held, grouped in zip(self.parts, self.in_place,
                                                      groups if groups is not None else (None,) * len(self.parts),
                                                      strict=True))
        self.native: native_kernel.BlockMatrix | None = None

    @property
    def copies_bytes(self) -> int:
        """Bytes of the interleaved copies held beside the rows (a block held in place has none)."""
        return sum(t.nbytes for t, held in zip(self.groups, self.in_place) if t is not None and not held)

    def matrix(self) -> native_kernel.BlockMatrix:
        """C's description of the matrix, made once, with the interleaved copies the i8dot decode kernel reads."""
        if self.native is None:
            self.groups = tuple(
                grouped if grouped is not None or not reads_groups(code, kind)
                else native_kernel.interleave(code, blocks, self.width)
                for (code, blocks), kind, grouped in zip(self.parts, self.activations, self.groups, strict=True))
            self.native = native_kernel.BlockMatrix(list(self.parts), self.width, self.activations, self.groups)
        return self.native

    def values(self, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop, exact, fp32 (N', K): each row block's rows in the range, gathered from their groups
        where a block is held interleaved."""
        pieces, first = [], 0
        for (code, blocks), held in zip(self.parts, self.in_place):
            lo, hi = max(start - first, 0), min(stop - first, blocks.shape[0])
            if lo < hi:
                rows = native_kernel.group_rows(code, blocks, self.width, torch.arange(lo, hi)) if held \
                    else blocks[lo:hi]
                pieces.append(native_kernel.dequantize(code, rows, self.width))
            first += blocks.shape[0]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces) if pieces else torch.empty(0, self.width)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows `ids` (1-D), exact, fp32 (ids, K): decoded alone from a single row block."""
        if len(self.parts) > 1:
            return self.values(0, sum(blocks.shape[0] for _, blocks in self.parts))[ids]
        code, blocks = self.parts[0]
        if self.in_place[0]:  # the rows gathered from their groups, then decoded
            return native_kernel.dequantize(code, native_kernel.group_rows(code, blocks, self.width, ids), self.width)
        return native_kernel.dequantize(code, blocks, self.width, ids)


class ExpertWeights:
    """A mixture of experts' E (N, K) matrices as a GGUF's 3-D ffn_*_exps tensor stores them: (E*N) rows of blocks,
    expert e's rows e*N..(e+1)*N one contiguous byte range, each expert a PackedWeight over its range (a view: one
    copy of the file's bytes in all). `experts[e](x)` multiplies by expert e through the stored kernel, as llama.cpp's
    mul_mat_id points each chosen expert's product at its slice of the one tensor. `stored_bytes` is the whole
    tensor's (E x one expert's): a product reads one expert's, `stored_bytes // E` (tracer/trace/stage_cost.py)."""

    __slots__ = ("experts", "format", "shape", "stored_bytes")

    def __init__(self, experts: tuple[PackedWeight, ...]) -> None:
        first = experts[0]
        if any(w.shape != first.shape or w.format != first.format for w in experts):
            raise ValueError("experts of one tensor differ in shape or format")
        self.experts = experts
        self.format = first.format
        self.shape = (len(experts), *first.shape)  # (E, N, K)
        self.stored_bytes = sum(w.stored_bytes for w in experts)

    def __getitem__(self, expert: int) -> PackedWeight:
        return self.experts[expert]

    def __len__(self) -> int:
        return len(self.experts)

    def __repr__(self) -> str:
        return f"ExpertWeights({self.format.label}, shape={self.shape}, stored_bytes={self.stored_bytes:,})"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """All E matrices as `dtype` (E, N, K): exact values (PackedWeight.dequantize)."""
        return torch.stack([w.dequantize(dtype) for w in self.experts])


# Rows per tile of the "blocks" kernel: this many values of fp32 (1 MiB) stay in L2 between dequantize and product.
_TILE_VALUES = 1 << 18
# On a GPU each tile is a few kernel launches: tiles of 16M values (32 MB in bf16) keep their count to a few per
# matrix, the temporary far below a card's memory.
_DEVICE_TILE_VALUES = 1 << 24


def _layout(fmt: WeightFormat, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    n, k = shape
    if runs_blocks(fmt.kernel):
        if fmt.stored not in _CODES:
            raise ValueError(f"{fmt.name}: row blocks of several formats are not rebuilt from tensors")
        code = _CODES[fmt.stored]
        _, block, block_bytes = GGML_TYPES[code]
        # i8dot's Q4_0/Q4_1 as the loader holds them (interleaved in place), where this library reads that order
        key = "groups" if fmt.kernel == I8DOT and code in native_kernel.GROUPED_TYPES and native_kernel.available() \
            and reads_groups(code, native_kernel.INT8_X) else "blocks"
        return {key: ((n, k // block * block_bytes), torch.uint8)}
    if fmt.name == "q8_0":
        return {"int8": ((n, k), torch.int8), "scale": ((n, k // GROUP), torch.float32)}
    return {"nibbles": ((n, k // 2), torch.uint8), "scale": ((n, k // GROUP), torch.float32),
            "zero": ((n, k // GROUP), torch.float32)}


def unpack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) uint8 in 0..15: byte j holds k = 2j in its low nibble, 2j+1 in its high one."""
    return torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-1).view(nibbles.shape[0], -1)


def concat_rows(weights: list[PackedWeight]) -> PackedWeight:
    """Row blocks of one format stacked into one matrix (wq|wk|wv, w1|w3: one product instead of several). The
    native kernel's are not copied, and may mix formats (a Q4_K_M file's Q4_K wq, wk and Q6_K wv): it multiplies
    every member's blocks in place in one call, each row block with its own kernel (i8dot, i16dot or native)."""
    first = weights[0]
    shape = (sum(w.shape[0] for w in weights), first.shape[1])
    stored = sum(w.stored_bytes for w in weights)
    if runs_blocks(first.format.kernel):
        if any(not runs_blocks(w.format.kernel) or w.shape[1] != first.shape[1] for w in weights):
            raise ValueError("concat_rows needs native-library weights of one input width")
        parts = tuple(part for w in weights for part in w.row_blocks.parts)
        activations = tuple(kind for w in weights for kind in w.row_blocks.activations)
        groups = tuple(grouped for w in weights for grouped in w.row_blocks.groups)
        formats = list(dict.fromkeys(w.format for w in weights))
        kernels = "+".join(dict.fromkeys(k for f in formats for k in f.kernel.split("+")))
        fmt = formats[0] if len(formats) == 1 else WeightFormat(
            "+".join(dict.fromkeys(f.name for f in formats)), kernels,
            "+".join(dict.fromkeys(f.stored for f in formats)), stored * 8 / (shape[0] * shape[1]))
        in_place = tuple(held for w in weights for held in w.row_blocks.in_place)
        tensors = {"groups" if in_place[0] else "blocks": parts[0][1]} if len(parts) == 1 else {
            f"{'groups' if held else 'blocks'}.{i}.{GGML_TYPES[code][0]}": t
            for i, ((code, t), held) in enumerate(zip(parts, in_place))}
        return PackedWeight(fmt, shape, tensors, stored, parts, activations, groups)
    if any(w.format != first.format or w.shape[1] != first.shape[1] for w in weights):
        raise ValueError("concat_rows needs weights of one format and one input width")
    tensors = {key: torch.cat([w.tensors[key] for w in weights]) for key in first.tensors}
    return PackedWeight(first.format, shape, tensors, stored)


# ---- from a GGUF's blocks -------------------------------------------------------------------------------------


def gguf_format(ggml_type: int, kernel: str) -> WeightFormat:
    """The stored format of a ggml type under `kernel` (one of stored_kernels(ggml_type))."""
    if kernel not in stored_kernels(ggml_type):
        raise ValueError(f"no {kernel!r} kernel for ggml type {ggml_type}")
    type_name, _, _ = GGML_TYPES[ggml_type]
    return WeightFormat(_BY_TYPE[ggml_type], kernel, type_name, _BITS[type_name])


def pack_gguf(rows: np.ndarray, ggml_type: int, row_len: int, kernel: str,
              groups: torch.Tensor | None = None, interleaved: bool = False) -> PackedWeight:
    """A GGUF tensor's raw blocks -> PackedWeight. `rows` is uint8 (N, bytes per row), each row `row_len` values
    (the file's order: Q/K rows already put in the model's order by the caller). "native" keeps `rows` itself
    (no copy when it is contiguous and writable, e.g. a copy-on-write map of the file; a read-only one is copied).
    `groups`: for i8dot Q4_0/Q4_1, `rows` already interleaved (native_kernel.interleave) where the caller wants them
    held (else they are made on the first product). `interleaved`: `rows` is such a matrix held in place (its whole
    groups interleaved, the rows after them as stored: PackedWeight's "groups"), its only copy."""
    fmt = gguf_format(ggml_type, kernel)
    rows = np.ascontiguousarray(rows)
    n = rows.shape[0]
    _, block, block_bytes = GGML_TYPES[ggml_type]
    if row_len % block or rows.shape[1] != row_len // block * block_bytes:
        raise ValueError(f"rows of {rows.shape[1]} bytes do not hold {row_len} values of {fmt.stored}")
    if interleaved and not (kernel == I8DOT and reads_groups(ggml_type, native_kernel.INT8_X)):
        raise ValueError(f"{fmt.stored} under {kernel} is not read interleaved here")
    if kernel in BLOCK_KERNELS:
        blocks = rows if rows.flags.writeable else rows.copy()
        return PackedWeight(fmt, (n, row_len), {"groups" if interleaved else "blocks": torch.from_numpy(blocks)},
                            rows.nbytes, groups=None if groups is None else (groups,))
    blocks = rows.reshape(-1, block_bytes)  # (N * K/block, block_bytes)
    if ggml_type == _Q8_0:
        d = _fp16(blocks, 0, 1)  # (blocks, 1)
        q = blocks[:, 2:].view(np.int8)
        tensors = {"int8": torch.from_numpy(q.reshape(n, row_len).copy()),
                   "scale": torch.from_numpy(d.reshape(n, -1))}
        return PackedWeight(fmt, (n, row_len), tensors, rows.nbytes)
    if ggml_type == _Q4_0:
        d = _fp16(blocks, 0, 1)
        scale, zero = d, np.zeros_like(d)
        codes = _ggml_nibbles(blocks[:, 2:])  # (blocks, 32)
    elif ggml_type == _Q4_1:
        dm = _fp16(blocks, 0, 2)
        scale, zero = dm[:, :1], dm[:, 1:2] + 8.0 * dm[:, :1]
        codes = _ggml_nibbles(blocks[:, 4:])
    else:  # Q4_K: 256 values = 8 sub-blocks of 32
        d, dmin = _fp16(blocks, 0, 1), _fp16(blocks, 2, 1)  # (blocks, 1) each
        sc, m = _q4_k_scale_min(blocks[:, 4:16])  # (blocks, 8) each
        scale = d * sc  # (blocks, 8)
        zero = 8.0 * scale - dmin * m
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & 0x0F).reshape(-1, 32)  # (blocks*8, 32): chunk i's low nibbles, then its high ones
    codes = codes.reshape(n, row_len)
    nibbles = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # (N, K/2)
    tensors = {"nibbles": torch.from_numpy(np.ascontiguousarray(nibbles)),
               "scale": torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(n, -1)),
               "zero": torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32).reshape(n, -1))}
    return PackedWeight(fmt, (n, row_len), tensors, rows.nbytes)


# Byte offsets of each block's fp16 fields (scales, mins) per type (ggml-common.h).
_FP16_FIELDS = {_Q4_0: (0,), _Q4_1: (0, 2), _Q5_0: (0,), _Q5_1: (0, 2), _Q8_0: (0,), _Q4_K: (0, 2), _Q5_K: (0, 2),
                _Q6_K: (208,)}


def finite_scales(weight: PackedWeight) -> bool:
    """Whether every scale (and min) of a stored weight is finite: NaN or infinity there is a corrupt file. The
    native kernel's blocks are checked in place (strided fp16 views of the bytes; nothing is decoded)."""
    if not runs_blocks(weight.format.kernel):
        return all(bool(torch.isfinite(t).all()) for t in weight.tensors.values() if t.is_floating_point())
    code = _CODES[weight.format.stored]
    if "groups" in weight.tensors:
        return grouped_scales_finite(code, weight.tensors["groups"].numpy())
    return rows_scales_finite(code, weight.tensors["blocks"].numpy())


def rows_scales_finite(code: int, rows: np.ndarray) -> bool:
    """Whether every fp16 scale and min of `rows` (uint8, whole blocks of ggml type `code` as stored) is finite."""
    _, _, block_bytes = GGML_TYPES[code]
    blocks = rows.reshape(-1, block_bytes)  # (blocks, bytes per block)
    return all(bool(np.isfinite(blocks[:, at:at + 2].view("<f2")).all()) for at in _FP16_FIELDS[code])


def grouped_scales_finite(code: int, held: np.ndarray) -> bool:
    """rows_scales_finite of a Q4_0/Q4_1 matrix held in place ((rows, bytes per row) uint8): each interleaved block
    of sixteen rows starts with their sixteen fp16 d (Q4_1: then their sixteen m), the rows after the whole groups
    are as stored."""
    rows, group = held.shape[0], native_kernel.GROUP_ROWS
    whole = rows // group * group
    _, _, block_bytes = GGML_TYPES[code]
    fields = 2 * group * len(_FP16_FIELDS[code])  # bytes of fp16 fields at the start of a group's block
    groups = held[:whole].reshape(-1, group * block_bytes)
    return bool(np.isfinite(groups[:, :fields].view("<f2")).all()) and rows_scales_finite(code, held[whole:])


def _fp16(blocks: np.ndarray, start: int, count: int) -> np.ndarray:
    """`count` fp16 fields per block from byte `start`, as float32 (blocks, count)."""
    return np.ascontiguousarray(blocks[:, start:start + 2 * count]).view("<f2").astype(np.float32)


def _ggml_nibbles(quants: np.ndarray) -> np.ndarray:
    """16 bytes per 32-value block -> (blocks, 32) codes: low nibbles are values 0-15, high nibbles 16-31."""
    return np.concatenate([quants & 0x0F, quants >> 4], axis=1)


def _q4_k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of 6-bit scales and mins -> (blocks, 8) float32 each (ggml's get_scale_min_k4)."""
    b = packed.reshape(-1, 3, 4)
    lo, hi, mixed = b[:, 0], b[:, 1], b[:, 2]
    sc = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    m = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), m.astype(np.float32)
