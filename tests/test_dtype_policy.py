"""`--dtype auto`: bf16 only where the CPU multiplies bf16 in hardware; the one map between formats and torch."""

from __future__ import annotations

import pytest
import torch

from llmtrace.tracer.core.dtypes import AUTO, BF16, COMPUTE_DTYPES, FP16, FP32, INT4, TF32
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.hardware import dtype_policy
from llmtrace.tracer.load.loader import load_model


@pytest.mark.parametrize(
    ("caps", "expected"),
    [
        ({"amx_bf16": True, "avx512_bf16": False}, BF16),
        ({"amx_bf16": False, "avx512_bf16": True}, BF16),
        ({"amx_bf16": False, "avx512_bf16": False, "avx2": True}, FP32),
        ({}, FP32),
    ],
)
def test_auto_follows_the_cpus_bf16_support(monkeypatch: pytest.MonkeyPatch, caps: dict, expected) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    assert dtype_policy.auto_dtype("cpu") is expected
    assert dtype_policy.resolve_dtype(AUTO, "cpu") is expected
    assert dtype_policy.resolve_dtype(FP16, "cpu") is FP16  # explicit choices pass through


def test_load_model_accepts_auto(monkeypatch: pytest.MonkeyPatch, tiny_llama_dir) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True})
    loaded = load_model(str(tiny_llama_dir), dtype=AUTO)
    assert next(loaded.model.parameters()).dtype == torch.float32
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": True})
    loaded = load_model(str(tiny_llama_dir), dtype=AUTO)
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


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
