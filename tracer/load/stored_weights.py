"""A GGUF's weights as stored (`--weights stored`): which matrices run packed, and their cache entry layout.

The choice: `--weights stored` multiplies every matrix whose ggml type has a stored kernel
(llmtrace.tracer.model.weight_formats.stored_kernels) in that kernel and dequantizes the rest; `--weights dense`
dequantizes everything to the compute dtype (the path llmtrace always had). With neither, a GGUF runs stored when
ALL its matrices have a kernel (a mixed model, part dense, would be neither the file's bytes nor the dense
baseline), otherwise dense, and `run` says which and why.

A cache entry (llmtrace.tracer.load.weights_cache) holds the dense tensors under their names and each packed
matrix's tensors under "<name>#<part>" ("layers.0.attention.wq.weight#nibbles"); the entry's metadata key
"packed_weights" is JSON {name: [format name, kernel, stored type, stored bits, N, K, stored bytes]}. Read back
strictly: JSON only (never unpickled), each part's shape and dtype checked by PackedWeight.from_tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.model.weight_formats import INT4PACK, PackedWeight, WeightFormat

STORED, DENSE = "stored", "dense"
WEIGHTS_CHOICES = (STORED, DENSE)
STORED_KERNEL = INT4PACK  # the kernel `--weights stored` runs (fastest measured here: BENCHMARKS.md)
_META_KEY = "packed_weights"


@dataclass(frozen=True, slots=True)
class WeightsChoice:
    """What a load decided: `mode` "stored" or "dense", and why, in one line for `run` to print."""

    mode: str
    reason: str


def choose_weights(asked: str | None, is_gguf: bool, packable: dict[str, str], unpackable: dict[str, str]
                   ) -> WeightsChoice:
    """`asked` is "stored", "dense" or None (the default). `packable`/`unpackable`: {matrix: ggml type} with and
    without a stored kernel (empty for checkpoints that are not GGUF)."""
    if asked not in (None, STORED, DENSE):
        raise BadArgumentError(f"--weights must be one of {', '.join(WEIGHTS_CHOICES)}, got {asked!r}")
    if not is_gguf:
        if asked == STORED:
            return WeightsChoice(DENSE, "not a GGUF: the checkpoint's tensors are dense already")
        return WeightsChoice(DENSE, "not a GGUF")
    if asked == DENSE:
        return WeightsChoice(DENSE, "--weights dense")
    kinds = sorted(set(unpackable.values()))
    if asked == STORED:
        if unpackable:
            return WeightsChoice(STORED, f"--weights stored ({len(unpackable)} matrices of type "
                                         f"{', '.join(kinds)} have no stored kernel and run dequantized)")
        return WeightsChoice(STORED, "--weights stored")
    if unpackable:
        return WeightsChoice(DENSE, f"default: {len(unpackable)} matrices are {', '.join(kinds)}, which no stored "
                                    "kernel runs, so all are dequantized (--weights stored runs the others as stored)")
    return WeightsChoice(STORED, "default for a GGUF whose matrices all have a stored kernel")


def entry_variant(kernel: str, dtype: torch.dtype) -> str:
    """The cache entry's name part for stored weights: "stored-int4pack-float32"."""
    return f"stored-{kernel}-{str(dtype).removeprefix('torch.')}"


def to_entry(dense: dict[str, torch.Tensor], packed: dict[str, PackedWeight]
             ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) for weights_cache.store."""
    tensors = dict(dense)
    described = {}
    for name, weight in packed.items():
        fmt = weight.format
        described[name] = [fmt.name, fmt.kernel, fmt.stored, fmt.stored_bits, *weight.shape, weight.stored_bytes]
        for part, tensor in weight.tensors.items():
            tensors[f"{name}#{part}"] = tensor
    return tensors, {_META_KEY: json.dumps(described, sort_keys=True)}


def from_entry(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None
               ) -> tuple[dict[str, torch.Tensor], dict[str, PackedWeight]]:
    """Inverse of to_entry; ValueError when the entry does not describe its tensors exactly."""
    try:
        described = json.loads((metadata or {})[_META_KEY])
    except (KeyError, ValueError, RecursionError) as exc:
        raise ValueError(f"no readable {_META_KEY!r} in the entry") from exc
    if not isinstance(described, dict):
        raise ValueError(f"{_META_KEY!r} is not an object")
    dense = {name: t for name, t in tensors.items() if "#" not in name}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "#" in key:
            name, part = key.split("#", 1)
            parts.setdefault(name, {})[part] = tensor
    if set(parts) != set(described):
        raise ValueError("packed tensors and their descriptions differ")
    packed = {}
    for name, fields in described.items():
        if not isinstance(fields, list) or len(fields) != 7:
            raise ValueError(f"bad description of {name!r}")
        fmt_name, kernel, stored, bits, rows, cols, stored_bytes = fields
        if not all(isinstance(v, str) for v in (fmt_name, kernel, stored)) or not all(
                isinstance(v, int) for v in (rows, cols, stored_bytes)) or not isinstance(bits, (int, float)):
            raise ValueError(f"bad description of {name!r}")
        fmt = WeightFormat(fmt_name, kernel, stored, float(bits))
        packed[name] = PackedWeight.from_tensors(fmt, (rows, cols), parts[name], stored_bytes)
    return dense, packed
