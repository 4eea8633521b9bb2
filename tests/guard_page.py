"""Blocks that end where an unreadable page starts, for the kernels' tests that no byte past W is read (Linux: libc
mprotect): a load past the end crashes the process instead of reading what follows; a prefetch never faults."""

from __future__ import annotations

import ctypes
import mmap
import os
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

from llmtrace.tracer.model.weight_formats import PackedWeight, pack_gguf
from tests.torch_threads import torch_threads


@contextmanager
def before_a_guard_page(raw: np.ndarray) -> Iterator[np.ndarray]:
    """A copy of `raw` (uint8 rows) whose last byte is the last before a PROT_NONE page, for the `with` block; the
    caller drops every view of it before the block ends (the page is made writable again so the map can go)."""
    page = mmap.PAGESIZE
    span = -(-raw.nbytes // page) * page
    region = mmap.mmap(-1, span + page)  # the blocks at the end of `span`, then the guard page
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    assert libc.mprotect(base + span, page, 0) == 0, os.strerror(ctypes.get_errno())  # PROT_NONE
    try:
        at_end = np.frombuffer(region, dtype=np.uint8, count=raw.nbytes, offset=span - raw.nbytes)
        at_end[:] = raw.reshape(-1)
        yield at_end.reshape(raw.shape)
    finally:
        libc.mprotect(base + span, page, 3)  # PROT_READ | PROT_WRITE


def guarded_products(raw: np.ndarray, ggml_type: int, cols: int, kernel: str
                     ) -> Iterator[tuple[PackedWeight, torch.Tensor]]:
    """(W, x) for a kernel's no-byte-past-the-end tests: W = `raw` packed for `kernel` in place, ending where an
    unreadable page starts (the kernel reads the guarded bytes themselves), x of one token and of three, each under
    1 and then 2 torch threads, which stay set while the caller multiplies."""
    with before_a_guard_page(raw) as at_end:
        weight = pack_gguf(at_end, ggml_type, cols, kernel)
        assert np.shares_memory(weight.tensors["blocks"].numpy(), at_end)
        for threads in (1, 2):
            for tokens in (1, 3):
                x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
                with torch_threads(threads):
                    yield weight, x
        del weight, at_end
