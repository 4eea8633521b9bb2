"""The sampler's top-value selection in one C pass (native/top_values.c), when the native library is loaded.

The sampler (tracer/run/sampling.py) sorts the best few logits for its candidate table (and top-k); after a decode
step every numpy call it makes is cold, and its numpy selection is ~8 of them. This is one ctypes call with the same
answer: the indices of the `count` largest values, largest first, ties by lower index. It never builds or loads the
library (native_kernel.loaded()): a process that has not loaded it gets None, and the caller selects in numpy.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from llmtrace.tracer.model import native_kernel

MAX_COUNT = 64  # LLMT_TOP_MAX in native/top_values.c
_DECLARED: dict[Any, Any] = {}  # by library file: the entry point with its signature declared


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
    written = call(x.__array_interface__["data"][0], x.shape[0], count, ids.__array_interface__["data"][0])
    return ids if written == ids.shape[0] else None  # -1: a NaN (the caller's numpy max says so)
