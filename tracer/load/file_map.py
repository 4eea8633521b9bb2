"""A GGUF's stored blocks read in place from a private map of the file, where a kernel reads them as they lie.

Why. The native library's kernels (native, i16dot, and i8dot on every type but Q4_0/Q4_1, whose rows it interleaves)
read a matrix's blocks exactly as the file stores them. Copying them into the weight arena
(tracer/load/weight_arena.py) costs a fresh page for every 4 KiB or 2 MiB of the model: at 7B Q8_0, 7 GB of
first-touch faults, 10-22 s of a load that llama.cpp, which maps the file and copies nothing, does in 0.3-1.7 s
(BENCHMARKS.md, issue 31). Mapped, the blocks are the page cache's own pages: no copy, nothing zeroed, and two runs
of one file share them. What must be rearranged (Q/K rows that llama.cpp permuted: the model holds HF's order;
i8dot's interleaved Q4_0/Q4_1) is written from the map into the weight arena in one pass (gguf_loader._hold_mapped),
its pages then dropped from this process's RSS (`release`: the page cache keeps them), so they are not counted
twice. Read with pread instead: 3-D expert tensors, and everything when the load writes a weights cache entry (that
pass hashes what it reads: tracer/load/gguf_source.py).

The map is MAP_PRIVATE (copy-on-write): nothing written to it can reach the file; nothing writes to it. While the
loader checks the held blocks' scales from the front (which touches each page), a second thread faults their
ranges in from the back (MADV_POPULATE_READ, Linux 5.14+: tracer/load/mapped_pages.py), as the arena's populating
thread does for its copies.

A file that changes under the run. The load is still checked as before: the descriptor's identity before and after
(gguf_source.GGUFSource), so a file rewritten or truncated while it loads is refused in one line. After the load,
a file rewritten in place changes the mapped weights (as it does llama.cpp's), and a truncated one raises SIGBUS at
the next touch of a page past its new end: the native library's handler (native/mapped_file.c) turns that into one
line naming the file and exit status 2, where the process would otherwise die silently (exit 135).
"""

from __future__ import annotations

import mmap
import weakref
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

from llmtrace.tracer.load.gguf_source import OpenedFile, changed
from llmtrace.tracer.load.mapped_pages import MADV_POPULATE_READ, populating_backwards, release
from llmtrace.tracer.model import native_kernel



class FileMap:
    """A private map of an opened file, its SIGBUS guarded (the module's docstring says why)."""

    def __init__(self, source: OpenedFile) -> None:
        self._map = mmap.mmap(source.fd, source.size, access=mmap.ACCESS_COPY)
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.address = self.bytes.ctypes.data
        handle = native_kernel.library().handle
        guard, unguard = handle.llmt_guard_map, handle.llmt_unguard_map
        path = "".join(c if c.isprintable() else "?" for c in str(source.path))
        line = f"llmtrace: error: {changed(path)}\n".encode("utf-8", "replace")
        self.guarded = guard(self.address, source.size, line) == 0
        if self.guarded:  # forgotten when the map goes (the last view of it dropped): its range may be reused
            weakref.finalize(self._map, unguard, self.address)

    def view(self, start: int, nbytes: int) -> np.ndarray:
        """Bytes [start, start + nbytes) of the file, in place (uint8, writable only as a private copy would be)."""
        return self.bytes[start:start + nbytes]

    def release(self, start: int, nbytes: int) -> None:
        """Drop bytes [start, start + nbytes) of the file, copied out and never read here again, from this process's
        resident memory (mapped_pages.release; the page cache keeps them, the map stays valid)."""
        release(self._map, start, nbytes)

    @contextmanager
    def populating(self, ranges: Sequence[tuple[int, int]]) -> Iterator[None]:
        """For the block: a second thread faults `ranges` ((start, nbytes) of the file) in, the last first, while the
        caller reads them from the first (mapped_pages.populating_backwards); where the call is missing or fails (a
        file that shrank) the caller's reads fault the pages in instead."""
        with populating_backwards([(self.address + start, nbytes) for start, nbytes in ranges], MADV_POPULATE_READ):
            yield
