"""The sampler's C passes (tracer/model/native_top.py, native/top_values.c) on values whose answers are known: each
weight against math.exp within the stated bound (in every lane position and the scalar tail), what a cut and -inf
entries do, the draw's inverse CDF at and around its boundaries, counts and ranks with ties. The sampler's use of
them is tests/test_sampling_equality.py's."""

from __future__ import annotations

import ctypes
import math
import os
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest

from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.native_kernel import CC_ENV, COMMON_FLAGS, FLAG_SETS, NATIVE_SOURCES
from llmtrace.tracer.model.native_top import DRAW_BLOCK, MAX_COUNT, SOFTMAX_WEIGHT_ERROR, SamplerPasses, sampler_passes


@pytest.fixture(scope="module")
def passes() -> SamplerPasses:
    if not native_kernel.available():
        pytest.skip(f"no native library: {native_kernel.unavailable_reason()}")
    found = sampler_passes()
    assert found is not None  # the library is loaded, so the passes are there
    return found


def test_each_weight_is_exp_within_the_stated_bound(passes: SamplerPasses) -> None:
    """One finite value among -inf ones, so the total is that value's weight alone; at positions 0..8 of a vector of
    11 (the 8-value vector lanes and the scalar tail), for shifts across [-708, 0] and the reduction's edges."""
    rng = np.random.default_rng(3)
    shifts = np.concatenate([-np.geomspace(1e-30, 707.9, 400), rng.uniform(-708, 0, 400), [0.0, -0.5 * math.log(2),
                             -1.5 * math.log(2), -math.log(2) * 700.5]]).astype(np.float32)
    for position in range(9):
        for s in shifts[position::9]:
            x = np.full(11, -np.inf, dtype=np.float32)
            x[position] = s
            got = passes.softmax(x, 0.0)
            want = math.exp(float(s))
            assert abs(got.total - want) <= SOFTMAX_WEIGHT_ERROR * want, (position, float(s))
            assert got.kept == 11  # no cut: every value counts as kept, -inf ones too


def test_the_max_weighs_exactly_one_and_lse_and_entropy_follow(passes: SamplerPasses) -> None:
    x = np.array([2.0, 2.0, 2.0, 2.0], dtype=np.float32)  # uniform over four: lse = 2 + log 4, H = log 4
    got = passes.softmax(x, 2.0)
    assert got.total == 4.0
    assert got.lse == pytest.approx(2 + math.log(4), abs=1e-15)
    assert got.entropy_nats == pytest.approx(math.log(4), abs=1e-15)
    one = passes.softmax(np.array([5.0, -np.inf, -1e30], dtype=np.float32), 5.0)  # one-hot: H = 0, not -0 or NaN
    assert (one.total, one.lse, one.entropy_nats) == (1.0, 5.0, 0.0)


def test_a_cut_drops_values_below_it_and_counts_those_kept(passes: SamplerPasses) -> None:
    x = np.array([0.0, -1.0, -2.0, -3.0, -2.0] * 5, dtype=np.float32)  # 25 values: lanes and a tail
    got = passes.softmax(x, 0.0, cut=-2.0)  # keeps 0, -1, -2, -2 of each five
    assert got.kept == 20
    assert got.total == pytest.approx(5 * (1 + math.exp(-1) + 2 * math.exp(-2)), rel=SOFTMAX_WEIGHT_ERROR)
    p = np.array([1, math.exp(-1), math.exp(-2), math.exp(-2)]) / (1 + math.exp(-1) + 2 * math.exp(-2))
    assert got.entropy_nats == pytest.approx(math.log(5) - float((p * np.log(p)).sum()), rel=1e-9)


def test_weights_below_exp_minus_708_are_zero(passes: SamplerPasses) -> None:
    x = np.array([0.0, -707.0, -709.0, -1e30], dtype=np.float32)
    assert passes.softmax(x, 0.0).total == pytest.approx(1 + math.exp(-707.0), rel=SOFTMAX_WEIGHT_ERROR)


def test_the_draw_is_the_inverse_cdf(passes: SamplerPasses) -> None:
    """Weights 1, 2, 3, 4 (cumulative 1, 3, 6, 10): u * 10 picks the first index whose running sum exceeds it."""
    x = np.log(np.array([1.0, 2.0, 3.0, 4.0])).astype(np.float32)
    sums = passes.softmax(x, float(x.max()))
    weights = np.exp(x.astype(np.float64) - float(x.max()))
    cumulative = np.cumsum(weights) / weights.sum()
    for u in (0.0, 0.05, 0.0999, 0.1001, 0.29, 0.31, 0.59, 0.61, 0.95, 0.999999):
        assert passes.draw(x, sums, u) == int(np.searchsorted(cumulative, u, side="right")), u


def test_the_draw_crosses_blocks_and_never_picks_a_zero_weight(passes: SamplerPasses) -> None:
    """Equal weights on every third value of three blocks and a bit, -inf between: u picks the
    (floor(u * kept) + 1)-th finite one; u just below 1 picks the last finite one, never a -inf after it."""
    n = 3 * DRAW_BLOCK + 37
    x = np.full(n, -np.inf, dtype=np.float32)
    finite = np.arange(0, n - 5, 3)
    x[finite] = 1.5
    sums = passes.softmax(x, 1.5)
    assert sums.total == finite.size
    for u in (0.0, 0.2, 0.5, 0.77, 0.9999):
        assert passes.draw(x, sums, u) == finite[int(u * finite.size)]
    assert passes.draw(x, sums, math.nextafter(1.0, 0.0)) == finite[-1]
    cut = passes.softmax(x, 1.5, cut=1.5)  # a cut at the value itself keeps it
    assert cut.kept == finite.size


def test_counts_and_ranks_settle_ties_by_index(passes: SamplerPasses) -> None:
    rng = np.random.default_rng(5)
    x = (np.round(rng.normal(size=1003) * 2) / 2).astype(np.float32)  # many ties
    x[[4, 500]] = -np.inf
    order = np.lexsort((np.arange(x.size), -x))
    rank = np.empty(x.size, dtype=np.int64)
    rank[order] = np.arange(1, x.size + 1)
    for index in (0, 4, 7, 500, 1002, int(order[0]), int(order[-1])):
        assert passes.rank_of(x, index) == rank[index]
    for threshold in (-np.inf, -1.0, 0.0, 0.25, 100.0):
        assert passes.count_at_least(x, threshold) == int(np.count_nonzero(x >= threshold))


TOP_P_CASES = [dict(temperature=0.7, top_p=0.9), dict(temperature=1.5, top_p=0.99),
               dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.3),
               dict(temperature=2.0, top_k=400, top_p=0.99)]


def test_top_p_s_first_fetch_changes_no_figure(passes: SamplerPasses, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under top-p with the C passes the sampler first fetches native top_values' most (MAX_COUNT) tokens, not
    _PREFIX: the nucleus fetches 16x more while it reaches past them, so every figure (token, ranks, counts,
    probabilities, entropies) is the one the longer first fetch gives, for nuclei of one token to thousands."""
    from llmtrace.tracer.run import sampling

    rng = np.random.default_rng(7)
    rows = [(rng.normal(size=5000) * scale).astype(np.float32) for scale in (8.0, 3.0, 1.0, 0.2)]
    nuclei = []
    for case in TOP_P_CASES:
        results = {}
        for first in (MAX_COUNT, sampling._PREFIX):
            monkeypatch.setattr(sampling, "MAX_COUNT", first)  # _PREFIX: past top_values' limit, numpy's selection
            sampler = sampling.Sampler(sampling.SamplingParams(seed=3, **case))
            results[first] = [sampler.sample(x, [1, 2, 3]) for x in rows for _ in range(3)]
        assert results[sampling._PREFIX] == results[MAX_COUNT], case
        nuclei += [r.n_after_top_p for r in results[MAX_COUNT]]
    assert min(nuclei) == 1 and any(MAX_COUNT < n <= sampling._PREFIX for n in nuclei) and max(nuclei) > 1000


def test_the_avx512_sums_have_the_avx2_sums_bits(tmp_path: Path) -> None:
    """top_values.c's AVX-512 loop keeps the AVX2 loop's eight sums in one register's lanes, added in the same order:
    built with and without AVX-512 (-mno-avx512f), the sums, block totals and counts are the same bits, on vectors
    of every length class (whole 8-value groups, a tail, many blocks), with -inf entries and cuts."""
    probe = tmp_path / "probe.c"
    probe.write_text("#ifndef __AVX512F__\n#error no AVX-512\n#endif\nint f(void) { return 0; }\n")
    flags = [flag for flag in FLAG_SETS[0] if flag != "-fopenmp"]
    compiler = shlex.split(os.environ.get(CC_ENV, "") or "cc")  # the compiler native_kernel builds with
    if subprocess.run([*compiler, *flags, "-c", "-o", str(tmp_path / "probe.o"), str(probe)], check=False,
                      capture_output=True).returncode != 0:
        pytest.skip("cc -march=native has no AVX-512 here: both builds would be the AVX2 one")
    unit = tmp_path / "unit.c"  # top_values.c as decode_step.c includes it, after gguf_matmul.c's headers
    unit.write_text("#include <math.h>\n#include <stdint.h>\n#include <string.h>\n#include <immintrin.h>\n"
                    f"#define LLMT_AVX2 1\n#include \"{NATIVE_SOURCES / 'top_values.c'}\"\n")
    sums_of = {}
    for name, extra in (("avx512", []), ("avx2", ["-mno-avx512f"])):
        out = tmp_path / f"{name}.so"
        subprocess.run([*compiler, *flags, *extra, *COMMON_FLAGS, "-o", str(out), str(unit), "-lm"], check=True)
        call = ctypes.CDLL(str(out)).llmt_softmax_sums
        call.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_float, ctypes.c_void_p,
                         ctypes.c_void_p]
        call.restype = ctypes.c_int64
        sums_of[name] = call
    rng = np.random.default_rng(11)
    for trial in range(200):
        n = (49152, 8, 7, 256, 300, int(rng.integers(1, 3000)))[trial % 6]
        x = (rng.standard_normal(n) * rng.uniform(0.1, 30)).astype(np.float32)
        x[rng.integers(0, n, size=n // 10)] = -np.inf
        x[0] = abs(x[0])  # a finite max
        x_max = float(x.max())
        cut = -math.inf if trial % 2 else float(np.float32(x_max - rng.uniform(0, 20)))
        results = []
        for call in sums_of.values():
            sums, blocks = np.zeros(2), np.zeros(-(-n // DRAW_BLOCK))
            kept = call(x.ctypes.data, n, x_max, cut, sums.ctypes.data, blocks.ctypes.data)
            results.append((kept, sums.tobytes(), blocks.tobytes()))
        assert results[0] == results[1], (trial, n)
