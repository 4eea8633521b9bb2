"""The one map between formats and torch; `--dtype auto` no longer follows CPU flags."""

from __future__ import annotations

import pytest
import torch

from llmtrace.tracer.core.dtypes import AUTO, BF16, COMPUTE_DTYPES, FP16, FP32, INT4, TF32
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.hardware import dtype_policy
from llmtrace.tracer.load.loader import load_model


def test_auto_ignores_the_cpus_flags(monkeypatch: pytest.MonkeyPatch, tiny_llama_dir) -> None:
    """Which dtype is fastest is measured (tests/test_kernel_choice.py), never read off CPU flags: an AMX CPU and
    an AVX2 one load the same fp32 checkpoint the same way (fp32: the only dtype that keeps its 24 bits)."""
    for caps in ({"avx2": True}, {"amx_bf16": True, "avx512_bf16": True}):
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda caps=caps: caps)
        loaded = load_model(str(tiny_llama_dir), dtype=AUTO)
        assert next(loaded.model.parameters()).dtype == torch.float32
    assert not hasattr(dtype_policy, "auto_dtype")


def test_torch_dtypes_round_trip() -> None:
    expected = {FP32: torch.float32, BF16: torch.bfloat16, FP16: torch.float16}
    for dtype in COMPUTE_DTYPES:
        assert dtype_policy.torch_dtype(dtype) is expected[dtype]
        assert dtype_policy.dtype_of(expected[dtype]) is dtype
        assert torch.empty(0, dtype=expected[dtype]).element_size() == dtype.bytes_per_value
    assert dtype_policy.torch_dtype(TF32) is torch.float32  # fp32 storage; the tensor-core mode is a switch


def test_storage_formats_have_no_torch_dtype() -> None:
    with pytest.raises(BadArgumentError, match="int4 is a storage format.*fp32, bf16, fp16"):
        dtype_policy.torch_dtype(INT4)
    with pytest.raises(BadArgumentError, match="unknown dtype 'int8'|cannot use 'int8'"):
        dtype_policy.dtype_of(torch.int8)
