"""The kernels a run uses: the default table (nothing measured, the same every run), the accuracy rule, `llmtrace tune`
with injected timings (no timed assertions), its saved picks (round trip, keys, damage) and `--weights tuned`, which
judges a saved pick again (issue 27 item 5), and the fp16 range checks."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import fixed_timings

from llmtrace.tracer.core.dtypes import AUTO, FP16
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.core.presets import get_preset
from llmtrace.tracer.hardware import kernel_choice as rule, kernel_defaults as table, kernel_store
from llmtrace.tracer.hardware.kernel_choice import COMPUTE_BITS, CandidateTiming, ranked, select, short_of_bits
from llmtrace.tracer.hardware.product_timing import DenseKernel, product_shapes, time_kernel
from llmtrace.tracer.load import kernel_pick
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.run.backends import backend_for, matvec_of
from llmtrace.tracer.run.select import Request


def timing(name: str, decode_ms: float, prefill_ms: float = 10.0, safe: bool = True) -> CandidateTiming:
    return CandidateTiming(name, name, rule.DENSE, "mv", decode_ms / 1e3, prefill_ms / 1e3, 1000, safe,
                           "" if safe else "test")


def no_timing(*args: object, **kwargs: object) -> None:
    pytest.fail("a load measured products")


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
    # held by its bits alone (no probe) when no stored format is short of them
    assert (not short_of_bits(COMPUTE_BITS[dtype], formats)) is safe


def test_the_rule_bounds_the_added_rounding_by_an_eighth_of_a_quantization_step() -> None:
    """bf16 on Q4 data: a dequantized value q*d (|q| <= 8) rounds to 8 significand bits, so its error is at most
    2^-8 * 8d = d/32 (within d/8); Q8_0's q*d (|q| <= 127) in bf16 could err by 127d/256 ~ d/2: refused."""
    d = 0.0123
    q4 = torch.arange(-8, 8, dtype=torch.float32) * d
    assert (q4.bfloat16().float() - q4).abs().max() <= d / 8
    q8 = torch.arange(-127, 128, dtype=torch.float32) * d
    assert (q8.bfloat16().float() - q8).abs().max() > d / 8
    assert (q8.half().float() - q8).abs().max() <= d / 8


# ---- tune's pick with injected timings -------------------------------------------------------------------------


def test_the_fastest_safe_candidate_wins_and_unsafe_ones_never_do() -> None:
    candidates = [timing("fp32", 20), timing("fp16", 10), timing("bf16", 5, safe=False)]
    assert select(candidates).name == "fp16"
    assert [c.name for c in ranked(candidates)] == ["fp16", "fp32", "bf16"]  # safe fastest first, unsafe last


def test_candidates_are_ranked_by_a_reference_generation_not_by_decode_alone() -> None:
    """prefill + 128 decode steps: a decode 1 ms faster loses to a prefill 1 s faster."""
    fast_decode = timing("bf16", 10, prefill_ms=1300)
    fast_prefill = timing("fp32", 11, prefill_ms=100)
    assert fast_decode.reference_s == pytest.approx(1.3 + 128 * 0.010)
    assert select([fast_decode, fast_prefill]).name == "fp32"
    assert select([replace(fast_decode, prefill_s=0.2), fast_prefill]).name == "bf16"


def test_no_safe_candidate_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        select([timing("fp16", 1, safe=False)])


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


# ---- the default table --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("device", "library", "avx2", "flags", "row"), [
    ("cpu", True, True, {"avx2", "avx512f", "avx512bw", "avx512_vnni"}, table.AVX512_VNNI),
    ("cpu", True, True, {"avx2", "fma", "f16c"}, table.AVX2),
    ("cpu", True, False, set(), table.PORTABLE),
    ("cpu", False, False, {"avx2"}, table.NO_COMPILER),
    ("cuda", False, False, set(), table.CUDA),
    ("mps", True, True, set(), table.OTHER),
])
def test_the_row_of_a_machine(device: str, library: bool, avx2: bool, flags: set[str], row: str) -> None:
    assert table.instruction_set(device, library, avx2, flags) == row


def test_the_table_in_the_docs_is_the_codes() -> None:
    """BENCHMARKS.md and README.md print table_markdown() verbatim, so neither can drift from what runs."""
    root = Path(__file__).resolve().parent.parent
    rendered = table.table_markdown()
    for doc in ("BENCHMARKS.md", "README.md"):
        assert rendered in (root / doc).read_text(encoding="utf-8"), doc
    assert table.row_for(table.AVX2).kernels == {"Q4_0": "i8dot", "Q4_1": "i8dot", "Q4_K": "i8dot", "Q5_0": "native",
                                                 "Q5_1": "native", "Q5_K": "native", "Q6_K": "native",
                                                 "Q8_0": "native"}
    assert table.row_for(table.AVX512_VNNI).kernels == {**table.row_for(table.AVX2).kernels, "Q8_0": "i8dot"}
    assert table.row_for(table.NO_COMPILER).kernels["Q4_K"] == "int4pack"
    assert table.row_for(table.NO_COMPILER).kernels["Q8_0"] == table.DENSE


def test_the_accuracy_rule_admits_what_the_table_runs(tiny_quantized: Callable[..., Path]) -> None:
    """Every kernel the table names for a type passes the rule a tuned pick meets, on a file of that type (the
    probe where the kernel's bits do not settle it)."""
    import gguf

    from llmtrace.tracer.checkpoint.resolve import resolve_model

    for qtype in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0):
        resolved = resolve_model(str(tiny_quantized(qtype)), vocabulary=True)
        for row in table.TABLE:
            plan = table.default_plan(row.instruction_set, [qtype.name])
            if not plan or (row.instruction_set == table.CUDA):
                continue
            choice = kernel_pick.stored_choice(",".join(f"{t}:{k}" for t, k in plan.items()), "fp32", rule.DEFAULT,
                                               "", row.instruction_set, [qtype.name])
            assert kernel_pick._rejudged(resolved, torch.device("cpu"), choice, [qtype.name]) == "", (row, plan)


@pytest.fixture()
def tiny_q_gguf(tiny_quantized: Callable[..., Path]) -> Path:
    """A tiny GGUF whose matrices are Q8_0: fp32 and fp16 are safe for it, bf16 is not."""
    import gguf

    return tiny_quantized(gguf.GGMLQuantizationType.Q8_0)


def test_a_load_never_measures(monkeypatch: pytest.MonkeyPatch, tiny_q_gguf: Path, tiny_llama_dir: Path) -> None:
    """The default, an explicit kernel, stored, dense and an explicit dtype: the table or the option, no timing."""
    monkeypatch.setattr(kernel_pick, "time_kernels", no_timing)
    loaded = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False)
    isa = kernel_pick.instruction_set(torch.device("cpu"))
    assert loaded.kernels.source == rule.DEFAULT and loaded.kernels.instruction_set == isa
    if isa in (table.AVX2, table.PORTABLE):
        assert loaded.kernels.picked == "Q8_0:native" and loaded.weights.kernel == "Q8_0:native"
        assert loaded.kernels.numerics == "exact" and loaded.weights.reason == f"the default for {isa}"
    if isa == table.AVX512_VNNI:  # llama.cpp's own Q8_0 products (kernel_defaults.py says why)
        assert loaded.kernels.picked == "Q8_0:i8dot" and loaded.weights.kernel == "Q8_0:i8dot"
        assert loaded.kernels.numerics == "int8 activations (llama.cpp-style)"
        assert loaded.weights.reason == f"the default for {isa}"
    for weights in ("native", "stored", "dense", "blocks"):
        forced = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights=weights)
        assert forced.kernels.source == rule.OPTION and f"--weights {weights}" in forced.kernels.rule
    assert load_model(str(tiny_q_gguf), dtype=FP16, use_cache=False, weights="dense").kernels.dtype == "fp16"
    dense = load_model(str(tiny_llama_dir), dtype=AUTO)
    assert dense.kernels.picked == "fp32" and dense.kernels.source == rule.DEFAULT
    assert "the checkpoint's own fp32" in dense.kernels.rule and next(dense.model.parameters()).dtype == torch.float32


def test_the_default_names_its_numerics_type_by_type(tiny_quantized: Callable[..., Path]) -> None:
    import gguf

    path = tiny_quantized(gguf.GGMLQuantizationType.Q4_1, head=gguf.GGMLQuantizationType.Q8_0)
    loaded = load_model(str(path), dtype=AUTO, use_cache=False)
    isa = kernel_pick.instruction_set(torch.device("cpu"))
    if isa == table.AVX512_VNNI:  # the Q8_0 head on i8dot too: one numerics for both types
        assert loaded.kernels.picked == "Q4_1:i8dot,Q8_0:i8dot"
        assert loaded.kernels.numerics == "int8 activations (llama.cpp-style)"
        assert [(b.type, b.kernel) for b in loaded.kernels.by_type] == [("Q4_1", "i8dot"), ("Q8_0", "i8dot")]
    if isa == table.AVX2:
        assert loaded.kernels.picked == "Q4_1:i8dot,Q8_0:native"
        assert loaded.kernels.numerics == "int8 activations (llama.cpp-style) on Q4_1; exact on Q8_0"
        assert [(b.type, b.kernel) for b in loaded.kernels.by_type] == [("Q4_1", "i8dot"), ("Q8_0", "native")]
    exact = load_model(str(path), dtype=AUTO, use_cache=False, weights="native")
    assert exact.kernels.numerics == "exact"


# ---- the store and --weights tuned --------------------------------------------------------------------------------


def test_tune_saves_a_pick_that_only_weights_tuned_uses(tiny_q_gguf: Path) -> None:
    from llmtrace.tracer.checkpoint.resolve import resolve_model

    with pytest.raises(BadArgumentError, match="no tuned kernels are saved for this model on this machine; run "):
        load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="tuned")
    seen: list[tuple[int, int, str]] = []
    tuned = kernel_pick.tune(resolve_model(str(tiny_q_gguf), vocabulary=True), torch.device("cpu"),
                             lambda done, total, what: seen.append((done, total, what)))
    assert tuned.choice.picked == "blocks" and tuned.choice.source == rule.TUNED  # fixed timings: blocks fastest
    assert tuned.saved_to == str(kernel_store.kernels_path()) and tuned.choice.candidates
    assert seen[-1][0] == seen[-1][1] and all(done <= total for done, total, _ in seen)  # counts for the bar
    assert "blocks products" in {what for _, _, what in seen}
    default = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False)
    assert default.kernels.source == rule.DEFAULT  # a saved pick is not used unasked
    used = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="tuned")
    assert used.kernels == tuned.choice and used.weights.kernel == "blocks" and used.kernel_note == ""


def _saved_entry(path: Path) -> dict:
    data = json.loads(path.read_text())
    (entry,) = [e for models in data["machines"].values() for e in models.values()]
    return data, entry


@pytest.mark.parametrize(("edit", "why"), [
    (lambda e: e.update(picked="warp9", decode_kernel="warp9"), "no stored kernel 'warp9' in this llmtrace"),
    (lambda e: e.update(dtype="fp8"), "unknown compute dtype 'fp8'"),
    (lambda e: e.update(weights="sideways"), "unknown weights form 'sideways'"),
    (lambda e: e.update(weights="dense", picked="bf16", dtype="bf16", decode_kernel="mv"),
     "Q8_0 matrices need 11 significand bits, bf16 keeps 8; probed product error"),
])
def test_a_saved_pick_is_judged_again_and_a_bad_one_is_one_note(tiny_q_gguf: Path, edit: Callable[[dict], None],
                                                                 why: str) -> None:
    """Issue 27 item 5: whatever a kernels.json names is judged by the rule a fresh pick meets; anything wrong is one
    note naming the file's pick, and the defaults run (never exit 1, never a blame on an option not given)."""
    from llmtrace.tracer.checkpoint.resolve import resolve_model

    kernel_pick.tune(resolve_model(str(tiny_q_gguf), vocabulary=True), torch.device("cpu"))
    path = kernel_store.kernels_path()
    data, entry = _saved_entry(path)
    edit(entry)
    for c in entry["candidates"]:
        c["safe"], c["unsafe_reason"] = True, ""
    path.write_text(json.dumps(data))
    loaded = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="tuned")
    assert loaded.kernels.source == rule.DEFAULT
    assert why in loaded.kernel_note and "ignored, running the defaults" in loaded.kernel_note
    assert "\n" not in loaded.kernel_note and "--dtype" not in loaded.kernel_note


def test_a_saved_i8dot_pick_on_q8_0_is_judged_by_llama_cpps_bits(tiny_q_gguf: Path) -> None:
    """A saved "Q8_0:i8dot" is judged again as a fresh pick: its probe on the file's Q8_0 matrices is over Q8_0's own
    2^-11 but within the 2^-7 of llama.cpp's int8 activations, which the rule holds i8dot to there
    (kernel_choice.LLAMA_CPP_MATH; until that rule this pick was the example of one refused), so it runs."""
    from llmtrace.tracer.checkpoint.resolve import resolve_model

    kernel_pick.tune(resolve_model(str(tiny_q_gguf), vocabulary=True), torch.device("cpu"))
    path = kernel_store.kernels_path()
    data, entry = _saved_entry(path)
    entry.update(picked="Q8_0:i8dot", decode_kernel="Q8_0:i8dot")
    path.write_text(json.dumps(data))
    loaded = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="tuned")
    assert loaded.kernels.source == rule.TUNED and loaded.weights.kernel == "Q8_0:i8dot"
    assert loaded.kernel_note == ""


@pytest.mark.parametrize("content", [
    b"\x00\xff not json",
    b'{"version": 99, "machines": {}}',
    b'{"version": 5, "machines": {"machine-a": []}}',
    b'{"version": 5, "machines": {"machine-a": {"model-x": {"picked": "fp16"}}}}',
])
def test_a_damaged_store_is_one_line(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "kernels.json"
    path.write_bytes(content)
    with pytest.raises(kernel_store.StoreProblem) as raised:
        kernel_store.load_choice("machine-a", "model-x", path)
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)


def test_a_damaged_or_older_store_runs_the_defaults_with_a_note(tiny_q_gguf: Path) -> None:
    kernel_store.kernels_path().write_text("{ torn")
    loaded = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="tuned")
    assert loaded.kernels.source == rule.DEFAULT and "kernels.json: not valid JSON" in loaded.kernel_note
    kernel_store.kernels_path().write_text('{"version": 4, "machines": {}}')
    older = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="tuned")
    assert "saved by an older llmtrace (version 4, by a run's own measurement, before `llmtrace tune`)" \
        in older.kernel_note


def test_store_round_trip_and_keys(tmp_path: Path, tiny_q_gguf: Path) -> None:
    from llmtrace.tracer.checkpoint.resolve import resolve_model

    path = tmp_path / "kernels.json"
    tuned = kernel_pick.tune(resolve_model(str(tiny_q_gguf), vocabulary=True), torch.device("cpu"), store_path=path)
    kernel_store.save_choice("machine-a", "model-y", replace(tuned.choice, picked="fp32"), path)
    machine = kernel_pick.machine_key("cpu")
    (model,) = json.loads(path.read_text())["machines"][machine]
    assert kernel_store.load_choice(machine, model, path) == tuned.choice
    assert kernel_store.load_choice("machine-a", "model-y", path).picked == "fp32"  # the other entry kept
    assert kernel_store.load_choice("machine-b", model, path) is None  # another CPU/torch/threads


def test_a_mistyped_timing_is_refused(tmp_path: Path, tiny_q_gguf: Path) -> None:
    from llmtrace.tracer.checkpoint.resolve import resolve_model

    path = tmp_path / "kernels.json"
    kernel_pick.tune(resolve_model(str(tiny_q_gguf), vocabulary=True), torch.device("cpu"), store_path=path)
    data, entry = _saved_entry(path)
    entry["candidates"][0]["decode_s"] = "fast"
    path.write_text(json.dumps(data))
    with pytest.raises(kernel_store.StoreProblem, match="decode_s"):
        kernel_store.load_choice(kernel_pick.machine_key("cpu"), next(iter(next(iter(data["machines"].values())))),
                                 path)


def test_a_pick_tuned_with_other_kernel_sources_is_not_served(monkeypatch: pytest.MonkeyPatch,
                                                              tiny_q_gguf: Path) -> None:
    from llmtrace.tracer.checkpoint.resolve import resolve_model

    kernel_pick.tune(resolve_model(str(tiny_q_gguf), vocabulary=True), torch.device("cpu"))
    assert load_model(str(tiny_q_gguf), use_cache=False, weights="tuned").kernels.source == rule.TUNED
    monkeypatch.setattr(native_kernel, "sources_digest", lambda: "0123456789ab")  # an upgraded llmtrace's C kernels
    with pytest.raises(BadArgumentError, match="no tuned kernels"):
        load_model(str(tiny_q_gguf), use_cache=False, weights="tuned")


def test_fp16_is_refused_when_the_residual_stream_would_overflow(monkeypatch: pytest.MonkeyPatch,
                                                                  tiny_q_gguf: Path) -> None:
    from llmtrace.tracer.checkpoint.resolve import resolve_model

    loaded = load_model(str(tiny_q_gguf), dtype=FP16, use_cache=False, weights="dense")
    assert kernel_pick.fp16_problem(loaded.model, loaded.tokenizer) == ""
    with torch.no_grad():
        loaded.model.tok_embeddings.weight.fill_(5000.0)  # a residual stream in the thousands: finite, over the limit
    assert "residual stream reaches" in kernel_pick.fp16_problem(loaded.model, loaded.tokenizer)
    with torch.no_grad():
        loaded.model.layers[0].feed_forward.w2.weight.fill_(float("inf"))
    assert "overflows fp16" in kernel_pick.fp16_problem(loaded.model, loaded.tokenizer)

    def fp16_fastest(kernels, config, device="cpu", progress=None):
        timings, seconds = fixed_timings(kernels, config)
        return tuple(replace(t, decode_s=t.decode_s / 100) if t.name == "fp16" else t for t in timings), seconds

    monkeypatch.setattr(kernel_pick, "time_kernels", fp16_fastest)
    kernel_pick.tune(resolve_model(str(tiny_q_gguf), vocabulary=True), torch.device("cpu"))
    monkeypatch.setattr(kernel_pick, "fp16_problem", lambda model, tokenizer: "a probe's residual stream reaches 9e4")
    fallback = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="tuned")
    assert next(fallback.model.parameters()).dtype == torch.float32
    assert fallback.kernels.dtype == "fp32" and "fp16 not used" in fallback.kernel_note


def test_the_trace_keeps_the_choice(tiny_q_gguf: Path) -> None:
    import jsonschema

    from llmtrace.tracer.run.generate import generate
    from llmtrace.tracer.trace.records import RunSettings
    from llmtrace.tracer.trace.run_trace import Trace, load_schema

    loaded = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False)
    trace = generate(loaded, RunSettings(model=str(tiny_q_gguf), prompt="sky", max_new_tokens=2, dtype="auto"))
    assert trace.kernels == loaded.kernels and trace.kernels.by_type
    data = json.loads(trace.to_json())
    jsonschema.validate(data, load_schema())
    assert data["kernels"]["numerics"] == loaded.kernels.numerics
    assert Trace.from_json(trace.to_json()).kernels == trace.kernels
    old = {"picked": "fp32", "dtype": "fp32", "weights": "dense", "decode_kernel": "mv", "rule": "r", "candidates": [],
           "measured_seconds": 0.0, "from_store": False, "overridden_by": "", "stored_dtype": None}
    data["kernels"] = old  # an older trace's measured choice: valid by the schema, read as what ran
    jsonschema.validate(data, load_schema())
    older = Trace.from_json(json.dumps(data)).kernels
    assert (older.picked, older.source, older.weights) == ("fp32", "measured", "dense")
    jsonschema.validate(json.loads(Trace.from_json(json.dumps(data)).to_json()), load_schema())


def test_a_tuned_decode_kernel_is_the_one_that_runs(monkeypatch: pytest.MonkeyPatch, tiny_q_gguf: Path) -> None:
    """decode_kernel "mm" sends the fused path's one-token products through mm (torch.mv never runs), with the same
    logits as "mv"; a run takes it from a tuned dense pick (matvec_of(loaded.kernels), the run's Request.matvec)."""
    from llmtrace.tracer.checkpoint.resolve import resolve_model

    def dense_mm_fastest(kernels, config, device="cpu", progress=None):
        timings, seconds = fixed_timings(kernels, config)
        return tuple(replace(t, decode_kernel="mm", decode_s=t.decode_s / 100) if t.name == "fp32" else t
                     for t in timings), seconds

    monkeypatch.setattr(kernel_pick, "time_kernels", dense_mm_fastest)
    kernel_pick.tune(resolve_model(str(tiny_q_gguf), vocabulary=True), torch.device("cpu"))
    loaded = load_model(str(tiny_q_gguf), dtype=AUTO, use_cache=False, weights="tuned")
    model = loaded.model
    assert matvec_of(loaded.kernels) == "mm"
    ids = torch.tensor([[3, 4, 5]])
    logits = {}
    for kernel in ("mv", "mm"):
        model.setup_cache(1, 8)
        run = backend_for(model, Request(matvec=kernel))
        run.prefill(ids)
        calls = []
        real_mv = torch.mv
        monkeypatch.setattr(torch, "mv", lambda *a: calls.append(1) or real_mv(*a))
        logits[kernel] = run.decode(torch.tensor([[6]]))
        monkeypatch.setattr(torch, "mv", real_mv)
        assert bool(calls) is (kernel == "mv")
    torch.testing.assert_close(logits["mm"], logits["mv"], rtol=1e-5, atol=1e-5)
