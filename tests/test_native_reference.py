"""Every vector kernel of the native library held to its plain scalar reference (llmt_matmul_reference: kernels.h),
on every build: the session's (-march=native: AVX2 and, on this CPU, AVX-512 VNNI), one without AVX-512 (the AVX2
kernels alone) and the portable one (no AVX2: the references are what it runs).

What each comparison may differ by, and why:
- i16dot (Q8_0, Q6_K): nothing. Its integer sums are exact and its references add the same fp32 terms in the same
  order as the vector kernels (int16_dot.c), so every product is the same bits.
- exact ("native") and i8dot: the vector kernels add the same terms in another order (and the exact ones another
  algebra: d * sum(x*q) + m * sum(x) for sum x*(d*q + m)). Each result is within gamma_n (n roundings on the way,
  n <= K + 16 here; gamma_n ~ n * 2^-24, Higham) of the exact sum of the terms, relative to the sum of the terms'
  sizes (the reference's `magnitude`), so the two are within 2 * gamma_n of each other: (K + 16) * 2^-23 * magnitude.
- in the portable build, nothing for any kernel: llmt_matmul runs the references themselves.
The reference's exact products are in turn held to x @ gguf's own dequantized values in fp64 (an independent
decoder), within 2^-20 of sum |x||w| as test_native_kernel holds the kernels.
"""

from __future__ import annotations

import ctypes
from contextlib import nullcontext
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from llmtrace.tracer.model import native_kernel
from tests.native_builds import PORTABLE_FLAGS, built_with
from tests.tiny_gguf import random_blocks

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
KINDS = {"exact": native_kernel.EXACT_X, "i8dot": native_kernel.INT8_X, "i16dot": native_kernel.INT16_X}
BUILDS = {  # name: the flag sets it is built with (None: the session's own build)
    "native": None,
    "no AVX-512": (("-O3", "-march=native", "-mno-avx512f", "-fopenmp"),),
    "portable": PORTABLE_FLAGS,
}
ROWS = 37  # an odd split between two threads, two whole groups of sixteen and a rest
SUM_TOLERANCE = 2**-20


def _columns(qtype: Q) -> int:
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return 7 * 32 if block == 32 else 2 * 256


def _cases() -> list[tuple[Q, str]]:
    return [(qtype, kind) for qtype in TYPES for kind in KINDS
            if kind != "i16dot" or qtype in (Q.Q8_0, Q.Q6_K)]


def _activations(tokens: int, cols: int, seed: int) -> torch.Tensor:
    """Blocks of 32 spanning 1e-3..1e3 in size, one all zero: rows whose sums round differently in another order."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, cols // 32, 32)) * np.exp(rng.uniform(-7, 7, (tokens, cols // 32, 1)))
    x[0, 0] = 0.0
    return torch.from_numpy(x.reshape(tokens, cols)).float()


def _reference(matrix: native_kernel.BlockMatrix, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    call = native_kernel.library().handle.llmt_matmul_reference
    call.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    call.restype = ctypes.c_int
    out = torch.empty(x.shape[0], matrix.rows, dtype=torch.float32)
    magnitude = torch.empty(x.shape[0], matrix.rows, dtype=torch.float64)
    assert call(matrix.address, x.data_ptr(), x.shape[0], out.data_ptr(), magnitude.data_ptr()) == 0
    return out, magnitude


def _matrix(qtype: Q, kind: str, raw: np.ndarray) -> native_kernel.BlockMatrix:
    """The rows as one part of `kind`; an i8dot Q4_0/Q4_1 part with its rows interleaved in sixteens too (the decode
    products read those)."""
    cols = _columns(qtype)
    blocks = torch.from_numpy(raw)
    groups = None
    if kind == "i8dot" and int(qtype) in native_kernel.GROUPED_TYPES:
        groups = (native_kernel.interleave(int(qtype), blocks, cols),)
    return native_kernel.BlockMatrix([(int(qtype), blocks)], cols, (KINDS[kind],), groups)


@pytest.fixture(scope="module", params=list(BUILDS))
def build(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    name = request.param
    flags = BUILDS[name]
    context = nullcontext() if flags is None else built_with(flags, tmp_path_factory.mktemp("native"))
    with context:
        if not native_kernel.available():
            pytest.skip(f"no {name} build here: {native_kernel.unavailable_reason()}")
        if name != "portable" and not native_kernel.library().avx2:
            pytest.skip(f"-march=native has no AVX2 here: the {name} build is the portable one")
        yield name


@pytest.mark.parametrize(("qtype", "kind"), _cases(), ids=lambda c: c.name if isinstance(c, Q) else c)
def test_each_vector_kernel_is_its_scalar_reference(build: str, qtype: Q, kind: str) -> None:
    cols = _columns(qtype)
    raw = random_blocks(qtype, ROWS, cols, np.random.default_rng(300 + int(qtype)))
    matrix = _matrix(qtype, kind, raw)
    for tokens in (1, 2, 5):  # one token (the decode kernels), prefill tiles and their padding
        x = _activations(tokens, cols, tokens)
        got = native_kernel.matmul(matrix, x)
        want, magnitude = _reference(matrix, x)
        assert torch.isfinite(want).all() and (magnitude > 0).all()
        if build == "portable" or kind == "i16dot":
            assert torch.equal(got, want), float((got - want).abs().max())
        else:
            bound = (cols + 16) * 2**-23 * magnitude
            assert ((got.double() - want.double()).abs() <= bound).all(), \
                float(((got.double() - want.double()).abs() / bound).max())
        if kind == "exact":
            values = np.asarray(gguf_dequantize(raw, qtype), dtype=np.float64)
            exact = x.double().numpy() @ values.T
            size = np.abs(x.double().numpy()) @ np.abs(values).T
            assert (np.abs(want.double().numpy() - exact) <= SUM_TOLERANCE * size).all()


def test_the_reference_and_its_magnitude_on_an_exact_row(build: str) -> None:
    """A Q8_0 row of codes j - 16 at d = 1 times x = 1..32: every product and sum an exact integer, so the reference,
    the kernel and the magnitude (sum |x| |w| here: Q8_0 has no offset) are the integers themselves."""
    block = np.concatenate([np.frombuffer(np.float16(1).tobytes(), np.uint8),
                            (np.arange(32) - 16).astype(np.int8).view(np.uint8)])
    matrix = native_kernel.BlockMatrix([(int(Q.Q8_0), torch.from_numpy(np.tile(block, (3, 1))))], 32)
    x = torch.arange(1, 33, dtype=torch.float32)[None]
    reference, magnitude = _reference(matrix, x)
    assert reference.tolist() == [[float(sum((j - 16) * (j + 1) for j in range(32)))] * 3]
    assert magnitude.tolist() == [[float(sum(abs(j - 16) * (j + 1) for j in range(32)))] * 3]
    assert torch.equal(native_kernel.matmul(matrix, x), reference)
