"""One question, one answer: `llmtrace roofline --hardware this-machine` and `run`'s summary judge by the same saved
profile (store.saved_this_machine), the same dtype rule (analysis.compute_dtype_for / activations_for) and the same
function (analysis.roofline), so the same inputs give the same verdict and tokens/s through both (issue 28: the
bundled GGUF was compute-bound at a bf16 peak of 13.2 GFLOP/s in one and memory-bound at fp32's 36.3 in the other)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
from gguf import GGMLQuantizationType as Q
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.dtypes import get_dtype
from llmtrace.tracer.hardware.profiles import THIS_MACHINE, HardwareProfile
from llmtrace.tracer.hardware.store import save_measured_profile
from llmtrace.tracer.roofline.analysis import activations_for, compute_dtype_for

runner = CliRunner()
GIGA = 1e9

# the figures of the machine: a slow bf16 GEMM (no AMX), fp32 near 36 GFLOP/s
SAVED = HardwareProfile(
    name=THIS_MACHINE, label="test CPU (2 threads, measured)", memory_bandwidth=20 * GIGA, memory_bytes=16 * 2**30,
    fp32=36.3 * GIGA, tf32=None, bf16=13.2 * GIGA, fp16=None, fp8=None, int8=None, interconnect="none",
    interconnect_bandwidth=0.0, source="test", measured=True)


@pytest.fixture()
def saved_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    save_measured_profile(SAVED, {"device": "cpu", "others_cpu": 0.01})
    return {"XDG_CONFIG_HOME": str(tmp_path)}


def test_a_quantized_model_on_this_machine_computes_in_fp32_activations() -> None:
    q4_1 = get_dtype("q4_1")
    assert activations_for(q4_1, SAVED).name == "fp32"  # llmtrace's own model: weights as stored, fp32 around them
    assert compute_dtype_for(q4_1, SAVED) == ("fp32", "q4_1 weights are dequantized in the kernel and multiplied in "
                                                      "fp32")
    from llmtrace.tracer.hardware.profiles import PROFILES

    assert compute_dtype_for(q4_1, PROFILES["a100-80gb"])[0] == "fp16"  # an engine's fp16 activations on a GPU
    assert compute_dtype_for(get_dtype("bf16"), SAVED) == ("bf16", "")  # dense weights compute in their own dtype


def _summary(model: Path, env: dict[str, str], *extra: str) -> dict[str, Any]:
    result = runner.invoke(app, ["run", "The capital of France is", "--model", str(model), "--max-new-tokens", "6",
                                 "--summary-json", *extra], env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _roofline(model: Path, env: dict[str, str], prompt: int, new: int, *extra: str) -> dict[str, Any]:
    result = runner.invoke(app, ["roofline", "--model", str(model), "--hardware", THIS_MACHINE, "-p", str(prompt),
                                 "-n", str(new), "--json", *extra], env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _same(summary: dict[str, Any], report: dict[str, Any]) -> None:
    verdict = summary["roofline"]
    assert verdict["hardware"] == THIS_MACHINE and verdict["compute_dtype"] == report["machine"]["compute_dtype"]
    assert verdict["prefill_bound"] == report["prefill"]["bound"]
    assert verdict["decode_bound"] == report["last_decode"]["bound"]
    assert verdict["predicted_ttft_ns"] == round(report["generation"]["ttft_seconds"] * 1e9)
    assert verdict["predicted_decode_tokens_per_second"] == pytest.approx(
        report["generation"]["tokens_per_s_per_sequence"], rel=1e-12)


def test_run_and_roofline_agree_on_a_gguf_read_as_stored(tiny_quantized: Callable[..., Path],
                                                         saved_profile: dict[str, str]) -> None:
    model = tiny_quantized(Q.Q4_1)
    summary = _summary(model, saved_profile, "--weights", "stored")
    assert summary["dtype"] == "float32" and "->" not in summary["weight_format"]  # as stored, fp32 activations
    report = _roofline(model, saved_profile, summary["prompt_tokens"], summary["generated_tokens"])
    assert report["weights_dtype_from"] == "file" and report["machine"]["compute_dtype"] == "fp32"
    assert report["kv_dtype"] == report["activation_dtype"] == "fp32"
    _same(summary, report)


def test_run_and_roofline_agree_on_dense_weights(tiny_quantized: Callable[..., Path],
                                                 saved_profile: dict[str, str]) -> None:
    model = tiny_quantized(Q.Q4_1)
    summary = _summary(model, saved_profile, "--weights", "dense", "--dtype", "bf16")
    assert summary["dtype"] == "bfloat16"
    report = _roofline(model, saved_profile, summary["prompt_tokens"], summary["generated_tokens"], "--dtype", "bf16")
    assert report["machine"]["compute_dtype"] == "bf16"
    _same(summary, report)


def test_a_profile_measured_on_a_busy_machine_judges_neither(tiny_quantized: Callable[..., Path], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from llmtrace.tracer.hardware.machine_load import BUSY_SHARE_ENV

    monkeypatch.delenv(BUSY_SHARE_ENV)  # the suite's "nothing is busy": judge with the default share
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    save_measured_profile(SAVED, {"device": "cpu", "others_cpu": 0.6})
    model = tiny_quantized(Q.Q4_1)
    summary = _summary(model, {}, "--weights", "stored")
    assert summary["roofline"] is None
    result = runner.invoke(app, ["roofline", "--model", str(model), "--hardware", THIS_MACHINE])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "measured while other processes took 60% of the CPUs" in result.stderr
    assert "llmtrace hardware --measure" in result.stderr
