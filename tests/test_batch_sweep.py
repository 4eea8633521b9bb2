"""The batch sweep and the decode prediction from kernels measured at decode shapes (issue 14, item 5).

No timing is asserted (speed lives in BENCHMARKS.md): the prediction's arithmetic against a hand computation from
given ceilings, the crossover rule, the ceilings' store, the measurement's records and the sweep's on a tiny
random model, the CLI's bad input, its JSON against its schema, and the rendered table against golden files.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core import contract
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.core.presets import get_preset
from llmtrace.tracer.hardware.decode_ceilings import (
    BatchCeilings,
    DecodeCeilings,
    DecodeCeilingsProblem,
    ProductTime,
    dense_key,
    load_ceilings,
    save_ceilings,
    shapes_key,
)
from llmtrace.tracer.hardware.product_shapes import product_shapes
from llmtrace.tracer.hardware.profiles import HardwareProfile, get_profile
from llmtrace.tracer.roofline.kernel_decode import (
    COPY_AND_GEMM,
    CROSSOVER_RULE,
    DATASHEET,
    MEASURED_KERNELS,
    growth_crossover,
    kernel_step,
    mean_step_seconds,
)
from llmtrace.tracer.run.backends import PackedBackend, backend_for

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("LLMTRACE_UPDATE_GOLDEN") == "1"
SMOL = get_preset("smollm2-135m")  # 30 layers, 9 heads over 3 KV heads of 64, dim 576
MACHINE = HardwareProfile("this-machine", "test CPU", 20e9, 16 * 2**30, 100e9, None, None, None, None, None,
                          "none", 0.0, "test", measured=True)


def ceilings_for(config, batches=(1, 2, 8), context=10, device="AMD EPYC", weights="dense fp32",
                 measured_at="2026-12-01T20:00:00+00:00") -> DecodeCeilings:
    """Hand-made ceilings: each product takes (1 + batch) µs per call times its position in the step (1..5), the
    other ops are 400 + batch at 10 µs each."""
    entries = []
    for b in batches:
        products = tuple(ProductTime(s.role, s.rows, s.cols, s.per_layer, (1 + b) * 1e-6 * (i + 1))
                         for i, s in enumerate(product_shapes(config)))
        entries.append(BatchCeilings(batch=b, products=products, ops=400 + b, other_seconds=(400 + b) * 10e-6,
                                     context=context))
    return DecodeCeilings(machine=f"cpu|{device}|torch x|AVX2|2 threads", device_name=device,
                          shapes=shapes_key(config), weights=weights, formats="fp32", compute_dtype="fp32",
                          n_layers=config.n_layers, memory_bandwidth=20e9, measured_at=measured_at,
                          batches=tuple(entries))


# ---- the prediction's arithmetic ----------------------------------------------------------------------------


def test_kernel_step_is_products_plus_ops_plus_context_bytes_by_hand() -> None:
    c = ceilings_for(SMOL)
    # products: the four per-layer ones (positions 1-4) x 30 layers + the LM head (position 5), (1 + B) µs each
    def products(b: int) -> float:
        return (1 + b) * 1e-6 * ((1 + 2 + 3 + 4) * 30 + 5)

    # each position beyond the measured context: per layer K and V rows of 3 KV heads x 64 fp32 values, and the
    # eager scores (B x 9 heads fp32) written by QKᵀ, read + written by the scaling and the softmax, read by PV
    def context_bytes(b: int, extra: int) -> int:
        return extra * 30 * (2 * b * 3 * 64 * 4 + 6 * b * 9 * 4)

    step = kernel_step(c, SMOL, 2, 25)
    assert step.products_seconds == pytest.approx(products(2))
    assert step.ops == 402 and step.ops_seconds == pytest.approx(402 * 10e-6) and not step.interpolated
    assert step.op_seconds == pytest.approx(10e-6)
    assert step.context_bytes == context_bytes(2, 25 - 10)
    assert step.context_seconds == pytest.approx(context_bytes(2, 15) / 20e9)
    assert step.seconds == pytest.approx(products(2) + 402 * 10e-6 + context_bytes(2, 15) / 20e9)
    assert kernel_step(c, SMOL, 1, 10).context_bytes == 0  # at the measured context: nothing added


def test_kernel_step_interpolates_between_and_extends_past_the_measured_batches() -> None:
    c = ceilings_for(SMOL)  # measured at 1, 2, 8: every term is linear in the batch, so interpolation is exact
    for b in (4, 5, 16):
        step = kernel_step(c, SMOL, b, 10)
        assert step.interpolated
        assert step.products_seconds == pytest.approx((1 + b) * 1e-6 * (10 * 30 + 5))
        assert step.ops == 400 + b and step.ops_seconds == pytest.approx((400 + b) * 10e-6)
    assert kernel_step(c, SMOL, 1, 10).products_seconds == pytest.approx(2e-6 * 305)


def test_mean_step_is_the_mean_of_every_step_because_each_is_affine_in_its_context() -> None:
    c = ceilings_for(SMOL)
    first, last, mean = mean_step_seconds(c, SMOL, 2, 20, 7)
    steps = [kernel_step(c, SMOL, 2, 20 + k).seconds for k in range(1, 8)]
    assert (first.kv_len, last.kv_len) == (21, 27)
    assert mean == pytest.approx(sum(steps) / len(steps))


def test_growth_crossover_rule() -> None:
    r2 = math.sqrt(2)
    # two roofs max(M, c B) sampled at their meeting point B* = 8 and at 2 B*: exactly B*
    assert growth_crossover([1, 2, 4, 8, 16, 32], [0.5, 1, 1, 1, 2, 4]) == pytest.approx(8.0)
    # the floor is the smallest step at batch >= 2 (10 ms); 14.1 ms is reached between 8 (11) and 16 (16) ms,
    # log-log: 8 * 2 ** (log(14.14/11) / log(16/11)), then divided by √2
    expected = 8 * 2 ** (math.log(0.010 * r2 / 0.011) / math.log(0.016 / 0.011)) / r2
    assert growth_crossover([1, 2, 4, 8, 16, 32], [0.010, 0.010, 0.010, 0.011, 0.016, 0.032]) == pytest.approx(expected)
    # batch 1's faster kernel is not a crossover: 1 -> 2 doubles the step, then it stays within √2 of its floor
    assert growth_crossover([1, 2, 4, 8], [0.005, 0.010, 0.010, 0.013]) is None
    # noise within √2 of the floor does not move it: a dip at 4 and a bump at 8 give the same crossover
    assert growth_crossover([2, 4, 8, 16, 32], [1.0, 0.95, 1.3, 2.0, 4.0]) == pytest.approx(
        8 * 2 ** (math.log(0.95 * r2 / 1.3) / math.log(2.0 / 1.3)) / r2)
    assert growth_crossover([1], [1.0]) is None and growth_crossover([1, 2], [1.0, 3.0]) is None


# ---- the store ----------------------------------------------------------------------------------------------


def test_ceilings_store_round_trip_latest_wins_damage_is_one_error(tmp_path: Path) -> None:
    path = tmp_path / "decode_kernels.json"
    old = ceilings_for(SMOL, measured_at="2026-12-01T19:00:00+00:00")
    new = replace(ceilings_for(SMOL, measured_at="2026-12-01T20:00:00+00:00"), machine="cpu|AMD EPYC|torch y|AVX2|1")
    save_ceilings(old, path)
    save_ceilings(new, path)
    assert load_ceilings("AMD EPYC", shapes_key(SMOL), dense_key("fp32"), path) == new
    assert load_ceilings("Other CPU", shapes_key(SMOL), dense_key("fp32"), path) is None
    assert load_ceilings("AMD EPYC", shapes_key(SMOL), "stored", path) is None
    assert load_ceilings("AMD EPYC", shapes_key(get_preset("llama-7b")), dense_key("fp32"), path) is None
    data = json.loads(path.read_text())
    entry = next(iter(data["entries"].values()))
    entry["batches"][0]["other_seconds"] = -1
    path.write_text(json.dumps(data))
    with pytest.raises(DecodeCeilingsProblem, match="other_seconds"):
        load_ceilings("AMD EPYC", shapes_key(SMOL), dense_key("fp32"), path)
    path.write_text("{not json")
    with pytest.raises(DecodeCeilingsProblem, match="not valid JSON"):
        load_ceilings("AMD EPYC", shapes_key(SMOL), dense_key("fp32"), path)
    save_ceilings(old, path)  # a damaged file is replaced by the next measurement
    assert load_ceilings("AMD EPYC", shapes_key(SMOL), dense_key("fp32"), path) == old


def test_roofline_reads_saved_ceilings_for_this_machine_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmtrace.tracer.core.dtypes import FP32
    from llmtrace.tracer.hardware import decode_ceilings
    from llmtrace.tracer.roofline.analysis import roofline
    from llmtrace.tracer.roofline.measured_decode import measured_roofline

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setattr(decode_ceilings, "this_cpu_name", lambda: "AMD EPYC")
    monkeypatch.setattr("llmtrace.tracer.roofline.measured_decode.this_cpu_name", lambda: "AMD EPYC")
    report = roofline(SMOL, MACHINE, prompt_len=20, new_tokens=8, batch=2, dtype=FP32, check_fit=False)
    assert report.decode_ceilings == COPY_AND_GEMM and report.kernel_decode is None
    gpu = roofline(SMOL, get_profile("h100-sxm"), prompt_len=20, new_tokens=8)
    assert gpu.decode_ceilings == DATASHEET
    assert measured_roofline(gpu, SMOL, get_profile("h100-sxm"), FP32, "option").kernel_decode is None

    c = ceilings_for(SMOL)
    save_ceilings(c)
    shown = measured_roofline(report, SMOL, MACHINE, FP32, "option")
    k = shown.kernel_decode
    assert shown.decode_ceilings == MEASURED_KERNELS and k is not None
    assert k.first_step == kernel_step(c, SMOL, 2, 21) and k.last_step == kernel_step(c, SMOL, 2, 27)
    assert k.time_per_output_token_seconds == pytest.approx(mean_step_seconds(c, SMOL, 2, 20, 7)[2])
    assert [r.batch for r in k.table] == [r.batch for r in report.batch_table]
    assert shown.generation == report.generation  # the copy + GEMM figures stay, beside the kernels'

    (tmp_path / "llmtrace" / "decode_kernels.json").write_text("[]")
    damaged = measured_roofline(report, SMOL, MACHINE, FP32, "option")
    assert damaged.kernel_decode is None and damaged.decode_ceilings == COPY_AND_GEMM
    assert any("decode ceilings not used" in n and "--batch-sweep" in n for n in damaged.notes)


# ---- measuring, on a tiny model -------------------------------------------------------------------------------


def test_measured_ceilings_have_every_product_and_count_the_other_ops(tiny_llama_dir: Path) -> None:
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.run.decode_measure import measure_decode_ceilings

    loaded = load_model(str(tiny_llama_dir))
    ids = loaded.tokenizer.encode("Once upon a time")
    seen = []
    c = measure_decode_ceilings(loaded, ids, (1, 3), 20e9, steps=2, repeats=1, progress=seen.append)
    assert seen == ["kernels at batch 1", "kernels at batch 3"]
    assert c.batch_sizes == (1, 3) and c.weights == "dense fp32" and c.formats == "fp32"
    assert c.shapes == shapes_key(loaded.config) and c.n_layers == loaded.config.n_layers
    non_products = [s for s in contract.fused_stages(loaded.config)
                    if s.in_layer and s.kind not in ("linear", "lm_head")]
    for entry in c.batches:
        assert [(p.role, p.rows, p.cols, p.per_layer) for p in entry.products] == [
            (s.role, s.rows, s.cols, s.per_layer) for s in product_shapes(loaded.config)]
        assert all(p.seconds > 0 for p in entry.products)
        # every non-product stage of every layer runs at least one tensor op
        assert entry.ops >= len(non_products) * loaded.config.n_layers
        assert entry.other_seconds > 0 and entry.context >= len(ids) + 1
    assert isinstance(backend_for(loaded.model), PackedBackend)  # nothing left watching the model
    loaded.model.setup_cache(1, 16)
    import torch

    with torch.no_grad():
        logits = loaded.model.prefill(torch.tensor([ids]))
    assert bool(torch.isfinite(logits).all())


def test_sweep_records_on_a_tiny_model(tiny_llama_dir: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.run.batch_sweep import sweep

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    loaded = load_model(str(tiny_llama_dir))
    fixed = ceilings_for(loaded.config, batches=(1, 2, 4))
    asked = []

    def measure(loaded_, ids, batches, bandwidth, progress=None):  # noqa: ANN001, ANN202
        asked.append((tuple(batches), bandwidth))
        return replace(fixed, batches=tuple(b for b in fixed.batches if b.batch in batches))

    heard = []
    result = sweep(loaded, MACHINE, ("Once upon a time",) * 4, (1, 2, 4), measure, steps=3, repeats=2,
                   progress=heard.append)
    assert asked == [((1,), 20e9), ((2,), 20e9), ((4,), 20e9)] * 2  # each batch after each of its generations
    assert sum("decode at batch" in h for h in heard) == 6 and sum("kernels at batch" in h for h in heard) == 6
    assert [r.batch for r in result.rows] == [1, 2, 4]
    prompt = len(loaded.tokenizer.encode("Once upon a time"))
    assert result.prompt_tokens == prompt and result.decode_steps == 3 and result.repeats == 2
    for r in result.rows:
        assert r.steps_timed == 6  # 3 steps x 2 rounds, every one with the whole batch
        assert r.measured_min_s <= r.measured_step_s <= r.measured_max_s
        assert r.predicted_step_s == pytest.approx(mean_step_seconds(fixed, loaded.config, r.batch, prompt, 3)[2])
        assert r.measured_over_predicted == pytest.approx(r.measured_step_s / r.predicted_step_s)
        assert r.predicted_ops == 400 + r.batch
    assert result.predicted_crossover == growth_crossover([1, 2, 4], [r.predicted_step_s for r in result.rows])
    assert result.measured_crossover == growth_crossover([1, 2, 4], [r.measured_step_s for r in result.rows])
    worst = max(max(r.measured_over_predicted, 1 / r.measured_over_predicted) for r in result.rows)
    assert result.worst_ratio == pytest.approx(worst)
    assert result.ceilings_saved_to == str(tmp_path / "llmtrace" / "decode_kernels.json")
    with pytest.raises(BadArgumentError, match="at least 2 decode steps"):
        sweep(loaded, MACHINE, ("x",), (1,), measure, steps=1)


def test_parse_batches_and_prompts() -> None:
    from llmtrace.tracer.run.batch_spec import parse_batches
    from llmtrace.tracer.run.batch_sweep import sweep_prompts

    assert parse_batches("1,2,4, 8") == (1, 2, 4, 8)
    for bad in ("", " ", "1,,2", "1,x", "4,2", "0,1", "1,1", "1.5", "5000"):
        with pytest.raises(BadArgumentError, match="--batch-sweep"):
            parse_batches(bad)
    assert sweep_prompts(("a",), (1, 2), from_file=False) == ("a", "a")
    assert sweep_prompts(("a", "b", "c"), (1, 2), from_file=True) == ("a", "b")
    with pytest.raises(BadArgumentError, match="--file has 2"):
        sweep_prompts(("a", "b"), (1, 4), from_file=True)


# ---- the CLI -----------------------------------------------------------------------------------------------


def _cli(*args: str, config: Path, input_: str | None = None):  # noqa: ANN202
    env = {"XDG_CONFIG_HOME": str(config), "COLUMNS": "80", "LLMTRACE_DEBUG": None}
    return CliRunner().invoke(app, ["run", *args], env=env, input=input_)


@pytest.mark.parametrize("args, message", [
    (["--batch-sweep", ""], "--batch-sweep takes batch sizes"),
    (["--batch-sweep", "0,1"], "from 1 to"),
    (["--batch-sweep", "one,two"], "whole numbers"),
    (["--batch-sweep", "1,2", "--batch", "2"], "drop --batch"),
    (["--batch-sweep", "1,2", "--temperature", "0.7"], "drop --temperature"),
    (["--batch-sweep", "1,2", "--max-new-tokens", "2"], "at least 2"),
])
def test_bad_sweep_input_is_one_line_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    result = _cli("hello", "--model", "/nonexistent-never-loaded", *args, config=tmp_path)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.output


def test_sweep_more_batches_than_file_prompts_is_one_line(tiny_llama_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n\n")
    result = _cli("--file", str(prompts), "--model", str(tiny_llama_dir), "--batch-sweep", "1,2,4",
                  config=tmp_path)
    assert result.exit_code == 2 and "--file has 2" in result.stderr and "Traceback" not in result.output


def test_sweep_cli_json_matches_its_schema(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import jsonschema

    from llmtrace.tracer.hardware.store import save_measured_profile

    save_measured_profile(MACHINE, {"device": "cpu"}, tmp_path / "llmtrace" / "hardware.json")  # no measuring
    result = _cli("Once upon a time", "--model", str(tiny_llama_dir), "--batch-sweep", "1,2",
                  "--max-new-tokens", "3", "--json", "-", config=tmp_path)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    schema_path = Path(__file__).resolve().parents[1] / "tracer" / "run" / "batch_sweep_schema.json"
    jsonschema.validate(data, json.loads(schema_path.read_text()))
    assert [r["batch"] for r in data["rows"]] == [1, 2] and data["ceilings"] == MEASURED_KERNELS
    assert "Batch sweep" in result.stderr  # the view goes to stderr when the JSON has stdout
    saved = json.loads((tmp_path / "llmtrace" / "decode_kernels.json").read_text())
    assert len(saved["entries"]) == 1


# ---- the view ------------------------------------------------------------------------------------------------


def fixed_sweep():  # noqa: ANN201
    from llmtrace.tracer.run.batch_sweep import BatchSweep, SweepRow

    rows = []
    for b, measured, predicted, roof in ((1, 0.0953, 0.0801, 0.0347), (2, 0.1695, 0.1512, 0.0349),
                                         (4, 0.1912, 0.1650, 0.0354), (8, 0.1669, 0.1701, 0.0364),
                                         (16, 0.2063, 0.2110, 0.0590), (32, 0.2518, 0.2498, 0.1181),
                                         (64, 0.3913, 0.3502, 0.2362)):
        rows.append(SweepRow(
            batch=b, steps_timed=48, measured_step_s=measured, measured_min_s=measured * 0.9,
            measured_max_s=measured * 1.3, predicted_step_s=predicted, predicted_products_s=predicted * 0.7,
            predicted_ops=1575 if b > 1 else 1605, predicted_ops_s=predicted * 0.3,
            # negative where the sweep's contexts are shorter than the one the ops were measured at
            predicted_context_s=-2e-4 if b < 4 else 1e-4,
            measured_over_predicted=measured / predicted, roofline_step_s=roof,
            roofline_bound="memory" if b < 16 else "compute", measured_over_roofline=measured / roof,
            measured_tokens_per_s=b / measured, predicted_tokens_per_s=b / predicted))
    return BatchSweep(
        model="SmolLM2-135M-Instruct", weights="dense fp32", formats="fp32", compute_dtype="fp32", device_name="AMD EPYC",
        machine="cpu|AMD EPYC|torch 2.13.0+cpu|AVX2|2 threads", prompts=1, prompt_tokens=5, decode_steps=16,
        repeats=3, ceilings=MEASURED_KERNELS, roofline_ceilings=COPY_AND_GEMM, roofline_weights="fp32",
        peak_flops=73.3e9, memory_bandwidth=15.63e9, rows=tuple(rows),
        crossover_rule=CROSSOVER_RULE, measured_crossover=21.4, predicted_crossover=19.8, roofline_crossover=11.3,
        roofline_exact_crossover=11,
        worst_ratio=1.19, goal_met=True, ceilings_saved_to="~/.config/llmtrace/decode_kernels.json", note="")


@pytest.mark.parametrize("width", (80, 120))
def test_sweep_view_matches_golden(width: int) -> None:
    from rich.cells import cell_len
    from rich.console import Console

    from llmtrace.cli.render_batch_sweep import render_batch_sweep

    out = io.StringIO()
    render_batch_sweep(Console(file=out, width=width, color_system=None, force_terminal=False), fixed_sweep())
    text = out.getvalue()
    golden = GOLDEN / f"batch-sweep-{width}.txt"
    if UPDATE:
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8")
    assert all(cell_len(line) <= width for line in text.splitlines())
    # a user's view: no benchmark's "goal", and no negative time (the context term is shown added to the ops')
    assert "goal" not in text and not re.search(r"(?<![\w.])[-−]\d", text), text
    assert json.loads(json.dumps(asdict(fixed_sweep())))["rows"][0]["batch"] == 1
    assert math.isclose(fixed_sweep().rows[0].measured_over_predicted, 0.0953 / 0.0801)


@pytest.mark.parametrize("width", (80, 120))
def test_roofline_view_with_measured_kernels_matches_golden(width: int, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.cells import cell_len
    from rich.console import Console

    from llmtrace.cli.render_roofline import render_report
    from llmtrace.tracer.core.dtypes import FP32
    from llmtrace.tracer.roofline.analysis import roofline
    from llmtrace.tracer.roofline.measured_decode import with_measured_kernels

    report = roofline(SMOL, MACHINE, prompt_len=5, new_tokens=17, batch=1, dtype=FP32, check_fit=False)
    shown = with_measured_kernels(report, SMOL, ceilings_for(SMOL, batches=(1, 2, 4, 8, 16, 32, 64)))
    out = io.StringIO()
    render_report(Console(file=out, width=width, color_system=None, force_terminal=False), shown)
    text = out.getvalue()
    golden = GOLDEN / f"roofline-kernels-{width}.txt"
    if UPDATE:
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8")
    assert all(cell_len(line) <= width for line in text.splitlines())
    assert "Decode from measured kernels at decode shapes" in text


def test_combine_takes_each_batch_median_over_rounds() -> None:
    from llmtrace.tracer.hardware.decode_ceilings import combine

    rounds = []
    for k, scale in enumerate((1.0, 3.0, 2.0)):
        c = ceilings_for(SMOL, batches=(1, 4), measured_at=f"2026-12-01T20:0{k}:00+00:00")
        rounds.append(replace(c, batches=tuple(
            replace(b, other_seconds=b.other_seconds * scale,
                    products=tuple(replace(p, seconds=p.seconds * scale) for p in b.products))
            for b in c.batches)))
    one = [replace(r, batches=r.batches[:1]) for r in rounds] + [replace(r, batches=r.batches[1:]) for r in rounds]
    combined = combine(one)
    middle = ceilings_for(SMOL, batches=(1, 4))  # the median scale is 2.0
    assert combined.batch_sizes == (1, 4) and combined.measured_at == "2026-12-01T20:02:00+00:00"
    for got, base in zip(combined.batches, middle.batches):
        assert got.other_seconds == pytest.approx(2.0 * base.other_seconds) and got.ops == base.ops
        assert [p.seconds for p in got.products] == pytest.approx([2.0 * p.seconds for p in base.products])
