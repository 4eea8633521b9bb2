"""The sampler's definition, written plainly: a full stable sort, float64 softmaxes, each filter as its docs state it
(tracer/run/sampling.py's module docstring, HF transformers' logits processors). It is the reference the package's
Sampler must agree with (tests/test_sampling_equality.py): the same token, rank, counts and candidate table, the
probabilities and entropies to 1e-6 (the package sums some weights in float32).

It shares no code with the package and is not a copy of it: no partial selections, no scratch arrays, no two-level
draw. Only two conventions are taken from the package's specification rather than derived here, because they decide
which token a given uniform picks:
- the uniforms come from the Sampler's seeded torch.Generator, 64 float64 draws at a time, used in order;
- the inverse-CDF draw walks the kept tokens in rank order when they fit in the prefix of sorted tokens the sampler
  fetched (top-p's always do), and in token-id order otherwise (a draw over the whole vocabulary needs no sort).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

_STEP_ORDER = ("repetition_penalty", "temperature", "greedy", "top_k", "top_p", "min_p")
_PREFIX = 256  # the sorted tokens the sampler fetches first when top-p or min-p is on


class ReferenceNonFiniteError(ValueError):
    """The logits hold a NaN or +inf, or nothing above -inf."""


def _softmax64(x: np.ndarray) -> np.ndarray:
    """softmax in float64; -inf entries get probability 0."""
    x = x.astype(np.float64)
    w = np.exp(x - x.max())
    return w / w.sum()


def _entropy_bits(p: np.ndarray) -> float:
    nz = p[p > 0]
    return max(float(-(nz * np.log2(nz)).sum()), 0.0)


class ReferenceSampler:
    """Picks tokens under a plain dict of SamplingParams' fields; one seed gives one token sequence."""

    def __init__(self, params: dict, *, n_candidates: int = 10) -> None:
        self.temperature = float(params["temperature"])
        self.top_k = int(params["top_k"])
        self.top_p = float(params["top_p"])
        self.min_p = float(params["min_p"])
        self.penalty = float(params["repetition_penalty"])
        self.n_candidates = n_candidates
        self.generator = torch.Generator().manual_seed(int(params["seed"]))
        self.uniforms: list[float] = []
        on = {"repetition_penalty": self.penalty != 1, "temperature": self.temperature not in (0, 1),
              "greedy": self.temperature == 0, "top_k": self.top_k > 0, "top_p": self.top_p < 1,
              "min_p": self.min_p > 0}
        self.active_steps = tuple(step for step in _STEP_ORDER if on[step])

    def _uniform(self) -> float:
        if not self.uniforms:
            self.uniforms = torch.rand(64, generator=self.generator, dtype=torch.float64).tolist()
        return self.uniforms.pop(0)

    def sample(self, logits: torch.Tensor, previous_ids: Sequence[int] | torch.Tensor = ()) -> dict:
        raw = logits.detach().to(torch.float32).numpy().copy()
        if np.isnan(raw).any() or np.isposinf(raw).any() or not np.isfinite(raw).any():
            raise ReferenceNonFiniteError("logits must be finite with at least one value > -inf")
        vocab = raw.size
        seen = sorted(set(int(i) for i in (previous_ids.tolist() if isinstance(previous_ids, torch.Tensor)
                                           else previous_ids)))
        penalised = raw.copy()
        if self.penalty != 1:  # CTRL: in the logits' own precision, as HF's processor computes it
            for i in seen:
                v = raw[i]
                penalised[i] = v * np.float32(self.penalty) if v < 0 else v / np.float32(self.penalty)
        common = dict(active_steps=self.active_steps, vocab_size=vocab,
                      n_penalized=len(seen) if self.penalty != 1 else 0,
                      entropy_raw_bits=_entropy_bits(_softmax64(raw)))
        prob_raw = _softmax64(raw)
        if self.temperature == 0:
            order = np.argsort(-penalised, kind="stable")  # ties: lower id first, as argmax
            ids = order[: self.n_candidates]
            table = [self._row(t, r + 1, raw, penalised, prob_raw, float(r == 0), (True, True, True),
                               float(r == 0), int(ids[0])) for r, t in enumerate(ids.tolist())]
            return dict(token_id=int(ids[0]), probability=1.0, probability_raw=float(prob_raw[ids[0]]), rank=1,
                        candidates=tuple(table), n_after_top_k=vocab, n_after_top_p=vocab, n_after_min_p=vocab,
                        n_final=1, top_p_mass=1.0, entropy_final_bits=0.0, **common)
        scaled = penalised / np.float32(self.temperature) if self.temperature != 1 else penalised
        order = np.argsort(-scaled, kind="stable")
        tempered = _softmax64(scaled)
        # 3. top-k: the k largest, and every token tied with the k-th
        n_k = vocab
        if 0 < self.top_k < vocab:
            n_k = int(np.count_nonzero(scaled >= scaled[order[self.top_k - 1]]))
        # 4. top-p over top-k's survivors renormalised: keep a token while the mass before it is below p
        n_p, mass = n_k, 1.0
        if self.top_p < 1:
            survivors = _softmax64(scaled[order[:n_k]])
            cumulative = np.cumsum(survivors)
            n_p = min(n_k, int(np.count_nonzero(cumulative < self.top_p)) + 1)
            mass = min(float(cumulative[n_p - 1]), 1.0)
        # 5. min-p: p_i >= min_p * p_max
        n_final = n_p
        if self.min_p > 0:
            n_final = min(n_p, int(np.count_nonzero(tempered >= self.min_p * tempered.max())))
        kept = order[:n_final]
        final = np.zeros(vocab)
        final[kept] = _softmax64(scaled[kept])
        fetched = min(vocab, max(self.n_candidates, self.top_k + 1 if self.top_k else 0,
                                 _PREFIX if self.top_p < 1 or self.min_p > 0 else 0))
        walk = kept if self.top_p < 1 or n_final <= fetched else np.sort(kept)
        cumulative = np.cumsum(final[walk])
        u = self._uniform()
        chosen = int(walk[min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), walk.size - 1)])
        rank = int(np.flatnonzero(order == chosen)[0]) + 1
        ids = order[: self.n_candidates].tolist()
        if rank > self.n_candidates:
            ids.append(chosen)
        table = []
        for token in ids:
            r = int(np.flatnonzero(order == token)[0]) + 1
            flags = (r <= n_k, r <= n_p, r <= n_final)
            table.append(self._row(token, r, raw, penalised, prob_raw, float(tempered[token]), flags,
                                   float(final[token]), chosen))
        return dict(token_id=chosen, probability=float(final[chosen]), probability_raw=float(prob_raw[chosen]),
                    rank=rank, candidates=tuple(table), n_after_top_k=n_k, n_after_top_p=n_p, n_after_min_p=n_final,
                    n_final=n_final, top_p_mass=mass, entropy_final_bits=_entropy_bits(final[kept]), **common)

    @staticmethod
    def _row(token: int, rank: int, raw: np.ndarray, penalised: np.ndarray, prob_raw: np.ndarray,
             prob_tempered: float, flags: tuple[bool, bool, bool], prob_final: float, chosen: int) -> dict:
        return dict(token_id=token, rank=rank, logit=float(raw[token]), logit_penalized=float(penalised[token]),
                    prob_raw=float(prob_raw[token]), prob_tempered=prob_tempered, kept_top_k=flags[0],
                    kept_top_p=flags[1], kept_min_p=flags[2], prob_final=prob_final, chosen=token == chosen)
