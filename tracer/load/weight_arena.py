"""One block of anonymous memory, advised for transparent huge pages, that a GGUF's stored matrices are copied into
where they are rearranged (Q/K rows in HF's order, i8dot's interleaved Q4_0/Q4_1) or a weights cache entry is written;
blocks the kernels read as the file stores them are held in the file's map instead (tracer/load/file_map.py).

Why: the native kernels read a GGUF's blocks as they are, and a decode step streams every matrix once (~100 MB on
the bundled model, ~120 products). Left as views of the memory-mapped file they lie in 4 KiB pages: every 4 KiB of
the stream needs its own TLB entry (a two-dimensional page walk under a virtual machine's nested paging) and the
hardware prefetchers stop at each page boundary. Copied into 2 MiB pages they do not. Measured on an AVX2 EPYC VM
(BENCHMARKS.md "Huge pages"): a C loop reading a step's 96 MB in the step's pattern 15.9 -> 17.8 GB/s median; the
bundled model's decode step 4-7 % faster. The copy costs one pass over the matrices at load.

Fresh pages cost more than the copy. The first write to each page of a new arena faults it in: the kernel finds and
zeroes a 2 MiB page (compacting or reclaiming the page cache when free memory is short), and under a virtual
machine the host may back the guest's page too. Measured at 7B (BENCHMARKS, issue 31), 3.6 GB of such pages took
6-17 s of a load that is ~1 s of copying on touched pages. `populating()` faults the arena in from its far end on a
second thread (madvise MADV_POPULATE_WRITE, Linux 5.14+: tracer/load/mapped_pages.py) while the loader fills it from the front: the faults of
the two halves run at once on two cores, and the loader's writes meet pages already there.

`madvise(MADV_HUGEPAGE)` is advice: where transparent huge pages are off ("never") or the platform has no such call,
the arena is plain anonymous memory and only the copy is paid. The matrices are placed one after another, each at a
cache-line boundary, from the first 2 MiB boundary of the mapping (THP backs only whole, aligned 2 MiB ranges).
"""

from __future__ import annotations

import mmap
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from llmtrace.tracer.load.mapped_pages import MADV_POPULATE_WRITE, populating_backwards

HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB granule) transparent huge page
ALIGN = 64  # each matrix starts on a cache line


class WeightArena:
    """Room for `nbytes` of matrices (plus each one's alignment); `place` copies one in and returns the copy."""

    def __init__(self, nbytes: int, matrices: int = 1) -> None:
        size = (nbytes + matrices * ALIGN + 2 * HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        self.advised = False
        self._map: mmap.mmap | None = None
        if hasattr(mmap, "MAP_ANONYMOUS"):
            # private, not shared: shared anonymous memory is shmem, whose huge pages a separate setting governs
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            advice = getattr(mmap, "MADV_HUGEPAGE", None)
            if advice is not None:
                try:
                    self._map.madvise(advice)
                    self.advised = True
                except OSError:  # THP compiled out: plain pages
                    pass
            self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        else:  # no anonymous mmap (Windows): ordinary memory
            self._bytes = np.empty(size, dtype=np.uint8)
        self._next = (-self._bytes.ctypes.data) % HUGE_PAGE
        self._start = self._next
        self.capacity = size
        self.populated = 0  # bytes populating() faulted in (0 where the kernel has no MADV_POPULATE_WRITE)

    @property
    def free(self) -> int:
        """Bytes left after the last placed matrix (the next one starts at the next cache line)."""
        return self._bytes.shape[0] - self._next

    def place(self, rows: np.ndarray) -> np.ndarray:
        """A copy of `rows` (C-contiguous, any shape) in the arena: writable, sharing the arena's lifetime."""
        view = self.take(rows.nbytes).view(rows.dtype).reshape(rows.shape)
        view[...] = rows
        return view

    def take(self, nbytes: int) -> np.ndarray:
        """The next `nbytes` of the arena (uint8, contents undefined) for the caller to fill: a matrix in another
        layout than the file's (the i8dot kernel's interleaved rows)."""
        start = self._next + (-self._next) % ALIGN
        end = start + nbytes
        if end > self._bytes.shape[0]:
            raise ValueError(f"weight arena full: {nbytes} bytes do not fit after {start} of {self.capacity}")
        self._next = end
        return self._bytes[start:end]

    @contextmanager
    def populating(self) -> Iterator[None]:
        """For the block: a second thread faults the taken part of the arena in, from its end backwards, while the
        caller writes it from the front (the module's docstring says why; mapped_pages.populating_backwards how).
        Contents are never changed: a page already there is left as it is."""
        if self._map is None or self._next <= self._start:
            yield
            return
        base = self._bytes.ctypes.data + self._start  # a 2 MiB boundary
        with populating_backwards([(base, self._next - self._start)], MADV_POPULATE_WRITE) as done:
            yield
        self.populated += done.bytes
