"""The "i8dot" stored kernel (tracer/model/native/int8_dot.c): activations rounded to int8 per 32 values, integer
dot products with the blocks' codes.

Two references, both independent of the C code's decoding (gguf's dequantizer gives the weights' values w):
- the SAME math: x quantized here as the kernel describes it (per 32 values d = max|x|/127, q = round-half-even(
  x * (127/max|x|)) in fp32), then sum over blocks of d * sum(w * q) in fp64. The kernel sums integer products exactly
  and rounds only its per-block fp32 terms, (a*d) * sum(c*q) and b * s (w = a*c + b: the block's scale, code and
  offset); those terms can exceed |w| * |q| (Q4_0's code 0..15 against its value c - 8; a K-quant's min), so the
  bound is 2^-16 of d * sum(|w| + max|w| of the block) * |q|: 2^-24 would be one rounding, 2^8 leaves room for the
  ~30 rounded additions of a 7-block row and the offsets' size (measured: below 2^-20 of it).
- the exact product x @ w.T: the kernel's result differs by the rounding of x, at most d/2 per value, so
  |y - x @ w.T| <= sum over blocks of d/2 * sum|w| (plus fp32 summation, 2^-20 of sum |x||w|): a derived bound.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from llmtrace.tracer.load.stored_weights import all_kernels, parse_weights, widest_kernel
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.weight_formats import (
    I8DOT,
    INT4PACK,
    NATIVE,
    concat_rows,
    pack_gguf,
    runs_blocks,
    stored_kernels,
)
from tests.activation_codes import round_activations
from tests.guard_page import guarded_products
from tests.native_builds import PORTABLE_FLAGS, built_with
from tests.tiny_gguf import random_blocks
from tests.torch_threads import torch_threads

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
SAME_MATH_TOLERANCE = 2**-16
SUM_TOLERANCE = 2**-20


@pytest.fixture
def native() -> None:
    if not native_kernel.available():
        pytest.skip(f"native kernel not available here: {native_kernel.unavailable_reason()}")


def _columns(qtype: Q) -> int:
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return 7 * 32 if block == 32 else 2 * 256


def q8_scale(d: np.ndarray) -> np.ndarray:
    """The activation scale of a Q8_0 product (int8_dot.c's q8_x_scale): d rounded to fp16 (nearest, ties to even)
    where fp16 holds it as a normal number, as llama.cpp's q8_0 activation blocks store it; d itself elsewhere."""
    normal = (d >= 2.0**-14) & (d <= 65504.0)
    return np.where(normal, d.astype(np.float16).astype(np.float32), d)


def same_math(x: np.ndarray, w: np.ndarray, qtype: Q | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(the kernel's product in fp64, the fp32-rounding bound of each output) for x (rows, K) and values w (N, K)
    of `qtype` (Q8_0: x's scales as q8_scale)."""
    codes, d = round_activations(x, 127)
    if qtype == Q.Q8_0:
        d = q8_scale(d)
    wb = w.astype(np.float64).reshape(w.shape[0], -1, 32)  # (N, K/32, 32)
    qb = codes.reshape(codes.shape[0], -1, 32).astype(np.float64)  # (rows, K/32, 32)
    product = np.einsum("rb,nbl,rbl->rn", d.astype(np.float64), wb, qb)
    size = np.abs(wb) + np.abs(wb).max(axis=2, keepdims=True)
    bound = np.einsum("rb,nbl,rbl->rn", d.astype(np.float64), size, np.abs(qb)) * SAME_MATH_TOLERANCE
    return product, bound


def rounding_bound(x: np.ndarray, w: np.ndarray, qtype: Q | None = None) -> np.ndarray:
    """sum over blocks of d/2 * sum|w|, plus fp32 summation: how far the kernel may be from x @ w.T. d is max|x| / 127
    rounded to fp32, which counts where d is subnormal (max|x| below 127 * 2^-126): |x - d*q| <= max|x|/254 +
    127 * |d - max|x|/127| <= d/2 + 64 ulp(d) (where d is normal, 64 ulp is 2^-17 of d/2). A Q8_0 product's d is
    rounded on to fp16 (q8_scale): 127 * |d16 - d| more (<= 2^-5 of d)."""
    _, d = round_activations(x, 127)
    step = 0.5 * d.astype(np.float64) + 64 * np.spacing(d).astype(np.float64)  # (rows, K/32)
    if qtype == Q.Q8_0:
        step += 127 * np.abs(q8_scale(d).astype(np.float64) - d.astype(np.float64))
    absw = np.abs(w.astype(np.float64)).reshape(w.shape[0], -1, 32).sum(axis=2)  # (N, K/32)
    return step @ absw.T + np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T * SUM_TOLERANCE


def _check(weight, raw: np.ndarray, qtype: Q, x: torch.Tensor) -> None:  # noqa: ANN001
    values = np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32)
    got = weight(x).double().numpy()
    want, bound = same_math(x.numpy(), values, qtype)
    assert (np.abs(got - want) <= bound).all(), float((np.abs(got - want) / bound).max())
    exact = x.double().numpy() @ values.astype(np.float64).T
    assert (np.abs(got - exact) <= rounding_bound(x.numpy(), values, qtype)).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_products_are_the_int8_math_and_within_the_rounding_bound(qtype: Q, native: None) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    rows, cols = 37, _columns(qtype)  # 37 rows: an odd split between two threads
    raw = random_blocks(qtype, rows, cols, rng)
    weight = pack_gguf(raw, int(qtype), cols, I8DOT)
    assert weight.format.kernel == I8DOT and weight.format.label == f"{qtype.name.lower()} (i8dot)"
    assert weight.stored_bytes == raw.nbytes and np.shares_memory(weight.tensors["blocks"].numpy(), raw)
    # the values (embedding rows, dequantize) are the exact ones: only products round the activations
    values = np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32)
    assert np.array_equal(weight.dequantize().numpy(), values)
    assert np.array_equal(weight.rows(torch.tensor([3, 0]), torch.float32).numpy(), values[[3, 0]])
    for tokens in (1, 3, 17):  # one token (decode), a few, a prefill
        x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens)) * 3
        x[0, :32] = 0.0  # an all-zero block: d = 0, no division by zero
        _check(weight, raw, qtype, x)


def test_a_block_whose_127_over_max_overflows_keeps_its_codes(tmp_path: Path, native: None) -> None:
    """A block whose max|x| is below 127 / FLT_MAX (~3.7e-37) has 127 / max|x| overflow fp32: quantize_x rounds its
    codes in double (before, every code of such a block became -128, or 0 in the portable loops, so a row of them came
    out with the wrong size and sign). Rows of only such blocks, max|x| from 3e-37 down to subnormal 2e-40, times Q8_0
    blocks whose scales (2^14..65504) keep d_w * d_x a normal fp32 number, on both builds: each product is the int8
    math, within the rounding bound of x @ w.T, and within 2^-6 of it in norm, as an ordinary row is (~5e-3)."""
    rng = np.random.default_rng(37)
    rows, cols = 13, 7 * 32
    raw = random_blocks(Q.Q8_0, rows, cols, rng)
    blocks = raw.reshape(rows, -1, 34)  # a Q8_0 block: fp16 scale, 32 int8 codes
    blocks[:, :, :2] = rng.uniform(2**14, 65504, blocks.shape[:2]).astype("<f2")[..., None].view(np.uint8)
    scale = np.exp(rng.uniform(np.log(2e-40), np.log(3e-37), (3, cols // 32, 1)))  # each block's own size
    x = torch.from_numpy((rng.uniform(-1, 1, (3, cols // 32, 32)) * scale).reshape(3, cols)).float()
    assert (x.abs().amax(dim=1) < 127 / np.finfo(np.float32).max).all()
    values = np.asarray(gguf_dequantize(raw, Q.Q8_0), dtype=np.float64)
    exact = x.double().numpy() @ values.T
    for build in (nullcontext(), built_with(PORTABLE_FLAGS, tmp_path / "portable")):
        with build:
            weight = pack_gguf(raw, int(Q.Q8_0), cols, I8DOT)
            for tokens in (1, 3):  # one token (decode), a few (prefill tiles)
                _check(weight, raw, Q.Q8_0, x[:tokens])
                got = weight(x[:tokens]).double().numpy()
                # the int8 rounding's ~5e-3 of an ordinary row (kernel_choice's probe), not the -128s' ~1 or more
                assert np.linalg.norm(got - exact[:tokens]) <= 2**-6 * np.linalg.norm(exact[:tokens])


def test_a_nan_or_infinite_activation_is_not_rounded_away(native: None) -> None:
    raw = random_blocks(Q.Q4_1, 5, 128, np.random.default_rng(1))
    weight = pack_gguf(raw, int(Q.Q4_1), 128, I8DOT)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 128)
        x[1, 70] = bad
        y = weight(x)
        assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()
        assert torch.isnan(weight(x[1:])).all()  # the one-row kernel too


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_threads_and_uneven_splits_give_the_same_sums(qtype: Q, native: None) -> None:
    """Each output is one thread's sum in one order: 1 and 2 threads agree bit for bit, whatever the split."""
    cols = 576 if gguf.GGML_QUANT_SIZES[qtype][0] == 32 else 1024
    x = torch.randn(5, cols)
    for rows in (1, 3, 301):
        raw = random_blocks(qtype, rows, cols, np.random.default_rng(rows))
        weight = pack_gguf(raw, int(qtype), cols, I8DOT)
        with torch_threads(1):
            one = (weight(x[:1]), weight(x))
        with torch_threads(2):
            two = (weight(x[:1]), weight(x))
        # decode takes rows eight (Q4_0/Q4_1) or four (K-quants) at a time and the rest one by one, prefill tiles
        # them (Q4_0/Q4_1): both differ with the split
        assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_a_q8_0_prefill_row_is_the_same_whatever_rows_come_with_it(native: None) -> None:
    """A Q8_0 prefill packs a thread's rows sixteen at a time for each call (AVX-512 VNNI: int8_dot.c's
    i8_q8_groups_many_x; elsewhere 2 x 4 tiles) and takes the activation rows four at a time, then one by one: a
    row's value must not depend on which rows of W or of x shared its pass. 37 rows (two groups, then five in a
    padded group) times 9 activation rows, against sub-matrices that start mid-group or hold one row, and fewer
    activation rows: the same bits; and the int8 math within its bound."""
    cols = 18 * 32
    raw = random_blocks(Q.Q8_0, 37, cols, np.random.default_rng(37))
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(9)) * 2
    full = pack_gguf(raw, int(Q.Q8_0), cols, I8DOT)(x)
    _check(pack_gguf(raw, int(Q.Q8_0), cols, I8DOT), raw, Q.Q8_0, x)
    for start, stop in ((5, 30), (36, 37), (0, 16), (16, 37)):
        part = pack_gguf(np.ascontiguousarray(raw[start:stop]), int(Q.Q8_0), cols, I8DOT)
        assert torch.equal(part(x), full[:, start:stop]), (start, stop)
        assert torch.equal(part(x[:2]), full[:2, start:stop]), (start, stop)
        assert torch.equal(part(x[3:8]), full[3:8, start:stop]), (start, stop)


K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_k_quant_rows_taken_together_and_alone_give_the_same_bits(qtype: Q, native: None) -> None:
    """The K-quants' decode takes a thread's rows four at a time (I8_K_ROWS, sharing x) and the rest one by one, and
    prefill asks for the one-row kernel: a row's value must not depend on which. 13 rows (three groups of four, then
    one alone; 1 and 2 threads) against each row as a matrix of its own (alone) and within a prefill: the same bits."""
    cols, rows = 3 * 256, 13
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(int(qtype)))
    weight = pack_gguf(raw, int(qtype), cols, I8DOT)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(5)) * 2
    alone = torch.cat([pack_gguf(raw[r : r + 1], int(qtype), cols, I8DOT)(x[:1]) for r in range(rows)], dim=1)
    for threads in (1, 2):
        with torch_threads(threads):
            decode, prefill = weight(x[:1]), weight(x)
        assert torch.equal(decode, alone), (decode - alone).abs().max()
        assert torch.equal(prefill[:1], decode)
    _check(weight, raw, qtype, x[:1])


def test_row_blocks_of_both_kernels_multiply_in_one_call(native: None) -> None:
    """A per-type plan on a Q4_K_M file: Q4_K rows on i8dot stacked with Q6_K rows on native, each its own kernel."""
    rng = np.random.default_rng(7)
    q4k = random_blocks(Q.Q4_K, 40, 512, rng)
    q6k = random_blocks(Q.Q6_K, 9, 512, rng)
    both = concat_rows([pack_gguf(q4k, int(Q.Q4_K), 512, I8DOT), pack_gguf(q6k, int(Q.Q6_K), 512, NATIVE)])
    assert both.format.kernel == "i8dot+native" and runs_blocks(both.format.kernel)
    assert both.format.label == "q4_k+q6_k (i8dot+native)"
    x = torch.randn(3, 512)
    got = both(x)
    assert torch.equal(got[:, :40], pack_gguf(q4k, int(Q.Q4_K), 512, I8DOT)(x))
    assert torch.equal(got[:, 40:], pack_gguf(q6k, int(Q.Q6_K), 512, NATIVE)(x))


def test_i8dot_is_listed_first_but_never_taken_unmeasured(native: None) -> None:
    """Fastest known first (a per-type plan takes each type's first kernel the probe admits); --weights stored
    with nothing measured takes the widest kernel that rounds nothing."""
    assert stored_kernels(int(Q.Q4_1))[:2] == (I8DOT, NATIVE) and all_kernels()[0] == I8DOT
    assert widest_kernel({I8DOT: 10, NATIVE: 10, INT4PACK: 10}) == NATIVE
    assert widest_kernel({I8DOT: 10, NATIVE: 0, INT4PACK: 4}) == I8DOT
    assert parse_weights(I8DOT).kernel == I8DOT


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="guard pages through libc mprotect (Linux)")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_no_byte_past_the_matrix_is_read(qtype: Q, native: None) -> None:
    """As the exact kernel's test: W ends where an unreadable page starts; one token and a few, 1 and 2 threads."""
    rows, cols = 301, _columns(qtype)  # enough work that 2 threads split it (PARALLEL_MIN_WORK), 301 % 8 = 5
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(11))
    for weight, x in guarded_products(raw, int(qtype), cols, I8DOT):
        _check(weight, raw, qtype, x)


def test_the_portable_build_computes_the_same_math(portable_build: None) -> None:
    if not native_kernel.available():
        pytest.skip(f"no C build here: {native_kernel.unavailable_reason()}")
    assert not native_kernel.library().avx2
    for qtype in TYPES:
        cols = _columns(qtype)
        raw = random_blocks(qtype, 6, cols, np.random.default_rng(int(qtype)))
        weight = pack_gguf(raw, int(qtype), cols, I8DOT)
        for tokens in (1, 2):
            _check(weight, raw, qtype, torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens)))


def test_the_build_without_vnni_gives_the_same_bits(tmp_path: Path, native: None) -> None:
    """The K-quant kernels' integer dot products are one vpdpbusd with AVX-512 VNNI, maddubs + madd without: the same
    integers, so the library built with -mno-avx512vnni gives every row the same bits (where the compiler takes it)."""
    raws = {qtype: random_blocks(qtype, 9, 512, np.random.default_rng(int(qtype))) for qtype in K_QUANTS}
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(2))
    with_vnni = {qtype: pack_gguf(raw, int(qtype), 512, I8DOT)(x[:1]) for qtype, raw in raws.items()}
    with built_with((("-O3", "-march=native", "-mno-avx512vnni", "-fopenmp"),), tmp_path / "native"):
        if not native_kernel.available():
            pytest.skip(f"no -mno-avx512vnni build here: {native_kernel.unavailable_reason()}")
        for qtype, raw in raws.items():
            assert torch.equal(pack_gguf(raw, int(qtype), 512, I8DOT)(x[:1]), with_vnni[qtype]), qtype.name
