"""KV-cache sizes against hand-derived values: 2 x layers x KV heads x head dim x bytes x positions x batch."""

from __future__ import annotations

import pytest

from llmtrace.tracer.analytic.kvmem import (
    context_lengths,
    kv_bytes_per_token,
    kv_cache_bytes,
    kvmem_report,
    parse_bytes,
)
from llmtrace.tracer.core.dtypes import FP16, FP32, INT4, INT8, get_dtype
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.core.presets import get_preset

MiB = 2**20


@pytest.mark.parametrize(
    ("preset", "per_token"),
    [
        ("llama-7b", 2 * 32 * 32 * 128 * 2),  # 524,288 B = 0.5 MiB, the well-known figure
        ("llama2-70b", 2 * 80 * 8 * 128 * 2),  # GQA: 8 KV heads -> 327,680 B
        ("llama3-8b", 2 * 32 * 8 * 128 * 2),  # 131,072 B = 128 KiB
        ("smollm2-135m", 2 * 30 * 3 * 64 * 2),  # 23,040 B
    ],
)
def test_fp16_bytes_per_token(preset: str, per_token: int) -> None:
    assert kv_bytes_per_token(get_preset(preset), FP16) == per_token


def test_llama_7b_half_mebibyte_per_token() -> None:
    assert kv_bytes_per_token(get_preset("llama-7b"), FP16) == 0.5 * MiB
    assert kv_cache_bytes(get_preset("llama-7b"), 2000, FP16) == 2000 * 524_288 == 1_048_576_000


def test_batch_and_dtype() -> None:
    cfg = get_preset("llama2-70b")
    assert kv_cache_bytes(cfg, 4096, FP32, batch=8) == 2 * 80 * 8 * 128 * 4 * 4096 * 8
    # int8 stores 32 values + one fp16 scale in 34 bytes: a 128-value head vector is 4 blocks = 136 bytes.
    assert kv_bytes_per_token(cfg, INT8) == 2 * 80 * 8 * 136
    # int4: 18 bytes per 32 values -> 72 bytes per head vector.
    assert kv_bytes_per_token(cfg, INT4) == 2 * 80 * 8 * 72
    assert kv_bytes_per_token(cfg, get_dtype("bf16")) == 2 * 80 * 8 * 128 * 2 == kv_bytes_per_token(cfg, FP16)


def test_report_llama_7b_seq_2000() -> None:
    r = kvmem_report(get_preset("llama-7b"), 2000, FP16)
    assert r.size.bytes_per_token_per_layer == 2 * 32 * 128 * 2 == 16_384
    assert r.size.bytes_per_layer == 16_384 * 2000
    assert r.size.total_bytes == 1_048_576_000
    assert r.formula.endswith("= 1,048,576,000 B")
    assert "2 × 32 layers × 32 KV heads × 128 head dim × 2 B (fp16) × 2000 positions × 1 batch" in r.formula
    assert r.gqa_saving == 1.0  # LLaMA-1 has no GQA
    assert [row.seq for row in r.table] == [128, 256, 512, 1024, 2000, 2048]
    assert r.table[-1].total_bytes == 2048 * 524_288
    assert r.budget is None


def test_report_without_gqa_llama2_70b() -> None:
    r = kvmem_report(get_preset("llama2-70b"), 1000, FP16)
    assert r.without_gqa.n_kv_heads == 64
    assert r.without_gqa.total_bytes == 2 * 80 * 64 * 128 * 2 * 1000
    assert r.gqa_saving == 8.0


def test_budget_fit_llama3_8b() -> None:
    r = kvmem_report(get_preset("llama3-8b"), 8192, FP16, batch=2, budget_bytes=24 * 2**30, weights_dtype=FP16)
    b = r.budget
    assert b is not None
    per_position = 131_072 * 2  # two sequences
    assert b.max_positions_kv_only == 24 * 2**30 // per_position == 98_304
    weights = 2 * 8_030_261_248
    assert b.weights_bytes == weights
    assert b.max_positions_with_weights == (24 * 2**30 - weights) // per_position


def test_budget_smaller_than_the_weights() -> None:
    r = kvmem_report(get_preset("llama2-70b"), 100, FP16, budget_bytes=80 * 10**9, weights_dtype=FP16)
    assert r.budget is not None and r.budget.max_positions_with_weights == 0


def test_context_lengths_reach_the_model_max() -> None:
    assert context_lengths(1024, 300) == (128, 256, 300, 512, 1024)
    assert context_lengths(2048, 4000) == (128, 256, 512, 1024, 2048, 4000)


@pytest.mark.parametrize(
    ("text", "value"),
    [("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), ("512 MiB", 512 * 2**20), ("1024", 1024), ("1.5kb", 1500)],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GB", "12XB", "-3GB", "0", "lots"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(BadArgumentError):
        parse_bytes(text)


@pytest.mark.parametrize(("seq", "batch"), [(0, 1), (-5, 1), (10, 0)])
def test_non_positive_sizes_rejected(seq: int, batch: int) -> None:
    with pytest.raises(BadArgumentError):
        kv_cache_bytes(get_preset("llama-7b"), seq, FP16, batch)


def test_unknown_dtype_names_the_choices() -> None:
    with pytest.raises(BadArgumentError, match="fp32, bf16, fp16, fp8, int8, int4"):
        get_dtype("fp7")
    assert get_dtype("float16") is FP16 and get_dtype("Q4_0") is INT4
