"""`--dtype auto` by measurement: the safety rule, the selection with injected timings (no timed assertions), the
saved choices (round trip, invalidation, damage), the loader's use of them and the fp16 range checks."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import fixed_timings

from llmtrace.tracer.core.dtypes import AUTO, FP16
from llmtrace.tracer.core.presets import get_preset
from llmtrace.tracer.hardware import kernel_choice as rule, kernel_store
from llmtrace.tracer.hardware.kernel_choice import CandidateTiming, precise_enough, select, without
from llmtrace.tracer.hardware.product_timing import DenseKernel, product_shapes, time_kernel
from llmtrace.tracer.load import kernel_pick
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.load.stored_weights import all_kernels
from llmtrace.tracer.model import native_kernel


def timing(name: str, decode_ms: float, prefill_ms: float = 10.0, safe: bool = True) -> CandidateTiming:
    return CandidateTiming(name, name, rule.DENSE, "mv", decode_ms / 1e3, prefill_ms / 1e3, 1000, safe,
                           "" if safe else "test")


# ---- the safety rule -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "formats", "safe"), [
    ("bf16", ["Q4_1", "Q4_K", "Q5_0"], True),  # 4-5 code bits + 3 guard bits fit bf16's 8
    ("bf16", ["Q4_1", "Q8_0"], False),  # Q8_0 needs 11: the bundled model's embedding
    ("bf16", ["Q6_K"], False),
    ("fp16", ["Q4_1", "Q8_0", "Q6_K"], True),
    ("fp16", ["F16"], True),
    ("bf16", ["F16"], False),  # fp16 -> bf16 drops 3 significand bits
    ("fp16", ["BF16"], True),  # exact within fp16's range (checked on the loaded model)
    ("fp16", ["F32"], False),
    ("bf16", ["F32"], False),
    ("fp32", ["F32", "Q8_0", "BF16"], True),
    ("fp32", ["some-new-format"], True),
    ("fp16", ["some-new-format"], False),  # unknown: only fp32 is known to be enough
    ("bf16", [], True),  # random weights: nothing stored to lose
])
def test_precision_rule(dtype: str, formats: list[str], safe: bool) -> None:
    ok, why = precise_enough(dtype, formats)
    assert ok is safe
    assert (why == "") is safe


def test_the_rule_bounds_the_added_rounding_by_an_eighth_of_a_quantization_step() -> None:
    """bf16 on Q4 data: a dequantized value q*d (|q| <= 8) rounds to 8 significand bits, so its error is at most
    2^-8 * 8d = d/32 (within d/8); Q8_0's q*d (|q| <= 127) in bf16 could err by 127d/256 ~ d/2: refused."""
    d = 0.0123
    q4 = torch.arange(-8, 8, dtype=torch.float32) * d
    assert (q4.bfloat16().float() - q4).abs().max() <= d / 8
    q8 = torch.arange(-127, 128, dtype=torch.float32) * d
    assert (q8.bfloat16().float() - q8).abs().max() > d / 8
    assert (q8.half().float() - q8).abs().max() <= d / 8


# ---- selection with injected timings --------------------------------------------------------------------------


def test_the_fastest_safe_candidate_wins_and_unsafe_ones_never_do() -> None:
    choice = select([timing("fp32", 20), timing("fp16", 10), timing("bf16", 5, safe=False)])
    assert choice.picked == "fp16" and choice.dtype == "fp16"
    assert [c.name for c in choice.candidates] == ["fp16", "fp32", "bf16"]  # safe fastest first, unsafe last
    assert "1.99x ahead of fp32" in choice.rule and "bf16: test" in choice.rule


def test_candidates_are_ranked_by_a_reference_generation_not_by_decode_alone() -> None:
    """prefill + 128 decode steps: a decode 1 ms faster loses to a prefill 1 s faster."""
    fast_decode = timing("bf16", 10, prefill_ms=1300)
    fast_prefill = timing("fp32", 11, prefill_ms=100)
    assert fast_decode.reference_s == pytest.approx(1.3 + 128 * 0.010)
    assert select([fast_decode, fast_prefill]).picked == "fp32"
    assert select([replace(fast_decode, prefill_s=0.2), fast_prefill]).picked == "bf16"


def test_a_half_precision_checkpoint_keeps_its_dtype_unless_another_is_measurably_faster() -> None:
    own = timing("bf16", 10)
    slightly = timing("fp16", 10 / 1.05)
    clearly = timing("fp16", 10 / 1.5)
    kept = select([own, slightly, timing("fp32", 30)], stored_dtype="bf16")
    assert kept.picked == "bf16" and "own bf16" in kept.rule and "1.05x" in kept.rule
    assert select([own, clearly], stored_dtype="bf16").picked == "fp16"
    # the margin is for fp16/bf16 checkpoints only: quantized weights take the fastest
    assert select([own, slightly]).picked == "fp16"


def test_without_re_decides_when_a_range_check_refuses_fp16() -> None:
    choice = select([timing("fp32", 20), timing("fp16", 10)])
    again = without(choice, "fp16", "overflows")
    assert again.picked == "fp32"
    assert again.timing("fp16").safe is False and again.timing("fp16").unsafe_reason == "overflows"


def test_no_safe_candidate_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        select([timing("fp16", 1, safe=False)])


# ---- the timing itself (its structure: no speed is asserted) ------------------------------------------------------


def test_time_kernel_times_the_models_own_shapes() -> None:
    config = get_preset("smollm2-135m")
    shapes = product_shapes(config)
    assert [(s.role, s.rows, s.cols, s.per_layer) for s in shapes] == [
        ("attention.wqkv", 576 + 2 * 192, 576, True), ("attention.wo", 576, 576, True),
        ("feed_forward.w13", 2 * 1536, 576, True), ("feed_forward.w2", 576, 1536, True), ("output", 49152, 576, False),
    ]
    tiny = replace(config, n_layers=2, vocab_size=64, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96,
                   explicit_head_dim=None)
    seen: list[str] = []
    result = time_kernel(DenseKernel("fp32"), tiny, budget=0.01, progress=seen.append)
    per_layer = sum(s.rows * s.cols for s in product_shapes(tiny) if s.per_layer)
    assert result.weight_bytes == 4 * (2 * per_layer + 64 * 64)  # every layer's matrices and the head, in fp32
    assert result.decode_kernel in ("mv", "mm") and result.decode_s > 0 and result.prefill_s > 0
    assert seen == ["fp32 products"]


# ---- the store -------------------------------------------------------------------------------------------------


def test_store_round_trip_and_keys(tmp_path: Path) -> None:
    path = tmp_path / "kernels.json"
    choice = select([timing("fp32", 20), timing("fp16", 10)], measured_seconds=1.5)
    kernel_store.save_choice("machine-a", "model-x", choice, path)
    kernel_store.save_choice("machine-a", "model-y", without(choice, "fp16", "x"), path)
    assert kernel_store.load_choice("machine-a", "model-x", path) == choice
    assert kernel_store.load_choice("machine-a", "model-y", path).picked == "fp32"  # the other entry kept
    assert kernel_store.load_choice("machine-b", "model-x", path) is None  # another CPU/torch/threads: measure
    assert kernel_store.load_choice("machine-a", "model-z", path) is None  # another model shape: measure


@pytest.mark.parametrize("content", [
    b"\x00\xff not json",
    b'{"version": 99, "machines": {}}',
    b'{"version": 1, "machines": {"machine-a": []}}',
    b'{"version": 1, "machines": {"machine-a": {"model-x": {"picked": "fp16"}}}}',
])
def test_a_damaged_store_is_one_line_then_a_fresh_measurement(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "kernels.json"
    path.write_bytes(content)
    with pytest.raises(kernel_store.StoreProblem) as raised:
        kernel_store.load_choice("machine-a", "model-x", path)
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)
    choice = select([timing("fp32", 20)])
    kernel_store.save_choice("machine-a", "model-x", choice, path)  # replaces the damaged file
    assert kernel_store.load_choice("machine-a", "model-x", path) == choice


def test_a_mistyped_timing_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kernels.json"
    kernel_store.save_choice("m", "x", select([timing("fp32", 20), timing("fp16", 10)]), path)
    data = json.loads(path.read_text())
    data["machines"]["m"]["x"]["candidates"][0]["decode_s"] = "fast"
    path.write_text(json.dumps(data))
    with pytest.raises(kernel_store.StoreProblem, match="decode_s"):
        kernel_store.load_choice("m", "x", path)


# ---- the loader ------------------------------------------------------------------------------------------------


@pytest.fixture()
def tiny_q_gguf(tiny_quantized: Callable[..., Path]) -> Path:
    """A tiny GGUF whose matrices are Q8_0: fp32 and fp16 are safe for it, bf16 is not."""
    import gguf

    return tiny_quantized(gguf.GGMLQuantizationType.Q8_0)


def test_auto_measures_once_then_reads_the_saved_choice(monkeypatch: pytest.MonkeyPatch, tiny_q_gguf: Path) -> None:
    calls: list[tuple[str, ...]] = []

    def fp16_fastest(kernels, config, device="cpu", progress=None, steps=None):
        calls.append(tuple(k.name for k in kernels))
        timings, seconds = fixed_timings(kernels, config)
        return tuple(replace(t, decode_s=t.decode_s / 10) if t.name == "fp16" else t for t in timings), seconds

    monkeypatch.setattr(kernel_pick, "time_kernels", fp16_fastest)
    first = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="dense")
    # bf16 and int4pack keep 8 bits, short of Q8_0's 11: probed, refused, and timed all the same (an option may force them)
    assert calls == [("fp32", "fp16", "bf16", *all_kernels())]  # all_kernels: native first where it builds
    assert first.kernels.picked == "fp16" and not first.kernels.from_store
    assert next(first.model.parameters()).dtype == torch.float16
    assert "bf16: Q8_0 matrices need 11" in first.kernels.rule
    again = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="dense")
    assert len(calls) == 1 and again.kernels.from_store and again.kernels.picked == "fp16"
    monkeypatch.setattr(kernel_pick, "machine_key", lambda device: "another CPU")
    load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="dense")
    assert len(calls) == 2  # a different machine measures again


def test_a_choice_saved_without_a_load_check_is_measured_again(monkeypatch: pytest.MonkeyPatch,
                                                                tiny_q_gguf: Path) -> None:
    """A version-3 kernels.json (no reading of the machine's load: it may have been measured on a busy machine)
    holding this very machine and model's choice is not served: one line, a fresh measurement, the file rewritten
    as version 4."""
    calls: list[int] = []

    def counted(kernels, config, device="cpu", progress=None, steps=None):
        calls.append(1)
        return fixed_timings(kernels, config)

    monkeypatch.setattr(kernel_pick, "time_kernels", counted)
    load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="dense")
    path = kernel_store.kernels_path()
    data = json.loads(path.read_text())
    assert data["version"] == kernel_store.STORE_VERSION == 4 and len(calls) == 1
    (entry,) = [e for models in data["machines"].values() for e in models.values()]
    assert entry["others_cpu"] is None and entry["provisional"] is False  # fixed readings: none taken in-process
    entry["picked"] = entry["dtype"] = "fp16"  # what the old measurement had decided, under the same keys
    del entry["others_cpu"], entry["provisional"]
    path.write_text(json.dumps({**data, "version": 3}))
    again = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="dense")
    assert len(calls) == 2 and not again.kernels.from_store and again.kernels.picked == "blocks"
    assert "saved by an older llmtrace (version 3, before a measurement checked how busy the machine was); " \
           "measuring again" in again.kernel_note
    assert json.loads(path.read_text())["version"] == 4


def test_an_explicit_dtype_is_recorded_as_an_override(tiny_q_gguf: Path) -> None:
    assert load_model(str(tiny_q_gguf), dtype=FP16, use_cache=False, weights="dense").kernels is None  # nothing measured yet
    load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="dense")  # measures (fixed timings: blocks fastest)
    forced = load_model(str(tiny_q_gguf), dtype=FP16, use_cache=False, weights="dense")
    assert next(forced.model.parameters()).dtype == torch.float16
    assert forced.kernels.overridden_by == "--dtype fp16 --weights dense" and forced.kernels.picked == "blocks"
    assert forced.kernels.ran == "fp16" and forced.weights.mode == "dense"


def test_a_damaged_store_does_not_stop_a_load(tiny_q_gguf: Path) -> None:
    kernel_store.kernels_path().write_text("{ torn")
    loaded = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="dense")
    assert loaded.kernels.picked == "blocks" and loaded.kernels.ran == "fp32" and "measuring again" in loaded.kernel_note
    names = [c.name for c in (kernel_pick.DenseKernel(d) for d in ("fp32", "fp16", "bf16"))] + list(all_kernels())
    names.append(f"native sources {native_kernel.sources_digest()}")
    key = kernel_store.model_key(product_shapes(loaded.config), 2, ("Q8_0",), names)
    assert kernel_store.load_choice(kernel_pick.machine_key("cpu"), key) is not None


def test_a_choice_measured_with_other_kernel_sources_is_measured_again(monkeypatch: pytest.MonkeyPatch,
                                                                       tiny_q_gguf: Path) -> None:
    calls = []
    real = kernel_pick.time_kernels
    monkeypatch.setattr(kernel_pick, "time_kernels", lambda *a, **k: calls.append(1) or real(*a, **k))
    load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="dense")
    load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="dense")
    assert len(calls) == 1  # the second run read the saved choice
    monkeypatch.setattr(native_kernel, "sources_digest", lambda: "0123456789ab")  # an upgraded llmtrace's C kernels
    again = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="dense")
    assert len(calls) == 2 and not again.kernels.from_store


def test_an_fp32_checkpoint_stays_fp32_without_measuring(monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path) -> None:
    monkeypatch.setattr(kernel_pick, "time_kernels", lambda *a, **k: pytest.fail("nothing to measure"))
    loaded = load_model(str(tiny_llama_dir), dtype=AUTO)
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert loaded.kernels.picked == "fp32" and not loaded.kernels.candidates
    assert "only acceptable candidate" in loaded.kernels.rule and "F32 matrices need 24" in loaded.kernels.rule


def test_fp16_is_refused_when_the_residual_stream_would_overflow(monkeypatch: pytest.MonkeyPatch,
                                                                  tiny_q_gguf: Path) -> None:
    loaded = load_model(str(tiny_q_gguf), dtype=FP16, use_cache=False, weights="dense")
    assert kernel_pick.fp16_problem(loaded.model, loaded.tokenizer) == ""
    with torch.no_grad():
        loaded.model.tok_embeddings.weight.fill_(5000.0)  # a residual stream in the thousands: finite, over the limit
    assert "residual stream reaches" in kernel_pick.fp16_problem(loaded.model, loaded.tokenizer)
    with torch.no_grad():
        loaded.model.layers[0].feed_forward.w2.weight.fill_(float("inf"))
    assert "overflows fp16" in kernel_pick.fp16_problem(loaded.model, loaded.tokenizer)

    def fp16_fastest(kernels, config, device="cpu", progress=None, steps=None):
        timings, seconds = fixed_timings(kernels, config)
        return tuple(replace(t, decode_s=t.decode_s / 10) if t.name == "fp16" else t for t in timings), seconds

    monkeypatch.setattr(kernel_pick, "time_kernels", fp16_fastest)
    monkeypatch.setattr(kernel_pick, "fp16_problem", lambda model, tokenizer: "a probe's residual stream reaches 9e4")
    fallback = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="dense")
    assert next(fallback.model.parameters()).dtype == torch.float32
    assert fallback.kernels.ran == "fp32" and "fp16 not used" in fallback.kernel_note


def test_the_trace_keeps_the_choice(tiny_q_gguf: Path) -> None:
    import jsonschema

    from llmtrace.tracer.run.generate import generate
    from llmtrace.tracer.trace.records import RunSettings
    from llmtrace.tracer.trace.run_trace import Trace, load_schema

    loaded = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="dense")
    trace = generate(loaded, RunSettings(model=str(tiny_q_gguf), prompt="sky", max_new_tokens=2, dtype="auto"))
    assert trace.kernels == loaded.kernels and trace.kernels.candidates
    data = json.loads(trace.to_json())
    jsonschema.validate(data, load_schema())
    assert Trace.from_json(trace.to_json()).kernels == trace.kernels


def test_the_measured_decode_kernel_is_the_one_that_runs(monkeypatch: pytest.MonkeyPatch, tiny_q_gguf: Path) -> None:
    """decode_kernel "mm" sends the fused path's one-token products through mm (torch.mv never runs), with the same
    logits as "mv"; the loader sets it from the measured choice."""
    def mm_faster(kernels, config, device="cpu", progress=None, steps=None):
        timings, seconds = fixed_timings(kernels, config)
        return tuple(replace(t, decode_kernel="mm") for t in timings), seconds

    monkeypatch.setattr(kernel_pick, "time_kernels", mm_faster)
    loaded = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="dense")
    model = loaded.model
    assert model.decode_kernel == "mm"
    ids = torch.tensor([[3, 4, 5]])
    logits = {}
    for kernel in ("mv", "mm"):
        model.decode_kernel = kernel
        model.setup_cache(1, 8)
        model.prefill(ids)
        calls = []
        real_mv = torch.mv
        monkeypatch.setattr(torch, "mv", lambda *a: calls.append(1) or real_mv(*a))
        logits[kernel] = model.decode_one(torch.tensor([[6]]))
        monkeypatch.setattr(torch, "mv", real_mv)
        assert bool(calls) is (kernel == "mv")
    torch.testing.assert_close(logits["mm"], logits["mv"], rtol=1e-5, atol=1e-5)
    forced = load_model(str(tiny_q_gguf), dtype=FP16, use_cache=False, weights="dense")  # the saved measurement timed fp16 too
    assert forced.model.decode_kernel == "mm"
