"""The fast sampler against the computation it replaced (tests/sampling_reference.py), call after call on one Sampler,
on logits built to reach every path: ties (grids, bf16), -inf entries, a vocabulary of one, small ones, the bundled
model's 49152 and one that no block size divides, flat distributions that grow the top-p prefix, peaked ones,
repetition penalties, huge magnitudes, zero maxima of both signs.

Every test runs twice (the `passes` fixture):
- numpy: the portable path (no native library). Every figure of every SampleResult equals the reference's bit for
  bit: the token, its probabilities, ranks, counts after each filter, entropies, the candidate table.
- native: the C passes (tracer/model/native_top.py). Everything discrete equals the reference's (the token drawn, its
  rank, every count, the candidate table's ids, ranks, logits and flags); every probability, entropy and mass is
  within the bound native_top.SOFTMAX_WEIGHT_ERROR derives, of the same figure computed in float64 numpy from the
  logits (`float64_figures`), not of the reference's fp32 one (which is itself only within ~1e-6 of it). A draw or a
  top-p cut could differ only where u or a cumulative probability lies within that bound of a boundary; the seeds
  and logits here put none there (the discrete comparison would fail if one did).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sampling_reference import ReferenceSampler

from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.native_top import MAX_COUNT, SOFTMAX_WEIGHT_ERROR, top_values
from llmtrace.tracer.run import sampling
from llmtrace.tracer.run.sampling import SampleResult, Sampler, SamplingParams

CASES = [
    dict(),  # greedy
    dict(repetition_penalty=1.3),
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.0, repetition_penalty=1.2),
    dict(temperature=0.7, top_k=50),
    dict(temperature=1.0, top_k=1),
    dict(temperature=0.9, top_k=300),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_p=0.99),
    dict(temperature=1.3, min_p=0.05),
    dict(temperature=1.0, min_p=0.001),
    dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.3),
    dict(temperature=1.0, top_p=0.5, repetition_penalty=0.8),
    dict(temperature=2.0, top_k=400, top_p=0.99),
]


@pytest.fixture(autouse=True, params=["native", "numpy"])
def passes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test twice: the sampler's passes in C (native/top_values.c, when the library builds here: loading it is
    what switches them on) and in numpy (the fallback)."""
    if request.param == "native":
        if not native_kernel.available():
            pytest.skip(f"no native library: {native_kernel.unavailable_reason()}")
    else:
        monkeypatch.setattr(sampling, "top_values", lambda x, count: None)
        monkeypatch.setattr(sampling, "sampler_passes", lambda: None)
    return request.param


def logits_family(vocab: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Logits of several shapes for one vocabulary size."""
    normal = torch.randn(vocab, generator=generator)
    out = [normal * 3.0, normal * 0.3]  # peaked-ish, very flat (top-p reaches past its first prefixes)
    out.append(torch.round(normal * 4) / 2)  # a grid: long runs of ties, ties at every cut
    out.append((normal * 3).bfloat16())  # bf16, as a real LM head may give them
    with_inf = normal * 2
    with_inf[torch.rand(vocab, generator=generator) < 0.3] = float("-inf")  # masked tokens
    with_inf[int(torch.randint(vocab, (1,), generator=generator))] = 5.0  # at least one finite
    out.append(with_inf)
    tied_top = normal.clone()
    tied_top[torch.randperm(vocab, generator=generator)[: max(1, vocab // 50)]] = 7.0  # many tied maxima
    out.append(tied_top)
    out.append(normal * 1e4)  # huge logits: exp underflows to 0 for all but a few
    signed_zeros = -normal.abs()
    signed_zeros[::7], signed_zeros[::11] = 0.0, -0.0  # the max is zero, of both signs
    out.append(signed_zeros)
    return out


def assert_same_calls(params: SamplingParams, calls: list[tuple[torch.Tensor, list[int]]],
                      n_candidates: int = 10) -> None:
    native = sampling.sampler_passes() is not None
    fast, reference = Sampler(params, n_candidates=n_candidates), ReferenceSampler(params, n_candidates=n_candidates)
    for logits, previous in calls:
        new, old = fast.sample(logits, previous), reference.sample(logits, previous)
        if native:
            assert discrete(new) == discrete(old), (params, logits.shape)
            assert_within_bounds(new, float64_figures(params, logits, previous, old))
        else:
            assert new == old, (params, logits.shape)
        # == compares floats by value: 0.0 == -0.0 and nothing else; check the signs too
        assert [math.copysign(1, c.prob_final) for c in new.candidates] == \
            [math.copysign(1, c.prob_final) for c in old.candidates]


def discrete(result: SampleResult) -> tuple:
    """Everything of a result but its probabilities, entropies and mass."""
    rows = tuple((c.token_id, c.rank, c.logit, c.logit_penalized, c.kept_top_k, c.kept_top_p, c.kept_min_p, c.chosen)
                 for c in result.candidates)
    return (result.token_id, result.rank, rows, result.active_steps, result.vocab_size, result.n_penalized,
            result.n_after_top_k, result.n_after_top_p, result.n_after_min_p, result.n_final)


# ---- the float64 figures, and the bounds the C passes are held to --------------------------------------------------

_ULP = 2.0**-53


def _lse(x: np.ndarray) -> float:
    """log(sum(exp(x))) in float64 (-inf entries allowed, at least one finite)."""
    m = float(x.max())
    return m + math.log(float(np.exp(x - m).sum()))


def _entropy(x: np.ndarray) -> float:
    """Entropy in nats of softmax(x), float64, -inf entries contributing 0."""
    logp = x - _lse(x)
    p = np.exp(logp)
    return float(-(p[p > 0] * logp[p > 0]).sum())


def float64_figures(params: SamplingParams, logits: torch.Tensor, previous: list[int],
                    result: SampleResult) -> dict:
    """The figures of `result` (a reference result: its kept counts say which tokens each filter kept) computed again
    in float64 from the logits: the penalty and temperature applied in fp32 as the sampler applies them (exact
    operations both ways), everything after that in float64."""
    raw = logits.to(torch.float32).numpy()
    raw64 = raw.astype(np.float64)
    lse_raw = _lse(raw64)
    out = {"entropy_raw": _entropy(raw64), "lse": {"raw": lse_raw},
           "prob_raw": {c.token_id: math.exp(float(raw64[c.token_id]) - lse_raw) for c in result.candidates}}
    if params.greedy:
        return out
    penalised = raw.copy()
    if params.repetition_penalty != 1 and previous:
        ids = np.asarray(previous)
        seen = raw[ids]
        penalised[ids] = np.where(seen < 0, seen * np.float32(params.repetition_penalty),
                                  seen / np.float32(params.repetition_penalty))
    scaled = penalised / np.float32(params.temperature) if params.temperature != 1 else penalised
    scaled64 = scaled.astype(np.float64)
    order = np.lexsort((np.arange(scaled.size), -scaled64))  # largest first, ties lower id first
    lse_tempered = _lse(scaled64)
    final = scaled64[order[: result.n_final]]
    lse_final = _lse(final)
    out["lse"].update(tempered=lse_tempered, final=lse_final)
    out["entropy_final"] = _entropy(final)
    out["prob_tempered"] = {c.token_id: math.exp(float(scaled64[c.token_id]) - lse_tempered) for c in result.candidates}
    out["prob_final"] = {c.token_id: math.exp(float(scaled64[c.token_id]) - lse_final) if c.kept_min_p else 0.0
                         for c in result.candidates}
    survivors = scaled64[order[: result.n_after_top_k]]
    mass = float(np.exp(survivors[: result.n_after_top_p] - _lse(survivors)).sum())
    out["top_p_mass"] = min(mass, 1.0) if params.top_p < 1 else 1.0
    return out


def assert_within_bounds(result: SampleResult, want: dict) -> None:
    """The bounds of native_top.SOFTMAX_WEIGHT_ERROR's comment, plus float64 rounding: eps = the weights' relative
    error; a probability exp(x - lse) within relative eps + 64 ulp of max(1, |lse|) (the subtraction's rounding); an
    entropy within eps (1 + 2H) nats + (n + 64) ulp (1 + H) (the sums' rounding, on both sides); a top-p mass within
    its probabilities' error plus n ulp."""
    eps, n = SOFTMAX_WEIGHT_ERROR, result.vocab_size
    relative = eps + 64 * _ULP * max(1.0, *(abs(v) for v in want["lse"].values()))

    def close(got: float, expected: float, tolerance: float, what: str) -> None:
        assert abs(got - expected) <= tolerance, (what, got, expected, tolerance)

    def entropy_bound(h: float) -> float:
        return eps * (1 + 2 * h) + (n + 64) * _ULP * (1 + h)

    close(result.entropy_raw_bits * math.log(2), want["entropy_raw"], entropy_bound(want["entropy_raw"]),
          "entropy_raw")
    for c in result.candidates:
        close(c.prob_raw, want["prob_raw"][c.token_id], relative * want["prob_raw"][c.token_id], "prob_raw")
        if "prob_tempered" in want:
            for name in ("prob_tempered", "prob_final"):
                close(getattr(c, name), want[name][c.token_id], relative * want[name][c.token_id], name)
        else:  # greedy: the T -> 0 limit, exactly
            assert c.prob_tempered == c.prob_final == (1.0 if c.chosen else 0.0)
    chosen = next(c for c in result.candidates if c.chosen)
    assert (result.probability, result.probability_raw) == (chosen.prob_final, chosen.prob_raw)
    if "entropy_final" in want:
        close(result.entropy_final_bits * math.log(2), want["entropy_final"], entropy_bound(want["entropy_final"]),
              "entropy_final")
        close(result.top_p_mass, want["top_p_mass"], relative * want["top_p_mass"] + n * _ULP, "top_p_mass")


@pytest.mark.parametrize("case", CASES, ids=lambda case: ",".join(f"{k}={v}" for k, v in case.items()) or "greedy")
def test_every_figure_equals_the_reference_computation(case: dict) -> None:
    generator = torch.Generator().manual_seed(len(str(case)))
    calls = []
    for vocab in (1, 7, 1000, 49152, 50021):  # 50021: prime, no block divides it
        for logits in logits_family(vocab, generator):
            previous = torch.randint(0, vocab, (40,), generator=generator).tolist()
            calls.append((logits, previous))
    # one Sampler for every call: its scratch arrays are reused (and remade when the vocabulary changes), its
    # seeded draws go on; nothing of one call may leak into the next
    assert_same_calls(SamplingParams(seed=11, **case), calls)


def test_a_seeded_run_of_decode_steps_draws_the_same_tokens() -> None:
    """Twenty steps on one vocabulary, as a decode loop makes them: the same tokens and every figure."""
    generator = torch.Generator().manual_seed(5)
    base = torch.randn(49152, generator=generator) * 2.5
    calls, previous = [], torch.randint(0, 49152, (8,), generator=generator).tolist()
    for _ in range(20):
        logits = base + torch.randn(49152, generator=generator) * 0.5
        calls.append((logits, list(previous)))
        previous.append(int(torch.randint(0, 49152, (1,), generator=generator)))
    for case in (dict(temperature=0.7, top_p=0.9, repetition_penalty=1.1), dict(temperature=1.0),
                 dict(temperature=0.8, min_p=0.05), dict()):
        assert_same_calls(SamplingParams(seed=3, **case), calls)


def test_a_candidate_table_as_large_as_the_vocabulary_equals_the_reference() -> None:
    generator = torch.Generator().manual_seed(9)
    logits = torch.round(torch.randn(2000, generator=generator) * 6) / 3
    for case in CASES:
        assert_same_calls(SamplingParams(seed=1, **case), [(logits, [3, 5, 5, 1999])], n_candidates=2000)


def test_the_native_selection_is_numpy_s(passes: str) -> None:
    """One C pass against the numpy selection on what could trip it: ties within and across its 8-value lanes,
    -inf, a vector shorter than the count, lengths no lane width divides, the largest values last or first."""
    if passes != "native":
        pytest.skip("the C pass itself")
    generator = torch.Generator().manual_seed(17)
    vectors = []
    for n in (1, 5, 8, 9, 63, 64, 65, 1000, 4099, 49152):
        normal = torch.randn(n, generator=generator)
        vectors += [normal, torch.round(normal * 2) / 2, torch.zeros(n), torch.arange(n, dtype=torch.float32),
                    -torch.arange(n, dtype=torch.float32)]
        with_inf = normal.clone()
        with_inf[torch.rand(n, generator=generator) < 0.5] = float("-inf")
        vectors.append(with_inf)
    for vector in vectors:
        x = vector.numpy()
        for count in (1, 2, 10, 11, 50, MAX_COUNT):
            native = top_values(x, count)
            assert native is not None
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(sampling, "top_values", lambda x, count: None)
                expected = sampling._top_sorted(x, min(count, x.size))
            assert native.tolist() == expected.tolist(), (x.size, count)
    assert top_values(np.ones(4, dtype=np.float32), MAX_COUNT + 1) is None  # more than one call selects
    with_nan = np.arange(100, dtype=np.float32)
    for at in (0, 3, 50, 99):  # in the first values, in the eight-value lanes, in the tail
        copy = with_nan.copy()
        copy[at] = np.nan
        assert top_values(copy, 5) is None  # the caller's numpy max raises
    assert top_values(np.ones(8, dtype=np.float32)[::2], 2) is None  # not contiguous: the caller's numpy


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_are_refused_whichever_passes_ran(passes: str, bad: float) -> None:
    from llmtrace.tracer.run.sampling import NonFiniteLogitsError

    logits = torch.randn(4099, generator=torch.Generator().manual_seed(2))
    for at in (0, 2000, 4098):
        broken = logits.clone()
        broken[at] = bad
        for case in (dict(), dict(temperature=0.7, top_k=50)):
            with pytest.raises(NonFiniteLogitsError):
                Sampler(SamplingParams(seed=1, **case)).sample(broken)
