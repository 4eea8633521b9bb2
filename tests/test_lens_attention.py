"""--lens and --attention: the lens's last layer is the model's own prediction, the attention rows sum to 1 per head
and equal HF transformers' eager attention weights, nothing is left hooked, and both are off (and free) by default.
The bundled model's " Paris" is followed through its layers."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch
import transformers
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model.fused import watcher
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.trace.records import PREFILL, RunSettings
from llmtrace.tracer.trace.run_trace import Trace, load_schema

PROMPT = "The capital of France is"
runner = CliRunner()


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path):
    return load_model(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def trace(loaded, tiny_llama_dir: Path) -> Trace:
    settings = RunSettings(model=str(tiny_llama_dir), prompt=PROMPT, max_new_tokens=3, temperatures=(), lens=True,
                           attention=True, attention_steps=(0, 2))
    return generate(loaded, settings)


def test_lens_after_the_last_layer_is_the_models_prediction(trace: Trace) -> None:
    n_layers = trace.config.n_layers
    assert [s.step for s in trace.lens] == [s.step for s in trace.steps]
    for lens, step in zip(trace.lens, trace.steps):
        assert [layer.layer for layer in lens.layers] == [None, *range(n_layers)]
        assert lens.token_id == step.token_id and lens.position == step.context_length - 1
        last = lens.layers[-1]
        model_p = {c.token_id: c.prob_raw for c in step.candidates}
        for token in last.top:
            assert token.probability == pytest.approx(model_p[token.token_id], abs=1e-5)
        assert last.chosen_rank == step.sampling.rank == 1  # greedy
        assert last.entropy_bits == pytest.approx(step.sampling.entropy_raw_bits, abs=1e-4)  # the model's own
        assert lens.first_top_layer is not None and lens.first_top_layer <= n_layers - 1
        assert all(layer.chosen_rank > 1 for layer in lens.layers[1:] if layer.layer < lens.first_top_layer)


def test_attention_rows_sum_to_one_and_equal_hf_eager_weights(trace: Trace, tiny_llama_dir: Path) -> None:
    first = trace.attention[0]
    ids = list(trace.tokenization.ids)
    assert first.positions == len(ids) and first.position == len(ids) - 1 and first.weights is not None
    full = torch.tensor(first.weights)  # (layers, H, S)
    assert torch.allclose(full.sum(dim=-1), torch.ones(full.shape[:2]), atol=1e-5)  # every head sums to 1
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32,
                                                       attn_implementation="eager")
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_attentions=True)
    expected = torch.stack([a[0, :, -1, :] for a in out.attentions])  # (layers, H, S): the last query's row
    assert torch.allclose(full, expected, atol=1e-5)
    assert torch.allclose(torch.tensor(first.mean_weights), expected.mean(dim=1), atol=1e-5)
    # each head's summary from HF's own weights: entropy in bits (0 log 0 = 0) and its highest weights
    hf_entropy = -(expected * expected.clamp_min(1e-30).log2()).sum(dim=-1)  # (layers, H)
    hf_top = expected.topk(3, dim=-1).values  # (layers, H, 3)
    assert [(h.layer, h.head) for h in first.heads] == [(i, j) for i in range(len(expected))
                                                         for j in range(expected.shape[1])]
    for head in first.heads:
        assert head.entropy_bits == pytest.approx(float(hf_entropy[head.layer, head.head]), abs=1e-4)
        assert head.top_weights == pytest.approx(hf_top[head.layer, head.head].tolist(), abs=1e-5)
    # decode steps: the new token over every cached position; full weights only for the steps asked for
    for step in trace.attention[1:]:
        assert (step.weights is not None) == (step.step == 2) and step.positions == len(ids) + step.step
        if step.weights is not None:
            assert torch.allclose(torch.tensor(step.weights).sum(dim=-1), torch.ones(full.shape[:2]), atol=1e-5)
        assert all(sum(row) == pytest.approx(1.0, abs=1e-5) for row in step.mean_weights)
        head = step.heads[0]
        assert list(head.top_weights) == sorted(head.top_weights, reverse=True)
        # between all on one position (0 bits) and spread evenly (log2 of the positions); the summary clamps at 0
        assert 0 < head.entropy_bits <= math.log2(step.positions) + 1e-6


def test_hooks_are_gone_and_the_views_are_off_by_default(loaded, trace: Trace, tiny_llama_dir: Path) -> None:
    assert watcher(loaded.model) == ""  # nothing left hooked or wrapped after the observed run
    # the observed run went stage by stage (the hooks watch the stage modules)
    assert any(s.stage.endswith("attention.wq") for s in trace.stages)
    plain = generate(loaded, RunSettings(model=str(tiny_llama_dir), prompt=PROMPT, max_new_tokens=2,
                                         temperatures=()))
    assert plain.lens == () and plain.attention == ()
    assert any(s.stage.endswith("attention.wqkv") for s in plain.stages)  # off: the fused path, as always
    # instrumentation stays apart: the same stages, the same FLOPs as a staged run without the views
    staged = generate(loaded, replace(plain.settings, staged=True, max_new_tokens=3))
    assert [(s.stage, s.flops) for s in staged.stages] == [(s.stage, s.flops) for s in trace.stages]


def test_json_round_trip_schema_and_show(trace: Trace, tmp_path: Path) -> None:
    assert Trace.from_json(trace.to_json()) == trace
    data = json.loads(trace.to_json())
    schema = load_schema()
    jsonschema.validate(data, schema)
    for key, definition in (("lens", "LensStep"), ("attention", "AttentionStep")):
        assert set(schema["$defs"][definition]["required"]) == set(data[key][0])
    assert set(schema["$defs"]["LensLayer"]["required"]) == set(data["lens"][0]["layers"][0])
    assert set(schema["$defs"]["HeadFocus"]["required"]) == set(data["attention"][0]["heads"][0])
    path = tmp_path / "t.json"
    path.write_text(trace.to_json())
    shown = runner.invoke(app, ["show", str(path)])
    assert shown.exit_code == 0, shown.output
    assert "5c · Logit lens" in shown.output and "first becomes the top token after layer" in shown.output
    assert "5d · Attention" in shown.output and "heads put most weight on position 0" in shown.output


def test_bundled_paris_takes_shape_in_the_last_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    # the exact kernel: the lens's figures are the file's values' (the default's int8 activations move them a little,
    # and its view says so: issue 31)
    result = runner.invoke(app, ["run", "capital", "--max-new-tokens", "1", "--lens", "--no-roofline",
                                 "--temperatures", "", "--threads", "1", "--weights", "native"])
    assert result.exit_code == 0, result.output
    lens = result.output[result.output.index("5c · Logit lens"):result.output.index("6 · Decode")]
    assert "·Paris first becomes the top token after layer 29 of 30" in lens
    assert "L29    ·Paris 77%" in lens and "◀ first top" in lens
    assert "numerics: exact (the file's values, fp32 products)" in lens


def test_bad_attention_steps_are_one_line(tiny_llama_dir: Path) -> None:
    result = runner.invoke(app, ["run", "sky", "--model", str(tiny_llama_dir), "--attention", "--attention-steps",
                                 "0,-1"])
    assert result.exit_code == 2 and "--attention-steps takes step numbers" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
