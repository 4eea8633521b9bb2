"""Read safetensors headers (names, dtypes, shapes, offsets) without touching tensor data. Pure Python.

Format (huggingface/safetensors README): u64 little-endian N, then N bytes of JSON
{"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__": {..}},
then the data; offsets are relative to the byte after the header. A sharded checkpoint has
model.safetensors.index.json whose "weight_map" names the shard of every tensor.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from tracer.errors import FileFormatError

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # the reference implementation refuses headers above 100 MB

# safetensors dtype names -> bytes per element.
DTYPE_BYTES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}


@dataclass(frozen=True, slots=True)
class SafetensorsTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str

    @property
    def n_elements(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def n_bytes(self) -> int:
        return self.n_elements * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class SafetensorsCheckpoint:
    files: tuple[str, ...]
    tensors: tuple[SafetensorsTensor, ...]
    metadata: dict[str, str]  # "__metadata__" of the first file

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors)


def read_safetensors_header(path: str | Path) -> SafetensorsCheckpoint:
    """Header of one .safetensors file; every entry is checked against the file's size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise FileFormatError(f"{path}: safetensors file is truncated ({size} bytes, no header length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise FileFormatError(f"{path}: safetensors header claims {n} bytes; the file is corrupt or not safetensors")
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
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FileFormatError(f"{path}: safetensors header is not valid JSON ({exc}); the file is corrupt") from exc
    if not isinstance(header, dict):
        raise FileFormatError(f"{path}: safetensors header is not a JSON object; the file is corrupt")
    data_size = size - 8 - n
    metadata = header.pop("__metadata__", None) or {}
    tensors = tuple(_tensor(path, name, entry, data_size) for name, entry in header.items())
    return SafetensorsCheckpoint(files=(str(path),), tensors=tensors, metadata=dict(metadata))


def _tensor(path: Path, name: str, entry: object, data_size: int) -> SafetensorsTensor:
    def bad(why: str) -> FileFormatError:
        return FileFormatError(f"{path}: tensor {name!r} {why}; the file is corrupt")

    if not isinstance(entry, dict):
        raise bad("has no header entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise bad(f"has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise bad(f"has a malformed shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"has malformed data_offsets {offsets!r}")
    tensor = SafetensorsTensor(name, dtype, tuple(shape), str(path))
    if offsets[1] - offsets[0] != tensor.n_bytes:
        raise bad(f"spans {offsets[1] - offsets[0]} bytes but {dtype}{list(shape)} needs {tensor.n_bytes}")
    if offsets[1] > data_size:
        raise FileFormatError(
            f"{path}: tensor {name!r} ends past the end of the file; the file is truncated, re-download it")
    return tensor


def read_safetensors_checkpoint(path: str | Path) -> SafetensorsCheckpoint:
    """All tensors of a checkpoint: a .safetensors file, an index.json, or a folder holding either."""
    path = Path(path)
    if path.is_dir():
        index = path / INDEX_NAME
        if index.exists():
            return _read_index(index)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileFormatError(f"{path}: no .safetensors files in this folder")
        return _merge([read_safetensors_header(f) for f in files])
    if path.name.endswith(".index.json"):
        return _read_index(path)
    return read_safetensors_header(path)


def _read_index(index: Path) -> SafetensorsCheckpoint:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise FileFormatError(f"{index}: no such file") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FileFormatError(f"{index}: not readable as JSON ({exc}); re-download the index") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FileFormatError(f"{index}: has no valid 'weight_map'; re-download the index")
    shards = sorted(set(weight_map.values()))
    merged = _merge([read_safetensors_header(index.parent / shard) for shard in shards])
    present = {t.name: t.file for t in merged.tensors}
    for name, shard in weight_map.items():
        if name not in present:
            raise FileFormatError(f"{index}: tensor {name!r} is listed in {shard} but that shard lacks it")
    return merged


def _merge(parts: list[SafetensorsCheckpoint]) -> SafetensorsCheckpoint:
    seen: dict[str, str] = {}
    tensors: list[SafetensorsTensor] = []
    for part in parts:
        for t in part.tensors:
            if t.name in seen:
                raise FileFormatError(f"tensor {t.name!r} appears in both {seen[t.name]} and {t.file}; remove one")
            seen[t.name] = t.file
            tensors.append(t)
    return SafetensorsCheckpoint(
        files=tuple(f for p in parts for f in p.files), tensors=tuple(tensors),
        metadata=parts[0].metadata if parts else {},
    )
