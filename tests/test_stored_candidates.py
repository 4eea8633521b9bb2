"""Stored kernels as measured candidates (issue 12 item 2): one accuracy rule for dense and stored candidates (with
injected probe errors, and the real probe on tiny GGUFs), the stored kernels timed through PackedWeight at the
model's shapes, `--weights auto|stored|dense|<kernel>` with `--dtype` as recorded overrides, an old kernels.json,
and the trace/JSON record. No timed assertions: the fixed timer of conftest ranks the candidates."""

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
from llmtrace.tracer.hardware.kernel_choice import CandidateTiming, constrained, judge, precision_bits, select
from llmtrace.tracer.hardware.product_timing import product_shapes, time_kernel, time_kernels
from llmtrace.tracer.load import kernel_pick
from llmtrace.tracer.load.gguf_loader import matrix_infos
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
    choice = select([dense("fp32", 10), dense("fp16", 6), stored("int4pack", 3, safe=False, error=3e-3),
                     stored("blocks", 5)])
    assert (choice.picked, choice.weights, choice.decode_kernel) == ("blocks", rule.STORED, "blocks")
    assert "refused: int4pack: probe" in choice.rule and choice.candidates[-1].name == "int4pack"


def test_options_constrain_the_candidates_and_are_recorded() -> None:
    choice = select([dense("fp32", 10), dense("fp16", 6), stored("int4pack", 3, safe=False), stored("blocks", 5)])
    assert constrained(choice, "--weights dense", weights=rule.DENSE).ran == "fp16"
    assert constrained(choice, "--weights stored", weights=rule.STORED).ran == "blocks"  # acceptable first
    forced = constrained(choice, "--weights int4pack", weights=rule.STORED, kernel="int4pack")
    assert (forced.ran, forced.picked, forced.overridden_by) == ("int4pack", "blocks", "--weights int4pack")
    assert forced.running is not None and forced.running.name == "int4pack"
    assert constrained(choice, "--dtype fp32 --weights dense", dtype="fp32", weights=rule.DENSE).ran == "fp32"
    assert constrained(choice, "--dtype fp32", dtype="fp32").ran == "blocks"  # stored runs fp32 activations too
    assert constrained(choice, "--dtype bf16 --weights dense", dtype="bf16", weights=rule.DENSE).ran == ""


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


# ---- the loader and the options -----------------------------------------------------------------------------------


def test_auto_takes_the_fastest_acceptable_stored_kernel(tiny: Callable[[Q], Path]) -> None:
    q4 = load_model(str(tiny(Q.Q4_1)), AUTO, use_cache=False)  # int4pack acceptable and (fixed timings) fastest
    assert (q4.weights.mode, q4.weights.kernel, q4.kernels.picked) == ("stored", "int4pack", "int4pack")
    assert "as stored (int4pack)" in q4.weight_format and q4.kernels.timing("int4pack").product_error is None
    q8 = load_model(str(tiny(Q.Q8_0)), AUTO, use_cache=False)  # int4pack refused by its probe: the exact blocks
    assert (q8.weights.mode, q8.weights.kernel, q8.kernels.picked) == ("stored", "blocks", "blocks")
    int4 = q8.kernels.timing("int4pack")
    assert not int4.safe and "probed product error" in int4.unsafe_reason and int4.product_error > 2.0 ** -11
    assert "bf16: Q8_0 matrices need 11 significand bits, bf16 keeps 8; probed" in q8.kernels.rule


def test_an_explicit_dtype_still_measures_the_weights_choice_and_records_it(tiny: Callable[[Q], Path]) -> None:
    loaded = load_model(str(tiny(Q.Q4_1)), FP16, use_cache=False)
    assert loaded.kernels.overridden_by == "--dtype fp16" and loaded.kernels.ran == "int4pack"
    assert loaded.weights.kernel == "int4pack" and "fp16 activations" in loaded.weight_format
    again = load_model(str(tiny(Q.Q4_1)), FP32, use_cache=False, weights="dense")  # read back, not measured
    assert again.kernels.from_store and again.kernels.ran == "fp32" and again.weights.mode == "dense"


@pytest.mark.parametrize(("weights", "mode", "kernel", "ran"), [
    ("stored", "stored", "blocks", "blocks"),
    ("int4pack", "stored", "int4pack", "int4pack"),
    ("dense", "dense", "", "fp32"),
])
def test_weights_overrides(tiny: Callable[[Q], Path], weights: str, mode: str, kernel: str, ran: str) -> None:
    loaded = load_model(str(tiny(Q.Q8_0)), AUTO, use_cache=False, weights=weights)
    assert (loaded.weights.mode, loaded.weights.kernel) == (mode, kernel)
    assert loaded.kernels.overridden_by == f"--weights {weights}" and loaded.kernels.ran == ran
    assert loaded.kernels.picked == "blocks"


def test_an_old_kernel_store_is_measured_again_with_one_note(tiny: Callable[[Q], Path]) -> None:
    path = kernel_store.kernels_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": 1, "machines": {"m": {"k": {}}}}))
    loaded = load_model(str(tiny(Q.Q4_0)), AUTO, use_cache=False)
    assert "older llmtrace (version 1" in loaded.kernel_note and "measuring again" in loaded.kernel_note
    assert json.loads(path.read_text())["version"] == kernel_store.STORE_VERSION
    assert loaded.kernels.picked == "int4pack"


def test_a_store_entry_with_an_unknown_ran_is_refused(tmp_path: Path) -> None:
    choice = select([dense("fp32", 10), stored("blocks", 5)])
    path = tmp_path / "kernels.json"
    kernel_store.save_choice("m", "x", choice, path)
    data = json.loads(path.read_text())
    data["machines"]["m"]["x"]["ran"] = "int2"
    path.write_text(json.dumps(data))
    with pytest.raises(kernel_store.StoreProblem, match="ran"):
        kernel_store.load_choice("m", "x", path)
    data["machines"]["m"]["x"].update(ran="", candidates=[dict(data["machines"]["m"]["x"]["candidates"][0],
                                                              product_error="big")])
    path.write_text(json.dumps(data))
    with pytest.raises(kernel_store.StoreProblem, match="product_error"):
        kernel_store.load_choice("m", "x", path)


def test_the_run_header_and_the_trace_show_every_candidate(tiny: Callable[[Q], Path], tmp_path: Path) -> None:
    import jsonschema

    from llmtrace.tracer.trace.run_trace import Trace, load_schema

    out = tmp_path / "t.json"
    result = CliRunner().invoke(app, ["run", "sky", "-m", str(tiny(Q.Q8_0)), "--max-new-tokens", "2", "--no-roofline",
                                      "--temperatures", "", "--json", str(out)], terminal_width=80)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "weights stored" not in text  # auto's pick is the kernels line's to say, once
    assert "kernels: auto, measured in" in text and "blocks (stored, fp32 activations), fastest of" in text
    assert "int4pack: Q8_0 matrices need 11 significand bits, int4pack keeps 8; probed product error" in text
    assert "int4pack" in text and "(refused, probe error" in text
    data = json.loads(out.read_text())
    jsonschema.validate(data, load_schema())
    names = [c["name"] for c in data["kernels"]["candidates"]]
    assert set(names) == {"fp32", "fp16", "bf16", *all_kernels()}
    assert Trace.from_json(out.read_text()).kernels.timing("int4pack").product_error > 2.0 ** -11
    forced = CliRunner().invoke(app, ["run", "sky", "-m", str(tiny(Q.Q8_0)), "--max-new-tokens", "1", "--no-trace",
                                      "--no-roofline", "--temperatures", "", "--weights", "int4pack"], terminal_width=80)
    text = " ".join(forced.output.split())
    assert "kernels: --weights int4pack (overrides auto): ran int4pack (stored, fp32 activations); auto would take " \
           "blocks (stored, fp32 activations)" in text


def test_a_fake_timer_sees_stored_candidates(tiny: Callable[[Q], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The stored candidates reach the timer as ProductKernels beside the dense ones; dense fastest -> dense."""
    seen = []

    def dense_fastest(kernels, config, device="cpu", progress=None, steps=None):
        seen.extend((k.name, k.weights) for k in kernels)
        timings, seconds = fixed_timings(kernels, config)
        return tuple(replace(t, decode_s=t.decode_s * 10) if t.weights == "stored" else t for t in timings), seconds

    monkeypatch.setattr(kernel_pick, "time_kernels", dense_fastest)
    loaded = load_model(str(tiny(Q.Q4_0)), AUTO, use_cache=False)
    assert ("int4pack", "stored") in seen and ("blocks", "stored") in seen and ("fp32", "dense") in seen
    assert loaded.weights.mode == "dense" and loaded.kernels.picked == "fp32"
    assert "auto: fp32 dense is the fastest acceptable candidate" in loaded.weights.reason
    assert next(loaded.model.parameters()).dtype == torch.float32 and FP32.name == "fp32" and FP16.name == "fp16"


@pytest.fixture(scope="module")
def tiny_mixed(tiny_quantized: Callable[..., Path]) -> Path:
    """The tiny LLaMA as Q4_1 matrices with a Q8_0 LM head (as the bundled file mixes them)."""
    return tiny_quantized(Q.Q4_1, head=Q.Q8_0)


def test_a_kernel_per_type_when_no_one_kernel_is_acceptable_for_all(tiny_mixed: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_1 + a Q8_0 head: int4pack is refused (the head), blocks is exact; the plan int4pack for Q4_1 and blocks
    for Q8_0 is a candidate of its own, acceptable type by type, and runs when fastest."""
    def plan_fastest(kernels, config, device="cpu", progress=None, steps=None):
        timings, seconds = fixed_timings(kernels, config)
        return tuple(replace(t, decode_s=t.decode_s / 100) if ":" in t.name else t for t in timings), seconds

    monkeypatch.setattr(kernel_pick, "time_kernels", plan_fastest)
    monkeypatch.setattr(native_kernel, "available", lambda: False)  # exact for every type, it would run them all
    loaded = load_model(str(tiny_mixed), AUTO, use_cache=False)
    spec = "Q4_1:int4pack,Q8_0:blocks"
    assert loaded.kernels.picked == spec and loaded.weights.kernel == spec and loaded.kernels.timing(spec).safe
    assert not loaded.kernels.timing("int4pack").safe
    formats = {name: w.format.label for name, w in loaded.model.stored_weights().items()}
    assert formats["output"] == "q8_0 (blocks)" and formats["layers.0.attention.wq"] == "q4_1 (int4pack)"
    again = load_model(str(tiny_mixed), AUTO, weights=spec)  # the spec as an option, cached under its own entry
    ids = torch.tensor([[1, 40, 41, 42]])
    dense = load_model(str(tiny_mixed), FP32, weights="dense").model
    for model in (loaded.model, again.model, dense):
        model.setup_cache(1, 8)
    logits = [m.prefill(ids) for m in (loaded.model, again.model, dense)]
    torch.testing.assert_close(logits[0], logits[1])
    assert (logits[0] - logits[2]).abs().max() <= 0.04 * logits[2].abs().max()
