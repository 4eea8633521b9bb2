"""The sampler's passes over the whole vocabulary in C (native/top_values.c), when the native library is loaded.

The sampler (tracer/run/sampling.py) needs, per token, the best few logits sorted (its candidate table, top-k) and,
over all 49152 of them, a softmax's log-sum-exp and entropy, sometimes with a cut (min-p), a draw from it, and a few
counts. After a decode step every numpy call it makes is cold, and numpy needs ~5 passes for one softmax; each of
these is one ctypes call and one pass:

- `top_values`: the indices of the `count` largest values, largest first, ties lower index first. Exact (comparisons
  only): numpy's selection gives the same indices.
- `SamplerPasses.softmax`: max + log(sum exp(x - max)) and the entropy, the weights exp(x - max) computed and summed
  in double. Not numpy's fp32 bits; within the bounds derived at SOFTMAX_WEIGHT_ERROR below.
- `SamplerPasses.top_softmax`: both of those over the same vector in one call (the raw logits, every token),
  returning Python lists: under greedy the sampler then makes no numpy call at all.
- `SamplerPasses.draw`: the inverse-CDF draw from those weights; `count_at_least` and `rank_of`: counts and ranks
  (comparisons only: exact).

None of this builds or loads the library (native_kernel.loaded()): a process that has not loaded it gets None, and
the caller computes in numpy.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmtrace.tracer.model import native_kernel

MAX_COUNT = 64  # LLMT_TOP_MAX in native/top_values.c
DRAW_BLOCK = 256  # LLMT_DRAW_BLOCK in native/top_values.c

# Relative error bound of one softmax weight exp(s) (LLMT_EXP_RELATIVE_ERROR, derived at llmt_exp_le0 in
# native/top_values.c: the degree-8 Taylor remainder 4.0e-10 on |r| <= ln2/2 plus double roundings; the measured worst
# over 2e8 values of s in [-708, 0] against libm's exp was 2.7e-10).
#
# What it bounds. Each weight is w_i (1 + e_i) with |e_i| <= eps = SOFTMAX_WEIGHT_ERROR (s_i = x_i - max is exact in
# double up to 2^-53 relative, which exp turns into |s_i| 2^-53 <= 708 * 1.1e-16 = 8e-14: inside eps's margin);
# the sums add up to n = 5e4 doubles, relative error <= n 2^-53 = 6e-12, also inside it. Then
#   total T = sum w_i: relative error <= eps, so the log-sum-exp max + log T is off by <= eps (absolute, nats),
#     plus the rounding of the sum max + log T, 2^-53 |lse|;
#   a probability exp(x_i - lse): relative error <= eps (+ the same rounding of x_i - lse);
#   entropy H = log T + A with A = sum p_i |s_i| (a p-weighted mean of |s_i|): perturbing every weight by a factor
#     within 1 +- eps moves a weighted mean by at most 2 eps A / (1 - eps), and log T by eps; A <= H because
#     log T >= 0 (the max's own weight is exp(0) = 1), so |dH| <= eps (1 + 2 H) + O(eps^2) nats.
# Weights below exp(-708) are taken as 0 (LLMT_EXP_MIN): at most n * 1e-307 of a total >= 1, nothing in double.
SOFTMAX_WEIGHT_ERROR = 4.1e-10

_DECLARED: dict[Any, Any] = {}  # by library file: the top_values entry point with its signature declared


def top_values(x: np.ndarray, count: int) -> np.ndarray | None:
    """Indices (int64) of the `count` largest values of `x` (1-D contiguous float32), largest first, ties lower index
    first; None when the library is not loaded, `count` is outside 1..MAX_COUNT or `x` holds a NaN."""
    if not 1 <= count <= MAX_COUNT:
        return None
    library = native_kernel.loaded()
    if library is None:
        return None
    call = _DECLARED.get(library.path)
    if call is None:
        call = _DECLARED[library.path] = library.handle.llmt_top_values
        call.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        call.restype = ctypes.c_int64
    if x.dtype != np.float32 or x.ndim != 1 or not x.flags.c_contiguous:
        return None
    ids = np.empty(min(count, x.shape[0]), dtype=np.int64)
    written = call(_address(x), x.shape[0], count, _address(ids))
    return ids if written == ids.shape[0] else None  # -1: a NaN (the caller's numpy max says so)


@dataclass(frozen=True, slots=True)
class SoftmaxSums:
    """softmax(x) with every value below `cut` taken as -inf, as the C pass summed it."""

    max: float  # the max the weights were shifted by
    cut: float  # -inf: nothing cut
    total: float  # sum of exp(x_i - max) over the kept values (>= 1 when the max is kept)
    lse: float  # log-sum-exp: max + log(total)
    entropy_nats: float
    kept: int  # how many values are >= cut
    blocks: ctypes.Array | None  # doubles, per DRAW_BLOCK values each block's total, for SamplerPasses.draw


def _address(x: np.ndarray) -> int:
    """Where x's first value lives: through ctypes' buffer view when x is writable (~0.6 us), else numpy's array
    interface (~3 us: it builds a dict; a decode token makes a few of these calls, every one of them cold)."""
    if x.flags.writeable:
        return ctypes.addressof(ctypes.c_char.from_buffer(x))
    return x.__array_interface__["data"][0]


class SamplerPasses:
    """The C passes of the loaded library. Every array argument must be 1-D, C-contiguous float32 (the caller checks
    once: the sampler's logits are, or it takes numpy's path throughout)."""

    __slots__ = ("_sums", "_draw", "_count", "_top_softmax")

    def __init__(self, handle: ctypes.CDLL) -> None:
        self._top_softmax = handle.llmt_top_softmax
        self._top_softmax.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._top_softmax.restype = ctypes.c_int64
        self._sums = handle.llmt_softmax_sums
        self._sums.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_float, ctypes.c_void_p,
                               ctypes.c_void_p]
        self._sums.restype = ctypes.c_int64
        self._draw = handle.llmt_softmax_draw
        self._draw.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_float, ctypes.c_void_p,
                               ctypes.c_double]
        self._draw.restype = ctypes.c_int64
        self._count = handle.llmt_count_before
        self._count.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int64]
        self._count.restype = ctypes.c_int64

    def top_softmax(self, x: np.ndarray, count: int, *,
                    for_draw: bool = True) -> tuple[list[int], list[float], SoftmaxSums] | None:
        """`top_values(x, count)` as a list of ids, their values, and `softmax(x, max(x))`, in one call (count in
        1..MAX_COUNT; for_draw=False: no block totals, so no `draw` from it); None when x holds a NaN or no finite
        max (the caller's numpy max says which). Python lists and ctypes arrays, not numpy's: this runs once a
        decode token, right after the step, when every numpy call is cold."""
        n = x.shape[0]
        k = min(count, n)
        ids, values, sums = (ctypes.c_int64 * k)(), (ctypes.c_float * k)(), (ctypes.c_double * 2)()
        blocks = (ctypes.c_double * -(-n // DRAW_BLOCK))() if for_draw else None
        if self._top_softmax(_address(x), n, count, ids, values, sums, blocks) != k:
            return None
        top = values[:]
        if not math.isfinite(top[0]):
            return None
        if blocks is None:
            return ids[:], top, top_pass_sums(top[0], sums[0], sums[1], n)
        return ids[:], top, _summed(top[0], -math.inf, sums[0], sums[1], n, blocks)

    def softmax(self, x: np.ndarray, x_max: float, cut: float = -math.inf) -> SoftmaxSums:
        """One pass: the log-sum-exp and entropy of softmax(x), values below `cut` taken as -inf. `x_max` must be
        max(x), and kept (x_max >= cut)."""
        n = x.shape[0]
        sums, blocks = (ctypes.c_double * 2)(), (ctypes.c_double * -(-n // DRAW_BLOCK))()
        kept = self._sums(_address(x), n, x_max, cut, sums, blocks)
        return _summed(x_max, cut, sums[0], sums[1], int(kept), blocks)

    def draw(self, x: np.ndarray, sums: SoftmaxSums, u: float) -> int:
        """Index i drawn with probability (its weight) / sums.total, u uniform in [0, 1): the first index whose
        running sum of weights exceeds u * total, never one of weight 0."""
        if sums.blocks is None:
            raise ValueError("these sums were taken without block totals (for_draw=False)")
        index = self._draw(_address(x), x.shape[0], sums.max, sums.cut, sums.blocks, u * sums.total)
        if index < 0:
            raise ValueError("no value of nonzero weight to draw")  # cannot happen: the max's weight is 1
        return int(index)

    def count_at_least(self, x: np.ndarray, threshold: float) -> int:
        return int(self._count(_address(x), x.shape[0], threshold, x.shape[0]))

    def rank_of(self, x: np.ndarray, index: int) -> int:
        """1-based rank of x[index], largest first, ties lower index first."""
        return int(self._count(_address(x), x.shape[0], float(x[index]), index)) + 1


def top_pass_sums(x_max: float, total: float, weighted: float, n: int) -> SoftmaxSums:
    """The SoftmaxSums `SamplerPasses.top_softmax(x, .., for_draw=False)` returns, from what its C pass wrote: the
    max, the two sums (total, then the weighted one) over all `n` values of x; for passes run inside C
    (native_step.py's run_ahead)."""
    return _summed(x_max, -math.inf, total, weighted, n, None)


def _summed(x_max: float, cut: float, total: float, weighted: float, kept: int,
            blocks: ctypes.Array | None) -> SoftmaxSums:
    log_total = math.log(total)
    # H = log T - sum w s / T (s <= 0); max(.., 0): a one-hot distribution's rounding must not go negative
    return SoftmaxSums(x_max, cut, total, x_max + log_total, max(log_total - weighted / total, 0.0), kept, blocks)


_PASSES: dict[Any, SamplerPasses] = {}  # by library file


def sampler_passes() -> SamplerPasses | None:
    """The C passes when this process has loaded the native library, else None (never builds or loads it)."""
    library = native_kernel.loaded()
    if library is None:
        return None
    passes = _PASSES.get(library.path)
    if passes is None:
        passes = _PASSES[library.path] = SamplerPasses(library.handle)
    return passes
