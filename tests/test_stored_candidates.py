"""Stored kernels as tune's candidates (issue 12 item 2): one accuracy rule for dense and stored candidates (with
injected probe errors, and the real probe on tiny GGUFs), the stored kernels timed through PackedWeight at the
model's shapes, `--weights auto|stored|dense|<kernel>` with `--dtype` as recorded options, and the run's kernel line,
`--detail kernels` and the JSON record. No timed assertions: the fixed timer of conftest ranks the candidates."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

import gguf
import pytest
import torch
from conftest import fixed_timings
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.dtypes import AUTO, FP16, FP32
from llmtrace.tracer.hardware import kernel_choice as rule, kernel_store
from llmtrace.tracer.hardware.kernel_defaults import default_phrase
from llmtrace.tracer.hardware.kernel_choice import CandidateTiming, judge, precision_bits, ranked, select
from llmtrace.tracer.hardware.product_timing import product_shapes, time_kernel, time_kernels
from llmtrace.tracer.load import kernel_pick
from llmtrace.tracer.load.gguf_loader import matrix_infos, pack_matrices
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.load.stored_candidates import StoredKernel, kernels_for, probe_errors
from llmtrace.tracer.load.stored_weights import all_kernels
from llmtrace.tracer.model import native_kernel

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny(tiny_quantized: Callable[[Q], Path]) -> Callable[[Q], Path]:
    """qtype -> the tiny LLaMA as a GGUF whose matrices are qtype (conftest's tiny_quantized)."""
    return tiny_quantized


def stored(name: str, decode_ms: float, safe: bool = True, error: float | None = None) -> CandidateTiming:
    return CandidateTiming(name, "fp32", rule.STORED, name, decode_ms / 1e3, 10 * decode_ms / 1e3, 500, safe,
                           "" if safe else "probe", error)


def dense(name: str, decode_ms: float) -> CandidateTiming:
    return CandidateTiming(name, name, rule.DENSE, "mv", decode_ms / 1e3, 10 * decode_ms / 1e3, 1000)


# ---- the rule ----------------------------------------------------------------------------------------------------


def test_precision_bits_of_each_kind_of_candidate() -> None:
    assert precision_bits(rule.DENSE, "bf16") == 8 and precision_bits(rule.DENSE, "fp16") == 11
    assert precision_bits(rule.STORED, "fp32", "int4pack") == 8  # bf16 inside, whatever the activations
    assert precision_bits(rule.STORED, "fp32", "blocks") == 24  # exact: the activations' own bits
    assert precision_bits(rule.STORED, "bf16", "blocks") == 8
    assert precision_bits(rule.STORED, "fp32", "some-new-kernel") is None  # judged by its probe alone


@pytest.mark.parametrize(("bits", "formats", "errors", "ok", "why"), [
    (8, ["Q4_1"], {}, True, ""),  # int4pack / bf16 on Q4: 8 >= 4 + 3, no probe needed
    (8, ["Q4_1", "Q8_0"], {}, False, "no probe was made"),
    (8, ["Q4_1", "Q8_0"], {"Q8_0": 2.7e-3}, False, "probed product error 0.0027 > 2^-11 = 0.00049"),
    (8, ["Q4_1", "Q8_0"], {"Q8_0": 2.0 ** -12}, True, ""),  # within the unit roundoff of 11 bits
    (8, ["Q6_K"], {"Q6_K": 2.0 ** -9}, True, ""),  # the tolerance is the format's: 2^-(6 + 3)
    (8, ["Q6_K"], {"Q6_K": 2.0 ** -8}, False, "> 2^-9"),
    (8, ["Q8_0"], {"Q8_0": float("nan")}, False, "probed product error nan"),
    (None, ["Q8_0"], {"Q8_0": 1e-7}, True, ""),  # an undeclared kernel passes on its probe
    (None, ["Q8_0"], {}, False, "declares none"),
    (8, ["F16"], {"F16": 0.0}, False, "F16 matrices need 11 significand bits"),  # a float format is never probed
    (24, ["F32", "Q8_0"], {}, True, ""),
])
def test_one_rule_for_dense_and_stored(bits: int | None, formats: list[str], errors: dict[str, float], ok: bool,
                                       why: str) -> None:
    accepted, reason = judge("cand", bits, formats, errors)
    assert accepted is ok and why in reason and (reason == "") is ok


def test_the_tolerance_is_the_unit_roundoff_of_the_bits_a_format_needs() -> None:
    assert rule.tolerance("Q8_0") == 2.0 ** -11 and rule.tolerance("Q4_1") == 2.0 ** -7
    # bf16 rounding of random products: relative error ~2^-9, between Q4's and Q8_0's tolerances
    x, w = torch.randn(64, 576, dtype=torch.float64), torch.randn(256, 576, dtype=torch.float64)
    exact = x @ w.t()
    err = float((x.bfloat16() @ w.bfloat16().t()).double().sub(exact).norm() / exact.norm())
    assert rule.tolerance("Q8_0") < err < rule.tolerance("Q4_1")


def test_a_stored_kernel_wins_when_fastest_and_acceptable() -> None:
    candidates = [dense("fp32", 10), dense("fp16", 6), stored("int4pack", 3, safe=False, error=3e-3),
                  stored("blocks", 5)]
    best = select(candidates)
    assert (best.name, best.weights, best.decode_kernel) == ("blocks", rule.STORED, "blocks")
    assert ranked(candidates)[-1].name == "int4pack"


# ---- the probe and the timing on real tiny GGUFs ------------------------------------------------------------------


def test_the_probe_measures_what_the_rule_expects(tiny: Callable[[Q], Path]) -> None:
    """On the file's own matrices: int4pack (bf16 inside) and dense bf16 err by ~2^-9, over Q8_0's 2^-11 and within
    Q4_1's 2^-7; the exact blocks kernel and dense fp32 agree with the fp64 product to fp32 rounding."""
    from llmtrace.tracer.checkpoint.resolve import resolve_model

    resolved = resolve_model(str(tiny(Q.Q8_0)))
    config = resolved.config
    errors = probe_errors(resolved.gguf_header, config, {"int4pack": ["Q8_0"], "bf16": ["Q8_0"], "blocks": ["Q8_0"],
                                                         "fp32": ["Q8_0"]})
    assert errors["int4pack"]["Q8_0"] > rule.tolerance("Q8_0") and errors["bf16"]["Q8_0"] > rule.tolerance("Q8_0")
    assert errors["blocks"]["Q8_0"] < 1e-6 and errors["fp32"]["Q8_0"] < 1e-6
    q4 = resolve_model(str(tiny(Q.Q4_1)))
    assert probe_errors(q4.gguf_header, q4.config, {"int4pack": ["Q4_1"]})["int4pack"]["Q4_1"] < rule.tolerance("Q4_1")


def test_stored_kernels_are_timed_at_the_models_shapes_on_its_own_blocks(tiny: Callable[[Q], Path]) -> None:
    from llmtrace.tracer.checkpoint.resolve import resolve_model

    resolved = resolve_model(str(tiny(Q.Q4_1)))
    header, config = resolved.gguf_header, resolved.config
    # i8dot and native (where they build), int4pack, blocks: every kernel but i16dot, which runs Q8_0 and Q6_K only
    assert kernels_for(header, config) == tuple(k for k in all_kernels() if k != "i16dot")
    matrix_bytes = sum(info.n_bytes for info in matrix_infos(header, config).values() if info.name != "token_embd.weight")
    for name in kernels_for(header, config):
        kernel = StoredKernel(header, config, name)
        timing = time_kernel(kernel, config, budget=0.0)
        assert (timing.name, timing.weights, timing.decode_kernel, timing.dtype) == (name, "stored", name, "fp32")
        assert timing.weight_bytes == matrix_bytes  # every layer's matrices and the (untied) head, as stored
        assert timing.decode_s > 0 and timing.prefill_s > 0
    kernel = StoredKernel(header, config, "int4pack")
    shape = next(s for s in product_shapes(config) if s.per_layer)
    handed = [kernel.prepare(shape, torch.Generator(), "cpu") for _ in range(2)]  # the sample, then a copy
    assert all(w._prepared is not None for w in handed)  # int4pack's repacking done before any product is timed
    time_kernels([kernel], config)
    assert kernel._members is None  # released: no packed copy stays beside the model


# ---- tune, the loader and the options ----------------------------------------------------------------------------


def _tune(path: Path) -> kernel_pick.Tuned:
    from llmtrace.tracer.checkpoint.resolve import resolve_model

    return kernel_pick.tune(resolve_model(str(path), vocabulary=True), torch.device("cpu"))


def test_tune_takes_the_fastest_acceptable_stored_kernel(tiny: Callable[[Q], Path]) -> None:
    q4 = _tune(tiny(Q.Q4_1)).choice  # int4pack acceptable and (fixed timings) fastest
    assert (q4.picked, q4.weights) == ("int4pack", "stored") and q4.timing("int4pack").product_error is None
    loaded = load_model(str(tiny(Q.Q4_1)), AUTO, use_cache=False, weights="tuned")
    assert loaded.weights.kernel == "int4pack" and "as stored (int4pack)" in loaded.weight_format
    q8 = _tune(tiny(Q.Q8_0)).choice  # int4pack refused by its probe: the exact blocks
    assert q8.picked == "blocks"
    int4 = q8.timing("int4pack")
    assert not int4.safe and "probed product error" in int4.unsafe_reason and int4.product_error > 2.0 ** -11
    assert not q8.timing("bf16").safe and "bf16 keeps 8; probed" in q8.timing("bf16").unsafe_reason


def test_an_explicit_dtype_runs_the_default_kernels_with_its_activations(tiny: Callable[[Q], Path]) -> None:
    default = load_model(str(tiny(Q.Q4_1)), AUTO, use_cache=False)
    loaded = load_model(str(tiny(Q.Q4_1)), FP16, use_cache=False)
    assert loaded.kernels.source == rule.OPTION and loaded.kernels.rule.startswith("--dtype fp16 with the default")
    assert loaded.weights.kernel == default.weights.kernel and "fp16 activations" in loaded.weight_format
    same = load_model(str(tiny(Q.Q4_1)), FP32, use_cache=False)  # the default's own dtype: the default itself
    assert same.kernels == default.kernels


@pytest.mark.parametrize(("weights", "mode", "kernel"), [
    ("int4pack", "stored", "int4pack"),
    ("blocks", "stored", "blocks"),
    ("dense", "dense", ""),
])
def test_weights_options(tiny: Callable[[Q], Path], weights: str, mode: str, kernel: str) -> None:
    loaded = load_model(str(tiny(Q.Q8_0)), AUTO, use_cache=False, weights=weights)
    assert (loaded.weights.mode, loaded.weights.kernel) == (mode, kernel)
    assert loaded.kernels.source == rule.OPTION and loaded.kernels.rule == f"--weights {weights}"
    assert loaded.kernels.picked == (kernel or "fp32")


def test_weights_stored_runs_the_tables_stored_kernels(tiny: Callable[[Q], Path]) -> None:
    default = load_model(str(tiny(Q.Q8_0)), AUTO, use_cache=False)
    stored_ = load_model(str(tiny(Q.Q8_0)), AUTO, use_cache=False, weights="stored")
    if default.kernels.weights == rule.STORED:
        assert stored_.weights.kernel == default.weights.kernel
    assert stored_.weights.mode == "stored"


def test_a_store_entry_with_a_mistyped_error_is_refused(tmp_path: Path, tiny: Callable[[Q], Path]) -> None:
    from llmtrace.tracer.checkpoint.resolve import resolve_model

    path = tmp_path / "kernels.json"
    kernel_pick.tune(resolve_model(str(tiny(Q.Q8_0)), vocabulary=True), torch.device("cpu"), store_path=path)
    data = json.loads(path.read_text())
    (machine, models), = data["machines"].items()
    (model, entry), = models.items()
    entry["candidates"][0]["product_error"] = "big"
    path.write_text(json.dumps(data))
    with pytest.raises(kernel_store.StoreProblem, match="product_error"):
        kernel_store.load_choice(machine, model, path)


def test_the_run_header_names_the_kernels_in_one_line_and_the_details_on_request(tiny: Callable[[Q], Path],
                                                                                tmp_path: Path) -> None:
    import jsonschema

    from llmtrace.tracer.trace.run_trace import Trace, load_schema

    out = tmp_path / "t.json"
    args = ["run", "sky", "-m", str(tiny(Q.Q8_0)), "--max-new-tokens", "2", "--no-roofline", "--temperatures", ""]
    result = CliRunner().invoke(app, [*args, "--json", str(out)], terminal_width=80)
    assert result.exit_code == 0, result.output
    isa = kernel_pick.instruction_set(torch.device("cpu"))
    assert "weights stored" not in result.output  # the default is the kernels line's to say, once
    (line,) = [l for l in result.output.splitlines() if l.startswith("kernels ")]
    assert len(line) <= 80 and line.endswith(f"· default, {isa}")
    if isa == "AVX2":
        assert line == f"kernels Q8_0 native (exact) · default, {isa}"
    if isa == "AVX-512 VNNI":  # llama.cpp's own Q8_0 products (kernel_defaults.py)
        assert line == f"kernels Q8_0 i8dot (int8 act.) · default, {isa}"
    assert "  Q8_0" not in result.output  # the details only under --detail kernels
    data = json.loads(out.read_text())
    jsonschema.validate(data, load_schema())
    assert data["kernels"]["source"] == "default" and data["kernels"]["by_type"][0]["type"] == "Q8_0"
    assert Trace.from_json(out.read_text()).kernels.numerics == data["kernels"]["numerics"]
    detail = CliRunner().invoke(app, [*args, "--detail", "kernels", "--no-trace"], terminal_width=80)
    assert detail.exit_code == 0, detail.output
    assert f"kernels: {default_phrase(isa)} (BENCHMARKS.md \"Default kernels\")" in detail.output
    assert any(l.startswith("  Q8_0 ") for l in detail.output.splitlines())
    forced = CliRunner().invoke(app, [*args, "--no-trace", "--weights", "int4pack"], terminal_width=80)
    assert "kernels Q8_0 int4pack (bf16) · --weights int4pack" in forced.output


def test_tune_offers_stored_candidates_beside_dense_ones(tiny: Callable[[Q], Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The stored candidates reach the timer as ProductKernels beside the dense ones; dense fastest -> dense."""
    seen = []

    def dense_fastest(kernels, config, device="cpu", progress=None):
        seen.extend((k.name, k.weights) for k in kernels)
        timings, seconds = fixed_timings(kernels, config)
        return tuple(replace(t, decode_s=t.decode_s * 10) if t.weights == "stored" else t for t in timings), seconds

    monkeypatch.setattr(kernel_pick, "time_kernels", dense_fastest)
    _tune(tiny(Q.Q4_0))
    assert ("int4pack", "stored") in seen and ("blocks", "stored") in seen and ("fp32", "dense") in seen
    loaded = load_model(str(tiny(Q.Q4_0)), AUTO, use_cache=False, weights="tuned")
    assert loaded.weights.mode == "dense" and loaded.kernels.picked == "fp32"
    assert loaded.weights.reason == "tuned (llmtrace tune): Q4_0 matrices dequantized"
    assert next(loaded.model.parameters()).dtype == torch.float32 and FP32.name == "fp32" and FP16.name == "fp16"


@pytest.fixture(scope="module")
def tiny_mixed(tiny_quantized: Callable[..., Path]) -> Path:
    """The tiny LLaMA as Q4_1 matrices with a Q8_0 LM head (as the bundled file mixes them)."""
    return tiny_quantized(Q.Q4_1, head=Q.Q8_0)


def test_a_kernel_per_type_when_no_one_kernel_is_acceptable_for_all(tiny_mixed: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_1 + a Q8_0 head: int4pack is refused (the head), blocks is exact; the plan int4pack for Q4_1 and blocks
    for Q8_0 is a candidate of its own, acceptable type by type, and runs when fastest."""
    def plan_fastest(kernels, config, device="cpu", progress=None):
        timings, seconds = fixed_timings(kernels, config)
        return tuple(replace(t, decode_s=t.decode_s / 100) if ":" in t.name else t for t in timings), seconds

    monkeypatch.setattr(kernel_pick, "time_kernels", plan_fastest)
    monkeypatch.setattr(native_kernel, "available", lambda: False)  # exact for every type, it would run them all
    tuned = _tune(tiny_mixed).choice
    spec = "Q4_1:int4pack,Q8_0:blocks"
    assert tuned.picked == spec and tuned.timing(spec).safe and not tuned.timing("int4pack").safe
    loaded = load_model(str(tiny_mixed), AUTO, use_cache=False, weights="tuned")
    assert loaded.weights.kernel == spec
    formats = {name: w.format.label for name, w in loaded.model.stored_weights().items()}
    assert formats["output"] == "q8_0 (blocks)" and formats["layers.0.attention.wq"] == "q4_1 (int4pack)"
    again = load_model(str(tiny_mixed), AUTO, weights=spec)  # the spec as an option, cached under its own entry
    ids = torch.tensor([[1, 40, 41, 42]])
    dense_ = load_model(str(tiny_mixed), FP32, weights="dense").model
    for model in (loaded.model, again.model, dense_):
        model.setup_cache(1, 8)
    logits = [m.prefill(ids) for m in (loaded.model, again.model, dense_)]
    torch.testing.assert_close(logits[0], logits[1])
    assert (logits[0] - logits[2]).abs().max() <= 0.04 * logits[2].abs().max()


def test_the_probe_reads_a_matrix_first_rows_exactly_as_the_whole_dequantized() -> None:
    """tune's accuracy probe compares a matrix's first rows (a 7B head whole would be 0.5 GB in fp32, 1 GB in
    fp64): reading only those rows' bytes gives exactly the rows of the whole dequantized matrix, in the model's
    order, for a plain matrix and for llama.cpp's interleaved Q rows."""
    from llmtrace.tracer.checkpoint.bundled import bundled_model_path
    from llmtrace.tracer.checkpoint.resolve import resolve_model
    from llmtrace.tracer.load.gguf_loader import exact_rows

    resolved = resolve_model(str(bundled_model_path()))
    header, config = resolved.gguf_header, resolved.config
    for name in ("tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.feed_forward.w3.weight"):
        whole = pack_matrices(header, config, [name], None)[name]
        got = exact_rows(header, config, name, 100)
        assert got.shape == (100, whole.shape[1]) and torch.equal(got, whole[:100])
