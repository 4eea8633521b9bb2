"""Compute dtypes and torch's dtypes: the one map between them.

What `--dtype auto` means is measured, not derived from CPU flags (which dtype is fastest is a property of the
machine): tracer/hardware/kernel_choice.py holds the rule, tracer/load/kernel_pick.py applies it to a model.

The formats themselves (names, aliases, sizes) live in llmtrace.tracer.core.dtypes; this is the one place that maps
them to and from torch's dtypes.
"""

from __future__ import annotations

import torch

from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, DType, get_dtype
from llmtrace.tracer.core.errors import BadArgumentError


def torch_dtype(dtype: DType) -> torch.dtype:
    """torch's dtype for a format torch computes in; BadArgumentError for a storage-only format (int4, fp8...)."""
    if dtype.torch_name is None:
        names = ", ".join(d.name for d in COMPUTE_DTYPES)
        raise BadArgumentError(f"{dtype.name} is a storage format, not one torch computes in; use one of {names}")
    return getattr(torch, dtype.torch_name)


def dtype_of(tensor_dtype: torch.dtype) -> DType:
    """The format of a torch dtype among COMPUTE_DTYPES (torch.bfloat16 -> bf16); BadArgumentError otherwise."""
    return get_dtype(str(tensor_dtype).removeprefix("torch."), COMPUTE_DTYPES)
