"""The array work of sampling one logits vector (tracer/run/sampling.py's Sampler): the repetition penalty, a
softmax held as its weights, the best few tokens sorted, the top-p nucleus, an inverse-CDF draw and a rank.

Single-threaded numpy on the CPU: on one vector its reductions and partial selection beat torch's, and torch's
two-thread kernels stall for milliseconds when another process holds the other core. Every filter keeps the largest
logits, so each kept set is a prefix of the tokens sorted by tempered logit (ties: lower token id first, argmax's
order); that is what lets the sampler select the best few tokens instead of sorting the vocabulary, and draw over
the whole vocabulary without sorting it at all.

A decode step calls this right after the step has streamed the weights, so every array it touches is cold: the
passes are kept few and write into a Scratch of the vocabulary's size, made once (a fresh array of the vocabulary's
size is mapped and page-faulted on every call; the exp pass took 1.7x as long into a new array as into a kept one).
Every figure is the one the straightforward computation gives, bit for bit (tests/test_sampling_equality.py holds
it to an independent one, tests/sampling_reference.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

# Weights per block of the two-level inverse-CDF draw over the whole vocabulary (draw_index).
DRAW_BLOCK = 256


class Scratch:
    """Full-vocabulary arrays one Sampler writes its intermediate results into, call after call (allocated once).
    What a call returns never points into them."""

    __slots__ = ("size", "shifted", "weights", "products", "scaled", "penalised", "padded")

    def __init__(self, size: int) -> None:
        self.size = size
        self.shifted = np.empty(size, dtype=np.float32)  # x - max(x)
        self.weights = np.empty(size, dtype=np.float32)  # exp(shifted)
        self.products = np.empty(size, dtype=np.float32)  # weights * shifted, for the entropy
        self.scaled = np.empty(size, dtype=np.float32)  # penalised / temperature
        self.penalised = np.empty(size, dtype=np.float32)  # the logits after the repetition penalty
        self.padded = np.zeros(-(-size // DRAW_BLOCK) * DRAW_BLOCK, dtype=np.float64)  # the draw's weights; the
        #                                                                        tail past `size` stays 0


@dataclass(frozen=True, slots=True)
class Softmax:
    """softmax(x) held as its unnormalised weights exp(x - max) (the arrays may be a Scratch's)."""

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

    def cut_below(self, x: np.ndarray, threshold: float) -> Softmax:
        """The softmax of x with every entry below `threshold` set to -inf, normalised against the same max (the
        arrays are new, so this one's stay valid)."""
        weights = np.where(x >= threshold, self.weights, np.float32(0))
        total = float(weights.sum())
        return Softmax(self.max, self.max + math.log(total), total, self.shifted, weights)


def softmax(x: np.ndarray, x_max: float, scratch: Scratch | None = None) -> Softmax:
    """softmax(x) as log(sum(exp(x))) and the unnormalised weights exp(x - x_max): one subtraction, one exp pass and
    one sum (into `scratch`'s arrays when given). -inf entries get weight 0."""
    shifted = np.subtract(x, np.asarray(x_max, dtype=x.dtype), out=None if scratch is None else scratch.shifted)
    weights = np.exp(shifted, out=None if scratch is None else scratch.weights)
    total = float(weights.sum())
    return Softmax(x_max, x_max + math.log(total), total, shifted, weights)


def apply_repetition_penalty(raw: np.ndarray, previous_ids: Sequence[int] | torch.Tensor,
                             penalty: float, out: np.ndarray) -> tuple[np.ndarray, int]:
    """CTRL's penalty, written into `out` (raw is left alone): seen positive logits / penalty, seen negative logits
    * penalty. Returns the penalised logits (raw itself when nothing was seen) and how many distinct ids it touched."""
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


def top_sorted(x: np.ndarray, count: int) -> np.ndarray:
    """Indices of the `count` largest values, largest first, ties by lower index (argmax's choice)."""
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


def nucleus(vals: np.ndarray, n_candidates: int, vocab: int, scaled_lse: float,
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


def first_above(cumulative: np.ndarray, target: float) -> int:
    """Inverse-CDF step: the first index whose cumulative weight exceeds target (never a zero-weight index)."""
    index = min(int(np.searchsorted(cumulative, target, side="right")), cumulative.size - 1)
    while index > 0 and cumulative[index] == cumulative[index - 1]:  # only when rounding put target past the end
        index -= 1
    return index


def draw_index(weights: np.ndarray, u: float, padded: np.ndarray) -> int:
    """Draw index i with probability weights[i] / sum(weights), u uniform in [0, 1).

    Two levels (block totals, then one block) so it costs two short cumulative sums, not one over the vocabulary.
    `padded`: float64 scratch of whole blocks whose entries past len(weights) are 0 (Scratch.padded).
    """
    block = DRAW_BLOCK
    blocks = -(-weights.size // block)
    padded[: weights.size] = weights
    block_cumulative = np.cumsum(padded.reshape(blocks, block).sum(axis=1))
    target = u * float(block_cumulative[-1])
    b = first_above(block_cumulative, target)
    inner = np.cumsum(padded[b * block : (b + 1) * block])
    before = float(block_cumulative[b - 1]) if b else 0.0
    return b * block + first_above(inner, target - before)


def rank_of(x: np.ndarray, index: int) -> int:
    """1-based rank of x[index], largest first, ties lower index first."""
    value = x[index]
    return int(np.count_nonzero(x > value)) + int(np.count_nonzero(x[:index] == value)) + 1
