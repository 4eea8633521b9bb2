"""Decode steps run ahead in C (decode_step.c's llmt_decode_ahead, NativeStep.run_ahead, PackedBackend.ahead,
Generation's run-ahead): several steps to a call, each next token chosen by the run's sampler (tracer/run/sampling.py),
called from C with the step's logits.

The independent reference is the step-at-a-time path the run-ahead replaces: the native backend's `decode` (the same
C step, one call each) with the Sampler choosing from its logits in Python. Run ahead, the tokens, the KV cache, every StepRecord and
every stage record must be the same values (bit for bit: the same C step and the same sampler on the same inputs);
only the times differ.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from llmtrace.tracer.core.errors import BadArgumentError, CheckpointError
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.native_step import AheadRun
from llmtrace.tracer.run import generate as generate_module
from llmtrace.tracer.run.generate import Generation, _steps_ahead
from llmtrace.tracer.run.backends import PackedBackend, backend_for
from llmtrace.tracer.run.sampling import NonFiniteLogitsError, SampleResult, Sampler, SamplingParams
from llmtrace.tracer.trace.records import DECODE, RunAhead, RunSettings
from llmtrace.tracer.trace.run_trace import Trace, load_schema
from tests.test_native_step import BASE, native_model
from tests.torch_threads import torch_threads

TIMES = ("start_ns", "forward_ns", "sample_ns", "detokenize_ns", "duration_ns")


@pytest.fixture(autouse=True)
def native() -> None:
    if not native_kernel.available():
        pytest.skip(f"native kernel not available here: {native_kernel.unavailable_reason()}")


def untimed(record: Any) -> Any:
    return dataclasses.replace(record, **{name: 0 for name in TIMES if hasattr(record, name)})


def prefilled(model: Any, prompt: int = 5, room: int = 16) -> int:
    """Prefill `prompt` tokens into a cache of prompt + room positions; the greedy first token."""
    model.setup_cache(1, prompt + room)
    logits = model.prefill(torch.arange(3, 3 + prompt).view(1, -1) % model.config.vocab_size)
    return int(logits.argmax())


def chooser(sampler: Sampler, previous: list[int] | None = None) -> tuple[Any, list[SampleResult]]:
    """A `choose` for decode_ahead that asks `sampler` (its penalty seeing `previous` and every token chosen since),
    and the list its results go into."""
    results: list[SampleResult] = []
    seen = list(previous or [])

    def choose(logits: np.ndarray) -> int:
        result = sampler.sample(logits, seen)
        results.append(result)
        seen.append(result.token_id)
        return result.token_id

    return choose, results


def greedy() -> Any:
    return chooser(Sampler(SamplingParams(temperature=0.0)))[0]


def one_by_one(model: Any, token: int, steps: int, params: SamplingParams = SamplingParams(),
               previous: list[int] | None = None) -> tuple[list[int], list[SampleResult]]:
    """`steps` decode_one calls, each next token a Sampler's choice from its logits: the tokens and sample results."""
    sampler, seen = Sampler(params), list(previous or [])
    tokens, results = [], []
    backend = backend_for(model)  # the native backend, a step a call
    for _ in range(steps):
        result = sampler.sample(backend.decode(torch.tensor([[token]]))[0].numpy(), seen)
        token = result.token_id
        seen.append(token)
        tokens.append(token)
        results.append(result)
    return tokens, results


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("variant", [{}, {"sliding_window": 3}, {"tie_embeddings": True}])
def test_steps_run_ahead_are_the_step_at_a_time_path_bit_for_bit(variant: dict[str, Any], threads: int) -> None:
    """Seven greedy steps in one call: the same tokens, the same KV cache bit for bit, the same position, and each
    step's sample result the one the Sampler computes from that step's logits a step at a time (a window of 3
    positions: the run attends the window each step moves to)."""
    config = dataclasses.replace(BASE, **variant)
    model = native_model(config, seed=3)
    with torch_threads(threads):
        first = prefilled(model)
        want_tokens, want_results = one_by_one(model, first, 7)
        want_kv, want_pos = model._kv_all.clone(), model.pos
        first = prefilled(model)
        choose, results = chooser(Sampler(SamplingParams(temperature=0.0)))
        backend = backend_for(model)
        run = backend.ahead(first, 7, None, choose)
    assert run is not None and run.failure is None
    assert list(run.tokens) == want_tokens and model.pos == want_pos
    assert torch.equal(model._kv_all, want_kv)
    assert results == want_results
    held = [min(length, config.sliding_window or length) for length in range(6, 13)]
    assert list(run.kv_live_bytes) == [backend.plan.position_bytes * h for h in held]


@pytest.mark.parametrize("params", [dict(temperature=0.6), dict(temperature=1.0), dict(temperature=1.7),
                                    dict(temperature=0.7, top_p=0.9), dict(temperature=0.9, top_k=5, min_p=0.05),
                                    dict(temperature=1.0, repetition_penalty=1.3)])
def test_steps_drawn_ahead_are_the_samplers_draws_bit_for_bit(params: dict[str, Any]) -> None:
    """Eight steps drawn in one call by a Sampler: the tokens a Sampler of the same seed draws a step at a time, the
    same KV cache, and each step's sample result equal to the one `sample` computed from that step's logits
    (candidates, ranks, probabilities, entropies), filters and a penalty (which sees the prompt too) included."""
    model = native_model(BASE, seed=7)
    sampling = SamplingParams(seed=11, **params)
    prompt = list(range(3, 8))
    first = prefilled(model)
    want_tokens, want_results = one_by_one(model, first, 8, sampling, prompt + [first])
    want_kv = model._kv_all.clone()
    prefilled(model)
    choose, results = chooser(Sampler(sampling), prompt + [first])
    run = backend_for(model).ahead(first, 8, None, choose)
    assert run is not None and list(run.tokens) == want_tokens and torch.equal(model._kv_all, want_kv)
    assert len(set(want_tokens)) > 1  # drawn, not one repeated argmax
    assert results == want_results


def test_the_least_temperature_is_one_line() -> None:
    with pytest.raises(BadArgumentError, match="temperature must be 0 .greedy. or at least 1e-06"):
        SamplingParams(temperature=1e-7)


def test_a_run_stops_after_the_step_that_chose_the_stop_token() -> None:
    """The stop token ends the run right after the step that chose it, and the cache counts only those steps; the
    next call carries on from there as the step-at-a-time path does."""
    model = native_model(BASE, seed=2)  # eight different greedy tokens
    first = prefilled(model)
    want, _ = one_by_one(model, first, 8)
    stop = want[2]
    assert stop not in want[:2]
    first = prefilled(model)
    run = backend_for(model).ahead(first, 8, stop, greedy())
    assert run is not None and list(run.tokens) == want[:3] and model.pos == 5 + 3
    rest = backend_for(model).ahead(run.tokens[-1], 5, None, greedy())
    assert rest is not None and list(rest.tokens) == want[3:]


def test_clock_readings_are_in_order_and_stamps_fill_each_step() -> None:
    """Each step's start, logits' end and choice's end are in order and the next step starts after the last one's
    choice; stamped, each step's stage readings lie within its forward."""
    model = native_model(BASE)
    first = prefilled(model)
    run = backend_for(model).ahead(first, 5, None, greedy(), stamps=True)
    assert run is not None and len(run.stamps) == 5
    for (start, forward_end, sample_end), stamps in zip(run.clock, run.stamps):
        assert start <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= forward_end <= sample_end
    ends = [c[2] for c in run.clock]
    assert all(end <= nxt[0] for end, nxt in zip(ends, run.clock[1:]))


def test_logits_that_are_not_finite_stop_the_run_before_that_step() -> None:
    """A step whose logits hold NaN (its token's embedding row is NaN) chooses nothing: the sampler's error is the
    run's failure, the run holds the steps before it, and the cache does not count it."""
    model = native_model(BASE, dense_embedding=True)
    first = prefilled(model)
    chosen, _ = one_by_one(model, first, 2)
    with torch.no_grad():
        model.tok_embeddings.weight[chosen[1]] = float("nan")  # the third step's input
    model.setup_cache(1, 21)  # a backend built after the edit reads the edited table
    model.prefill(torch.arange(3, 8).view(1, -1))
    run = backend_for(model).ahead(first, 6, None, greedy())
    assert run is not None and list(run.tokens) == chosen and model.pos == 5 + 2
    assert isinstance(run.failure, NonFiniteLogitsError)


def test_what_the_chooser_raises_ends_the_call_and_is_handed_back() -> None:
    """Ctrl-C (or any error) inside the chooser: C stops after that step's forward, and the exception comes back
    with the steps chosen before it; a token outside the vocabulary is refused."""
    model = native_model(BASE)
    first = prefilled(model)
    want, _ = one_by_one(model, first, 2)
    prefilled(model)
    answers = iter(want)

    def choose(logits: np.ndarray) -> int:
        token = next(answers, None)
        if token is None:
            raise KeyboardInterrupt
        return token

    run = backend_for(model).ahead(first, 6, None, choose)
    assert run is not None and list(run.tokens) == want and isinstance(run.failure, KeyboardInterrupt)
    assert model.pos == 5 + 2
    with pytest.raises(native_kernel.NativeKernelError, match="outside the vocabulary"):
        backend_for(model).ahead(want[-1], 2, None, lambda logits: BASE.vocab_size)


def test_models_the_native_step_cannot_run_get_none() -> None:
    """No native step (a dense model), a batch, or too few positions left: None, and nothing written."""
    from llmtrace.tracer.model.transformer import Transformer

    dense = Transformer(BASE).eval()
    prefilled(dense)
    assert backend_for(dense).ahead(1, 4, None, greedy()) is None and dense.pos == 5
    model = native_model(BASE)
    first = prefilled(model, room=3)
    assert backend_for(model).ahead(first, 4, None, greedy()) is None and model.pos == 5
    assert backend_for(model).ahead(first, 3, None, greedy()) is not None and model.pos == 8


def test_steps_ahead_take_about_fifty_milliseconds() -> None:
    def run(per_step_ns: int, steps: int = 4) -> AheadRun:
        clock = [(i * per_step_ns, i * per_step_ns + per_step_ns - 10, (i + 1) * per_step_ns) for i in range(steps)]
        return AheadRun(tokens=(1,) * steps, clock=tuple(clock), stamps=())

    assert _steps_ahead(run(2_500_000)) == 20
    assert _steps_ahead(run(100_000_000)) == 1
    assert _steps_ahead(run(100_000)) == generate_module.MOST_RUN_AHEAD


# ---- the generation loop on the bundled model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled() -> Any:
    from llmtrace.tracer.load.loader import load_model

    return load_model(None, weights="Q4_1:i8dot,Q8_0:i16dot")  # the runs below end as they assert (EOS, 48 tokens)


def generation(loaded: Any, run_ahead: bool, **settings: Any) -> Any:
    options = dict(model="", prompt="The capital of France is", max_new_tokens=48) | settings
    made = Generation(loaded, RunSettings(**options), run_ahead=run_ahead)
    try:
        return made.run()
    finally:
        made.close()


SAMPLED = dict(prompt="The capital of France is", max_new_tokens=48, temperature=0.7, seed=5)


RUNS = {"greedy to EOS": dict(prompt="What is 2+2?", chat=True), "drawn at T=0.7": SAMPLED,
        "drawn at T=1": SAMPLED | dict(temperature=1.0), "top-p and a penalty": SAMPLED | dict(top_p=0.9,
                                                                                              repetition_penalty=1.2),
        "top-k and min-p": SAMPLED | dict(top_k=20, min_p=0.05)}


@pytest.mark.parametrize("trace", [False, True])
@pytest.mark.parametrize("run", list(RUNS))
def test_a_run_ahead_trace_is_the_step_at_a_time_trace(bundled: Any, trace: bool, run: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled model, greedy to EOS (12 tokens, EOS inside a call), or drawn at a temperature, with filters and
    a penalty or without (47 decode steps): the same tokens, text, stop reason, step records and stage records,
    times apart; the run-ahead path made several steps a call."""
    settings = RUNS[run]
    calls = []
    ahead = PackedBackend.ahead

    def counted(backend: PackedBackend, *args: Any, **kwargs: Any) -> Any:
        run = ahead(backend, *args, **kwargs)
        calls.append(len(run.tokens))
        return run

    monkeypatch.setattr(PackedBackend, "ahead", counted)
    # calls of as many steps as take 50 ms: on a loaded machine (a step over 50 ms) that is one; the test's calls
    # must run several whatever the machine's pace
    monkeypatch.setattr(generate_module, "RUN_AHEAD_NS", 60_000_000_000)
    ahead = generation(bundled, True, trace=trace, **settings)
    assert calls and max(calls) > 1 and sum(calls) == len(ahead.steps) - 1
    calls_ahead = list(calls)
    calls.clear()
    step_by_step = generation(bundled, False, trace=trace, **settings)
    assert calls == []
    assert ahead.stop_reason == step_by_step.stop_reason
    if run in ("greedy to EOS", "drawn at T=0.7", "drawn at T=1"):
        assert ahead.stop_reason == ("eos" if run == "greedy to EOS" else "max_new_tokens")
    assert ahead.generated_ids == step_by_step.generated_ids and ahead.generated_text == step_by_step.generated_text
    assert [untimed(s) for s in ahead.steps] == [untimed(s) for s in step_by_step.steps]
    assert [untimed(s) for s in ahead.stages] == [untimed(s) for s in step_by_step.stages]
    assert len(ahead.stages) == (len(ahead.steps) * 423 if trace else 0)
    decode = [s for s in ahead.steps if s.phase == DECODE]
    for step, following in zip(decode, decode[1:] + [None]):  # C's spans, back to back: none overlaps the next
        assert step.duration_ns == step.forward_ns + step.sample_ns and step.detokenize_ns == 0 and step.forward_ns > 0
        assert following is None or step.end_ns <= following.start_ns
    assert ahead.run_ahead == RunAhead(len(calls_ahead), sum(calls_ahead), max(calls_ahead))
    assert step_by_step.run_ahead is None and "run_ahead" not in json.loads(step_by_step.to_json())
    data = json.loads(ahead.to_json())
    jsonschema.validate(data, load_schema())
    assert Trace.from_json(ahead.to_json()).run_ahead == ahead.run_ahead


@pytest.mark.parametrize("trace_it", [True, False])
def test_show_says_the_steps_ran_ahead(bundled: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       trace_it: bool) -> None:
    """`llmtrace show` of a run-ahead trace, traced or not, says so in its summary, within 80 columns."""
    from typer.testing import CliRunner

    from llmtrace.cli.app import app

    trace = generation(bundled, True, trace=trace_it, prompt="The sky is", chat=True)
    path = tmp_path / "trace.json"
    path.write_text(trace.to_json(), encoding="utf-8")
    monkeypatch.setenv("COLUMNS", "80")
    result = CliRunner().invoke(app, ["show", str(path)])
    assert result.exit_code == 0, result.output
    note = f"the {trace.run_ahead.steps} decode steps ran ahead in C, {trace.run_ahead.calls} calls"
    assert note in " ".join(result.output.split())
    assert max(len(line) for line in result.output.splitlines()) <= 80


@pytest.mark.parametrize("settings", [dict(lens=True), dict(staged=True)])
def test_runs_that_need_each_step_run_a_step_at_a_time(bundled: Any, settings: dict[str, Any],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The logit lens's hooks and --staged read each step: no run ahead."""
    calls = []
    monkeypatch.setattr(PackedBackend, "ahead", lambda *a, **k: calls.append(1))
    trace = generation(bundled, True, max_new_tokens=4, **settings)
    assert calls == [] and len(trace.steps) == 4


def test_a_sampler_of_its_own_runs_ahead_asked_for_every_token(bundled: Any) -> None:
    """A Sampler subclass whose `sample` does something else is what C calls for every token (C chooses nothing
    itself), and its tokens are those it gives a step at a time."""
    asked = []

    class Counting(Sampler):
        def sample(self, logits: Any, previous_ids: Any = ()) -> Any:
            asked.append(1)
            return super().sample(logits, previous_ids)

    def run(run_ahead: bool) -> Any:
        settings = RunSettings(model="", prompt="The capital of France is", max_new_tokens=8)
        made = Generation(bundled, settings, sampler=Counting(SamplingParams(temperature=0.0)), run_ahead=run_ahead)
        try:
            return made.run()
        finally:
            made.close()

    ahead = run(True)
    assert len(asked) == len(ahead.steps) == 8 and ahead.run_ahead is not None
    assert ahead.generated_ids == run(False).generated_ids


def test_a_sampler_used_again_draws_as_after_a_step_at_a_time(bundled: Any) -> None:
    """Two drawn runs through one Sampler, the first ending at EOS inside a call: the sampler drew for the steps
    that ran and no more, so the second run draws what it draws after a first run a step at a time."""
    def two_runs(run_ahead: bool) -> list[Any]:
        sampler = Sampler(SamplingParams(temperature=0.7, seed=2))
        traces = []
        for _ in range(2):
            settings = RunSettings(model="", prompt="The sky is", chat=True, max_new_tokens=48, temperature=0.7, seed=2)
            made = Generation(bundled, settings, sampler=sampler, run_ahead=run_ahead)
            try:
                traces.append(made.run())
            finally:
                made.close()
        return traces

    ahead, step_by_step = two_runs(True), two_runs(False)
    assert ahead[0].stop_reason == "eos" and ahead[0].run_ahead is not None  # ended inside a call
    for got, want in zip(ahead, step_by_step):
        assert got.generated_ids == want.generated_ids
        assert [untimed(s) for s in got.steps] == [untimed(s) for s in want.steps]


def test_ctrl_c_between_steps_of_a_call_keeps_the_steps_recorded(bundled: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the records of a call's steps are made: the run ends "interrupted" with the steps recorded
    before it, their stage records, and no stage record of the step it interrupted."""
    added = itertools.count()
    text_stream_add = generate_module.TextStream.add

    def interrupted(stream: Any, token: int) -> str:
        if next(added) == 6:
            raise KeyboardInterrupt
        return text_stream_add(stream, token)

    monkeypatch.setattr(generate_module.TextStream, "add", interrupted)
    trace = generation(bundled, True, trace=True)
    assert trace.stop_reason == "interrupted"
    assert [s.step for s in trace.steps] == list(range(6))
    assert trace.run_ahead is not None and trace.run_ahead.steps == 5  # recorded, not run: the call ran more
    assert {s.step for s in trace.stages} == set(range(6))
    decode = [s for s in trace.steps if s.phase == DECODE]
    assert np.all(np.diff([s.start_ns for s in decode]) > 0)
