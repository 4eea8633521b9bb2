"""A GGUF file opened once for a load: its header, the bytes converted and the cache key all come through one
descriptor, and the file is checked to be the one its header was read from.

Why one descriptor. The header is parsed when the model is resolved; the tensors are read seconds (or, during a
first run's kernel measurement, minutes) later. A file renamed over meanwhile would otherwise be converted with the
old file's header and cached under the new file's key, for good. Opened here, the descriptor stays on one inode
whatever is renamed over the path; its fstat must equal the header's (tracer/checkpoint/gguf_header.py records it)
and its first data_offset bytes must hash to what the header was parsed from, else the load is refused in one line.
A file rewritten in place changes its ctime, which the fstat after the reads sees.

Why pread into private buffers, not a memory map. Pages of a map whose file shrinks raise SIGBUS when touched: the
process dies (exit 135) with no message, and no check before a read closes the window (the file can shrink between
the check and the touch). A pread of a shrunk file is merely short, which is one line here, exit 2. The cost: a
copy of each tensor's bytes into memory the process owns. Converted tensors (dequantized, packed for torch's
kernels) were copied out of the map anyway and the copy of the source lives only while its tensor is converted (at
most one tensor: ~0.3 GB for a 128k-vocabulary Q6_K embedding). The C library's kernels read most blocks as the
file stores them: those are held in place in a private map of the file after all (tracer/load/file_map.py: a 7 GB
copy into fresh pages was most of a 7B load), where the library's SIGBUS handler turns a truncation into this
module's one line; what must be rearranged (Q/K rows, i8dot's interleaved Q4_0/Q4_1) is written from that map into
the weight arena in one pass (gguf_loader._hold_mapped). Where no guarded map can be used (a pass that hashes the file
for a cache entry, a --tp shard, 3-D expert tensors), it is read with pread, piece by piece through one scratch
buffer (gguf_loader._read_held). pread from the page cache runs at memcpy speed (BENCHMARKS.md "Weights cache
checks" times a first load before and after).

The key from what was read. `reads()` hashes the whole file in order as the tensors are read (gaps between them,
header and tail included), so on a cache miss the entry is stored under the XXH3-128 of the bytes it was converted
from, which must equal the key it was looked up under: a file changed in between is refused, never cached.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Protocol, Self

import numpy as np
import xxhash

from llmtrace.tracer.checkpoint.gguf_header import GGUFHeader
from llmtrace.tracer.core.errors import FileFormatError

_CHUNK = 16 * 2**20  # gaps and whole-file hashes are read in pieces of this size


def identity_of(st: os.stat_result) -> tuple[int, ...]:
    """What names one version of a file: (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def changed(path: str | Path) -> FileFormatError:
    return FileFormatError(f"{path}: the file changed while llmtrace read it (replaced, rewritten or truncated by "
                           "another program); nothing was cached: run again once it is complete")


class OpenedFile:
    """A file opened once (read-only, never blocking on a FIFO), a regular one, with its identity at the open.
    Use as a context manager (closes the descriptor)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise FileFormatError(f"{self.path}: cannot open ({exc.strerror or exc}); check the file") from None
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                raise FileFormatError(f"{self.path}: not a regular file; pass a .gguf file")
            self.identity = identity_of(st)
            self.size = st.st_size
        except BaseException:
            os.close(self.fd)
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read(self, start: int, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """Bytes [start, start + n) of the file in `out` (n contiguous uint8, e.g. a matrix's room in the weight
        arena) or a new writable uint8 array; FileFormatError when the file ends sooner (it was truncated after its
        header was read)."""
        out = np.empty(n, dtype=np.uint8) if out is None else out.reshape(-1).view(np.uint8)
        if out.shape[0] != n:
            raise ValueError(f"a read of {n} bytes into {out.shape[0]}")
        view, got = memoryview(out), 0
        try:
            while got < n:
                k = os.preadv(self.fd, [view[got:]], start + got)
                if k <= 0:
                    raise changed(self.path)
                got += k
        except OSError as exc:
            raise FileFormatError(f"{self.path}: cannot read ({exc.strerror or exc}); check the file") from None
        finally:
            view.release()
        return out

    def now(self) -> tuple[int, ...]:
        """The file's identity now, through the descriptor."""
        return identity_of(os.fstat(self.fd))

    def check_unchanged(self) -> None:
        """FileFormatError unless the file still has the identity it was opened with (no write since)."""
        if self.now() != self.identity:
            raise changed(self.path)

    def hash_file(self) -> str:
        """XXH3-128 of the whole file, read through the descriptor (hex)."""
        h = xxhash.xxh3_128()
        for begin in range(0, self.size, _CHUNK):
            h.update(self.read(begin, min(_CHUNK, self.size - begin)))
        return h.hexdigest()


class GGUFSource(OpenedFile):
    """A GGUF file opened for a load and checked against the header it was parsed into: the same identity, and its
    first data_offset bytes hash to the header's (else the file changed since: FileFormatError, one line)."""

    def __init__(self, header: GGUFHeader) -> None:
        super().__init__(header.path)
        self.header = header
        try:
            if header.identity and self.identity != header.identity:
                raise changed(self.path)
            # the bytes the header was parsed from (a corrupt file's data_offset may lie past its end)
            head = self.read(0, min(header.data_offset, self.size))
            if header.header_xxh3 and xxhash.xxh3_128_hexdigest(head) != header.header_xxh3:
                raise changed(self.path)
        except BaseException:
            self.close()
            raise

    def reads(self) -> TensorReads:
        """A pass that reads tensors and hashes the whole file in the order they are read."""
        return TensorReads(self)


class Reader(Protocol):
    """What the GGUF loader reads tensors through: a GGUFSource, or a TensorReads pass over one."""

    def read(self, start: int, n: int, out: np.ndarray | None = None) -> np.ndarray: ...


class TensorReads:
    """Tensor reads through one OpenedFile that also hash the file: every byte before a read that was not hashed yet
    (the header, padding, tensors not converted) is hashed before it, so reads in the file's order hash the whole
    file once `digest()` adds the tail. A read that goes back before what was hashed (out of order, or overlapping
    another tensor) leaves no digest: the bytes hashed would not all be the bytes converted."""

    def __init__(self, source: OpenedFile) -> None:
        self.source = source
        self._hash = xxhash.xxh3_128()
        self._hashed_to = 0
        self._in_order = True

    def read(self, start: int, n: int, out: np.ndarray | None = None) -> np.ndarray:
        if start < self._hashed_to:
            self._in_order = False
        elif self._in_order:
            self._hash_until(start)
        out = self.source.read(start, n, out)
        if self._in_order:
            self._hash.update(out)
            self._hashed_to = start + n
        return out

    def _hash_until(self, end: int) -> None:
        while self._hashed_to < end:
            piece = self.source.read(self._hashed_to, min(_CHUNK, end - self._hashed_to))
            self._hash.update(piece)
            self._hashed_to += piece.shape[0]

    def digest(self) -> str | None:
        """XXH3-128 of the whole file as read in this pass, None when it was not read in order."""
        if not self._in_order:
            return None
        self._hash_until(self.source.size)
        return self._hash.hexdigest()

    def confirm(self, digest: str) -> bool:
        """Whether what this pass read is the file whose XXH3-128 is `digest` (the key a cache entry of it is stored
        under), unchanged since it was opened; FileFormatError when it is not (the file changed in between: what
        was converted may mix two versions). False when the reads were not in order (no digest to compare): the
        conversion is the file's, but it is not cached."""
        self.source.check_unchanged()
        mine = self.digest()
        if mine is not None and mine != digest:
            raise changed(self.source.path)
        return mine is not None
