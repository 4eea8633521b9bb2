"""The package's sampler against its definition written plainly (tests/sampling_reference.py: a full stable sort,
float64 softmaxes, sharing no code with the package and not a copy of it), call after call on one Sampler, on logits
built to reach every path: ties (grids, bf16), -inf entries, a vocabulary of one, small ones, the bundled model's
49152 and one that no block size divides, flat distributions that grow the top-p prefix, peaked ones, repetition
penalties, huge magnitudes, zero maxima of both signs.

The token, its rank, the counts after each filter and the candidate table (ids, ranks, logits, kept flags) are equal;
probabilities and entropies agree to 1e-6 relative (the package sums a whole-vocabulary draw's weights in float32).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from sampling_reference import ReferenceNonFiniteError, ReferenceSampler

from llmtrace.tracer.run.sampling import NonFiniteLogitsError, Sampler, SamplingParams

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


_APPROX = ("probability", "probability_raw", "top_p_mass", "entropy_raw_bits", "entropy_final_bits")
_APPROX_ROW = ("prob_raw", "prob_tempered", "prob_final")


def assert_agrees(new: dict, ref: dict, context: object) -> None:
    """Every exact figure equal; every probability within 1e-6 relative (1e-12 absolute), every entropy within 1e-6
    bits (a float32 sum of weights moves a near-certain distribution's entropy by ~1e-7 bits)."""
    def close(key: str, a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6 if key.startswith("entropy") else 1e-12)

    assert {k: v for k, v in new.items() if k not in _APPROX + ("candidates",)} == \
        {k: v for k, v in ref.items() if k not in _APPROX + ("candidates",)}, context
    assert all(close(k, new[k], ref[k]) for k in _APPROX), (context, {k: (new[k], ref[k]) for k in _APPROX})
    assert len(new["candidates"]) == len(ref["candidates"]), context
    for mine, theirs in zip(new["candidates"], ref["candidates"]):
        assert {k: v for k, v in mine.items() if k not in _APPROX_ROW} == \
            {k: v for k, v in theirs.items() if k not in _APPROX_ROW}, context
        assert all(close(k, mine[k], theirs[k]) for k in _APPROX_ROW), (context, mine, theirs)


def assert_same_calls(params: SamplingParams, calls: list[tuple[torch.Tensor, list[int]]],
                      n_candidates: int = 10) -> None:
    package = Sampler(params, n_candidates=n_candidates)
    reference = ReferenceSampler(dataclasses.asdict(params), n_candidates=n_candidates)
    for logits, previous in calls:
        assert_agrees(dataclasses.asdict(package.sample(logits, previous)), reference.sample(logits, previous),
                      (params, logits.shape))


@pytest.mark.parametrize("case", CASES, ids=lambda case: ",".join(f"{k}={v}" for k, v in case.items()) or "greedy")
def test_every_figure_agrees_with_the_plain_definition(case: dict) -> None:
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


def test_a_candidate_table_as_large_as_the_vocabulary_agrees() -> None:
    generator = torch.Generator().manual_seed(9)
    logits = torch.round(torch.randn(2000, generator=generator) * 6) / 3
    for case in CASES:
        assert_same_calls(SamplingParams(seed=1, **case), [(logits, [3, 5, 5, 1999])], n_candidates=2000)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_are_refused(bad: float) -> None:
    logits = torch.randn(4099, generator=torch.Generator().manual_seed(2))
    for at in (0, 2000, 4098):
        broken = logits.clone()
        broken[at] = bad
        for case in (dict(), dict(temperature=0.7, top_k=50)):
            with pytest.raises(NonFiniteLogitsError):
                Sampler(SamplingParams(seed=1, **case)).sample(broken)
            with pytest.raises(ReferenceNonFiniteError):
                ReferenceSampler(dataclasses.asdict(SamplingParams(seed=1, **case))).sample(broken)


def test_the_reference_shares_no_code_with_the_package() -> None:
    """The reference is independent: it imports nothing of llmtrace's (tests/sampling_reference.py), and is no copy
    of the package's array work (none of its helpers' names appear in it)."""
    import ast

    import sampling_reference

    tree = ast.parse(Path(sampling_reference.__file__).read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported == {"__future__", "math", "typing", "numpy", "torch"}
    text = Path(sampling_reference.__file__).read_text(encoding="utf-8")
    assert not any(name in text for name in ("top_sorted", "nucleus", "draw_index", "first_above", "argpartition"))
