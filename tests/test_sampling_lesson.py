"""The sampling lesson: the seed article's table recomputed by hand, the run's filters or the illustrative ones,
the run's own tokens untouched, and the panel in `run` and `show`."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.run.sampling_lesson import sampling_lesson
from llmtrace.tracer.run.sampling_params import check_temperatures
from llmtrace.tracer.trace.journey_records import FILTERS_FROM_RUN, FILTERS_ILLUSTRATIVE
from llmtrace.tracer.trace.records import RunSettings

# The seed article's distribution (好 72.5%, 热 15.1%, 冷 5.2%, ...) under shuffled ids, the rest of a 100-token
# vocabulary at -inf.
SEED_PROBS = {40: 0.725, 7: 0.151, 93: 0.052, 2: 0.030, 61: 0.022, 15: 0.020}
runner = CliRunner()


def seed_logits() -> torch.Tensor:
    logits = torch.full((100,), float("-inf"))
    for token, p in SEED_PROBS.items():
        logits[token] = math.log(p)
    return logits


def settings(**overrides) -> RunSettings:
    return replace(RunSettings(model="", prompt="x"), **overrides)


def tempered(temperature: float) -> dict[int, float]:
    """softmax(log p / T) by hand: p^(1/T) renormalised."""
    powered = {t: p ** (1 / temperature) for t, p in SEED_PROBS.items()}
    total = sum(powered.values())
    return {t: v / total for t, v in powered.items()}


def test_columns_are_the_tempered_distribution_with_what_the_filters_keep() -> None:
    lesson = sampling_lesson(seed_logits(), [], settings(temperatures=(0.5, 1.0, 2.0)), str, n_tokens=6)
    assert [t.token_id for t in lesson.tokens] == [40, 7, 93, 2, 61, 15]  # highest logit first
    assert (lesson.top_k, lesson.top_p, lesson.min_p, lesson.filters_from) == (50, 0.9, 0.05, FILTERS_ILLUSTRATIVE)
    for column in lesson.columns:
        expected = tempered(column.temperature)
        assert column.probabilities == pytest.approx([expected[t.token_id] for t in lesson.tokens], rel=1e-5)
        bits = -sum(p * math.log2(p) for p in expected.values())
        assert column.entropy_bits == pytest.approx(bits, rel=1e-5)
        # top-k 50 keeps the same whatever T is: here all 100, as the 50th is the -inf tail and ties are kept
        assert column.n_after_top_k == 100
    by_t = {c.temperature: c for c in lesson.columns}
    # T = 1: the article's nucleus {好, 热, 冷} (72.5 + 15.1 = 87.6% < 90%, + 5.2% crosses it); min-p 0.05 drops
    # nothing more (5.2% >= 0.05 x 72.5%), and the three are renormalised.
    assert (by_t[1.0].n_after_top_p, by_t[1.0].n_after_min_p) == (3, 3)
    assert by_t[1.0].final_probabilities[:3] == pytest.approx([p / 0.928 for p in (0.725, 0.151, 0.052)], rel=1e-5)
    assert by_t[1.0].final_probabilities[3:] == (0.0, 0.0, 0.0)
    # T = 0.5 sharpens: 好 alone holds 95% (> 0.9), so top-p keeps one; T = 2 flattens, so it keeps more.
    assert by_t[0.5].n_after_top_p == 1 and by_t[0.5].final_probabilities[0] == pytest.approx(1.0)
    assert by_t[2.0].n_after_top_p == 5
    assert by_t[0.5].entropy_bits < by_t[1.0].entropy_bits < by_t[2.0].entropy_bits


def test_the_runs_own_filters_are_used_when_it_set_any() -> None:
    lesson = sampling_lesson(seed_logits(), [], settings(temperature=1.0, top_k=2), str)
    assert (lesson.top_k, lesson.top_p, lesson.min_p, lesson.filters_from) == (2, 1.0, 0.0, FILTERS_FROM_RUN)
    assert all((c.n_after_top_k, c.n_after_top_p, c.n_after_min_p) == (2, 2, 2) for c in lesson.columns)


def test_the_repetition_penalty_orders_the_tokens_as_the_run_saw_them() -> None:
    # token 40 already seen: its logit log(0.725) = -0.32 is multiplied by 7 (-2.25), which drops it below 热 (-1.89)
    lesson = sampling_lesson(seed_logits(), [40], settings(repetition_penalty=7.0), str, n_tokens=3)
    assert [t.token_id for t in lesson.tokens] == [7, 40, 93]
    assert lesson.tokens[1].logit == pytest.approx(7 * math.log(0.725), rel=1e-6)


@pytest.mark.parametrize("values, message", [((0.0, 1.0), "> 0"), ((float("nan"),), "finite"),
                                             ((1.0,) * 7, "at most 6")])
def test_bad_temperatures_are_named(values: tuple[float, ...], message: str) -> None:
    with pytest.raises(BadArgumentError, match=message):
        check_temperatures(values)


def test_the_lesson_leaves_the_runs_tokens_alone(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir))
    base = RunSettings(model=str(tiny_llama_dir), prompt="The sky is", max_new_tokens=4, temperature=0.9, seed=5)
    with_lesson = generate(loaded, base)
    without = generate(loaded, replace(base, temperatures=()))
    assert with_lesson.generated_ids == without.generated_ids
    assert without.sampling_lesson is None
    lesson = with_lesson.sampling_lesson
    assert lesson is not None and [c.temperature for c in lesson.columns] == [0.1, 1.0, 2.0]
    # the T = 1 column's probabilities are the model's own, as the prefill's candidate table recorded them
    prefill = with_lesson.prefill_step
    raw = {c.token_id: c.prob_raw for c in prefill.candidates}
    at_one = lesson.columns[1]
    for token, p in zip(lesson.tokens, at_one.probabilities):
        assert p == pytest.approx(raw[token.token_id], rel=1e-5)


@pytest.mark.parametrize("value, message", [("0,1", "> 0"), ("a,b", "numbers separated by commas")])
def test_cli_rejects_bad_temperatures_in_one_line(value: str, message: str, tiny_llama_dir: Path) -> None:
    result = runner.invoke(app, ["run", "sky", "--model", str(tiny_llama_dir), "--temperatures", value])
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_cli_shows_the_lesson_and_can_leave_it_out(tiny_llama_dir: Path) -> None:
    args = ["run", "sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "1", "--no-roofline"]
    shown = runner.invoke(app, [*args, "--temperatures", "0.5,1.5"])
    assert shown.exit_code == 0, shown.output
    assert "5b · Sampling lesson  the same logits at T = 0.5, 1.5" in shown.output
    assert "then top-p 0.9 keeps" in shown.output and "this run is greedy" in shown.output
    hidden = runner.invoke(app, [*args, "--temperatures", ""])
    assert hidden.exit_code == 0 and "Sampling lesson" not in hidden.output
