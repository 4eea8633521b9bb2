"""Compute dtypes on this machine: which one `auto` means, and the torch dtype of each format.

`auto`, from what was measured (BENCHMARKS.md, "Model speed"): on CPUs that multiply bf16 in hardware (AMX or
AVX-512 BF16) bf16 GEMMs ran 4x fp32 and bf16 decode beat fp32 by 1.16x on the bundled model; with AVX2-only
kernels bf16 prefill ran 5x slower than fp32 and decode slower too. So `auto` is bf16 where the hardware has bf16
arithmetic, fp32 elsewhere.

The formats themselves (names, aliases, sizes) live in llmtrace.tracer.core.dtypes; this is the one place that maps
them to and from torch's dtypes.
"""

from __future__ import annotations

import torch

from llmtrace.tracer.core.dtypes import BF16, COMPUTE_DTYPES, FP32, AutoDtype, DType, get_dtype
from llmtrace.tracer.core.errors import BadArgumentError


def cpu_has_native_bf16() -> bool:
    """AMX tiles or AVX-512 BF16, as torch's CPU capability probe reports them."""
    try:
        caps = torch.cpu.get_capabilities()
    except (AttributeError, RuntimeError):  # older torch: no probe, assume the slow path
        return False
    return bool(caps.get("amx_bf16") or caps.get("avx512_bf16"))


def auto_dtype(device: str | torch.device) -> DType:
    """The fastest format that keeps results close to fp32 on `device` (fp32 or bf16)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return BF16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else FP32
    if kind == "cpu":
        return BF16 if cpu_has_native_bf16() else FP32
    return FP32  # mps and others: fp32 until measured


def resolve_dtype(choice: DType | AutoDtype, device: str | torch.device) -> DType:
    """`auto` -> the concrete format for `device`; a format passes through."""
    return auto_dtype(device) if isinstance(choice, AutoDtype) else choice


def torch_dtype(dtype: DType) -> torch.dtype:
    """torch's dtype for a format torch computes in; BadArgumentError for a storage-only format (int4, fp8...)."""
    if dtype.torch_name is None:
        names = ", ".join(d.name for d in COMPUTE_DTYPES)
        raise BadArgumentError(f"{dtype.name} is a storage format, not one torch computes in; use one of {names}")
    return getattr(torch, dtype.torch_name)


def dtype_of(tensor_dtype: torch.dtype) -> DType:
    """The format of a torch dtype among COMPUTE_DTYPES (torch.bfloat16 -> bf16); BadArgumentError otherwise."""
    return get_dtype(str(tensor_dtype).removeprefix("torch."), COMPUTE_DTYPES)
