"""The generation loop: the tokens it feeds, where it stops, the KV cache it leaves, Ctrl-C, dry runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from llmtrace.tracer.analytic.kvmem import kv_cache_bytes
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.load.loader import LoadedModel, load_model
from llmtrace.tracer.model.fused import no_mark
from llmtrace.tracer.run.generate import Finished, Generation, PrefillDone, Tokenized, TokenStep, generate
from llmtrace.tracer.trace.records import DECODE, PREFILL, RunSettings
from llmtrace.tracer.trace.run_trace import STOP_DRY_RUN, STOP_EOS, STOP_INTERRUPTED, STOP_MAX_NEW_TOKENS


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir))


def _settings(**overrides: object) -> RunSettings:
    base = dict(model="tiny", prompt="Once upon a time", max_new_tokens=6)
    base.update(overrides)
    return RunSettings(**base)  # type: ignore[arg-type]


def _hooks(model: torch.nn.Module) -> int:
    """Module hooks and instance-level forward wrappers: the tracer's instrumentation of the model, whichever
    mechanism (the fused path's marks live in the run's backend, not on the model)."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + ("forward" in m.__dict__) for m in model.modules())


@dataclass
class ScriptedSampler:
    """Returns the argmax, except: `eos_at` call -> the EOS id; `interrupt_at` call -> KeyboardInterrupt."""

    eos_id: int
    eos_at: int | None = None
    interrupt_at: int | None = None
    calls: int = 0
    seen: list[list[int]] = field(default_factory=list)

    def sample(self, logits: torch.Tensor, previous_ids: list[int]) -> object:
        self.calls += 1
        self.seen.append(list(previous_ids))
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        token = self.eos_id if self.calls == self.eos_at else int(logits.argmax())
        return _Result(token)


@dataclass(frozen=True)
class _Result:
    token_id: int
    probability: float = 1.0
    candidates: tuple = ()
    active_steps: tuple = ("greedy",)


def test_greedy_tokens_equal_the_argmax_of_a_full_recompute(loaded: LoadedModel) -> None:
    trace = generate(loaded, _settings(max_new_tokens=5))
    ids = list(trace.tokenization.ids)
    for token in trace.generated_ids:
        with torch.no_grad():
            logits = loaded.model(torch.tensor([ids]))  # cache-free forward over everything so far
        assert int(logits[0, -1].argmax()) == token
        ids.append(token)
    assert trace.stop_reason == STOP_MAX_NEW_TOKENS
    assert [s.phase for s in trace.steps] == [PREFILL] + [DECODE] * 4
    assert [s.context_length for s in trace.steps] == [len(trace.tokenization.ids) + i for i in range(5)]
    assert trace.generated_text == loaded.tokenizer.decode(list(trace.generated_ids))
    assert "".join(s.text for s in trace.steps) == trace.generated_text


def test_events_come_in_the_order_of_the_journey(loaded: LoadedModel) -> None:
    generation = Generation(loaded, _settings(max_new_tokens=3))
    kinds = [type(e).__name__ for e in generation.events()]
    assert kinds == ["Tokenized", "PrefillDone", "TokenStep", "TokenStep", "Finished"]
    assert _hooks(loaded.model) == 0


def test_kv_live_bytes_equal_the_formula_for_the_context(loaded: LoadedModel) -> None:
    trace = generate(loaded, _settings(max_new_tokens=4))
    context = len(trace.tokenization.ids) + 4 - 1  # the last token is sampled, never fed
    assert trace.steps[-1].context_length == context
    assert trace.steps[-1].kv_live_bytes == kv_cache_bytes(loaded.config, context, FP32)
    assert trace.steps[-1].kv_allocated_bytes == kv_cache_bytes(loaded.config, context + 1, FP32)
    for step in trace.steps:
        assert step.kv_live_bytes == kv_cache_bytes(loaded.config, step.context_length, FP32)


def test_stops_at_eos_and_feeds_the_sampler_prompt_and_generated_ids(loaded: LoadedModel) -> None:
    sampler = ScriptedSampler(eos_id=loaded.tokenizer.eos_id, eos_at=3)
    trace = Generation(loaded, _settings(max_new_tokens=10), sampler=sampler).run()
    assert trace.stop_reason == STOP_EOS
    assert len(trace.steps) == 3 and trace.generated_ids[-1] == loaded.tokenizer.eos_id
    prompt = list(trace.tokenization.ids)
    assert sampler.seen == [prompt, prompt + list(trace.generated_ids[:1]), prompt + list(trace.generated_ids[:2])]


def test_ctrl_c_inside_the_loop_returns_the_partial_trace(loaded: LoadedModel) -> None:
    sampler = ScriptedSampler(eos_id=-1, interrupt_at=4)
    generation = Generation(loaded, _settings(max_new_tokens=10), sampler=sampler)
    events = list(generation.events())
    assert isinstance(events[-1], Finished)
    trace = events[-1].trace
    assert trace.stop_reason == STOP_INTERRUPTED
    assert len(trace.steps) == 3 and len(trace.generated_ids) == 3
    assert {s.step for s in trace.stages} == {0, 1, 2}  # the interrupted step's stages are not half-recorded
    assert _hooks(loaded.model) == 0


def test_ctrl_c_in_the_caller_keeps_what_was_traced(loaded: LoadedModel) -> None:
    generation = Generation(loaded, _settings(max_new_tokens=10))
    for event in generation.events():
        if isinstance(event, TokenStep) and event.generated == 3:
            assert generation._tracer.mark is not no_mark  # recording: its marks are in the run's backend
            break
    generation.close()
    assert _hooks(loaded.model) == 0
    trace = generation.trace()
    assert trace.stop_reason == STOP_INTERRUPTED
    assert len(trace.generated_ids) == 3 and len(trace.steps) == 3


def test_prompt_longer_than_the_context_is_a_clear_error(loaded: LoadedModel) -> None:
    long_prompt = "sky " * (loaded.config.max_seq_len + 10)
    generation = Generation(loaded, _settings(prompt=long_prompt))
    with pytest.raises(BadArgumentError, match=r"the prompt is \d+ tokens but .* holds 256 positions"):
        next(iter(generation.events()))
    assert _hooks(loaded.model) == 0


def test_new_tokens_are_capped_by_the_context(loaded: LoadedModel) -> None:
    prompt = "sky " * 80
    n_prompt = len(loaded.tokenizer.encode(prompt))
    room = loaded.config.max_seq_len - n_prompt
    assert 0 < room < 1000
    sampler = ScriptedSampler(eos_id=-1)
    trace = Generation(loaded, _settings(prompt=prompt, max_new_tokens=1000, trace=False), sampler=sampler).run()
    assert len(trace.generated_ids) == room
    assert trace.stop_reason == "context_full"


def test_no_trace_times_steps_without_hooks(loaded: LoadedModel) -> None:
    generation = Generation(loaded, _settings(max_new_tokens=3, trace=False))
    for event in generation.events():
        if isinstance(event, PrefillDone):
            assert event.stages == ()
            assert _hooks(loaded.model) == 0
    trace = generation.trace()
    assert trace.stages == () and len(trace.steps) == 3
    assert all(s.forward_ns > 0 for s in trace.steps)


def test_max_new_tokens_below_one_is_refused(loaded: LoadedModel) -> None:
    with pytest.raises(BadArgumentError, match="at least 1"):
        Generation(loaded, _settings(max_new_tokens=0))


def test_dry_run_of_llama_7b_has_32_layers_of_t_by_4096_and_the_analytical_flops() -> None:
    from llmtrace.tracer.analytic import estimate

    loaded = load_model("llama-7b", dry_run=True)
    generation = Generation(loaded, RunSettings(model="llama-7b", prompt="今天天气真", dry_run=True, prompt_tokens=4))
    events = list(generation.events())
    assert isinstance(events[0], Tokenized) and events[0].prompt_tokens == 4
    trace = events[-1].trace
    assert trace.stop_reason == STOP_DRY_RUN
    prefill = trace.stages_of(PREFILL)
    residuals = [s for s in prefill if s.kind == "residual" and s.stage.endswith("ffn_residual")]
    assert len(residuals) == 32
    assert {s.output_shapes for s in residuals} == {((1, 4, 4096),)}
    dtypes = estimate.Dtypes.for_weights(FP32)
    assert sum(s.flops for s in prefill) == estimate.prefill(loaded.config, 4, dtypes).totals.total_flops
    decode = trace.stages_of(DECODE)
    assert sum(s.flops for s in decode) == estimate.decode_step(loaded.config, 4, dtypes).totals.total_flops


def test_an_unseeded_sampling_run_records_its_drawn_seed_and_replays_with_it(loaded: LoadedModel) -> None:
    first = generate(loaded, _settings(max_new_tokens=5, temperature=1.5))
    assert first.settings.seed_drawn and first.settings.seed is not None
    replay = generate(loaded, _settings(max_new_tokens=5, temperature=1.5, seed=first.settings.seed))
    assert not replay.settings.seed_drawn and replay.settings.seed == first.settings.seed
    assert replay.generated_ids == first.generated_ids
    greedy = generate(loaded, _settings(max_new_tokens=2))
    assert greedy.settings.seed is None and not greedy.settings.seed_drawn  # greedy needs no seed


def test_steps_record_the_models_own_probability_and_the_survivors(loaded: LoadedModel) -> None:
    trace = generate(loaded, _settings(max_new_tokens=3, temperature=0.8, top_p=0.5, seed=3))
    vocab = loaded.config.vocab_size
    for step in trace.steps:
        chosen = next(c for c in step.candidates if c.token_id == step.token_id)
        s = step.sampling
        assert s is not None and s.probability_raw == chosen.prob_raw and s.vocab_size == vocab
        assert s.n_final == s.n_after_top_p <= s.n_after_top_k == vocab
        assert s.n_final == sum(1 for c in step.candidates if c.kept_top_p) or s.n_final > len(step.candidates)
        assert s.entropy_raw_bits > 0
    greedy = generate(loaded, _settings(max_new_tokens=2))
    step = greedy.steps[0]
    assert step.probability == 1.0 and step.sampling.probability_raw < 1.0 and step.sampling.n_final == 1


@pytest.mark.parametrize("warmup, staged", [(True, False), (False, False), (True, True)])
def test_warm_up_runs_one_untraced_pass_on_the_traced_path_first(loaded: LoadedModel, warmup: bool, staged: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    model = loaded.model
    calls: list[tuple[str, int, bool]] = []  # (which, tokens, through a backend's fused path)
    real_prefill, real_decode = model.prefill, model.decode_one

    def prefill(tokens: torch.Tensor, pad: list[int] | None = None, path: Any = None) -> torch.Tensor:
        calls.append(("prefill", tokens.shape[1], path is not None))
        return real_prefill(tokens, pad, path)

    def decode_one(tokens: torch.Tensor, path: Any = None) -> torch.Tensor:
        calls.append(("decode", tokens.shape[1], path is not None))
        return real_decode(tokens, path)

    monkeypatch.setattr(model, "prefill", prefill)
    monkeypatch.setattr(model, "decode_one", decode_one)
    trace = Generation(loaded, _settings(max_new_tokens=2, warmup=warmup, staged=staged)).run()
    prompt_len = len(trace.tokenization.ids)
    fused = not staged  # the traced run takes the fused path unless --staged; the warm-up takes the same one
    traced = [("prefill", prompt_len), ("decode", 1)]
    expected = ([("prefill", prompt_len, fused), ("decode", 1, fused)] if warmup else []) + [
        (which, n, fused) for which, n in traced]
    assert calls == expected
    assert {s.short_name for s in trace.stages} >= ({"attention.wq", "feed_forward.w1"} if staged
                                                    else {"attention.wqkv", "feed_forward.w13"})
    # the warm-up leaves nothing in the cache: the traced steps see the context they would without it
    assert [s.context_length for s in trace.steps] == [prompt_len, prompt_len + 1]
