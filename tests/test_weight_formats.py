"""Weights multiplied as GGUF stores them (tracer/model/weight_formats.py), against gguf's own dequantizer.

The reference is `gguf.quants.dequantize` (an independent decoder): the packed values must equal its values (to fp32
rounding of the scale and zero folding), and every kernel's product must equal the product with its matrix."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.weight_formats import (
    BLOCKS,
    I8DOT,
    I16DOT,
    INT4PACK,
    NATIVE,
    PackedWeight,
    concat_rows,
    pack_gguf,
    stored_kernels,
)
from tests.tiny_gguf import random_blocks

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0]
CASES = [(qtype, kernel) for qtype in TYPES for kernel in (NATIVE, INT4PACK, BLOCKS)]  # not stored_kernels: it
# would build the native kernel while collecting, before conftest points its build folder away from the user's


def _reference(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32))


@pytest.mark.parametrize(("qtype", "kernel"), CASES, ids=[f"{q.name}-{k}" for q, k in CASES])
def test_stored_values_and_products_match_ggufs_dequantizer(qtype: Q, kernel: str) -> None:
    if kernel not in stored_kernels(int(qtype)):
        pytest.skip(f"{kernel} does not run here: {native_kernel.unavailable_reason()}")
    rng = np.random.default_rng(int(qtype))
    rows, cols = 48, 512
    raw = random_blocks(qtype, rows, cols, rng)
    weight = pack_gguf(raw, int(qtype), cols, kernel)
    reference = _reference(raw, qtype)  # (48, 512) fp32
    assert weight.shape == (rows, cols) and weight.stored_bytes == raw.nbytes
    assert weight.format.stored == qtype.name and weight.format.kernel == kernel
    # Values: (q-8)*scale + zero in fp32 against d*q + m (or d*sc*q - dmin*m): the same up to fp32 rounding.
    scale = reference.abs().max()
    torch.testing.assert_close(weight.dequantize(), reference, rtol=0, atol=float(scale) * 2**-20)
    # "blocks" and "native" sum in fp32 in another order: within 2^-20 of the sum of |x|*|w| (K = 512 terms).
    # "int4pack" runs in bf16: x and the scales rounded to 8 significant bits, so within 2^-6 of it.
    tolerance = 2**-6 if kernel == INT4PACK else 2**-20
    for tokens in (1, 5):
        x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
        expected = x @ reference.T  # (T, 48)
        bound = float((x.abs() @ reference.abs().T).max()) * tolerance
        torch.testing.assert_close(weight(x), expected, rtol=0, atol=bound)
    one = torch.randn(cols)
    bound = float((one.abs() @ reference.abs().T).max()) * tolerance
    torch.testing.assert_close(weight(one), reference @ one, rtol=0, atol=bound)  # a 1-D token
    # the bf16 activation the model may run in: the kernel's own rounding, same bound
    got = weight(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=float((x.abs() @ reference.abs().T).max()) * 2**-6)


def test_embedding_rows_and_row_blocks() -> None:
    rng = np.random.default_rng(1)
    raw_a, raw_b = random_blocks(Q.Q8_0, 16, 64, rng), random_blocks(Q.Q8_0, 8, 64, rng)
    a, b = pack_gguf(raw_a, int(Q.Q8_0), 64, BLOCKS), pack_gguf(raw_b, int(Q.Q8_0), 64, BLOCKS)
    ids = torch.tensor([[3, 0, 15]])
    torch.testing.assert_close(a.rows(ids, torch.float32), _reference(raw_a, Q.Q8_0)[ids])
    both = concat_rows([a, b])
    assert both.shape == (24, 64) and both.stored_bytes == raw_a.nbytes + raw_b.nbytes
    torch.testing.assert_close(both.dequantize(), torch.cat([_reference(raw_a, Q.Q8_0), _reference(raw_b, Q.Q8_0)]))


def test_rebuilding_from_tensors() -> None:
    raw = random_blocks(Q.Q4_K, 4, 256, np.random.default_rng(2))
    packed = pack_gguf(raw, int(Q.Q4_K), 256, INT4PACK)
    again = PackedWeight.from_tensors(packed.format, packed.shape, dict(packed.tensors), packed.stored_bytes)
    torch.testing.assert_close(again(torch.ones(2, 256)), packed(torch.ones(2, 256)))
    with pytest.raises(ValueError, match="needs tensors"):
        PackedWeight.from_tensors(packed.format, packed.shape, {"nibbles": packed.tensors["nibbles"]}, 0)


def test_types_without_a_stored_kernel() -> None:
    native = (I8DOT, I16DOT, NATIVE) if native_kernel.available() else ()  # the native library's kernels
    assert stored_kernels(int(Q.Q6_K)) == native and stored_kernels(int(Q.F16)) == ()
    assert stored_kernels(int(Q.Q8_0)) == (*native, INT4PACK, BLOCKS)
    assert I16DOT not in stored_kernels(int(Q.Q4_1))  # i16dot: Q8_0 and Q6_K only
    assert stored_kernels(int(Q.Q2_K)) == () and stored_kernels(int(Q.IQ4_XS)) == ()
    assert gguf.GGML_QUANT_SIZES[Q.Q4_K] == (256, 144)
