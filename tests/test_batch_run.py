"""`llmtrace run --batch N` (llmtrace.tracer.run.batch_generate): prompts of different lengths in one left-padded
batch, each sequence on its own positions, sampler and stop, finished sequences leaving the batch.

What is held: each sequence's greedy tokens equal its own batch-1 run's (fp32); the pads change no logit (not even a
bit, whatever their ids); the traced stage shapes are [N, ...] and their matmul FLOPs FlopCounterMode's for the
batched tensors; the KV bytes per sequence and in total are the cache's; the trace reads back equal.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model.transformer import build_random_model
from llmtrace.tracer.run.backends import backend_for
from llmtrace.tracer.run.batch_generate import BatchGeneration
from llmtrace.tracer.run.batch_spec import check_batch_settings
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.run.select import Request
from llmtrace.tracer.trace.hooks import Tracer
from llmtrace.tracer.trace.records import DECODE, MATMUL_KINDS, MODULES, PREFILL, RunSettings
from llmtrace.tracer.trace.run_trace import STOP_MAX_NEW_TOKENS, Trace

PROMPTS = ("The sky is blue because", "Hi", "Once upon a time there was a small dog who")
GQA = ModelConfig("gqa", 128, 64, 3, 4, 2, 96, max_seq_len=64)
WINDOWED = ModelConfig("win", 128, 64, 2, 4, 2, 96, max_seq_len=64, sliding_window=4)


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    longest = max(len(p) for p in prompts)
    pads = [longest - len(p) for p in prompts]
    return torch.tensor([[0] * k + p for k, p in zip(pads, prompts)]), pads


def _greedy_logits(model, tokens: torch.Tensor, pads: list[int] | None, steps: int, fused: bool) -> torch.Tensor:
    """Logits (B, steps + 1, V) of a greedy run: the prefill's, then each decode step's; on the backend a run takes
    (`fused`), or on the stage modules."""
    model.setup_cache(tokens.shape[0], tokens.shape[1] + steps)
    run = backend_for(model, Request(batch=tokens.shape[0], backend=None if fused else MODULES))
    logits = run.prefill(tokens, pads)
    out = [logits]
    for _ in range(steps):
        logits = run.decode(logits.argmax(-1, keepdim=True))
        out.append(logits)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "staged"])
@pytest.mark.parametrize("config", [GQA, WINDOWED], ids=["gqa", "sliding-window"])
def test_left_padded_rows_give_their_batch_1_logits(config: ModelConfig, fused: bool) -> None:
    model = build_random_model(config, seed=3)
    prompts = [[5, 9, 13], [7, 3, 11, 21, 40, 2, 8], [8]]
    tokens, pads = _left_padded(prompts)
    batched = _greedy_logits(model, tokens, pads, 5, fused)
    for row, prompt in enumerate(prompts):
        single = _greedy_logits(model, torch.tensor([prompt]), None, 5, fused)[0]
        torch.testing.assert_close(batched[row], single, rtol=1e-5, atol=1e-5)
        assert torch.equal(batched[row].argmax(-1), single.argmax(-1))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "staged"])
def test_pads_change_no_logit_whatever_their_ids(fused: bool) -> None:
    """A pad is never attended: other pad ids leave every real row's logits bit for bit the same."""
    model = build_random_model(GQA, seed=3)
    tokens, pads = _left_padded([[5, 9, 13], [7, 3, 11, 21, 40, 2, 8]])
    first = _greedy_logits(model, tokens, pads, 3, fused)
    other = tokens.clone()
    other[0, : pads[0]] = torch.tensor([100, 17, 64, 1])
    assert torch.equal(_greedy_logits(model, other, pads, 3, fused), first)


@pytest.mark.parametrize("held", ["dense", "stored"])
def test_keep_rows_drops_a_sequence_and_leaves_the_others_as_they_were(held: str) -> None:
    """Dense, and with every matrix (the embedding table too) held as stored, whose module weights are meta
    placeholders: the kept rows' next logits are the ones the whole batch gives them."""
    if held == "stored":
        from tests.test_native_step import native_model

        model = native_model(replace(GQA, name="gqa-stored"), seed=3)
    else:
        model = build_random_model(GQA, seed=3)
    tokens, pads = _left_padded([[5, 9, 13], [7, 3, 11, 21, 40], [8, 30]])
    model.setup_cache(3, 12)
    logits = model.prefill(tokens, pads)
    nxt = logits.argmax(-1, keepdim=True)  # (3, 1)
    full = model.decode_one(nxt)
    model.setup_cache(3, 12)
    model.prefill(tokens, pads)
    model.keep_rows([0, 2])
    assert model.batch == 2 and model.pads == (2, 3)
    kept = model.decode_one(nxt[[0, 2]])
    torch.testing.assert_close(kept, full[[0, 2]], rtol=1e-6, atol=1e-6)
    assert model.kv_live_bytes == 2 * (5 + 1) * model.kv_bytes_per_position
    with pytest.raises(BadArgumentError, match="ascending row indices"):
        model.keep_rows([1, 0])


def test_batched_prefill_flops_equal_flop_counter_mode() -> None:
    """The traced matmul FLOPs of a left-padded prefill and a decode step of 3 rows: FlopCounterMode's, per role;
    shapes [3, ...] (pads run: they are counted)."""
    model = build_random_model(GQA, seed=1)
    tokens, pads = _left_padded([[5, 9, 13], [7, 3, 11, 21, 40], [8]])
    model.setup_cache(3, 8)
    counted = []
    with Tracer(model, mechanism="wrap") as tracer:
        for step in range(2):
            tracer.begin_step(PREFILL if step == 0 else DECODE, step)
            with FlopCounterMode(display=False) as counter:
                logits = model.prefill(tokens, pads) if step == 0 else model.decode_one(logits.argmax(-1, True))
            tracer.end_step()
            counted.append((counter.get_total_flops(), counter.get_flop_counts()))
    records = tracer.records()
    for step, (total, per_module) in enumerate(counted):
        stages = [r for r in records if r.step == step]
        assert sum(r.matmul_flops for r in stages) == total > 0
        for role in ("attention.wq", "attention.scores", "attention.pv", "feed_forward.w2"):
            ours = sum(r.matmul_flops for r in stages if r.short_name == role)
            assert ours == sum(per_module[f"TransformerBlock.{role}"].values()) > 0, (step, role)
        assert all(r.output_shapes[0][0] == 3 for r in stages if r.kind in MATMUL_KINDS)
    scores = next(r for r in records if r.step == 0 and r.short_name == "attention.scores")
    assert scores.output_shapes[0] == (3, GQA.n_heads, 5, 5)
    rope = next(r for r in records if r.step == 0 and r.short_name == "attention.rope")
    assert rope.input_shapes[2] == (3, 5)  # each row its own positions


# ---- the batched generation ---------------------------------------------------------------------------------


def _settings(model_dir: Path, prompts: tuple[str, ...], **kw) -> RunSettings:
    return RunSettings(model=str(model_dir), prompt=prompts[0], max_new_tokens=kw.pop("max_new_tokens", 6),
                       dtype="fp32", batch=len(prompts), batch_prompts=prompts, temperatures=(), **kw)


@pytest.fixture(scope="module", params=[False, True], ids=["fused", "staged"])
def batched(tiny_llama_dir: Path, request: pytest.FixtureRequest) -> tuple[Trace, list[Trace]]:
    loaded = load_model(str(tiny_llama_dir), dtype=FP32)
    generation = BatchGeneration(loaded, _settings(tiny_llama_dir, PROMPTS, staged=request.param))
    try:
        trace = generation.run()
    finally:
        generation.close()
    singles = [generate(loaded, RunSettings(model=str(tiny_llama_dir), prompt=p, max_new_tokens=6, dtype="fp32",
                                            temperatures=())) for p in PROMPTS]
    return trace, singles


def test_each_sequence_generates_its_batch_1_tokens(batched) -> None:
    trace, singles = batched
    assert trace.batch is not None
    lengths = {len(s.tokenization.ids) for s in trace.batch.sequences}
    assert len(lengths) == 3  # three different prompt lengths
    for sequence, single in zip(trace.batch.sequences, singles):
        assert sequence.generated_ids == single.generated_ids
        assert sequence.generated_text == single.generated_text
        assert sequence.stop_reason == single.stop_reason
    assert trace.generated_ids == singles[0].generated_ids  # the top level is the first sequence's


def test_batched_steps_and_stages_have_the_batch_shape(batched) -> None:
    trace, _ = batched
    n = len(PROMPTS)
    longest = max(len(s.tokenization.ids) for s in trace.batch.sequences)
    prefill = trace.prefill_step
    assert (prefill.batch, prefill.input_tokens) == (n, n * longest)
    assert [r.sequence for r in prefill.rows] == [0, 1, 2]
    embed = next(s for s in trace.stages_of(PREFILL) if s.kind == "embedding")
    assert embed.input_shapes[0] == (n, longest) and embed.output_shapes[0] == (n, longest, trace.config.dim)
    for step in trace.decode_steps:
        stages = [s for s in trace.stages if s.step == step.step]
        assert {s.output_shapes[0][0] for s in stages if s.kind in MATMUL_KINDS} == {step.batch}
    for sequence in trace.batch.sequences:
        assert sequence.pad == longest - len(sequence.tokenization.ids)
    rope = next(s for s in trace.stages_of(PREFILL) if s.kind == "rope")
    assert rope.input_shapes[2] == (n, longest)  # each row its own positions, on either path
    packed = any(s.short_name == "attention.wqkv" for s in trace.stages)
    assert packed == (not trace.settings.staged)  # the path the settings ask for is the one traced


def test_kv_bytes_per_sequence_and_in_total(batched) -> None:
    trace, singles = batched
    batch = trace.batch
    config = trace.config
    per_position = 2 * config.n_layers * config.n_kv_heads * config.head_dim * 4  # fp32
    assert batch.kv_bytes_per_position == per_position
    assert batch.kv_pad_bytes == sum(s.pad for s in batch.sequences) * per_position
    for sequence, single in zip(batch.sequences, singles):
        assert sequence.kv_live_bytes == single.steps[-1].kv_live_bytes  # what its batch-1 run held at its end
    prefill = trace.prefill_step
    longest = max(len(s.tokenization.ids) for s in batch.sequences)
    assert prefill.kv_live_bytes == len(PROMPTS) * longest * per_position  # the cache holds the pads too
    assert [r.kv_live_bytes for r in prefill.rows] == [len(s.tokenization.ids) * per_position
                                                       for s in batch.sequences]


def test_finished_sequences_leave_the_batch(tiny_llama_dir: Path) -> None:
    """A sequence that stops (here: EOS forced at sequence 1's second token) is not generated or counted after
    its step; the next steps run one row fewer."""
    loaded = load_model(str(tiny_llama_dir), dtype=FP32)
    eos = loaded.tokenizer.eos_id
    generation = BatchGeneration(loaded, _settings(tiny_llama_dir, PROMPTS))
    samplers = generation._samplers
    original = samplers[1].sample
    calls = []

    def eos_on_second(logits, previous=()):
        result = original(logits, previous)
        calls.append(1)
        return replace(result, token_id=eos) if len(calls) == 2 else result

    samplers[1].sample = eos_on_second
    try:
        trace = generation.run()
    finally:
        generation.close()
    seq = trace.batch.sequences
    assert seq[1].stop_reason == "eos" and seq[1].last_step == 1 and len(seq[1].generated_ids) == 2
    assert [s.batch for s in trace.steps] == [3, 3, 2, 2, 2, 2]
    assert [r.sequence for r in trace.steps[2].rows] == [0, 2]
    assert trace.steps[1].rows[1].finished == "eos"
    assert seq[0].stop_reason == seq[2].stop_reason == STOP_MAX_NEW_TOKENS == trace.stop_reason
    assert sum(s.tokens_out for s in trace.steps) == sum(len(s.generated_ids) for s in seq) == 6 + 2 + 6


def test_each_sequence_samples_with_its_own_seed(tiny_llama_dir: Path) -> None:
    """Sampling: sequence i uses seed + i, so a batch of one prompt repeated gives different texts, and sequence i
    equals a batch-1 run of seed + i."""
    loaded = load_model(str(tiny_llama_dir), dtype=FP32)
    prompts = ("The sky is",) * 3
    generation = BatchGeneration(loaded, _settings(tiny_llama_dir, prompts, temperature=1.0, seed=7))
    try:
        trace = generation.run()
    finally:
        generation.close()
    assert [s.seed for s in trace.batch.sequences] == [7, 8, 9]
    for s in trace.batch.sequences:
        single = generate(loaded, RunSettings(model="", prompt=prompts[0], max_new_tokens=6, dtype="fp32",
                                              temperature=1.0, seed=s.seed, temperatures=()))
        assert s.generated_ids == single.generated_ids
    assert len({s.generated_ids for s in trace.batch.sequences}) > 1


def test_batched_trace_reads_back_equal(batched) -> None:
    trace, _ = batched
    again = Trace.from_json(trace.to_json(indent=1))
    assert again == trace
    assert Trace.from_json(trace.to_json()).batch.sequences[2].tokenization == trace.batch.sequences[2].tokenization


@pytest.mark.parametrize("change, message", [
    (dict(batch=0, batch_prompts=()), "--batch must be at least 1, got 0"),
    (dict(batch=3, batch_prompts=("a", "b")), "--batch 3 needs 3 prompts, got 2"),
    (dict(no_kv_cache=True), "--batch does not combine with --no-kv-cache"),
    (dict(lens=True), "--batch does not combine with --lens"),
    (dict(dry_run=True), "--batch does not combine with --dry-run"),
])
def test_bad_batch_settings_are_one_line(change: dict, message: str) -> None:
    settings = replace(RunSettings(model="", prompt="a", batch=2, batch_prompts=("a", "b")), **change)
    with pytest.raises(BadArgumentError, match=message):
        check_batch_settings(settings)


# ---- the command ----------------------------------------------------------------------------------------------


@pytest.fixture()
def _private_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def _cli(*args: str):
    from typer.testing import CliRunner

    from llmtrace.cli.app import app

    return CliRunner().invoke(app, ["run", *args], env={"COLUMNS": "80"})


def test_run_batch_writes_every_view(tiny_llama_dir: Path, tmp_path: Path, _private_config: None) -> None:
    """--file's lines as the batch: the run view at 80 columns, --json (schema-valid, reads back), --summary-json,
    the Chrome trace."""
    import json

    import jsonschema

    from llmtrace.tracer.trace.run_trace import load_schema

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The sky is blue because\n\nHi\nOnce upon a time\nnot used\n", encoding="utf-8")
    trace_path, chrome = tmp_path / "t.json", tmp_path / "c.json"
    result = _cli("--model", str(tiny_llama_dir), "--batch", "3", "--file", str(prompts), "--max-new-tokens", "3",
                  "--json", str(trace_path), "--chrome-trace", str(chrome), "--summary-json", "--no-roofline")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["sequences"] == 3 and summary["generated_tokens"] == 9
    assert all(len(line) <= 80 for line in result.stderr.splitlines())
    for title in ("N prompts → one batch", "one token per sequence", "Sequences", "8 · Summary"):
        assert title in result.stderr
    data = json.loads(trace_path.read_text(encoding="utf-8"))
    jsonschema.validate(data, load_schema())
    trace = Trace.from_dict(data)
    assert trace.settings.batch_prompts == ("The sky is blue because", "Hi", "Once upon a time")
    assert [len(s.generated_ids) for s in trace.batch.sequences] == [3, 3, 3]
    doc = json.loads(chrome.read_text(encoding="utf-8"))
    assert doc["otherData"]["batch"] == 3
    assert sum(e["name"].startswith("tokenize seq") for e in doc["traceEvents"]) == 3


@pytest.mark.parametrize("args, message", [
    (["--batch", "0"], "--batch must be at least 1, got 0"),
    (["--batch", "4", "--file", "{prompts}"], "--batch 4 takes one prompt per line, but {prompts} has 2 non-empty lines"),
    (["--batch", "2", "--no-kv-cache"], "--batch does not combine with --no-kv-cache"),
    (["--batch", "2", "--lens"], "--batch does not combine with --lens"),
])
def test_bad_batch_input_is_one_line_exit_2(args: list[str], message: str, tiny_llama_dir: Path,
                                             tmp_path: Path, _private_config: None) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n", encoding="utf-8")
    args = [a.replace("{prompts}", str(prompts)) for a in args]
    if "--file" not in args:
        args = ["sky", *args]
    result = _cli("--model", str(tiny_llama_dir), *args)
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert message.replace("{prompts}", str(prompts)) in result.stderr


def test_repeat_with_batch_reports_medians_per_stage_and_writes_the_trace(
        tiny_llama_dir: Path, tmp_path: Path, _private_config: None) -> None:
    """--repeat K with --batch N (issue 14, item 4): K batched generations of the same tokens, medians and spreads
    per stage over them (checked against repeat_summary of K batched runs made here), and the first run's trace
    written as JSON (schema-valid, a batch of N)."""
    import json

    import jsonschema

    from llmtrace.tracer.trace.repeat_summary import repeat_summary
    from llmtrace.tracer.trace.run_trace import load_schema

    loaded = load_model(str(tiny_llama_dir))
    settings = RunSettings(model=str(tiny_llama_dir), prompt="sky", max_new_tokens=3, batch=2,
                           batch_prompts=("The sky is", "Once upon a time"))
    traces = [BatchGeneration(loaded, replace(settings, warmup=k == 0)).run() for k in range(3)]
    assert len({tuple(s.generated_ids for s in t.batch.sequences) for t in traces}) == 1  # same tokens each run
    summary = repeat_summary(traces)
    assert summary.repeats == 3 and summary.decode_steps == 2
    forward = sorted(sum(s.forward_ns for s in t.steps[1:]) / 1e9 / 2 for t in traces)
    assert summary.decode_forward_per_token.median == pytest.approx(forward[1])
    roles = {s.role for s in summary.stages}
    assert {"attention.wqkv", "output"} <= roles and len(roles) == len(summary.stages)
    for stage in summary.stages:  # every stage of every run: a median between the fastest and the slowest
        spread = stage.decode_per_step
        assert len(spread.samples) == 3 and spread.fastest <= spread.median <= spread.slowest

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The sky is\nOnce upon a time\n", encoding="utf-8")
    trace_path = tmp_path / "t.json"
    result = _cli("--model", str(tiny_llama_dir), "--batch", "2", "--file", str(prompts), "--max-new-tokens", "3",
                  "--repeat", "3", "--json", str(trace_path), "--no-roofline")
    assert result.exit_code == 0, result.output
    assert "Repeated 3 times" in result.output and "decode per token" in result.output
    assert "Q|K|V proj" in result.output  # the per-stage medians, under the labels every view uses
    data = json.loads(trace_path.read_text(encoding="utf-8"))
    jsonschema.validate(data, load_schema())
    assert Trace.from_dict(data).settings.batch == 2
