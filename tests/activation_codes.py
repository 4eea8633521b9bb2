"""The activations rounded to integers per 32 values as the int8 and int16 kernels round them (int8_dot.c's
quantize_x with top 127, int16_dot.c's quantize_x16 with 32767), written from their documented math: the tests'
reference for what those kernels multiply."""

from __future__ import annotations

import numpy as np


def round_activations(x: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, K) fp32 -> (codes (rows, K) int64, scales d (rows, K/32) fp32): per 32 values d = max|x| / top and
    q = round-half-even(x * (top / max|x|)), the quotient and product in fp32; a block whose max|x| is so small that
    top / max|x| overflows fp32 rounded in double (x * top / max|x|), as the kernels do."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)  # (rows, K/32, 1)
    d = amax / np.float32(top)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inverse = np.where(amax != 0, np.float32(top) / amax, np.float32(0)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        codes = np.rint(blocks * inverse)  # fp32 product, then round half to even
    tiny = np.broadcast_to(~np.isfinite(inverse), blocks.shape)  # top / max|x| overflowed: in double
    with np.errstate(divide="ignore", invalid="ignore"):  # the other blocks' quotients are not taken
        codes[tiny] = np.rint(blocks.astype(np.float64) * top / amax.astype(np.float64))[tiny]
    assert np.abs(codes).max() <= top
    return codes.reshape(x.shape).astype(np.int64), d[..., 0]
