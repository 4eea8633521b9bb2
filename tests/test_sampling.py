"""Sampling: hand-derived distributions, seeds, bad parameters, and HF transformers' logits processors as referee."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.run.sampling import Candidate, Sampler, SampleResult, SamplingParams

# The seed article's table (好 72.5%, 热 15.1%, 冷 5.2%, ...), completed so it sums to 1, under shuffled token ids
# so that nothing can pass by reading positions.
SEED_PROBS = {40: 0.725, 7: 0.151, 93: 0.052, 2: 0.030, 61: 0.022, 15: 0.020}
SEED_VOCAB = 100


def seed_logits() -> torch.Tensor:
    """log-probabilities (softmax gives SEED_PROBS back); tokens not in the table get -inf."""
    logits = torch.full((SEED_VOCAB,), float("-inf"))
    for token, p in SEED_PROBS.items():
        logits[token] = math.log(p)
    return logits


def by_id(result: SampleResult) -> dict[int, Candidate]:
    return {c.token_id: c for c in result.candidates}


def sample(logits: torch.Tensor, previous_ids=(), n_candidates: int = 10, **params) -> SampleResult:
    return Sampler(SamplingParams(**params), n_candidates=n_candidates).sample(logits, previous_ids)


# ---- hand-made distributions --------------------------------------------------------------------------------------


def test_top_p_0_9_keeps_the_seed_articles_three_candidates() -> None:
    # 72.5 -> 87.6 (< 90, go on) -> 92.8 (crossed 90: 冷 is kept, the rest dropped)
    result = sample(seed_logits(), temperature=1.0, top_p=0.9, seed=0)
    assert result.n_after_top_k == SEED_VOCAB  # top-k off
    assert result.n_after_top_p == 3 and result.n_final == 3
    kept_mass = 0.725 + 0.151 + 0.052
    cands = by_id(result)
    for token, p in SEED_PROBS.items():
        c = cands[token]
        assert c.prob_raw == pytest.approx(p, rel=1e-6)
        assert c.prob_tempered == pytest.approx(p, rel=1e-6)  # T = 1
        kept = token in (40, 7, 93)
        assert (c.kept_top_k, c.kept_top_p, c.kept_min_p) == (True, kept, kept)
        assert c.prob_final == pytest.approx(p / kept_mass if kept else 0.0, rel=1e-6)
    assert [c.token_id for c in result.candidates[:6]] == [40, 7, 93, 2, 61, 15]
    assert [c.rank for c in result.candidates[:6]] == [1, 2, 3, 4, 5, 6]
    assert result.token_id in (40, 7, 93)
    assert result.probability == pytest.approx(SEED_PROBS[result.token_id] / kept_mass, rel=1e-6)
    assert result.active_steps == ("top_p",)


def test_top_k_2_keeps_two_and_renormalises() -> None:
    result = sample(seed_logits(), temperature=1.0, top_k=2, seed=0)
    assert (result.n_after_top_k, result.n_after_top_p, result.n_after_min_p, result.n_final) == (2, 2, 2, 2)
    cands = by_id(result)
    assert cands[40].prob_final == pytest.approx(0.725 / 0.876, rel=1e-6)
    assert cands[7].prob_final == pytest.approx(0.151 / 0.876, rel=1e-6)
    assert [cands[t].kept_top_k for t in (40, 7, 93, 2)] == [True, True, False, False]
    assert not cands[93].kept_top_p and not cands[93].kept_min_p  # the flags are cumulative
    assert cands[93].prob_final == 0.0


def test_top_p_works_on_what_top_k_kept_renormalised() -> None:
    # top-k 3 leaves 0.725/0.928 = 0.781, 0.151/0.928 = 0.163, 0.056: top-p 0.9 now stops after the second token
    # (mass before the third is 0.944 >= 0.9); on the raw distribution it would have kept three
    result = sample(seed_logits(), temperature=1.0, top_k=3, top_p=0.9, seed=0)
    assert (result.n_after_top_k, result.n_after_top_p) == (3, 2)
    assert by_id(result)[40].prob_final == pytest.approx(0.725 / 0.876, rel=1e-6)


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability() -> None:
    # 0.1 * 0.725 = 0.0725: 0.151 stays, 0.052 goes
    result = sample(seed_logits(), temperature=1.0, min_p=0.1, seed=0)
    assert result.n_after_top_p == SEED_VOCAB and result.n_after_min_p == 2
    assert [by_id(result)[t].kept_min_p for t in (40, 7, 93)] == [True, True, False]
    # 0.05 * 0.725 = 0.03625: 0.052 stays, 0.030 goes
    result = sample(seed_logits(), temperature=1.0, min_p=0.05, seed=0)
    assert result.n_final == 3
    assert by_id(result)[93].prob_final == pytest.approx(0.052 / 0.928, rel=1e-6)


def test_temperature_0_5_squares_and_renormalises() -> None:
    # softmax(log(p) / 0.5) = p^2 / sum(p^2)
    result = sample(seed_logits(), temperature=0.5, seed=0)
    squares = sum(p * p for p in SEED_PROBS.values())
    for token, p in SEED_PROBS.items():
        c = by_id(result)[token]
        assert c.prob_raw == pytest.approx(p, rel=1e-6)
        assert c.prob_tempered == pytest.approx(p * p / squares, rel=1e-5)
        assert c.prob_final == pytest.approx(p * p / squares, rel=1e-5)  # nothing filtered
    assert result.n_final == SEED_VOCAB  # the -inf tokens are not filtered, only impossible
    assert result.active_steps == ("temperature",)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([2.6, -1.0, 2.2, 0.5, -0.4])
    result = sample(logits, previous_ids=[0, 1, 1], repetition_penalty=1.3)  # greedy
    cands = by_id(result)
    assert cands[0].logit == pytest.approx(2.6) and cands[0].logit_penalized == pytest.approx(2.0)
    assert cands[1].logit == pytest.approx(-1.0) and cands[1].logit_penalized == pytest.approx(-1.3)
    assert cands[2].logit_penalized == pytest.approx(2.2) and cands[4].logit_penalized == pytest.approx(-0.4)
    assert result.n_penalized == 2  # distinct ids
    assert result.token_id == 2  # 2.6 / 1.3 = 2.0 < 2.2: the penalty changed the argmax
    assert [c.token_id for c in result.candidates] == [2, 0, 3, 4, 1]  # ranked by penalised logit
    raw_total = sum(math.exp(v) for v in logits.tolist())
    assert result.probability_raw == pytest.approx(math.exp(2.2) / raw_total, rel=1e-6)
    assert result.active_steps == ("repetition_penalty", "greedy")


def test_repetition_penalty_before_temperature_and_input_untouched() -> None:
    logits = torch.tensor([2.6, -1.0, 2.2, 0.5])
    before = logits.clone()
    result = sample(logits, previous_ids=torch.tensor([0, 1]), temperature=0.5, repetition_penalty=1.3, seed=0)
    assert torch.equal(logits, before)
    scaled = [2.0 / 0.5, -1.3 / 0.5, 2.2 / 0.5, 0.5 / 0.5]
    total = sum(math.exp(v) for v in scaled)
    for c in result.candidates:
        assert c.prob_tempered == pytest.approx(math.exp(scaled[c.token_id]) / total, rel=1e-5)


def test_greedy_takes_the_argmax_with_probability_one() -> None:
    logits = torch.tensor([0.5, 3.0, -2.0, 2.9])
    result = sample(logits)
    assert result.token_id == 1 and result.rank == 1 and result.probability == 1.0
    total = sum(math.exp(v) for v in logits.tolist())
    assert result.probability_raw == pytest.approx(math.exp(3.0) / total, rel=1e-6)
    assert [c.prob_final for c in result.candidates] == [1.0, 0.0, 0.0, 0.0]
    assert [c.prob_tempered for c in result.candidates] == [1.0, 0.0, 0.0, 0.0]  # the T -> 0 limit
    assert result.n_final == 1 and result.entropy_final_bits == 0.0
    assert result.active_steps == ("greedy",)


def test_greedy_breaks_ties_like_argmax() -> None:
    logits = torch.tensor([1.0, 3.0, 0.0, 3.0, 3.0])
    result = sample(logits)
    assert result.token_id == int(torch.argmax(logits)) == 1
    assert [c.token_id for c in result.candidates] == [1, 3, 4, 0, 2]
    # more tied maxima than the candidate table holds, scattered over a large vocabulary
    big = torch.randn(49152, generator=torch.Generator().manual_seed(3))
    tied = torch.randperm(49152, generator=torch.Generator().manual_seed(4))[:30]
    big[tied] = 9.0
    result = sample(big)
    assert result.token_id == int(torch.argmax(big)) == int(tied.min())
    assert [c.token_id for c in result.candidates] == sorted(tied.tolist())[:10]


def test_top_k_keeps_tokens_tied_with_the_kth_like_hf() -> None:
    logits = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0])
    result = sample(logits, temperature=1.0, top_k=2, seed=0)
    hf = TopKLogitsWarper(top_k=2)(None, logits[None].clone())[0]
    assert result.n_after_top_k == int(torch.isfinite(hf).sum()) == 4


def test_entropies_in_bits() -> None:
    # p = 1/2, 1/4, 1/8, 1/8: H = 1/2 + 2/4 + 3/8 + 3/8 = 1.75 bits; top-k 2 leaves 2/3, 1/3: H = log2(3) - 2/3
    logits = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.125), math.log(0.125)])
    result = sample(logits, temperature=1.0, top_k=2, seed=0)
    assert result.entropy_raw_bits == pytest.approx(1.75, rel=1e-6)
    assert result.entropy_final_bits == pytest.approx(math.log2(3) - 2 / 3, rel=1e-6)
    assert sample(seed_logits()).entropy_raw_bits == pytest.approx(
        -sum(p * math.log2(p) for p in SEED_PROBS.values()), rel=1e-6)  # -inf tokens add nothing


# ---- seeds and draws ----------------------------------------------------------------------------------------------


def draw_sequence(seed: int | None, n: int = 200) -> tuple[list[int], int]:
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
    logits = torch.linspace(0.0, 1.0, 50)  # 50 plausible tokens
    return [sampler.sample(logits).token_id for _ in range(n)], sampler.seed


def test_a_seed_reproduces_the_token_sequence_and_another_seed_differs() -> None:
    first, _ = draw_sequence(7)
    again, _ = draw_sequence(7)
    other, _ = draw_sequence(8)
    assert first == again
    assert first != other
    assert len(set(first)) > 20  # really random, not stuck on one token
    unseeded, drawn_seed = draw_sequence(None)
    assert draw_sequence(drawn_seed)[0] == unseeded  # the reported seed replays an unseeded run


def test_draw_frequencies_follow_the_final_probabilities_over_a_prefix() -> None:
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=3))
    logits = seed_logits()
    draws = [sampler.sample(logits).token_id for _ in range(8000)]
    assert set(draws) == {40, 7}
    assert draws.count(40) / len(draws) == pytest.approx(0.725 / 0.876, abs=0.015)  # std 0.004


def test_draw_frequencies_follow_the_probabilities_over_the_whole_vocabulary() -> None:
    # no filter and a vocabulary larger than the candidate table: the draw runs over all 1000 tokens
    probs = torch.full((1000,), 0.05 / 997)
    probs[700], probs[3], probs[999] = 0.5, 0.3, 0.15
    sampler = Sampler(SamplingParams(temperature=1.0, seed=11), n_candidates=3)
    draws = [sampler.sample(probs.log()).token_id for _ in range(5000)]  # seeded: the same draws every run
    share = {t: draws.count(t) / len(draws) for t in (700, 3, 999)}
    assert share[700] == pytest.approx(0.5, abs=0.025)  # std 0.007
    assert share[3] == pytest.approx(0.3, abs=0.025)  # std 0.0065
    assert share[999] == pytest.approx(0.15, abs=0.02)  # std 0.005
    assert sum(share.values()) == pytest.approx(0.95, abs=0.012)  # the other 997 tokens share 0.05


def test_a_chosen_token_below_the_table_is_appended_with_its_rank() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(SamplingParams(temperature=5.0, seed=1), n_candidates=3)
    result = next(r for r in (sampler.sample(logits) for _ in range(50)) if r.rank > 3)
    assert len(result.candidates) == 4
    last = result.candidates[-1]
    assert last.chosen and last.token_id == result.token_id and last.rank == result.rank
    assert result.rank == 1 + int((logits > logits[result.token_id]).sum())
    assert [c.chosen for c in result.candidates[:3]] == [False, False, False]
    assert result.probability == pytest.approx(float(torch.softmax(logits / 5.0, 0)[result.token_id]), rel=1e-5)


# ---- bad input ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("params", "named"), [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.2}, "top_p"), ({"temperature": 1.0, "top_k": -1}, "top_k"),
    ({"temperature": 1.0, "top_k": 2.5}, "top_k"), ({"temperature": 1.0, "top_k": True}, "top_k"),
    ({"min_p": 1.0}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.3}, "repetition_penalty"), ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"),
    ({"temperature": 0.0, "top_k": 50}, "top_k"), ({"top_p": 0.9}, "top_p"), ({"min_p": 0.1}, "min_p"),
])
def test_invalid_parameters_raise_one_clear_line(params: dict, named: str) -> None:
    with pytest.raises(BadArgumentError) as caught:
        SamplingParams(**params)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("--" + named.replace("_", "-"))  # the option, as typed


def test_greedy_with_a_filter_says_to_give_a_temperature() -> None:
    with pytest.raises(BadArgumentError, match="temperature > 0"):
        SamplingParams(top_p=0.9)


def test_invalid_candidate_count_and_logits_are_refused() -> None:
    with pytest.raises(BadArgumentError, match="n_candidates"):
        Sampler(SamplingParams(), n_candidates=0)
    sampler = Sampler(SamplingParams(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="1-D"):
        sampler.sample(torch.zeros(1, 8))
    with pytest.raises(ValueError, match="finite"):
        sampler.sample(torch.tensor([0.0, float("nan"), 1.0]))
    with pytest.raises(ValueError, match="previous_ids"):
        sampler.sample(torch.zeros(8), [3, 8])


# ---- records --------------------------------------------------------------------------------------------------------


def test_records_are_frozen_plain_values_and_json_ready() -> None:
    result = sample(seed_logits(), previous_ids=[40], temperature=0.8, top_k=4, top_p=0.95, min_p=0.01,
                    repetition_penalty=1.1, seed=5)
    as_dict = dataclasses.asdict(result)
    restored = json.loads(json.dumps(as_dict))
    assert restored["candidates"] == [dataclasses.asdict(c) for c in result.candidates]
    assert restored == {**as_dict, "candidates": restored["candidates"], "active_steps": list(result.active_steps)}
    for c in result.candidates:
        assert type(c.token_id) is int and type(c.rank) is int and type(c.kept_top_p) is bool
        assert type(c.logit) is float and type(c.prob_final) is float
    assert type(result.entropy_raw_bits) is float and type(result.n_after_top_p) is int
    assert result.active_steps == ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.token_id = 3  # type: ignore[misc]


def test_low_precision_logits_are_read_as_float32() -> None:
    logits = torch.randn(300, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    low = sample(logits, temperature=0.7, top_p=0.8, seed=9)
    full = sample(logits.float(), temperature=0.7, top_p=0.8, seed=9)
    assert low == full


# ---- HF transformers' logits processors as an independent referee ------------------------------------------------


def hf_stages(logits: torch.Tensor, params: SamplingParams, previous_ids: list[int]) -> dict[str, torch.Tensor]:
    """The scores after each of HF's processors, applied in generate()'s order."""
    scores = logits[None].clone()
    input_ids = torch.tensor([previous_ids or [0]])
    stages = {}
    if params.repetition_penalty != 1:
        scores = RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))(input_ids, scores)
    stages["penalised"] = scores[0]
    if params.temperature != 1:
        scores = TemperatureLogitsWarper(float(params.temperature))(input_ids, scores)
    stages["tempered"] = scores[0]
    if params.top_k:
        scores = TopKLogitsWarper(top_k=params.top_k)(input_ids, scores)
    stages["top_k"] = scores[0]
    if params.top_p < 1:
        scores = TopPLogitsWarper(top_p=params.top_p)(input_ids, scores)
    stages["top_p"] = scores[0]
    if params.min_p > 0:
        scores = MinPLogitsWarper(min_p=params.min_p)(input_ids, scores)
    stages["min_p"] = scores[0]
    return stages


def assert_matches_hf(result: SampleResult, logits: torch.Tensor, params: SamplingParams,
                      previous_ids: list[int]) -> None:
    hf = hf_stages(logits, params, previous_ids)
    kept = {name: torch.isfinite(hf[name]) for name in ("top_k", "top_p", "min_p")}
    assert result.n_after_top_k == int(kept["top_k"].sum())
    assert result.n_after_top_p == int(kept["top_p"].sum())
    assert result.n_after_min_p == result.n_final == int(kept["min_p"].sum())
    assert bool(kept["min_p"][result.token_id])
    raw = torch.softmax(logits.double(), 0)
    tempered = torch.softmax(hf["tempered"].double(), 0)
    final = torch.softmax(hf["min_p"].double(), 0)
    for c in result.candidates:
        t = c.token_id
        assert c.logit == float(logits[t])
        assert c.logit_penalized == pytest.approx(float(hf["penalised"][t]), rel=1e-6, abs=1e-6)
        flags = (c.kept_top_k, c.kept_top_p, c.kept_min_p)
        assert flags == tuple(bool(kept[name][t]) for name in ("top_k", "top_p", "min_p"))
        assert c.prob_raw == pytest.approx(float(raw[t]), rel=1e-4, abs=1e-9)
        assert c.prob_tempered == pytest.approx(float(tempered[t]), rel=1e-4, abs=1e-9)
        assert c.prob_final == pytest.approx(float(final[t]), rel=1e-4, abs=1e-9)
    ranks = [c.rank for c in result.candidates]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)
    assert result.rank == 1 + int((hf["tempered"] > hf["tempered"][result.token_id]).sum())


HF_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=50),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.3, min_p=0.05),
    dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.3),
    dict(temperature=1.0, top_p=0.5, repetition_penalty=0.8),
    dict(temperature=2.0, top_k=400, top_p=0.99),
]


@pytest.mark.parametrize("case", HF_CASES)
def test_every_token_matches_hf_processors_on_random_logits(case: dict) -> None:
    # a candidate table as large as the vocabulary: every token's flags and probabilities are compared
    generator = torch.Generator().manual_seed(len(str(case)))
    for scale in (1.0, 4.0):
        logits = torch.randn(1000, generator=generator) * scale
        previous = torch.randint(0, 1000, (60,), generator=generator).tolist()
        params = SamplingParams(seed=0, **case)
        result = Sampler(params, n_candidates=1000).sample(logits, previous)
        assert len(result.candidates) == 1000
        assert_matches_hf(result, logits, params, previous)
        assert sum(c.prob_final for c in result.candidates) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("shape", ["peaked", "medium", "flat"])
@pytest.mark.parametrize("case", HF_CASES + [dict(temperature=1.0, top_p=0.9), dict(temperature=1.0, min_p=0.001)])
def test_partial_selection_on_a_49152_vocabulary_matches_hf(shape: str, case: dict) -> None:
    # the default 10-row table: the fast paths (partial selection, growing the top-p prefix, the whole-vocabulary
    # draw) decide the counts, flags and probabilities that HF computes with full sorts
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(49152, generator=generator) * {"peaked": 2.0, "medium": 1.5, "flat": 1.0}[shape]
    if shape == "peaked":
        logits[torch.randperm(49152, generator=generator)[:5]] = torch.tensor([14.0, 12.4, 11.4, 10.9, 10.5])
    previous = torch.randint(0, 49152, (200,), generator=generator).tolist()
    params = SamplingParams(seed=4, **case)
    result = Sampler(params).sample(logits, previous)
    assert_matches_hf(result, logits, params, previous)


def test_greedy_matches_torch_on_a_49152_vocabulary() -> None:
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(5)) * 3
    result = sample(logits)
    top = torch.topk(logits, 10)
    assert result.token_id == int(torch.argmax(logits))
    assert [c.token_id for c in result.candidates] == top.indices.tolist()
    probs = torch.softmax(logits.double(), 0)
    assert [c.prob_raw for c in result.candidates] == pytest.approx(probs[top.indices].tolist(), rel=1e-5)
    entropy = -float((probs * probs.log()).sum()) / math.log(2)
    assert result.entropy_raw_bits == pytest.approx(entropy, rel=1e-5)


def test_partial_selection_is_exact_when_its_sample_misleads_it() -> None:
    from llmtrace.tracer.run.distribution import top_sorted

    # every 16th value holds the largest ones: the sampled threshold lets too few through, so it must fall back
    x = torch.zeros(49152)
    x[::16] = torch.arange(1.0, 3073.0)
    assert top_sorted(x.numpy(), 10).tolist() == torch.topk(x, 10).indices.tolist()
    # a sample that sees only ties: many values pass, and the tied ones come out lower index first
    y = torch.zeros(49152)
    y[[5, 40000, 77]] = torch.tensor([3.0, 2.0, 2.0])
    assert top_sorted(y.numpy(), 6).tolist() == [5, 77, 40000, 0, 1, 2]


# ---- top-p on tied distributions: a count, as HF's TopPLogitsWarper keeps it ---------------------------------------


def test_top_p_keeps_the_fewest_tokens_even_inside_a_tie() -> None:
    """Five tokens tied at 16% behind one at 20%: p = 0.5 is reached by the third (20 + 16 + 16 = 52%).

    A threshold on the logit would keep all six (every tied token has the cut-off's logit); the nucleus is the three.
    Ties are cut in rank order: lower token id first, argmax's order.
    """
    probs = {11: 0.20, 3: 0.16, 8: 0.16, 20: 0.16, 31: 0.16, 40: 0.16}
    logits = torch.full((50,), float("-inf"))
    for token, p in probs.items():
        logits[token] = math.log(p)
    result = sample(logits, temperature=1.0, top_p=0.5, seed=0)
    assert result.n_after_top_p == result.n_final == 3
    assert result.top_p_mass == pytest.approx(0.52)
    kept = [c.token_id for c in result.candidates if c.kept_top_p]
    assert kept == [11, 3, 8]
    assert result.token_id in kept
    assert sum(c.prob_final for c in result.candidates) == pytest.approx(1.0)
    hf = TopPLogitsWarper(top_p=0.5)(torch.tensor([[0]]), logits[None].clone())[0]
    assert int(torch.isfinite(hf).sum()) == 3  # HF's count, its own tie order aside


def _hf_top_p_kept(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    return torch.isfinite(TopPLogitsWarper(top_p=top_p)(torch.tensor([[0]]), scores[None].clone())[0])


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.8, 0.9, 0.95])
@pytest.mark.parametrize("step", [0.25, 0.5, 1.0])
def test_top_p_on_tied_logits_keeps_as_many_as_hf(top_p: float, step: float) -> None:
    """Logits rounded to a grid tie in runs (as bf16 logits do). HF keeps a count decided by its sort: the same
    count here, every token above the cut-off's logit kept by both, the rest of the count taken from the tie."""
    generator = torch.Generator().manual_seed(int(100 * top_p + 10 * step))
    for vocab in (64, 1000, 49152):
        logits = torch.round(torch.randn(vocab, generator=generator) * 2 / step) * step
        result = Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=0), n_candidates=vocab).sample(logits)
        hf = _hf_top_p_kept(logits, top_p)
        assert result.n_after_top_p == result.n_final
        if result.n_after_top_p != int(hf.sum()):
            # HF sums fp32 probabilities from the smallest up; here they are summed in fp64 from the largest. They
            # may disagree only where the nucleus's mass is within fp32 rounding of p: check that it is.
            assert abs(result.n_after_top_p - int(hf.sum())) == 1 and abs(result.top_p_mass - top_p) < 1e-6
            continue
        kept = torch.zeros(vocab, dtype=torch.bool)
        kept[[c.token_id for c in result.candidates if c.kept_top_p]] = True
        cut = float(logits[kept].min())
        assert torch.equal(kept & (logits > cut), hf & (logits > cut))  # above the cut-off: the same tokens
        assert int((kept & (logits == cut)).sum()) == int((hf & (logits == cut)).sum())  # from the tie: as many
        tied = torch.nonzero(logits == cut).flatten()
        assert kept[tied].tolist() == sorted(kept[tied].tolist(), reverse=True)  # lower ids first
        assert bool(kept[result.token_id])
        mass = float(torch.softmax(logits.double(), 0)[kept].sum())
        assert result.top_p_mass == pytest.approx(mass, rel=1e-6) and mass >= top_p - 1e-6


def test_top_p_ties_with_top_k_and_min_p_in_bf16() -> None:
    """bf16 logits of a real LM head tie often; top-k's ties are kept (HF's rule for top-k), top-p's are cut."""
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(49152, generator=generator) * 3).bfloat16()
    params = SamplingParams(temperature=1.0, top_k=200, top_p=0.6, min_p=0.0005, seed=1)
    result = Sampler(params).sample(logits)
    scores = logits.float()[None]
    after_k = TopKLogitsWarper(top_k=200)(torch.tensor([[0]]), scores.clone())
    after_p = TopPLogitsWarper(top_p=0.6)(torch.tensor([[0]]), after_k.clone())
    after_m = MinPLogitsWarper(min_p=0.0005)(torch.tensor([[0]]), after_p.clone())
    assert result.n_after_top_k == int(torch.isfinite(after_k).sum())
    assert result.n_after_top_p == int(torch.isfinite(after_p).sum())
    assert result.n_final == int(torch.isfinite(after_m).sum())
