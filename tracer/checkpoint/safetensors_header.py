"""Read safetensors headers (names, dtypes, shapes, byte offsets) without touching tensor data. Pure Python.

Format (huggingface/safetensors README): u64 little-endian N, then N bytes of JSON
{"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__": {..}},
then the data; offsets are relative to the byte after the header. A sharded checkpoint has
model.safetensors.index.json whose "weight_map" names the shard of every tensor.

The one reader for both paths: the analytical commands count parameters and bytes from these records, and
tracer/load/hf_loader.py memory-maps tensors at `SafetensorsFile.data_start + SafetensorsTensor.begin`.
"""

from __future__ import annotations

import math
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from llmtrace.tracer.core.errors import CheckpointError, FileFormatError
from llmtrace.tracer.core.json_input import parse_json

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # the reference implementation refuses headers above 100 MB

# safetensors dtype names -> bytes per element.
DTYPE_BYTES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}


@dataclass(frozen=True, slots=True)
class SafetensorsTensor:
    """One tensor as its file's header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    begin: int  # byte offsets into the file's data section (after the header)
    end: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def n_bytes(self) -> int:
        return self.n_elements * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class SafetensorsFile:
    """The header of one .safetensors file."""

    path: str
    data_start: int  # byte offset of the data section in the file (8 + header length)
    file_size: int
    tensors: tuple[SafetensorsTensor, ...]
    metadata: dict[str, str]  # the header's "__metadata__"


@dataclass(frozen=True, slots=True)
class SafetensorsCheckpoint:
    """All files of a checkpoint (one, or the shards an index lists), no tensor named twice."""

    shards: tuple[SafetensorsFile, ...]

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(s.path for s in self.shards)

    @property
    def tensors(self) -> tuple[SafetensorsTensor, ...]:
        return tuple(t for s in self.shards for t in s.tensors)

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors)


def read_safetensors_header(path: str | Path) -> SafetensorsFile:
    """Header of one .safetensors file; every entry is checked against the file's size."""
    path = Path(path)
    try:
        st = path.stat()
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(path)
        if not stat.S_ISREG(st.st_mode):
            raise FileFormatError(f"{path}: not a regular file (a FIFO, device or socket); pass a .safetensors file")
        size = st.st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise FileFormatError(
                    f"{path}: safetensors file is truncated ({size} bytes, no header length); re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise FileFormatError(
                    f"{path}: safetensors header claims {n} bytes (file has {size}); "
                    "the file is corrupt or not safetensors")
            if 8 + n > size:
                raise FileFormatError(
                    f"{path}: safetensors header is truncated (needs {n} bytes, file is {size}); re-download the file")
            raw = fh.read(n)
    except FileNotFoundError as exc:
        raise FileFormatError(f"{path}: no such file; check the checkpoint folder") from exc
    except IsADirectoryError as exc:
        raise FileFormatError(f"{path}: is a folder, not a safetensors file") from exc
    except PermissionError as exc:
        raise FileFormatError(f"{path}: permission denied; check the file's permissions") from exc
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc}); check the path and permissions") from exc
    header = parse_json(raw, f"{path}: safetensors header", FileFormatError, "the file is corrupt")
    if not isinstance(header, dict):
        raise FileFormatError(f"{path}: safetensors header is not a JSON object; the file is corrupt")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise FileFormatError(f"{path}: safetensors '__metadata__' is not a JSON object; the file is corrupt")
    data_start = 8 + n
    tensors = tuple(_tensor(path, name, entry, data_start, size) for name, entry in header.items())
    return SafetensorsFile(str(path), data_start, size, tensors, dict(metadata))


def _tensor(path: Path, name: str, entry: object, data_start: int, file_size: int) -> SafetensorsTensor:
    def bad(why: str) -> FileFormatError:
        return FileFormatError(f"{path}: tensor {name!r} {why}; the file is corrupt")

    if not isinstance(entry, dict):
        raise bad("has no header entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise bad(f"has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise bad(f"has a malformed shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"has malformed data_offsets {offsets!r}")
    begin, end = offsets
    tensor = SafetensorsTensor(name, dtype, tuple(shape), str(path), begin, end)
    if end - begin != tensor.n_bytes:
        raise bad(f"spans bytes {begin}..{end} ({end - begin} bytes) but {dtype}{list(shape)} needs {tensor.n_bytes}")
    if data_start + end > file_size:
        raise FileFormatError(
            f"{path}: tensor {name!r} ends at byte {data_start + end}, past the end of the file ({file_size} bytes); "
            "the file is truncated, re-download it")
    return tensor


def read_safetensors_checkpoint(path: str | Path) -> SafetensorsCheckpoint:
    """All tensors of a checkpoint: a .safetensors file, an index.json, or a folder holding either."""
    path = Path(path)
    if path.is_dir():
        index = path / INDEX_NAME
        if index.exists():
            return read_safetensors_index(index)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileFormatError(f"{path}: no .safetensors files in this folder")
        return _merge([read_safetensors_header(f) for f in files])
    if path.name.endswith(".index.json"):
        return read_safetensors_index(path)
    return _merge([read_safetensors_header(path)])


def read_safetensors_index(index: str | Path) -> SafetensorsCheckpoint:
    """The shards a model.safetensors.index.json lists, each checked to hold the tensors the index puts there."""
    index = Path(index)
    folder = index.parent
    try:
        raw = index.read_bytes()
    except FileNotFoundError as exc:
        raise FileFormatError(f"{index}: no such file") from exc
    except OSError as exc:
        raise FileFormatError(f"{index}: cannot read ({exc.strerror or exc}); check the file") from exc
    data = parse_json(raw, f"{index}: safetensors index", FileFormatError, "re-download the index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FileFormatError(
            f"{index}: not a valid safetensors index (needs a 'weight_map' of tensor name -> shard file); "
            "re-download the index")
    shards = []
    for shard in sorted(set(weight_map.values())):
        if not (folder / shard).exists():
            raise FileFormatError(
                f"{index}: lists shard {shard!r}, which is not in {folder} (no such file); re-download the model")
        shards.append(read_safetensors_header(folder / shard))
    merged = _merge(shards)
    file_of = {t.name: t.file for t in merged.tensors}
    for name, shard in weight_map.items():
        if file_of.get(name) != str(folder / shard):
            raise FileFormatError(
                f"{index}: says {name!r} is in {shard!r}, but that shard has no such tensor; re-download the model")
    return merged


def _merge(parts: list[SafetensorsFile]) -> SafetensorsCheckpoint:
    seen: dict[str, str] = {}
    for part in parts:
        for t in part.tensors:
            if t.name in seen:
                raise FileFormatError(
                    f"tensor {t.name!r} appears in both {seen[t.name]} and {t.file}; the checkpoint is inconsistent, "
                    "remove one")
            seen[t.name] = t.file
    return SafetensorsCheckpoint(tuple(parts))
