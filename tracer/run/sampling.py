"""Turn one logits vector into the next token, and record what each sampling step did to the distribution.

The steps (their parameters: tracer/run/sampling_params.py) run in the order HF transformers' `generate()` applies
its logits processors:

  1. repetition penalty (CTRL, Keskar et al. 2019, HF's RepetitionPenaltyLogitsProcessor): for every token id
     already seen, a positive logit is divided by the penalty and a negative one multiplied by it;
  2. temperature: logits / T.  T = 0 means greedy: the argmax of the penalised logits, no randomness, and
     steps 3-5 do not exist (asking for them with T = 0 is an error rather than being silently ignored);
  3. top-k: keep the k largest logits (tokens tied with the k-th are kept too, as HF does);
  4. top-p (nucleus): renormalise what top-k kept, then keep the fewest tokens, largest first, whose probability
     sums to at least p: a token is kept while the mass before it is below p (so the one that crosses p is kept,
     and at least one token always is). Tokens tied with the last one kept are cut by the sort, as HF's
     TopPLogitsWarper cuts them: top-p keeps a count, not a threshold;
  5. min-p: keep tokens whose probability is at least min_p times the largest probability (a ratio, so it is the
     same before or after steps 3-4 renormalise);
  then renormalise what is left and draw one token with the Sampler's own seeded torch.Generator.

This is the one implementation every run uses: a step at a time, and steps run ahead in C, where the C loop calls
back into `Sampler.sample` for each step's token (tracer/model/native_step.py's run_ahead), so a run's tokens and
records do not depend on which backend ran its steps. The array work is tracer/run/distribution.py's (numpy): a
partial selection of the best few tokens instead of a full sort (greedy: the candidate table only; top-p: 256
tokens, then 4096, and only for a very flat distribution the whole vocabulary, once), and a draw over the whole
vocabulary that needs no sort at all. Logits on another device are copied over first.

Records are frozen dataclasses of plain Python values, so `dataclasses.asdict()` is JSON-ready.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.core.json_input import is_int
from llmtrace.tracer.run.distribution import (Scratch, Softmax, apply_repetition_penalty, draw_index, first_above,
                                              nucleus, rank_of, softmax, top_sorted)
from llmtrace.tracer.run.sampling_params import SamplingParams

# How many top tokens the first partial selection fetches when top-p or min-p may need more than the candidate
# table; top-p fetches 16 times more each time the nucleus reaches past them (256, 4096, then the whole vocabulary).
_PREFIX = 256
_LN2 = math.log(2.0)
_NEG_INF = float("-inf")


class NonFiniteLogitsError(ValueError):
    """The logits hold a NaN or +inf, or nothing above -inf: there is no distribution to sample. The generation loop
    relies on this check (one numpy max over the vector it reads anyway) instead of testing the logits itself."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One token of the candidate table, followed through every step.

    The `kept_*` flags are cumulative, in step order: kept_top_p implies kept_top_k, kept_min_p implies kept_top_p;
    a step that is off keeps everything. prob_final > 0 exactly when the token could be drawn.
    """

    token_id: int
    rank: int  # 1-based, by penalised logit (the order every filter works in); ties: lower token id first
    logit: float  # raw, as the LM head produced it
    logit_penalized: float  # after the repetition penalty
    prob_raw: float  # softmax(raw logits): the model's own distribution
    prob_tempered: float  # softmax(penalised logits / T); under greedy the T -> 0 limit: 1 for the argmax, else 0
    kept_top_k: bool
    kept_top_p: bool
    kept_min_p: bool
    prob_final: float  # renormalised over everything kept: the probability it was drawn with
    chosen: bool


@dataclass(frozen=True, slots=True)
class SampleResult:
    """The chosen token and what sampling did to the distribution."""

    token_id: int
    probability: float  # of the chosen token after all steps (1.0 under greedy)
    probability_raw: float  # of the chosen token in the model's own distribution
    rank: int  # the chosen token's 1-based rank by penalised logit
    candidates: tuple[Candidate, ...]  # top-N by penalised logit, plus the chosen token if it ranked lower
    active_steps: tuple[str, ...]  # names from STEP_ORDER
    vocab_size: int
    n_penalized: int  # distinct seen tokens the repetition penalty touched (0 when it is off)
    n_after_top_k: int  # tokens left after each filter (cumulative); vocab_size when a filter is off or greedy
    n_after_top_p: int
    n_after_min_p: int
    n_final: int  # tokens the draw chose from (1 under greedy)
    top_p_mass: float  # probability the top-p survivors hold among top-k's, renormalised (1.0 when top-p is off)
    entropy_raw_bits: float  # of the model's own distribution
    entropy_final_bits: float  # of the distribution actually drawn from (0 under greedy)


@dataclass(frozen=True, slots=True)
class _Logits:
    """One call's logits at each stage: raw, after the penalty, and scaled by 1/T, with the softmaxes of the raw and
    of the scaled ones (the arrays may be the Sampler's Scratch's)."""

    raw: np.ndarray
    penalised: np.ndarray
    scaled: np.ndarray
    raw_softmax: Softmax
    raw_entropy: float  # nats
    tempered: Softmax  # softmax(scaled)


@dataclass(frozen=True, slots=True)
class _Kept:
    """What the filters keep of the tokens sorted by scaled logit: a prefix of `order`, or of the whole vocabulary."""

    order: np.ndarray  # the best tokens, sorted (at least the candidate table)
    vals: np.ndarray  # their scaled logits
    n_after_top_k: int
    n_after_top_p: int
    n_final: int
    top_p_mass: float
    threshold: float  # the larger of top-k's and min-p's cuts on the scaled logit (-inf: none)


class Sampler:
    """Picks tokens under fixed SamplingParams; owns the random generator, so one seed gives one token sequence."""

    def __init__(self, params: SamplingParams, *, n_candidates: int = 10) -> None:
        if not is_int(n_candidates) or n_candidates < 1:
            raise BadArgumentError(f"n_candidates must be a whole number >= 1, got {n_candidates!r}")
        self._params = params
        self._active_steps = params.active_steps  # a property that builds its tuple: once, not per token
        self._n_candidates = n_candidates
        self._generator = torch.Generator(device="cpu")
        self._uniforms: list[float] = []
        self._scratch: Scratch | None = None  # made on the first call, for that vocabulary's size
        if params.seed is None:
            self._seed = self._generator.seed()  # drawn from the OS; reported so the run can be replayed
        else:
            self._seed = params.seed
            self._generator.manual_seed(int(params.seed))

    @property
    def seed(self) -> int:
        return self._seed

    def _next_uniform(self) -> float:
        """A uniform draw in [0, 1) from the seeded generator, fetched 64 at a time (one torch call costs ~5 us)."""
        if not self._uniforms:
            self._uniforms = torch.rand(64, generator=self._generator, dtype=torch.float64).tolist()[::-1]
        return self._uniforms.pop()

    def _scratch_for(self, vocab: int) -> Scratch:
        if self._scratch is None or self._scratch.size != vocab:
            self._scratch = Scratch(vocab)
        return self._scratch

    def sample(self, logits: torch.Tensor | np.ndarray,
               previous_ids: Sequence[int] | torch.Tensor = ()) -> SampleResult:
        """Pick the next token from `logits` (shape (vocab,): a tensor, or a float32 numpy array); `previous_ids` are
        the tokens the penalty sees."""
        p = self._params
        raw = _logits_as_numpy(logits)
        raw_max = float(raw.max())  # numpy's max propagates NaN
        if not math.isfinite(raw_max):
            raise NonFiniteLogitsError(f"logits must be finite with at least one value > -inf, got max {raw_max}")
        scratch = self._scratch_for(raw.size)
        raw_softmax = softmax(raw, raw_max, scratch)
        # greedy reads none of raw_softmax's arrays again: its products may overwrite `shifted`
        raw_entropy = raw_softmax.entropy_nats(raw_softmax.shifted if p.greedy else scratch.products)
        penalised, n_penalized = raw, 0
        if p.repetition_penalty != 1:
            penalised, n_penalized = apply_repetition_penalty(raw, previous_ids, p.repetition_penalty,
                                                              scratch.penalised)
        common = dict(active_steps=self._active_steps, vocab_size=raw.size, n_penalized=n_penalized,
                      entropy_raw_bits=raw_entropy / _LN2)
        if p.greedy:
            return self._greedy(raw, raw_softmax.lse, penalised, common)
        return self._draw(self._tempered(raw, raw_softmax, raw_entropy, penalised, scratch), common, scratch)

    def _greedy(self, raw: np.ndarray, raw_lse: float, penalised: np.ndarray, common: dict) -> SampleResult:
        """The argmax and its candidate table: under greedy, the T -> 0 limit, the argmax has probability 1 before
        and after every filter, which keep everything."""
        vocab = penalised.size
        ids = top_sorted(penalised, min(self._n_candidates, vocab))
        logits = raw[ids]
        prob_raw = np.exp(logits.astype(np.float64) - raw_lse).tolist()
        logit_list = logits.tolist()
        penalised_list = logit_list if penalised is raw else penalised[ids].tolist()
        chosen = int(ids[0])  # ties sort lower ids first, so this is argmax's first maximum, like HF
        candidates = tuple(Candidate(token, rank, logit, logit_penalized, p_raw, float(rank == 1), True, True, True,
                                     float(rank == 1), rank == 1)
                           for rank, token, logit, logit_penalized, p_raw in zip(itertools.count(1), ids.tolist(),
                                                                                logit_list, penalised_list, prob_raw))
        return SampleResult(token_id=chosen, probability=1.0, probability_raw=prob_raw[0], rank=1,
                            candidates=candidates, n_after_top_k=vocab, n_after_top_p=vocab, n_after_min_p=vocab,
                            n_final=1, top_p_mass=1.0, entropy_final_bits=0.0, **common)

    def _tempered(self, raw: np.ndarray, raw_softmax: Softmax, raw_entropy: float, penalised: np.ndarray,
                  scratch: Scratch) -> _Logits:
        """Step 2: the scaled logits penalised / T and their softmax (the raw softmax itself when nothing changed
        them: T = 1 and no penalty)."""
        t = self._params.temperature
        if t == 1 and penalised is raw:  # the model's own distribution, computed
            return _Logits(raw, penalised, raw, raw_softmax, raw_entropy, raw_softmax)
        scaled = np.divide(penalised, np.float32(t), out=scratch.scaled) if t != 1 else penalised
        if penalised is raw:  # x -> x / T (T > 0) rounds monotonically: the max is the raw max's quotient, in fp32
            scaled_max = float(np.float32(raw_softmax.max) / np.float32(t))
        else:
            scaled_max = float(scaled.max())
        # into the raw softmax's scratch arrays: the raw one's lse and entropy are all that is read of it from here
        return _Logits(raw, penalised, scaled, raw_softmax, raw_entropy, softmax(scaled, scaled_max, scratch))

    def _filtered(self, scaled: np.ndarray, tempered: Softmax) -> _Kept:
        """Steps 3-5 on the scaled logits: how many tokens top-k, top-p and min-p keep (each a prefix of the sorted
        tokens), and the best tokens sorted, as many as the candidate table and the filters need to be read."""
        p, vocab = self._params, scaled.size
        want = self._n_candidates
        if p.top_k:
            want = max(want, p.top_k + 1)  # +1 shows whether the k-th is tied with the next
        if p.top_p < 1 or p.min_p > 0:
            want = max(want, _PREFIX)
        order = top_sorted(scaled, min(want, vocab))
        vals = scaled[order]
        # 3. top-k
        t_k = float(vals[p.top_k - 1]) if 0 < p.top_k < vocab else _NEG_INF
        n_after_top_k = _count_at_least(scaled, t_k)
        # 4. top-p, on the top-k survivors renormalised: a count of sorted tokens, ties at the cut cut by the sort
        n_after_top_p, top_p_mass = n_after_top_k, 1.0
        if p.top_p < 1:
            kept = nucleus(vals, n_after_top_k, vocab, tempered.lse, p.top_p)
            while kept is None:  # a flatter distribution: the nucleus reaches past the prefix; fetch 16x more
                order = top_sorted(scaled, min(vocab, order.size * 16))
                vals = scaled[order]
                kept = nucleus(vals, n_after_top_k, vocab, tempered.lse, p.top_p)
            n_after_top_p, top_p_mass = kept
        # 5. min-p: p_i >= min_p * p_max  <=>  logit_i >= max logit + log(min_p)
        t_m = tempered.max + math.log(p.min_p) if p.min_p > 0 else _NEG_INF
        threshold = max(t_k, t_m)
        n_final = min(n_after_top_p, _count_at_least(scaled, threshold))
        return _Kept(order, vals, n_after_top_k, n_after_top_p, n_final, top_p_mass, threshold)

    def _draw(self, x: _Logits, common: dict, scratch: Scratch) -> SampleResult:
        """A token drawn from what the filters kept, renormalised, and its record."""
        kept = self._filtered(x.scaled, x.tempered)
        u = self._next_uniform()
        if kept.n_final <= kept.order.size:  # the kept set is a prefix of the sorted tokens
            final = softmax(kept.vals[: kept.n_final].astype(np.float64), float(kept.vals[0]))
            final_lse, final_entropy = final.lse, final.entropy_nats()
            cumulative = np.cumsum(final.weights)
            position = first_above(cumulative, u * float(cumulative[-1]))
            chosen, rank = int(kept.order[position]), position + 1
        else:  # no top-p; min-p alone, or nothing, cut less than the prefix holds: draw over the whole vocabulary
            if kept.threshold == _NEG_INF:  # nothing cut: the final distribution is the tempered one
                whole = x.tempered
                final_entropy = x.raw_entropy if whole is x.raw_softmax else whole.entropy_nats(scratch.products)
            else:  # exp(-inf) = 0 for a cut token, its kept neighbours' weights unchanged: mask the weights
                whole = x.tempered.cut_below(x.scaled, kept.threshold)
                final_entropy = whole.entropy_nats(scratch.products)
            final_lse = whole.lse
            chosen = draw_index(whole.weights, u, scratch.padded)
            # the sorted prefix is the ranking's (ties lower id first): a token in it has its place there
            listed = np.flatnonzero(kept.order == chosen)
            rank = int(listed[0]) + 1 if listed.size else rank_of(x.scaled, chosen)
        ids, ranks = kept.order[: self._n_candidates], np.arange(1, min(self._n_candidates, kept.order.size) + 1)
        if rank > self._n_candidates:
            ids, ranks = np.append(ids, chosen), np.append(ranks, rank)
        return _drawn_result(ids, ranks, x, (final_lse, final_entropy), chosen, rank, kept, common)


def _count_at_least(x: np.ndarray, threshold: float) -> int:
    return x.size if threshold == _NEG_INF else int(np.count_nonzero(x >= threshold))


def _logits_as_numpy(logits: torch.Tensor | np.ndarray) -> np.ndarray:
    """A read-only-by-convention float32 CPU view of 1-D logits, a tensor or a numpy array (copied only if needed).
    No torch op when it need not: right after a decode step each one costs tens of microseconds (cold caches)."""
    if isinstance(logits, np.ndarray):
        if logits.ndim != 1 or logits.shape[0] == 0:
            raise ValueError(f"logits must be a non-empty 1-D array of shape (vocab,), got {logits.shape}")
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 1 or logits.shape[0] == 0:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a non-empty 1-D tensor of shape (vocab,), got {shape}")
    return float32_numpy(logits)


def float32_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The tensor as a float32 CPU numpy array: a view, with no torch op, when it already is CPU float32 and needs no
    grad (right after a decode step each torch op costs tens of microseconds, cold caches), else a converted copy.
    numpy() gives a strided view, so a non-contiguous slice needs no copy either."""
    if tensor.dtype != torch.float32 or not tensor.is_cpu:
        tensor = tensor.to(device="cpu", dtype=torch.float32)
    if tensor.requires_grad:
        tensor = tensor.detach()
    return tensor.numpy()


def _drawn_result(ids: np.ndarray, ranks: np.ndarray, x: _Logits, final: tuple[float, float], chosen: int,
                  rank: int, kept: _Kept, common: dict) -> SampleResult:
    """A drawn token's SampleResult from its candidate table: the ids (the chosen one appended when it ranked past
    the table) and their ranks, the logits at each stage, the final distribution's log-sum-exp and entropy (nats),
    and what the filters kept."""
    final_lse, final_entropy = final
    # every kept set is a prefix of the sorted order, so a rank says which filters kept a token
    kept_k, kept_p, kept_m = ranks <= kept.n_after_top_k, ranks <= kept.n_after_top_p, ranks <= kept.n_final
    scaled_at = x.scaled[ids].astype(np.float64)
    prob_raw = np.exp(x.raw[ids].astype(np.float64) - x.raw_softmax.lse)
    prob_tempered = np.exp(scaled_at - x.tempered.lse)
    prob_final = np.where(kept_m, np.exp(scaled_at - final_lse), 0.0)
    columns = zip(ids.tolist(), ranks.tolist(), x.raw[ids].tolist(), x.penalised[ids].tolist(), prob_raw.tolist(),
                  prob_tempered.tolist(), kept_k.tolist(), kept_p.tolist(), kept_m.tolist(), prob_final.tolist())
    candidates = tuple(Candidate(*row, row[0] == chosen) for row in columns)  # positional: the field order above
    chosen_row = next(c for c in candidates if c.chosen)
    return SampleResult(token_id=chosen, probability=chosen_row.prob_final, probability_raw=chosen_row.prob_raw,
                        rank=rank, candidates=candidates, n_after_top_k=kept.n_after_top_k,
                        n_after_top_p=kept.n_after_top_p, n_after_min_p=kept.n_final, n_final=kept.n_final,
                        top_p_mass=kept.top_p_mass, entropy_final_bits=final_entropy / _LN2, **common)
