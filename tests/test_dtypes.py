"""One dtype value type, one alias table, one parser: every spelling of every option lands on the same DType."""

from __future__ import annotations

import pytest

from llmtrace.tracer.core.dtypes import (
    AUTO,
    BF16,
    COMPUTE_DTYPES,
    DTYPES,
    FP8,
    FP16,
    FP32,
    GGUF_DTYPES,
    INT4,
    INT8,
    TF32,
    dtype_of_file_type,
    get_compute_dtype,
    get_dtype,
)
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.hardware.profiles import MEASURABLE_DTYPES, PEAK_DTYPES


@pytest.mark.parametrize(("text", "expected"), [
    ("fp32", FP32), ("float32", FP32), ("F32", FP32), ("float", FP32), (" FP32 ", FP32),
    ("bf16", BF16), ("bfloat16", BF16), ("BF16", BF16),
    ("fp16", FP16), ("float16", FP16), ("half", FP16), ("f16", FP16),
    ("fp8", FP8), ("e4m3", FP8), ("fp8_e4m3", FP8), ("F8_E4M3", FP8),
    ("int8", INT8), ("q8_0", INT8), ("Q8_0", INT8), ("i8", INT8),
    ("int4", INT4), ("q4_0", INT4), ("i4", INT4),
])
def test_every_alias_parses_to_one_value(text: str, expected) -> None:
    assert get_dtype(text) is expected
    assert get_dtype(expected) is expected  # a parsed value passes through


def test_unknown_and_unavailable_name_the_choices() -> None:
    with pytest.raises(BadArgumentError) as exc:
        get_dtype("fp7")
    assert str(exc.value) == ("unknown dtype 'fp7'; choose one of fp32, bf16, fp16, fp8, int8, int4 (or a GGUF "
                              "block type: q4_1, q4_k, q6_k...)")
    with pytest.raises(BadArgumentError) as exc:
        get_dtype("tf32", DTYPES.values())  # a real format, but not one a budget is stored in
    assert str(exc.value) == "cannot use 'tf32'; choose one of fp32, bf16, fp16, fp8, int8, int4"
    with pytest.raises(BadArgumentError) as exc:
        get_dtype(INT8, MEASURABLE_DTYPES, refusal="cannot measure")
    assert str(exc.value) == "cannot measure 'int8'; choose one of fp32, tf32, bf16, fp16"


def test_compute_choice_is_auto_or_a_torch_format() -> None:
    assert get_compute_dtype("auto") is AUTO and get_compute_dtype(" AUTO ") is AUTO and get_compute_dtype(AUTO) is AUTO
    assert get_compute_dtype("bfloat16") is BF16
    assert all(d.torch_name for d in COMPUTE_DTYPES)
    with pytest.raises(BadArgumentError) as exc:
        get_compute_dtype("int4")
    assert str(exc.value) == "cannot compute in 'int4'; choose one of auto, fp32, bf16, fp16"


def test_storage_sizes() -> None:
    assert [d.bits_per_value for d in DTYPES.values()] == [32, 16, 16, 8, 8.5, 4.5]
    assert INT4.row_bytes(33) == 2 * 18  # a partial block stores a whole one
    assert TF32.bytes_per_value == 4 and TF32 not in DTYPES.values()
    assert str(BF16) == "bf16" and f"{INT8}" == "int8"  # what help texts and messages print


def test_file_types_map_only_exact_layouts() -> None:
    assert [dtype_of_file_type(t) for t in ("F32", "F16", "BF16", "F8_E4M3", "Q8_0", "Q4_0")] == [
        FP32, FP16, BF16, FP8, INT8, INT4]
    # Q4_1 keeps a minimum per block (its own format, not int4's); I8 has no scale at all: not int8's layout
    assert dtype_of_file_type("Q4_1") is GGUF_DTYPES["q4_1"] is get_dtype("Q4_1")
    assert dtype_of_file_type("I8") is None


def test_hardware_columns_are_format_names() -> None:
    assert all(get_dtype(name, (FP32, TF32, BF16, FP16, FP8, INT8)).name == name for name in PEAK_DTYPES)
    assert {d.name for d in MEASURABLE_DTYPES} <= set(PEAK_DTYPES)
