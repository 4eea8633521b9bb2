"""Which compute dtype `auto` means on this machine, from what was measured (BENCHMARKS.md, "Model speed").

On CPUs that multiply bf16 in hardware (AMX or AVX-512 BF16) bf16 GEMMs ran 4x fp32 and bf16 decode beat fp32 by
1.16x on the bundled model; with AVX2-only kernels bf16 prefill ran 5x slower than fp32 and decode slower too.
So `auto` is bf16 where the hardware has bf16 arithmetic, fp32 elsewhere.
"""

from __future__ import annotations

import torch

AUTO = "auto"


def cpu_has_native_bf16() -> bool:
    """AMX tiles or AVX-512 BF16, as torch's CPU capability probe reports them."""
    try:
        caps = torch.cpu.get_capabilities()
    except (AttributeError, RuntimeError):  # older torch: no probe, assume the slow path
        return False
    return bool(caps.get("amx_bf16") or caps.get("avx512_bf16"))


def auto_dtype(device: str | torch.device) -> str:
    """The fastest dtype that keeps results close to fp32 on `device` ('fp32' or 'bf16')."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    if kind == "cpu":
        return "bf16" if cpu_has_native_bf16() else "fp32"
    return "fp32"  # mps and others: fp32 until measured


def resolve_dtype(name: str | torch.dtype, device: str | torch.device) -> str | torch.dtype:
    """`auto` -> a concrete dtype name for `device`; anything else unchanged."""
    if isinstance(name, str) and name.strip().lower() == AUTO:
        return auto_dtype(device)
    return name
