"""`--dtype auto`: bf16 only where the CPU multiplies bf16 in hardware."""

from __future__ import annotations

import pytest
import torch

from llmtrace.tracer.hardware import dtype_policy
from llmtrace.tracer.load.loader import load_model


@pytest.mark.parametrize(
    ("caps", "expected"),
    [
        ({"amx_bf16": True, "avx512_bf16": False}, "bf16"),
        ({"amx_bf16": False, "avx512_bf16": True}, "bf16"),
        ({"amx_bf16": False, "avx512_bf16": False, "avx2": True}, "fp32"),
        ({}, "fp32"),
    ],
)
def test_auto_follows_the_cpus_bf16_support(monkeypatch: pytest.MonkeyPatch, caps: dict, expected: str) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    assert dtype_policy.auto_dtype("cpu") == expected
    assert dtype_policy.resolve_dtype("auto", "cpu") == expected
    assert dtype_policy.resolve_dtype("fp16", "cpu") == "fp16"  # explicit choices pass through


def test_load_model_accepts_auto(monkeypatch: pytest.MonkeyPatch, tiny_llama_dir) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True})
    loaded = load_model(str(tiny_llama_dir), dtype="auto")
    assert next(loaded.model.parameters()).dtype == torch.float32
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": True})
    loaded = load_model(str(tiny_llama_dir), dtype="auto")
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
