"""The no-KV-cache counterfactual: the analytic ratios (LLaMA-7B's 981x per step, 494-540x per generation), the sum
in closed form against the step-by-step sum, and a real replay on the tiny model counted exactly as estimated."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.analytic import estimate
from llmtrace.tracer.analytic.estimate import Dtypes
from llmtrace.tracer.analytic.no_cache import generation_without_cache, step_ratio
from llmtrace.tracer.core.dtypes import get_dtype
from llmtrace.tracer.core.presets import get_preset
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.trace.records import RunSettings
from llmtrace.tracer.trace.run_trace import Trace, load_schema

FP16 = Dtypes.for_weights(get_dtype("fp16"))
runner = CliRunner()


def test_llama_7b_ratios_correct_the_articles_1000x() -> None:
    llama = get_preset("llama-7b")
    # the step that runs t = 1000 positions: a 1000-token prefill against one token reading 999 cached + itself
    assert step_ratio(llama, 1000, FP16) == pytest.approx(980.95, abs=0.01)
    # a whole 1000-token generation: far less, and it depends on the prompt's length
    assert generation_without_cache(llama, 1, 1000, FP16).ratio == pytest.approx(494.07, abs=0.01)
    assert generation_without_cache(llama, 100, 1000, FP16).ratio == pytest.approx(539.81, abs=0.01)


@pytest.mark.parametrize("preset, prompt, new", [("llama-7b", 7, 40), ("llama3-8b", 1, 25)])
def test_closed_form_sum_equals_the_step_by_step_sum(preset: str, prompt: int, new: int) -> None:
    cfg = get_preset(preset)
    result = generation_without_cache(cfg, prompt, new, FP16)
    by_step = sum(estimate.prefill(cfg, prompt + i, FP16).totals.total_flops for i in range(new))
    assert result.uncached_flops == by_step
    assert result.cached_flops == estimate.generation(cfg, prompt, new, FP16).totals.total_flops


@pytest.fixture(scope="module")
def trace(tiny_llama_dir: Path) -> Trace:
    loaded = load_model(str(tiny_llama_dir))
    settings = RunSettings(model=str(tiny_llama_dir), prompt="The capital of France is", max_new_tokens=5,
                           temperatures=(), no_kv_cache=True)
    return generate(loaded, settings)


def test_replay_recomputes_every_step_counted_as_estimated(trace: Trace) -> None:
    run = trace.no_kv_cache
    assert run is not None and run.complete
    prompt = len(trace.tokenization.ids)
    assert [s.step for s in run.steps] == [s.step for s in trace.steps]
    assert [s.positions for s in run.steps] == [prompt + i for i in range(len(trace.steps))]
    assert all(s.same_token for s in run.steps)  # greedy: the recomputation agrees with the cached path
    for s, cached in zip(run.steps, trace.steps):
        assert s.cached_forward_ns == cached.forward_ns and s.forward_ns > 0
        assert s.cached_flops == sum(x.flops for x in trace.stages if x.step == cached.step)
        # counted by the tracer on the real uncached pass == the analytic estimate, exactly, both with and without
        assert (s.flops, s.cached_flops) == (s.analytic_flops, s.analytic_cached_flops)
    assert run.steps[0].flops_ratio == 1.0  # the prefill is the same work either way
    assert [s.flops_ratio for s in run.steps[1:]] == sorted(s.flops_ratio for s in run.steps[1:])  # grows with t
    assert run.flops == sum(s.flops for s in run.steps) and run.flops_ratio == run.flops / run.cached_flops
    assert run.analytic_generation_ratio == pytest.approx(run.flops_ratio)


def test_replay_is_in_the_json_and_schema(trace: Trace) -> None:
    data = json.loads(trace.to_json())
    jsonschema.validate(data, load_schema())
    assert set(load_schema()["$defs"]["NoCacheStep"]["required"]) == set(data["no_kv_cache"]["steps"][0])
    assert set(load_schema()["$defs"]["NoCacheRun"]["required"]) == set(data["no_kv_cache"])
    assert Trace.from_json(trace.to_json()) == trace


def test_off_by_default(tiny_llama_dir: Path, trace: Trace) -> None:
    loaded = load_model(str(tiny_llama_dir))
    plain = generate(loaded, replace(trace.settings, no_kv_cache=False, max_new_tokens=2))
    assert plain.no_kv_cache is None


def test_cli_shows_section_8_in_run_and_show(tiny_llama_dir: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    path = tmp_path / "t.json"
    result = runner.invoke(app, ["run", "sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "3",
                                 "--no-roofline", "--no-kv-cache", "--json", str(path)])
    assert result.exit_code == 0, result.output
    section = result.output[result.output.index("8 · Without a KV cache"):]
    assert "every step's recomputed logits pick the cached run's token" in section
    assert "for the step at t = 1000" in section
    shown = runner.invoke(app, ["show", str(path)])
    assert shown.exit_code == 0
    assert shown.output[shown.output.index("8 · Without a KV cache"):] == section.split("trace written")[0]


def test_cli_no_kv_cache_with_dry_run_is_one_line() -> None:
    result = runner.invoke(app, ["run", "--dry-run", "--no-kv-cache"])
    assert result.exit_code == 2 and "drop --dry-run" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
