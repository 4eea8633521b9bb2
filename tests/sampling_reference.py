"""The sampler as it was before its per-token work was cut (main dc68e94, tracer/run/sampling.py), frozen as the
reference the package's one must equal: every figure of every SampleResult, bit for bit
(tests/test_sampling_equality.py).

It shares no code with the package (it imports nothing from llmtrace): it takes the parameters as a plain dict
(`dataclasses.asdict(SamplingParams(...))`) and returns each result as the dict `dataclasses.asdict(SampleResult)`
gives, so the test compares the two with `==`. Do not "improve" this file: its worth is that it is the old
computation, written apart from the one it checks.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

_PREFIX = 256
_LN2 = math.log(2.0)
_NEG_INF = float("-inf")
_STEP_ORDER = ("repetition_penalty", "temperature", "greedy", "top_k", "top_p", "min_p")
_CANDIDATE_FIELDS = ("token_id", "rank", "logit", "logit_penalized", "prob_raw", "prob_tempered", "kept_top_k",
                     "kept_top_p", "kept_min_p", "prob_final", "chosen")


class ReferenceNonFiniteError(ValueError):
    """The logits hold a NaN or +inf, or nothing above -inf."""


class _Params:
    """The sampling parameters read from a plain dict (SamplingParams' field names)."""

    def __init__(self, params: dict) -> None:
        self.temperature = float(params["temperature"])
        self.top_k = int(params["top_k"])
        self.top_p = float(params["top_p"])
        self.min_p = float(params["min_p"])
        self.repetition_penalty = float(params["repetition_penalty"])
        self.seed = params["seed"]
        self.greedy = self.temperature == 0
        on = {"repetition_penalty": self.repetition_penalty != 1,
              "temperature": not self.greedy and self.temperature != 1, "greedy": self.greedy,
              "top_k": self.top_k > 0, "top_p": self.top_p < 1, "min_p": self.min_p > 0}
        self.active_steps = tuple(step for step in _STEP_ORDER if on[step])


class ReferenceSampler:
    """Picks tokens under fixed sampling parameters; owns the random generator, so one seed gives one token sequence."""

    def __init__(self, params: dict, *, n_candidates: int = 10) -> None:
        self._params = params = _Params(params)
        self._n_candidates = n_candidates
        self._generator = torch.Generator(device="cpu")
        self._uniforms: list[float] = []
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

    @property
    def seed(self) -> int:
        return self._seed

    def sample(self, logits: torch.Tensor, previous_ids: Sequence[int] | torch.Tensor = ()) -> dict:
        """Pick the next token from `logits` (shape (vocab,)); `previous_ids` are the tokens the penalty sees."""
        p = self._params
        raw = _logits_as_numpy(logits)
        vocab = raw.size
        raw_max = float(raw.max())  # NaN propagates through max, so this also catches NaN
        if not math.isfinite(raw_max):
            raise ReferenceNonFiniteError(f"logits must be finite with at least one value > -inf, got max {raw_max}")
        raw_lse, raw_entropy, _ = _softmax_stats(raw, raw_max)
        if p.repetition_penalty != 1:
            penalised, n_penalized = _apply_repetition_penalty(raw, previous_ids, p.repetition_penalty)
        else:
            penalised, n_penalized = raw, 0
        common = dict(active_steps=p.active_steps, vocab_size=vocab, n_penalized=n_penalized,
                      entropy_raw_bits=raw_entropy / _LN2)
        if p.greedy:
            return self._greedy(raw, raw_lse, penalised, common)
        return self._draw(raw, raw_max, raw_lse, penalised, common)

    def _greedy(self, raw: np.ndarray, raw_lse: float, penalised: np.ndarray, common: dict) -> dict:
        ids = _top_sorted(penalised, min(self._n_candidates, penalised.size))
        chosen = int(ids[0])  # ties sort lower ids first, so this is argmax's first maximum, like HF
        vocab = penalised.size
        prob_raw = np.exp(raw[ids].astype(np.float64) - raw_lse)
        one_hot = (ids == chosen).astype(np.float64)
        everything = np.ones(ids.size, dtype=bool)
        candidates = _candidates(ids, np.arange(1, ids.size + 1), raw, penalised, prob_raw, one_hot,
                                 everything, everything, everything, one_hot, chosen)
        return dict(token_id=chosen, probability=1.0, probability_raw=float(prob_raw[0]), rank=1,
                    candidates=candidates, n_after_top_k=vocab, n_after_top_p=vocab, n_after_min_p=vocab,
                    n_final=1, top_p_mass=1.0, entropy_final_bits=0.0, **common)

    def _draw(self, raw: np.ndarray, raw_max: float, raw_lse: float, penalised: np.ndarray,
              common: dict) -> dict:
        p = self._params
        vocab = penalised.size
        if p.temperature == 1 and penalised is raw:
            scaled, scaled_max, scaled_lse = raw, raw_max, raw_lse
        else:
            scaled = penalised / np.float32(p.temperature) if p.temperature != 1 else penalised
            scaled_max = float(scaled.max())
            scaled_lse, _, _ = _softmax_stats(scaled, scaled_max, entropy=False)

        want = self._n_candidates
        if p.top_k:
            want = max(want, p.top_k + 1)  # +1 shows whether the k-th is tied with the next
        if p.top_p < 1 or p.min_p > 0:
            want = max(want, _PREFIX)
        order = _top_sorted(scaled, min(want, vocab))
        vals = scaled[order]

        def count_at_least(threshold: float) -> int:
            return vocab if threshold == _NEG_INF else int(np.count_nonzero(scaled >= threshold))

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
            final_lse, final_entropy, weights = _softmax_stats(kept, float(kept[0]))
            cumulative = np.cumsum(weights)
            position = _first_above(cumulative, u * float(cumulative[-1]))
            chosen, rank = int(order[position]), position + 1
        else:  # no top-p; min-p alone, or nothing, cut less than the prefix holds: draw over the whole vocabulary
            masked = scaled if threshold == _NEG_INF else np.where(scaled >= threshold, scaled, np.float32(_NEG_INF))
            final_lse, final_entropy, weights = _softmax_stats(masked, scaled_max)
            chosen = _draw_index(weights, u)
            rank = _rank_of(scaled, chosen)

        ids, ranks = order[: self._n_candidates], np.arange(1, min(self._n_candidates, order.size) + 1)
        if rank > self._n_candidates:
            ids, ranks = np.append(ids, chosen), np.append(ranks, rank)
        s = scaled[ids]
        # every kept set is a prefix of the sorted order, so a rank says which filters kept a token
        kept_k, kept_p, kept_m = ranks <= n_after_top_k, ranks <= n_after_top_p, ranks <= n_final
        prob_raw = np.exp(raw[ids].astype(np.float64) - raw_lse)
        prob_tempered = np.exp(s.astype(np.float64) - scaled_lse)
        prob_final = np.where(kept_m, np.exp(s.astype(np.float64) - final_lse), 0.0)
        candidates = _candidates(ids, ranks, raw, penalised, prob_raw, prob_tempered, kept_k, kept_p, kept_m,
                                 prob_final, chosen)
        chosen_row = next(c for c in candidates if c["chosen"])
        return dict(token_id=chosen, probability=chosen_row["prob_final"], probability_raw=chosen_row["prob_raw"],
                    rank=rank, candidates=candidates, n_after_top_k=n_after_top_k, n_after_top_p=n_after_top_p,
                    n_after_min_p=n_final, n_final=n_final, top_p_mass=top_p_mass,
                    entropy_final_bits=final_entropy / _LN2, **common)


def _logits_as_numpy(logits: torch.Tensor) -> np.ndarray:
    """A read-only-by-convention float32 CPU view of a 1-D logits tensor (copied only if needed)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 1 or logits.shape[0] == 0:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a non-empty 1-D tensor of shape (vocab,), got {shape}")
    if logits.dtype != torch.float32 or not logits.is_cpu:
        logits = logits.to(device="cpu", dtype=torch.float32)
    return logits.detach().numpy()  # numpy() gives a strided view, so a non-contiguous slice needs no copy


def _apply_repetition_penalty(raw: np.ndarray, previous_ids: Sequence[int] | torch.Tensor,
                              penalty: float) -> tuple[np.ndarray, int]:
    """CTRL's penalty on a copy: seen positive logits / penalty, seen negative logits * penalty."""
    if isinstance(previous_ids, torch.Tensor):
        ids = previous_ids.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)
    else:
        ids = np.fromiter(previous_ids, dtype=np.int64)
    if ids.size == 0:
        return raw, 0
    if ids.min() < 0 or ids.max() >= raw.size:
        raise ValueError(f"previous_ids must lie in [0, {raw.size}), got ids from {ids.min()} to {ids.max()}")
    out = raw.copy()
    seen = raw[ids]  # repeated ids just write the same value again
    out[ids] = np.where(seen < 0, seen * np.float32(penalty), seen / np.float32(penalty))
    distinct = np.zeros(raw.size, dtype=bool)
    distinct[ids] = True
    return out, int(np.count_nonzero(distinct))


def _softmax_stats(x: np.ndarray, x_max: float, *, entropy: bool = True) -> tuple[float, float, np.ndarray]:
    """log(sum(exp(x))), the entropy (nats) of softmax(x), and the unnormalised weights exp(x - x_max).

    -inf entries count as probability 0. One exp pass and two reductions over x.
    """
    shifted = x - np.asarray(x_max, dtype=x.dtype)
    weights = np.exp(shifted)
    total = float(weights.sum())
    nats = 0.0
    if entropy:
        if float(shifted.min()) == _NEG_INF:
            shifted = np.where(weights > 0, shifted, 0)  # 0 * -inf would be NaN
        # not np.dot: BLAS may spread a long dot product over threads, which stalls on a busy machine
        nats = max(math.log(total) - float((weights * shifted).sum()) / total, 0.0)
    return x_max + math.log(total), nats, weights


def _top_sorted(x: np.ndarray, count: int) -> np.ndarray:
    """Indices of the `count` largest values, largest first, ties by lower index (argmax's choice)."""
    if count < x.size:
        top = _top_unordered(x, count)
        boundary = x[top].min()
        at_boundary = int(np.count_nonzero(x[top] == boundary))
        if np.count_nonzero(x == boundary) > at_boundary:  # the cut went through tied values: take the lowest ids
            top = np.concatenate((top[x[top] > boundary], np.flatnonzero(x == boundary)[:at_boundary]))
    else:
        top = np.arange(x.size)
    top = top[np.argsort(-x[top])]
    values = x[top]
    tied = values[1:] == values[:-1]
    if tied.any():  # rare; a stable sort of everything costs several times more than fixing the tied runs
        in_run = np.flatnonzero(np.concatenate(([False], tied)) | np.concatenate((tied, [False])))
        members = top[in_run]
        top[in_run] = members[np.lexsort((members, -values[in_run]))]
    return top


def _top_unordered(x: np.ndarray, count: int) -> np.ndarray:
    """Indices of the `count` largest values, in no order.

    A full argpartition costs ~60 us on 49152 values. Instead, the (1.5 count/16 + 8)-th largest of every 16th
    value is a threshold that leaves about 1.5 count + 128 values above it (~10 us to find them); in the rare case
    it leaves fewer than `count`, fall back to the full partition. When >= count values pass, the top `count` do.
    """
    stride = 16
    if count * stride * 2 < x.size:
        sample = x[::stride]
        rank = (3 * count) // (2 * stride) + 8
        threshold = np.partition(sample, sample.size - rank)[sample.size - rank]
        passed = np.flatnonzero(x >= threshold)
        if passed.size >= count:
            if passed.size == count:
                return passed
            return passed[np.argpartition(x[passed], passed.size - count)[passed.size - count:]]
    return np.argpartition(x, x.size - count)[x.size - count:]


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


def _draw_index(weights: np.ndarray, u: float) -> int:
    """Draw index i with probability weights[i] / sum(weights), u uniform in [0, 1).

    Two levels (block totals, then one block) so it costs two short cumulative sums, not one over the vocabulary.
    """
    block = 256
    blocks = -(-weights.size // block)
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


def _candidates(ids: np.ndarray, ranks: np.ndarray, raw: np.ndarray, penalised: np.ndarray, prob_raw: np.ndarray,
                prob_tempered: np.ndarray, kept_k: np.ndarray, kept_p: np.ndarray, kept_m: np.ndarray,
                prob_final: np.ndarray, chosen: int) -> tuple[dict, ...]:
    columns = zip(ids.tolist(), ranks.tolist(), raw[ids].tolist(), penalised[ids].tolist(), prob_raw.tolist(),
                  prob_tempered.tolist(), kept_k.tolist(), kept_p.tolist(), kept_m.tolist(), prob_final.tolist())
    return tuple(dict(zip(_CANDIDATE_FIELDS, (*row, row[0] == chosen))) for row in columns)
