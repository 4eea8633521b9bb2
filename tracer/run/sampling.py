"""Turn one logits vector into the next token, and record what each sampling step did to the distribution.

The steps run in the order HF transformers' `generate()` applies its logits processors:

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

Every filter keeps the largest logits, so each kept set is a prefix of the tokens sorted by tempered logit (ties:
lower token id first, argmax's order): top-k and min-p are thresholds on the logit (ties at their cut all kept),
top-p a length. The kept set is the shortest of those prefixes. That is what keeps a call cheap on a
49152-token vocabulary: a partial selection of the best few tokens instead of a full sort (greedy: the candidate
table only; top-p: 256 tokens, then 4096, and only for a very flat distribution the whole vocabulary, once), and
a draw over the whole vocabulary needs no sort at all. The arithmetic is single-threaded numpy on the CPU: on
one vector its reductions and partial selection beat torch's, and torch's two-thread kernels stall for
milliseconds when another process holds the other core. Logits on another device are copied over first.

A decode step calls this once per token, right after the step has streamed ~100 MB of weights, so every array it
touches is cold; its full-vocabulary passes are kept few. Two paths compute them:

- native (the library tracer/model/native_top.py calls, when this process has loaded it, as a run on the native
  kernel has, and the logits are contiguous fp32): one C pass per softmax gives its log-sum-exp and entropy (numpy needed
  five), one the draw over the whole vocabulary, one each count or rank. What is exact: the token chosen under
  greedy (the argmax, ties to the lower id), the candidate table's tokens, ranks, logits and flags, every count
  (n_after_top_k/top_p/min_p, n_final, n_penalized), and a seeded draw: the same token as the numpy path unless the
  uniform, or a cumulative probability at top-p's cut, lies within the bound below of a boundary. What is within
  a tolerance: the probabilities, entropies and top-p mass. The weights exp(x - max) are computed and summed in
  double with a relative error under eps = native_top.SOFTMAX_WEIGHT_ERROR = 4.1e-10 (derived there), so against
  the exact float64 figures a log-sum-exp is within eps (nats), a probability within relative eps, an entropy
  within eps (1 + 2H) nats, plus float64 rounding: ~1000 times closer than the fp32 numpy figures are.
- numpy (the portable fallback: no compiler, a library not loaded, a strided logits view): numpy's fp32 passes,
  allocation-free (the Sampler owns scratch arrays of the vocabulary's size: a fresh 192 KiB numpy array is mapped
  and page-faulted on every call, and the exp pass took 1.7x as long into a new array as into a kept one), the
  entropy with no separate pass to find -inf logits, a distribution the draw uses again (temperature 1, or no
  filter that cuts) not recomputed. Every figure is the one the straightforward computation gives, bit for bit.

tests/test_sampling_equality.py holds both to that straightforward computation (the numpy path bit for bit; the
native path's discrete figures exactly and the rest within the bounds above of a float64 computation); the top
tokens are sorted within the few that pass a threshold instead of the whole vocabulary on both.

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
from llmtrace.tracer.model.native_top import (MAX_COUNT, SamplerPasses, SoftmaxSums, sampler_passes,
                                              top_pass_sums, top_values)
from llmtrace.tracer.run.sampling_params import SamplingParams, is_int

# How many top tokens the first partial selection fetches when top-p or min-p may need more than the candidate
# table; top-p fetches 16 times more each time the nucleus reaches past them (256, 4096, then the whole vocabulary).
_PREFIX = 256
# Weights per block of the two-level inverse-CDF draw over the whole vocabulary (_draw_index).
_DRAW_BLOCK = 256
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
        self._scratch: _Scratch | None = None  # made on the first call, for that vocabulary's size
        self._passes: SamplerPasses | None = None  # the C passes, once found (_native_passes)
        if params.seed is None:
            self._seed = self._generator.seed()  # drawn from the OS; reported so the run can be replayed
        else:
            self._seed = params.seed
            self._generator.manual_seed(int(params.seed))

    def _next_uniform(self) -> float:
        """A uniform draw in [0, 1) from the seeded generator, fetched 64 at a time (one torch call costs ~5 us)."""
        if not self._uniforms:
            self._uniforms = torch.rand(64, generator=self._generator, dtype=torch.float64).tolist()[::-1]
        return self._uniforms.pop()

    def _scratch_for(self, vocab: int) -> _Scratch:
        if self._scratch is None or self._scratch.size != vocab:
            self._scratch = _Scratch(vocab)
        return self._scratch

    def _native_passes(self, raw: np.ndarray) -> SamplerPasses | None:
        """The C passes for these logits: None without the library, or for a strided view (numpy's path
        throughout). Looked up until found, then kept: the lookup alone cost ~25 us a token, cold."""
        if self._passes is None:
            self._passes = sampler_passes()
        return self._passes if raw.flags.c_contiguous else None

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def temperature(self) -> float:
        """The temperature its draws divide the logits by; 0: greedy."""
        return self._params.temperature

    def sample(self, logits: torch.Tensor | np.ndarray,
               previous_ids: Sequence[int] | torch.Tensor = ()) -> SampleResult:
        """Pick the next token from `logits` (shape (vocab,): a tensor, or a float32 numpy array); `previous_ids` are
        the tokens the penalty sees."""
        p = self._params
        raw = _logits_as_numpy(logits)
        vocab = raw.size
        native = self._native_passes(raw)
        table = self.table_size(vocab)
        raw_softmax: _Softmax | SoftmaxSums
        top: tuple[list[int], list[float]] | None = None  # greedy, raw logits: the C pass's table, ids and logits
        if native is not None:
            # one call: the top values (the candidate table under greedy, else just the max) and the raw softmax
            greedy_table = self.greedy_from_table(vocab)
            found = native.top_softmax(raw, table if greedy_table else 1, for_draw=not p.greedy)
            if found is None:  # a NaN or no finite max: numpy's max says which
                raise NonFiniteLogitsError(f"logits must be finite with at least one value > -inf, got max "
                                           f"{float(raw.max())}")
            top_ids, top_logits, raw_softmax = found
            top = (top_ids, top_logits) if greedy_table else None
            raw_max, raw_entropy = raw_softmax.max, raw_softmax.entropy_nats
            scratch = self._scratch_for(vocab)
        else:
            raw_max = float(raw.max())  # numpy's max propagates NaN
            if not math.isfinite(raw_max):
                raise NonFiniteLogitsError(f"logits must be finite with at least one value > -inf, got max {raw_max}")
            scratch = self._scratch_for(vocab)
            raw_softmax = _softmax(raw, raw_max, scratch)
            # greedy reads none of raw_softmax's arrays again: its products may overwrite `shifted`
            raw_entropy = raw_softmax.entropy_nats(raw_softmax.shifted if p.greedy else scratch.products)
        if p.repetition_penalty != 1:
            penalised, n_penalized = _apply_repetition_penalty(raw, previous_ids, p.repetition_penalty,
                                                               scratch.penalised)
        else:
            penalised, n_penalized = raw, 0
        common = self._common(vocab, n_penalized, raw_entropy)
        if p.greedy:
            if top is not None:
                return self._greedy_of_table(vocab, top[0], top[1], raw_softmax.lse, common)
            return self._greedy(raw, raw_softmax.lse, penalised, common)
        return self._draw(raw, raw_max, raw_softmax, raw_entropy, penalised, common, scratch, native)

    def _common(self, vocab: int, n_penalized: int, raw_entropy_nats: float) -> dict:
        """The SampleResult fields every way of choosing fills the same way."""
        return dict(active_steps=self._active_steps, vocab_size=vocab, n_penalized=n_penalized,
                    entropy_raw_bits=raw_entropy_nats / _LN2)

    def chooses_by_passes(self, vocab: int) -> bool:
        """Whether every token this sampler chooses follows from the C passes alone, greedy (`greedy_from_table`)
        or drawn (`draws_from_passes`): then a C loop can choose it as `sample` would (NativeStep.run_ahead)."""
        return self.greedy_from_table(vocab) or self.draws_from_passes(vocab)

    def table_size(self, vocab: int) -> int:
        """How many candidates a step's table lists for a vocabulary of `vocab`."""
        return min(self._n_candidates, vocab)

    def greedy_from_table(self, vocab: int) -> bool:
        """Whether this sampler's choice and records follow from the C pass's table and softmax of the raw logits
        alone (`greedy_of_pass`): greedy, no repetition penalty, a table the pass can select."""
        p = self._params
        return p.greedy and p.repetition_penalty == 1 and self.table_size(vocab) <= MAX_COUNT

    def greedy_of_pass(self, vocab: int, top_ids: list[int], top_logits: list[float],
                       raw_softmax: SoftmaxSums) -> SampleResult:
        """What `sample` returns under `greedy_from_table(vocab)` for logits whose C pass (SamplerPasses.top_softmax,
        count `table_size(vocab)`) found `top_ids`, `top_logits` and `raw_softmax`: for steps whose pass ran in C
        right after the step (NativeStep.run_ahead)."""
        return self._greedy_of_table(vocab, top_ids, top_logits, raw_softmax.lse,
                                     self._common(vocab, 0, raw_softmax.entropy_nats))

    def _greedy_of_table(self, vocab: int, id_list: list[int], logit_list: list[float], raw_lse: float,
                         common: dict) -> SampleResult:
        """The greedy result from the C pass's table of the raw logits (no penalty): exp within its tolerance.
        Python lists, not numpy arrays of ten: after a decode step each numpy call costs microseconds, cold."""
        prob_raw = [math.exp(logit - raw_lse) for logit in logit_list]
        return self._greedy_result(vocab, id_list, logit_list, logit_list, prob_raw, common)

    def _greedy(self, raw: np.ndarray, raw_lse: float, penalised: np.ndarray, common: dict) -> SampleResult:
        """The greedy result computed in numpy (numpy's exp: the reference's bits)."""
        vocab = penalised.size
        ids = _top_sorted(penalised, self.table_size(vocab))
        id_list = ids.tolist()
        logits = raw[ids]
        prob_raw = np.exp(logits.astype(np.float64) - raw_lse).tolist()
        logit_list = logits.tolist()
        penalised_list = logit_list if penalised is raw else penalised[ids].tolist()
        return self._greedy_result(vocab, id_list, logit_list, penalised_list, prob_raw, common)

    @staticmethod
    def _greedy_result(vocab: int, id_list: list[int], logit_list: list[float], penalised_list: list[float],
                       prob_raw: list[float], common: dict) -> SampleResult:
        chosen = id_list[0]  # ties sort lower ids first, so this is argmax's first maximum, like HF
        # the T -> 0 limit: the argmax has probability 1 before and after every filter, which keep everything
        candidates = tuple(Candidate(token, rank, logit, logit_penalized, p_raw, float(rank == 1), True, True, True,
                                     float(rank == 1), rank == 1)
                           for rank, token, logit, logit_penalized, p_raw in zip(itertools.count(1), id_list,
                                                                                logit_list, penalised_list, prob_raw))
        return SampleResult(token_id=chosen, probability=1.0, probability_raw=prob_raw[0], rank=1,
                            candidates=candidates, n_after_top_k=vocab, n_after_top_p=vocab, n_after_min_p=vocab,
                            n_final=1, top_p_mass=1.0, entropy_final_bits=0.0, **common)

    def _draw(self, raw: np.ndarray, raw_max: float, raw_softmax: _Softmax | SoftmaxSums, raw_entropy: float,
              penalised: np.ndarray, common: dict, scratch: _Scratch, native: SamplerPasses | None) -> SampleResult:
        p = self._params
        vocab = penalised.size
        raw_lse = raw_softmax.lse
        if p.temperature == 1 and penalised is raw:
            scaled, scaled_max, tempered = raw, raw_max, raw_softmax  # the model's own distribution, computed
        else:
            scaled = np.divide(penalised, np.float32(p.temperature), out=scratch.scaled) \
                if p.temperature != 1 else penalised
            if penalised is raw:  # x -> x / T (T > 0) rounds monotonically: the max is the raw max's quotient, in fp32
                scaled_max = float(np.float32(raw_max) / np.float32(p.temperature))
            else:
                scaled_max = float(scaled.max())
            tempered = native.softmax(scaled, scaled_max) if native is not None \
                else _softmax(scaled, scaled_max, scratch)  # the raw one's scratch arrays: it is done with them
        scaled_lse = tempered.lse

        want = self._n_candidates
        if p.top_k:
            want = max(want, p.top_k + 1)  # +1 shows whether the k-th is tied with the next
        if p.top_p < 1 and native is not None:
            # Under top-p every kept set ends inside the prefix (the nucleus fetches 16x more while it reaches past
            # it), so its length changes no figure: native top_values' most, one C pass instead of numpy's
            # selection of _PREFIX (the nucleus of t=0.7, top-p 0.9 on the bundled model held <= 64 tokens at 97%
            # of steps). Without top-p, min-p's cut may reach past it: that draw runs over the whole vocabulary.
            want = max(want, MAX_COUNT)
        elif p.top_p < 1 or p.min_p > 0:
            want = max(want, _PREFIX)
        order = _top_sorted(scaled, min(want, vocab))
        vals = scaled[order]

        def count_at_least(threshold: float) -> int:
            if threshold == _NEG_INF:
                return vocab
            if native is not None:
                return native.count_at_least(scaled, threshold)
            return int(np.count_nonzero(scaled >= threshold))

        # 3. top-k
        t_k = float(vals[p.top_k - 1]) if 0 < p.top_k < vocab else _NEG_INF
        n_after_top_k = count_at_least(t_k)
        # 4. top-p, on the top-k survivors renormalised: a count of sorted tokens, ties at the cut cut by the sort
        n_after_top_p, top_p_mass = n_after_top_k, 1.0
        if p.top_p < 1:
            nucleus = _nucleus(vals, n_after_top_k, vocab, scaled_lse, p.top_p)
            while nucleus is None:  # a flatter distribution: the nucleus reaches past the prefix; fetch 16x more
                order = _top_sorted(scaled, min(vocab, order.size * 16))
                vals = scaled[order]
                nucleus = _nucleus(vals, n_after_top_k, vocab, scaled_lse, p.top_p)
            n_after_top_p, top_p_mass = nucleus
        # 5. min-p: p_i >= min_p * p_max  <=>  logit_i >= max logit + log(min_p)
        t_m = scaled_max + math.log(p.min_p) if p.min_p > 0 else _NEG_INF
        threshold = max(t_k, t_m)
        n_final = min(n_after_top_p, count_at_least(threshold))

        u = self._next_uniform()
        if n_final <= order.size:  # the kept set is a prefix of the sorted tokens
            kept = vals[:n_final].astype(np.float64)
            kept_softmax = _softmax(kept, float(kept[0]))
            final_lse, final_entropy = kept_softmax.lse, kept_softmax.entropy_nats()
            cumulative = np.cumsum(kept_softmax.weights)
            position = _first_above(cumulative, u * float(cumulative[-1]))
            chosen, rank = int(order[position]), position + 1
        elif native is not None:  # the same over the whole vocabulary, in C: a pass for a cut, one for the draw
            cut = tempered if threshold == _NEG_INF else native.softmax(scaled, scaled_max, threshold)
            final_lse, final_entropy = cut.lse, cut.entropy_nats
            chosen = native.draw(scaled, cut, u)
            rank = native.rank_of(scaled, chosen)
        else:  # no top-p; min-p alone, or nothing, cut less than the prefix holds: draw over the whole vocabulary
            if threshold == _NEG_INF:  # nothing cut: the final distribution is the tempered one
                final = tempered if tempered is not raw_softmax else None
                final_entropy = raw_entropy if final is None else final.entropy_nats(scratch.products)
                final_lse, weights = tempered.lse, tempered.weights
            else:  # exp(-inf) = 0 for a cut token, its kept neighbours' weights unchanged: mask the weights
                final = tempered.cut_below(scaled, threshold)
                final_lse, final_entropy, weights = final.lse, final.entropy_nats(scratch.products), final.weights
            chosen = _draw_index(weights, u, scratch.padded)
            rank = _rank_of(scaled, chosen)

        ids, ranks = order[: self._n_candidates], np.arange(1, min(self._n_candidates, order.size) + 1)
        if rank > self._n_candidates:
            ids, ranks = np.append(ids, chosen), np.append(ranks, rank)
        return _drawn_result(ids, ranks, raw[ids], penalised[ids], scaled[ids], (raw_lse, scaled_lse, final_lse),
                             chosen, rank, (n_after_top_k, n_after_top_p, n_final), top_p_mass, final_entropy, common)

    def draws_from_passes(self, vocab: int) -> bool:
        """Whether this sampler's draw and records follow from C passes alone (`drawn_of_pass`): a temperature and
        nothing else (no top-k, top-p, min-p or penalty: their kept prefixes are summed in numpy), a table the
        passes can select."""
        p = self._params
        # with a table as long as the vocabulary `_draw` draws from the sorted prefix in numpy instead
        return (not p.greedy and p.repetition_penalty == 1 and p.top_k == 0 and p.top_p == 1 and p.min_p == 0
                and self.table_size(vocab) <= MAX_COUNT and self._n_candidates < vocab)

    def uniforms(self, count: int) -> list[float]:
        """The next `count` draws of this sampler's generator, in the order `sample` would use them."""
        return [self._next_uniform() for _ in range(count)]

    def unread(self, values: list[float]) -> None:
        """Give back draws `uniforms` handed out and nothing used (steps a C call did not run), first first: the
        next `sample` or `uniforms` takes them again, as if they had never been drawn."""
        self._uniforms.extend(reversed(values))

    def drawn_of_pass(self, vocab: int, top_ids: list[int], top_logits: list[float], scaled_logits: list[float],
                      chosen: int, rank: int, chosen_logits: tuple[float, float], raw_max: float,
                      raw_sums: tuple[float, float], scaled_sums: tuple[float, float]) -> SampleResult:
        """What `sample` returns under `draws_from_passes(vocab)` for logits whose C passes (NativeStep.run_ahead,
        as `sample`'s: the raw softmax, the logits / T, their softmax, table, draw and rank) found these: the table's
        ids (`table_size(vocab)`, largest scaled logit first) with their logits and scaled logits, the chosen id,
        its rank, logit and scaled logit, the largest logit and the two softmaxes' sums."""
        p = self._params
        raw_softmax = top_pass_sums(raw_max, *raw_sums, vocab)
        if p.temperature == 1:
            tempered = raw_softmax  # `sample`'s: the model's own distribution
        else:
            scaled_max = float(np.float32(raw_max) / np.float32(p.temperature))  # `_draw`'s, in fp32
            tempered = top_pass_sums(scaled_max, *scaled_sums, vocab)
        ids, ranks = np.array(top_ids, dtype=np.int64), np.arange(1, len(top_ids) + 1)
        raw_at, scaled_at = np.array(top_logits, dtype=np.float32), np.array(scaled_logits, dtype=np.float32)
        if rank > self._n_candidates:
            ids, ranks = np.append(ids, chosen), np.append(ranks, rank)
            raw_at = np.append(raw_at, np.float32(chosen_logits[0]))
            scaled_at = np.append(scaled_at, np.float32(chosen_logits[1]))
        return _drawn_result(ids, ranks, raw_at, raw_at, scaled_at, (raw_softmax.lse, tempered.lse, tempered.lse),
                             chosen, rank, (vocab, vocab, vocab), 1.0, tempered.entropy_nats,
                             self._common(vocab, 0, raw_softmax.entropy_nats))


class _Scratch:
    """Full-vocabulary arrays one Sampler writes its intermediate results into, call after call (allocated once:
    see the module's docstring). What a call returns never points into them."""

    __slots__ = ("size", "shifted", "weights", "products", "scaled", "penalised", "padded")

    def __init__(self, size: int) -> None:
        self.size = size
        self.shifted = np.empty(size, dtype=np.float32)  # x - max(x)
        self.weights = np.empty(size, dtype=np.float32)  # exp(shifted)
        self.products = np.empty(size, dtype=np.float32)  # weights * shifted, for the entropy
        self.scaled = np.empty(size, dtype=np.float32)  # penalised / temperature
        self.penalised = np.empty(size, dtype=np.float32)  # the logits after the repetition penalty
        self.padded = np.zeros(-(-size // _DRAW_BLOCK) * _DRAW_BLOCK, dtype=np.float64)  # the draw's weights; the
        #                                                                        tail past `size` stays 0


@dataclass(frozen=True, slots=True)
class _Softmax:
    """softmax(x) held as its unnormalised weights exp(x - max) (the arrays may be a _Scratch's)."""

    max: float  # max(x)
    lse: float  # log(sum(exp(x))) = max + log(total)
    total: float  # sum(weights)
    shifted: np.ndarray  # x - max(x)
    weights: np.ndarray  # exp(shifted); 0 for a -inf entry

    def entropy_nats(self, out: np.ndarray | None = None) -> float:
        """H = log(total) - sum(weights * shifted) / total, the products written into `out` (may be `shifted` itself
        when nothing reads it afterwards: one full-vocabulary array fewer for the caches). A -inf entry (weight 0)
        makes 0 * -inf = NaN; only then is the sum taken again with those entries' terms set to 0 (a probability 0
        adds nothing)."""
        with np.errstate(invalid="ignore"):  # 0 * -inf: found below by its NaN
            products = np.multiply(self.weights, self.shifted, out=out)
        # not np.dot: BLAS may spread a long dot product over threads, which stalls on a busy machine
        weighted = float(products.sum())
        if math.isnan(weighted):  # weight > 0: its product as computed; weight 0: 0 (not 0 * -inf)
            weighted = float(np.where(self.weights > 0, products, np.float32(0)).sum())
        return max(math.log(self.total) - weighted / self.total, 0.0)

    def cut_below(self, x: np.ndarray, threshold: float) -> _Softmax:
        """The softmax of x with every entry below `threshold` set to -inf, normalised against the same max (the
        arrays are new, so this one's stay valid)."""
        weights = np.where(x >= threshold, self.weights, np.float32(0))
        total = float(weights.sum())
        return _Softmax(self.max, self.max + math.log(total), total, self.shifted, weights)


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


def _apply_repetition_penalty(raw: np.ndarray, previous_ids: Sequence[int] | torch.Tensor,
                              penalty: float, out: np.ndarray) -> tuple[np.ndarray, int]:
    """CTRL's penalty, written into `out` (raw is left alone): seen positive logits / penalty, seen negative logits
    * penalty."""
    if isinstance(previous_ids, torch.Tensor):
        ids = previous_ids.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)
    else:
        ids = np.fromiter(previous_ids, dtype=np.int64)
    if ids.size == 0:
        return raw, 0
    if ids.min() < 0 or ids.max() >= raw.size:
        raise ValueError(f"previous_ids must lie in [0, {raw.size}), got ids from {ids.min()} to {ids.max()}")
    np.copyto(out, raw)
    seen = raw[ids]  # repeated ids just write the same value again
    out[ids] = np.where(seen < 0, seen * np.float32(penalty), seen / np.float32(penalty))
    return out, int(np.unique(ids).size)


def _softmax(x: np.ndarray, x_max: float, scratch: _Scratch | None = None) -> _Softmax:
    """softmax(x) as log(sum(exp(x))) and the unnormalised weights exp(x - x_max): one subtraction, one exp pass and
    one sum (into `scratch`'s arrays when given). -inf entries get weight 0."""
    shifted = np.subtract(x, np.asarray(x_max, dtype=x.dtype), out=None if scratch is None else scratch.shifted)
    weights = np.exp(shifted, out=None if scratch is None else scratch.weights)
    total = float(weights.sum())
    return _Softmax(x_max, x_max + math.log(total), total, shifted, weights)


def _top_sorted(x: np.ndarray, count: int) -> np.ndarray:
    """Indices of the `count` largest values, largest first, ties by lower index (argmax's choice). Up to
    native_top.MAX_COUNT of them in one C pass when the native library is loaded (the same indices), else numpy."""
    native = top_values(x, count)
    if native is not None:
        return native
    pool = _pool(x, count) if count < x.size else None
    if pool is not None:  # a few hundred ascending indices: a stable sort puts tied values lower index first
        return pool[np.argsort(-x[pool], kind="stable")[:count]]
    if count < x.size:  # partition the whole vector, then settle the cut's ties
        top = np.argpartition(x, x.size - count)[x.size - count:]
        boundary = x[top].min()
        at_boundary = int(np.count_nonzero(x[top] == boundary))
        if np.count_nonzero(x == boundary) > at_boundary:  # the cut went through tied values: take the lowest ids
            top = np.concatenate((top[x[top] > boundary], np.flatnonzero(x == boundary)[:at_boundary]))
    else:
        top = np.arange(x.size)
    top = top[np.argsort(-x[top])]
    values = x[top]
    tied = values[1:] == values[:-1]
    if tied.any():  # a stable sort of everything costs several times more than fixing the tied runs
        in_run = np.flatnonzero(np.concatenate(([False], tied)) | np.concatenate((tied, [False])))
        members = top[in_run]
        top[in_run] = members[np.lexsort((members, -values[in_run]))]
    return top


def _pool(x: np.ndarray, count: int) -> np.ndarray | None:
    """Ascending indices of every value at or above a threshold that at least `count` values reach, so the pool
    holds the top `count` and every value tied with the count-th; None when this shortcut does not apply.

    A full argpartition costs ~60 us on 49152 values. Instead, the (1.5 count/16 + 8)-th largest of every 16th
    value is a threshold that leaves about 1.5 count + 128 values above it (~10 us to find them); in the rare case
    it leaves fewer than `count`, the caller partitions the whole vector.
    """
    stride = 16
    if count * stride * 2 >= x.size:
        return None
    sample = x[::stride]
    rank = (3 * count) // (2 * stride) + 8
    threshold = np.partition(sample, sample.size - rank)[sample.size - rank]
    passed = np.flatnonzero(x >= threshold)
    return passed if passed.size >= count else None


def _nucleus(vals: np.ndarray, n_candidates: int, vocab: int, scaled_lse: float,
             top_p: float) -> tuple[int, float] | None:
    """How many of the sorted tokens top-p keeps among the first `n_candidates` (top-k's survivors), and the
    probability they hold.

    HF keeps a token while the mass strictly before it is below top_p: the fewest tokens whose probability sums to
    top_p, at least one. None: the prefix `vals` is too short to say.
    """
    if n_candidates != vocab and n_candidates > vals.size:
        return None  # top-k's ties reach past the prefix: its survivors cannot be normalised from it
    available = min(n_candidates, vals.size)
    head = vals[:available].astype(np.float64)
    if n_candidates == vocab:
        lse = scaled_lse  # nothing cut yet: normalise over the whole vocabulary
    else:
        lse = float(head[0]) + math.log(float(np.exp(head - head[0]).sum()))
    cumulative = np.cumsum(np.exp(head - lse))
    below = int(np.count_nonzero(cumulative < top_p))
    if below == available and available < n_candidates:
        return None
    count = min(n_candidates, below + 1)
    return count, min(float(cumulative[count - 1]), 1.0)


def _first_above(cumulative: np.ndarray, target: float) -> int:
    """Inverse-CDF step: the first index whose cumulative weight exceeds target (never a zero-weight index)."""
    index = min(int(np.searchsorted(cumulative, target, side="right")), cumulative.size - 1)
    while index > 0 and cumulative[index] == cumulative[index - 1]:  # only when rounding put target past the end
        index -= 1
    return index


def _draw_index(weights: np.ndarray, u: float, padded: np.ndarray | None = None) -> int:
    """Draw index i with probability weights[i] / sum(weights), u uniform in [0, 1).

    Two levels (block totals, then one block) so it costs two short cumulative sums, not one over the vocabulary.
    `padded`: float64 scratch of whole blocks whose entries past len(weights) are 0 (made here when not given).
    """
    block = _DRAW_BLOCK
    blocks = -(-weights.size // block)
    if padded is None:
        padded = np.zeros(blocks * block, dtype=np.float64)
    padded[: weights.size] = weights
    block_cumulative = np.cumsum(padded.reshape(blocks, block).sum(axis=1))
    target = u * float(block_cumulative[-1])
    b = _first_above(block_cumulative, target)
    inner = np.cumsum(padded[b * block : (b + 1) * block])
    before = float(block_cumulative[b - 1]) if b else 0.0
    return b * block + _first_above(inner, target - before)


def _rank_of(x: np.ndarray, index: int) -> int:
    value = x[index]
    return int(np.count_nonzero(x > value)) + int(np.count_nonzero(x[:index] == value)) + 1


def _drawn_result(ids: np.ndarray, ranks: np.ndarray, raw_at: np.ndarray, penalised_at: np.ndarray,
                  scaled_at: np.ndarray, lses: tuple[float, float, float], chosen: int, rank: int,
                  kept_counts: tuple[int, int, int], top_p_mass: float, final_entropy: float,
                  common: dict) -> SampleResult:
    """A drawn token's SampleResult from its candidate table: the ids (the chosen one appended when it ranked past
    the table), their ranks, their raw, penalised and scaled logits (fp32), the raw, tempered and final log-sum-exps,
    and the counts top-k, top-p and min-p left."""
    raw_lse, scaled_lse, final_lse = lses
    n_after_top_k, n_after_top_p, n_final = kept_counts
    # every kept set is a prefix of the sorted order, so a rank says which filters kept a token
    kept_k, kept_p, kept_m = ranks <= n_after_top_k, ranks <= n_after_top_p, ranks <= n_final
    prob_raw = np.exp(raw_at.astype(np.float64) - raw_lse)
    prob_tempered = np.exp(scaled_at.astype(np.float64) - scaled_lse)
    prob_final = np.where(kept_m, np.exp(scaled_at.astype(np.float64) - final_lse), 0.0)
    columns = zip(ids.tolist(), ranks.tolist(), raw_at.tolist(), penalised_at.tolist(), prob_raw.tolist(),
                  prob_tempered.tolist(), kept_k.tolist(), kept_p.tolist(), kept_m.tolist(), prob_final.tolist())
    candidates = tuple(Candidate(*row, row[0] == chosen) for row in columns)  # positional: the field order above
    chosen_row = next(c for c in candidates if c.chosen)
    return SampleResult(token_id=chosen, probability=chosen_row.prob_final, probability_raw=chosen_row.prob_raw,
                        rank=rank, candidates=candidates, n_after_top_k=n_after_top_k, n_after_top_p=n_after_top_p,
                        n_after_min_p=n_final, n_final=n_final, top_p_mass=top_p_mass,
                        entropy_final_bits=final_entropy / _LN2, **common)
