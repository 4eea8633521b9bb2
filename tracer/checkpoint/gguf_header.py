"""A pure-Python reader for a GGUF file's header: key/value metadata and tensor descriptors, never tensor data.

Format (llama.cpp's gguf.md): magic "GGUF", u32 version, u64 tensor count, u64 metadata count, then the
metadata pairs, then one descriptor per tensor (name, dims, ggml type, offset), then data at an aligned offset.
No numpy or torch, so `llmtrace flops --model file.gguf` stays instant.
"""

from __future__ import annotations

import math
import os
import stat
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import xxhash

from llmtrace.tracer.core.errors import FileFormatError
from llmtrace.tracer.core.ggml_types import GGML_TYPES

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types (gguf.md: GGUF_METADATA_VALUE_TYPE_*): code -> struct format, None for string/array.
_SCALAR_FORMATS: dict[int, str] = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")

@dataclass(frozen=True, slots=True)
class ArraySummary:
    """Stands in for a metadata array that was skipped rather than decoded."""

    item_type: int
    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first (ne[0], ne[1], ...)
    ggml_type: int
    offset: int  # relative to the start of the data section

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"type{self.ggml_type}", 0, 0))[0]

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def n_bytes(self) -> int:
        if self.ggml_type not in GGML_TYPES:
            raise FileFormatError(f"tensor {self.name!r}: unknown ggml type {self.ggml_type}")
        _, block, block_bytes = GGML_TYPES[self.ggml_type]
        return self.n_elements // block * block_bytes

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """Row-major shape as PyTorch (and HF) write it: GGUF's dims reversed."""
        return tuple(reversed(self.shape))


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    data_offset: int  # absolute file offset of the tensor data section
    file_size: int
    # The file the header was read from, as fstat saw it through the descriptor it was read with: (st_dev, st_ino,
    # st_size, st_mtime_ns, st_ctime_ns), and XXH3-128 of its bytes [0, data_offset). A load opens the file again and
    # checks both (tracer/load/gguf_source.py): a file replaced or rewritten since is refused, never converted with
    # this header. Empty for a header not read from a file.
    identity: tuple[int, ...] = ()
    header_xxh3: str = ""


class _Cursor:
    """Bounds-checked sequential reads from a buffer; a short read means a truncated file."""

    def __init__(self, buf: Any, path: str) -> None:
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            if n >= 0 and self.pos + n <= getattr(self.buf, "known", 0):
                raise _ShortPrefix(f"{self.path}: header continues past byte {self.size}")
            raise FileFormatError(
                f"{self.path}: GGUF header is truncated at byte {self.pos} (file is {self.size} bytes); "
                "re-download or re-convert the file"
            )

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        self.need(size)
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.unpack("Q")
        self.need(n)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        # A tight loop (locals, one precompiled struct): a vocabulary is 50k-150k strings and
        # `llmtrace flops --model file.gguf` must stay instant.
        unpack_u64, buf, pos, size = _U64.unpack_from, self.buf, self.pos, self.size
        for _ in range(count):
            if pos + 8 > size:
                break
            end = pos + 8 + unpack_u64(buf, pos)[0]
            if end > size:
                break
            pos = end
        else:
            self.pos = pos
            return
        self.pos = pos
        self.need(8 + (unpack_u64(buf, pos)[0] if pos + 8 <= size else 0))  # raises: the file is truncated


MAX_ARRAY_NESTING = 4  # llama.cpp writes flat arrays; arrays of arrays nested deeper are a corrupt or hostile file


def _read_value(cur: _Cursor, vtype: int, decode_arrays: bool, depth: int = 0) -> Any:
    if vtype in _SCALAR_FORMATS:
        return cur.unpack(_SCALAR_FORMATS[vtype])
    if vtype == _STRING:
        return cur.string()
    if vtype == _ARRAY:
        item_type, count = cur.unpack("I"), cur.unpack("Q")
        if item_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[item_type]
            size = struct.calcsize("<" + fmt) * count
            cur.need(size)
            if not decode_arrays:
                cur.pos += size
                return ArraySummary(item_type, count)
            values = struct.unpack_from(f"<{count}{fmt}", cur.buf, cur.pos)
            cur.pos += size
            return list(values)
        if item_type == _STRING:
            if not decode_arrays:
                cur.skip_strings(count)
                return ArraySummary(item_type, count)
            return [cur.string() for _ in range(count)]
        if item_type == _ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise FileFormatError(f"{cur.path}: GGUF metadata arrays nested more than {MAX_ARRAY_NESTING} deep at "
                                      f"byte {cur.pos}; the file is corrupt")
            cur.need(count * 12)  # each nested array is at least its item type (4 bytes) and count (8)
            return [_read_value(cur, _ARRAY, decode_arrays, depth + 1) for _ in range(count)]
        raise FileFormatError(f"{cur.path}: GGUF metadata array has unknown item type {item_type}; file is corrupt")
    raise FileFormatError(f"{cur.path}: GGUF metadata value has unknown type {vtype}; file is corrupt")


# The first read of a header; a header longer than this (a vocabulary of millions of pieces) is read again whole in
# reads 4x longer. The bundled model's header is 1.8 MB, a 128k-vocabulary Llama 3's ~9 MB.
_FIRST_READ = 4 << 20
_MAX_HEADER = 1 << 30  # what a header may take: far above any real one, never the whole of a multi-GB file


class _ShortPrefix(FileFormatError):
    """The parser needs bytes past the prefix read so far (not past the end of the file): read more."""


def read_gguf_header(path: str | Path, decode_arrays: bool = False) -> GGUFHeader:
    """Parse metadata and tensor descriptors. With decode_arrays=False, arrays (the vocabulary) are only skipped.

    The bytes are read with pread through one descriptor, never memory-mapped: a file truncated by another program
    while it is parsed is a short read (a FileFormatError saying it is truncated), where a map of it would kill the
    process with SIGBUS. The descriptor's fstat gives the size and the identity the load checks again."""
    path = Path(path)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
            # open() of a FIFO blocks until a writer comes: forever, for a mistyped --model
            raise FileFormatError(f"{path}: not a regular file (a FIFO, device or socket); pass a .gguf file")
        # O_NONBLOCK: a FIFO swapped in after the stat above does not block the open either
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(path)
            if not stat.S_ISREG(st.st_mode):
                raise FileFormatError(f"{path}: not a regular file (a FIFO, device or socket); pass a .gguf file")
            file_size = st.st_size
            if file_size == 0:
                raise FileFormatError(f"{path}: file is empty; not a GGUF file")
            want = min(file_size, _FIRST_READ)
            while True:
                buf = _pread_all(fd, want)
                # a prefix of the whole read is known to go on to file_size; a short read (the file shrank) not
                known = file_size if len(buf) == want < file_size else len(buf)
                try:
                    header = _parse(_Prefix(buf, known), str(path), file_size, decode_arrays)
                    break
                except _ShortPrefix:
                    if want >= _MAX_HEADER:
                        raise FileFormatError(f"{path}: GGUF header runs past {_MAX_HEADER >> 20} MiB; the file is "
                                              "corrupt") from None
                    want = min(file_size, want * 4, _MAX_HEADER)
            if len(buf) < header.data_offset:  # the padding up to the data (never past the end of the file)
                buf = _pread_all(fd, min(header.data_offset, file_size))
            identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            return replace(header, identity=identity,
                           header_xxh3=xxhash.xxh3_128_hexdigest(bytes(buf[:header.data_offset])))
        finally:
            os.close(fd)
    except FileNotFoundError as exc:
        raise FileFormatError(f"{path}: no such file; check the path") from exc
    except IsADirectoryError as exc:
        raise FileFormatError(f"{path}: is a folder, not a GGUF file") from exc
    except PermissionError as exc:
        raise FileFormatError(f"{path}: permission denied; check the file's permissions") from exc
    except OSError as exc:
        raise FileFormatError(f"{path}: cannot read ({exc.strerror or exc}); check the file") from exc


class _Prefix(bytes):
    """The first bytes of the file, and how far the file is known to go on (`known`): the cursor asks for more
    rather than calling the file truncated when what it needs lies within that."""

    known: int

    def __new__(cls, data: bytes, known: int) -> "_Prefix":
        obj = super().__new__(cls, data)
        obj.known = known
        return obj


def _pread_all(fd: int, n: int) -> bytes:
    """The file's first `n` bytes, fewer only where the file ends sooner (a short pread is retried)."""
    parts, got = [], 0
    while got < n:
        chunk = os.pread(fd, n - got, got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _parse(buf: memoryview, path: str, file_size: int, decode_arrays: bool) -> GGUFHeader:
    cur = _Cursor(buf, path)
    cur.need(4)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise FileFormatError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
    cur.pos = 4
    version = cur.unpack("I")
    if version not in (2, 3):
        raise FileFormatError(f"{path}: GGUF version {version} is not supported (llmtrace reads 2 and 3)")
    n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise FileFormatError(f"{path}: GGUF header claims {n_tensors} tensors and {n_kv} keys; file is corrupt")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = _read_value(cur, cur.unpack("I"), decode_arrays)
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        if n_dims > 8:
            raise FileFormatError(f"{path}: tensor {name!r} claims {n_dims} dimensions; file is corrupt")
        shape = tuple(cur.unpack("Q") for _ in range(n_dims))
        tensors.append(GGUFTensorInfo(name, shape, cur.unpack("I"), cur.unpack("Q")))
    alignment = _alignment(metadata, path)
    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    known_up_to = max(GGML_TYPES)
    for info in tensors:
        if info.ggml_type not in GGML_TYPES:
            raise FileFormatError(
                f"{path}: tensor {info.name!r} has ggml type code {info.ggml_type}, which llmtrace does not know "
                f"(it knows codes up to {known_up_to}); the file is corrupt or from a newer llama.cpp: use another "
                "quantization of the model (Q4_K_M, Q8_0, F16) or its HF safetensors folder"
            )
        name, block, _ = GGML_TYPES[info.ggml_type]
        if info.shape and info.shape[0] % block:
            raise FileFormatError(
                f"{path}: tensor {info.name!r} has rows of {info.shape[0]} values, not whole {name} blocks of "
                f"{block}; the file is corrupt"
            )
        if info.offset % alignment:
            raise FileFormatError(f"{path}: tensor {info.name!r} starts at data offset {info.offset}, not a multiple "
                                  f"of the file's alignment {alignment}; the file is corrupt")
        if data_offset + info.offset + info.n_bytes > file_size:
            raise FileFormatError(
                f"{path}: tensor {info.name!r} ends past the end of the file ({file_size} bytes); the file is truncated"
            )
    _check_layout(tensors, alignment, path)
    return GGUFHeader(path, version, metadata, tuple(tensors), data_offset, file_size)


def _alignment(metadata: dict[str, Any], path: str) -> int:
    """general.alignment: a positive power of two (gguf.md; llama.cpp refuses anything else), DEFAULT_ALIGNMENT when
    absent. A string, float, array or boolean there is a corrupt file, not a number to coerce."""
    value = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        shown = repr(value)[:40] if isinstance(value, (int, float, str)) else "an array"  # the only other kind
        raise FileFormatError(f"{path}: general.alignment is {shown}, not a power of two; the file is corrupt")
    return value


def _check_layout(tensors: list[GGUFTensorInfo], alignment: int, path: str) -> None:
    """Each tensor's bytes are its own, and as many as its type and shape say. GGUF writers (llama.cpp's gguf.c,
    gguf-py) put the tensors one after another, each padded to the alignment: two ranges that overlap would give two
    tensors the same bytes, and a gap of a whole alignment or more before the next tensor means the declared type
    reads fewer bytes than were written (a norm of F32 values declared Q8_0 reads 34 bytes per 32 values of the 128
    written: garbage weights, silently). The last tensor is not checked this way: data may follow it."""
    ordered = sorted(tensors, key=lambda info: info.offset)
    for this, after in zip(ordered, ordered[1:]):
        end = this.offset + this.n_bytes
        if after.offset < end:
            raise FileFormatError(f"{path}: tensors {this.name!r} (bytes {this.offset}-{end} of the data) and "
                                  f"{after.name!r} (from {after.offset}) overlap; the file is corrupt")
        if after.offset - end >= alignment:
            raise FileFormatError(
                f"{path}: tensor {this.name!r} is declared {this.type_name} {list(this.shape)} ({this.n_bytes} bytes) "
                f"but {after.offset - this.offset} bytes lie before the next tensor; its type does not match its data "
                "(the file is corrupt)")
