"""The "i16dot" stored kernel (tracer/model/native/int16_dot.c): Q8_0 and Q6_K blocks times activations rounded to
int16 per 32 values.

Two references, both independent of the C code (gguf's dequantizer gives the weights' values w):
- the SAME math: x quantized here as the kernel describes it (per 32 values d = max|x|/32767, q = round-half-even(
  x * (32767/max|x|)) in fp32), then sum over blocks of d * sum(w * q) in fp64. The kernel's integer sums are exact
  and each block (Q6_K: each 16 values) adds one fp32 multiply-add of (d_w * d_x) and the sum, so the fp32 rounding
  is within 2^-20 of
  sum over blocks of d_x * sum|w * q| (2^-24 would be one rounding; 2^4 leaves room for ~20 rounded additions).
- the exact product x @ w.T: the kernel's result differs by the rounding of x, at most d/2 per value, so
  |y - x @ w.T| <= sum over blocks of d/2 * sum|w| (plus fp32 summation, 2^-20 of sum |x||w|): the docstring's bound.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.load.stored_weights import (
    STORED,
    all_kernels,
    kernel_plan,
    parse_weights,
    plan_spec,
    widest_kernel,
)
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.weight_formats import (
    I8DOT,
    I16DOT,
    NATIVE,
    concat_rows,
    gguf_format,
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
SAME_MATH_TOLERANCE = 2**-20
SUM_TOLERANCE = 2**-20
TYPES = [Q.Q8_0, Q.Q6_K]


@pytest.fixture
def native() -> None:
    if not native_kernel.available():
        pytest.skip(f"native kernel not available here: {native_kernel.unavailable_reason()}")


def _columns(qtype: Q) -> int:
    return 7 * 32 if qtype == Q.Q8_0 else 2 * 256


def check(weight, raw: np.ndarray, x: torch.Tensor, qtype: Q = Q.Q8_0) -> np.ndarray:  # noqa: ANN001
    """The kernel's product against both references (module docstring); returns |y - x @ w.T|."""
    values = np.asarray(gguf_dequantize(raw, qtype), dtype=np.float64)  # (N, K)
    got = weight(x).double().numpy()
    codes, d = round_activations(x.numpy(), 32767)
    wb = values.reshape(values.shape[0], -1, 32)  # (N, K/32, 32)
    qb = codes.reshape(codes.shape[0], -1, 32).astype(np.float64)  # (rows, K/32, 32)
    same = np.einsum("rb,nbl,rbl->rn", d.astype(np.float64), wb, qb)
    same_bound = np.einsum("rb,nbl,rbl->rn", d.astype(np.float64), np.abs(wb), np.abs(qb)) * SAME_MATH_TOLERANCE
    assert (np.abs(got - same) <= same_bound).all(), float((np.abs(got - same) / same_bound).max())
    xd = x.double().numpy()
    exact = xd @ values.T
    bound = 0.5 * d.astype(np.float64) @ np.abs(wb).sum(axis=2).T + np.abs(xd) @ np.abs(values).T * SUM_TOLERANCE
    assert (np.abs(got - exact) <= bound).all(), float((np.abs(got - exact) / bound).max())
    return np.abs(got - exact)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_products_are_the_int16_math_and_within_the_rounding_bound(qtype: Q, native: None) -> None:
    rng = np.random.default_rng(16)
    rows, cols = 37, _columns(qtype)  # 37 rows: groups of eight (Q8_0) or four (Q6_K), the rest alone; an odd split
    raw = random_blocks(qtype, rows, cols, rng)
    weight = pack_gguf(raw, int(qtype), cols, I16DOT)
    assert weight.format.kernel == I16DOT and weight.format.label == f"{qtype.name.lower()} (i16dot)"
    assert weight.stored_bytes == raw.nbytes and np.shares_memory(weight.tensors["blocks"].numpy(), raw)
    values = np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32)
    assert np.array_equal(weight.dequantize().numpy(), values)  # only products round the activations
    i8 = pack_gguf(raw, int(qtype), cols, I8DOT)
    for tokens in (1, 3, 17):  # one token (decode), a few, a prefill
        x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens)) * 3
        x[0, :32] = 0.0  # an all-zero block: d = 0, no division by zero
        x[-1, 64:96] *= 1e-36  # a block whose 32767 / max|x| overflows fp32: rounded in double
        error = check(weight, raw, x, qtype)
        # two orders of magnitude closer than i8dot (258x in the bound)
        i8_error = np.abs(i8(x).double().numpy() - x.double().numpy() @ values.astype(np.float64).T)
        assert np.linalg.norm(error) * 100 < np.linalg.norm(i8_error)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_the_probe_s_criterion_admits_it_where_it_refuses_i8dot(qtype: Q, native: None) -> None:
    """kernel_choice's probe on random blocks: relative product error over 4 standard-normal rows against the fp64
    product of the exact values, within 2^-required_bits (Q8_0 11, Q6_K 9) for i16dot (measured ~2e-5), over it for
    i8dot (~5e-3)."""
    from llmtrace.tracer.hardware import kernel_choice as rule

    cols = _columns(qtype)
    raw = random_blocks(qtype, 256, cols, np.random.default_rng(0))
    exact = torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype), dtype=np.float64))
    x = torch.randn(rule.PROBE_ROWS, cols, generator=torch.Generator().manual_seed(0))
    reference = x.double() @ exact.T

    def error(kernel: str) -> float:
        return float((pack_gguf(raw, int(qtype), cols, kernel)(x).double() - reference).norm() / reference.norm())

    assert error(I16DOT) <= rule.tolerance(qtype.name) / 16 and error(I8DOT) > rule.tolerance(qtype.name)
    assert rule.judge(I16DOT, None, [qtype.name], {qtype.name: error(I16DOT)}) == (True, "")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_a_nan_or_infinite_activation_is_not_rounded_away(qtype: Q, native: None) -> None:
    cols = _columns(qtype)
    raw = random_blocks(qtype, 11, cols, np.random.default_rng(1))
    weight = pack_gguf(raw, int(qtype), cols, I16DOT)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(2, cols)
        x[1, 70] = bad
        y = weight(x)
        assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()
        assert torch.isnan(weight(x[1:])).all()  # the one-row kernel too


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_rows_together_alone_threads_and_prefill_give_the_same_bits(qtype: Q, native: None) -> None:
    """Decode takes a thread's rows eight (Q8_0) or four (Q6_K) at a time and the rest one by one; prefill takes
    tiles of 2 x 4 (Q8_0) or each row alone (Q6_K): a row's value must depend on none of it. 203 rows (1 and 2
    threads: different splits; enough work that 2 threads do split it, gguf_matmul.c's PARALLEL_MIN_WORK) against
    each row as its own matrix."""
    rows, cols = 203, 576 if qtype == Q.Q8_0 else 3 * 256
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(45))
    weight = pack_gguf(raw, int(qtype), cols, I16DOT)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(5)) * 2
    alone = torch.cat([pack_gguf(raw[r : r + 1], int(qtype), cols, I16DOT)(x[:1]) for r in range(rows)], dim=1)
    for threads in (1, 2):
        with torch_threads(threads):
            decode, prefill, last = weight(x[:1]), weight(x), weight(x[2:])
        assert torch.equal(decode, alone), (decode - alone).abs().max()
        assert torch.equal(prefill[:1], decode) and torch.equal(prefill[2:], last)
    check(weight, raw, x, qtype)


def test_row_blocks_of_three_kernels_multiply_in_one_call(native: None) -> None:
    """Q4_1 rows on i8dot, Q8_0 rows on i16dot and on native stacked: each row block keeps its own kernel."""
    rng = np.random.default_rng(7)
    q41, q80 = random_blocks(Q.Q4_1, 20, 256, rng), random_blocks(Q.Q8_0, 12, 256, rng)
    members = [pack_gguf(q41, int(Q.Q4_1), 256, I8DOT), pack_gguf(q80, int(Q.Q8_0), 256, I16DOT),
               pack_gguf(q80, int(Q.Q8_0), 256, NATIVE)]
    stacked = concat_rows(members)
    assert stacked.format.kernel == "i8dot+i16dot+native" and runs_blocks(stacked.format.kernel)
    x = torch.randn(2, 256)
    got = stacked(x)
    assert torch.equal(got, torch.cat([m(x) for m in members], dim=1))
    assert not torch.equal(got[:, 20:32], got[:, 32:])  # int16 activations are not the exact kernel's


def test_only_q8_0_and_q6_k_take_int16_activations(native: None) -> None:
    raw = random_blocks(Q.Q4_1, 4, 64, np.random.default_rng(2))
    with pytest.raises(ValueError, match="no activation kind"):
        native_kernel.BlockMatrix([(int(Q.Q4_1), torch.from_numpy(raw))], 64, (native_kernel.INT16_X,))
    with pytest.raises(ValueError, match="no 'i16dot' kernel"):
        gguf_format(int(Q.Q4_1), I16DOT)
    lib = native_kernel.library()  # the C side refuses it too (BAD_TYPE), whatever Python checks
    described = ctypes.create_string_buffer(lib.matrix_size)
    status = lib.describe(1, (ctypes.c_int * 1)(int(Q.Q4_1)), (ctypes.c_void_p * 1)(raw.ctypes.data),
                          (ctypes.c_int64 * 1)(raw.shape[1]), (ctypes.c_int64 * 1)(4), 64,
                          (ctypes.c_int * 1)(native_kernel.INT16_X), described)
    assert status == 1


def test_listed_for_q8_0_and_q6_k_between_i8dot_and_native_and_never_taken_unmeasured(native: None) -> None:
    assert stored_kernels(int(Q.Q8_0))[:3] == (I8DOT, I16DOT, NATIVE) == stored_kernels(int(Q.Q6_K))
    assert I16DOT not in stored_kernels(int(Q.Q4_1)) and I16DOT not in stored_kernels(int(Q.Q4_K))
    assert all_kernels()[:3] == (I8DOT, I16DOT, NATIVE)
    assert widest_kernel({I8DOT: 10, I16DOT: 10, NATIVE: 10}) == NATIVE
    assert widest_kernel({I8DOT: 10, I16DOT: 3, NATIVE: 0}) == I8DOT
    assert parse_weights(I16DOT).kernel == I16DOT
    spec = "Q4_1:i8dot,Q8_0:i16dot"
    assert parse_weights(spec).kernel == spec
    assert kernel_plan(spec) == {"Q4_1": I8DOT, "Q8_0": I16DOT} and plan_spec(kernel_plan(spec)) == spec


def test_weights_i16dot_on_a_q4_file_says_which_matrices_run_dequantized(
        native: None, tiny_quantized: Callable[..., Path]) -> None:
    """`--weights i16dot` on the bundled model's mix (Q4_1 layers, a Q8_0 head): the head runs as stored on i16dot,
    the Q4_1 matrices, which it has no kernel for, dequantized, and the run's weights line says so."""
    loaded = load_model(str(tiny_quantized(Q.Q4_1, head=Q.Q8_0)), FP32, weights=I16DOT, use_cache=False)
    assert loaded.weights.mode == STORED
    kernels = {name: w.format.kernel for name, w in loaded.model.stored_weights().items()}
    assert kernels == {"output": I16DOT}  # the head (untied): as stored; every Q4_1 matrix dense
    q4_1 = 2 * 7 + 1  # the tiny model's 2 layers of 7 Q4_1 matrices, and its Q4_1 embedding table
    assert loaded.weights.reason == f"--weights i16dot; {q4_1} matrices of type Q4_1 have no i16dot kernel and " \
                                    "run dequantized"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="guard pages through libc mprotect (Linux)")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_no_byte_past_the_matrix_is_read(qtype: Q, native: None) -> None:
    """W ends where an unreadable page starts; one token and a few, 1 and 2 threads (the eight-row kernel's
    prefetches run past the end: a prefetch never faults, a load would)."""
    rows, cols = 301, _columns(qtype)  # enough work that 2 threads split it (PARALLEL_MIN_WORK), 301 % 8 = 5
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(11))
    for weight, x in guarded_products(raw, int(qtype), cols, I16DOT):
        check(weight, raw, x, qtype)


def test_the_portable_build_computes_the_same_math(portable_build: None) -> None:
    if not native_kernel.available():
        pytest.skip(f"no C build here: {native_kernel.unavailable_reason()}")
    assert not native_kernel.library().avx2
    for qtype in TYPES:
        raw = random_blocks(qtype, 10, _columns(qtype), np.random.default_rng(8))
        weight = pack_gguf(raw, int(qtype), _columns(qtype), I16DOT)
        for tokens in (1, 2):
            check(weight, raw, torch.randn(tokens, _columns(qtype), generator=torch.Generator().manual_seed(tokens)),
                  qtype)


def test_the_portable_build_gives_the_avx2_build_s_bits(tmp_path: Path, native: None) -> None:
    """int16_dot.c's portable loops add the same fp32 terms in the same order as its AVX2 kernels (the integer sums
    are exact, so only the float order can differ): built both ways, every product is the same bits. Random shapes
    (decode rows in fours or eights and alone, prefill tiles, a few columns to many) and activations whose blocks
    span 1e-4..1e4, with all-zero blocks and blocks whose 32767 / max|x| overflows fp32, so a sum in another order
    would round differently somewhere."""
    if not native_kernel.library().avx2:
        pytest.skip("the session's build is the portable one: nothing to compare it with")
    rng = np.random.default_rng(1616)
    cases = []
    for trial in range(80):
        qtype = TYPES[trial % 2]
        cols = int(rng.integers(1, 7)) * 256 if qtype == Q.Q6_K else int(rng.integers(1, 41)) * 32
        rows, tokens = int(rng.integers(1, 40)), int(rng.integers(1, 6))
        x = rng.standard_normal((tokens, cols // 32, 32)) * np.exp(rng.uniform(-9, 9, (tokens, cols // 32, 1)))
        x[rng.random((tokens, cols // 32)) < 0.05] = 0.0
        x[rng.random((tokens, cols // 32)) < 0.05] *= 1e-40
        cases.append((qtype, random_blocks(qtype, rows, cols, rng), torch.from_numpy(x.reshape(tokens, cols)).float()))

    def products() -> list[torch.Tensor]:
        return [pack_gguf(raw, int(qtype), x.shape[1], I16DOT)(x) for qtype, raw, x in cases]

    avx2 = products()
    with built_with(PORTABLE_FLAGS, tmp_path / "native"):
        assert not native_kernel.library().avx2
        portable = products()
    for (qtype, raw, x), a, p in zip(cases, avx2, portable, strict=True):
        assert torch.equal(a, p), (qtype.name, raw.shape, tuple(x.shape), float((a - p).abs().max()))
    assert all(torch.isfinite(a).all() for a in avx2)  # every case compared numbers, not NaN against NaN
