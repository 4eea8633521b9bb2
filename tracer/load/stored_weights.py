"""A GGUF's weights as stored: what `--weights` asks for, which matrices run packed, and their cache entry layout.

`--weights` (parsed once, `parse_weights`): "auto" (the default) runs the default table's kernels for this machine's
instruction set (tracer/hardware/kernel_defaults.py; nothing measured); "tuned" `llmtrace tune`'s saved pick for this
machine and model (tracer/load/kernel_pick.py), judged again before it runs; "stored" the table's stored kernels
(or, where the table dequantizes, the kernel that runs the most matrices); "dense" dequantizes every matrix to the
compute dtype; a kernel's name ("int4pack", "blocks", any kernel llmtrace.tracer.model.weight_formats lists) runs that
kernel, and "Q4_1:int4pack,Q8_0:blocks" a kernel per ggml type. A kernel multiplies every matrix whose ggml type it
runs and the rest are dequantized. Nothing here measures.

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
from llmtrace.tracer.core.ggml_types import GGML_TYPES
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.weight_formats import (
    BLOCK_KERNELS,
    I8DOT,
    I16DOT,
    STORED_KERNELS,
    PackedWeight,
    WeightFormat,
    stored_kernels,
)

AUTO, STORED, DENSE, TUNED = "auto", "stored", "dense", "tuned"
_META_KEY = "packed_weights"


def all_kernels() -> tuple[str, ...]:
    """Every stored kernel weight_formats knows (that some ggml type runs here), in its order of preference."""
    names = {k for ggml_type in GGML_TYPES for k in stored_kernels(ggml_type)}
    return tuple(k for k in STORED_KERNELS if k in names)


@dataclass(frozen=True, slots=True)
class WeightsRequest:
    """`--weights` parsed: `mode` AUTO, STORED or DENSE; `kernel` a stored kernel's name when one was named."""

    mode: str = AUTO
    kernel: str | None = None

    @property
    def flag(self) -> str:
        """As typed: "--weights int4pack"; "" for auto."""
        return "" if self.mode == AUTO else f"--weights {self.kernel or self.mode}"


def parse_weights(text: str | None) -> WeightsRequest:
    """`--weights` text (None or "" = auto) -> WeightsRequest; BadArgumentError naming the choices otherwise."""
    if text in (None, "", AUTO):
        return WeightsRequest()
    if text in (STORED, DENSE, TUNED):
        return WeightsRequest(text)
    if text in all_kernels():
        return WeightsRequest(STORED, text)
    if text in BLOCK_KERNELS:  # a kernel of weight_formats that cannot be built here: say why, not just "one of"
        raise BadArgumentError(f"--weights {text}: {native_kernel.unavailable_reason()}; use --weights stored "
                               "(another stored kernel) or dense")
    try:
        plan = kernel_plan(text)
    except ValueError:
        plan = None
    if isinstance(plan, dict):
        return WeightsRequest(STORED, text)
    raise BadArgumentError(f"--weights must be one of {', '.join((AUTO, TUNED, STORED, DENSE, *all_kernels()))}, or a "
                           f"kernel per type (Q4_1:int4pack,Q8_0:blocks), got {text!r}")


def kernel_plan(spec: str) -> str | dict[str, str]:
    """A stored-kernel spec as gguf_loader takes it: "int4pack" (every matrix), or "Q4_1:int4pack,Q8_0:blocks"
    ({ggml type name: kernel}); ValueError for a kernel llmtrace does not have or a malformed part."""
    if ":" not in spec:
        if spec not in all_kernels():
            raise ValueError(f"no stored kernel {spec!r}")
        return spec
    plan = {}
    for part in spec.split(","):
        type_name, _, kernel = part.partition(":")
        if not type_name or kernel not in all_kernels():
            raise ValueError(f"bad kernel spec part {part!r}")
        plan[type_name] = kernel
    return plan


def plan_spec(plan: dict[str, str]) -> str:
    """The spec of a per-type plan, types sorted: "Q4_1:int4pack,Q8_0:blocks"."""
    return ",".join(f"{t}:{plan[t]}" for t in sorted(plan))


@dataclass(frozen=True, slots=True)
class WeightsChoice:
    """What a load decided: `mode` "stored" or "dense", the stored `kernel`, and why, in one line for `run`."""

    mode: str
    reason: str
    kernel: str = ""
    # False when `reason` only restates what the header says anyway (auto's measured pick is the kernels line; an
    # option is what the user typed): `run` then leaves the line out.
    news: bool = True

    @property
    def label(self) -> str:
        return f"{self.mode} ({self.kernel})" if self.kernel else self.mode


def tensors_as_read(source: object, choice: WeightsChoice) -> tuple[tuple[str, int, int], ...]:
    """The checkpoint's tensors at their stored sizes (flops_report.weights_as_stored) when a load read them as
    stored, so a roofline bound counts the bytes the run moves (`run`'s summary, `run --batch-sweep`); () when they
    were converted to the compute dtype. `source`: what load_model was given."""
    if choice.mode != "stored":
        return ()
    from llmtrace.tracer.analytic.flops_report import weights_as_stored
    from llmtrace.tracer.checkpoint.resolve import resolve_model

    return weights_as_stored(resolve_model(source))


def widest_kernel(packable_by_kernel: dict[str, int]) -> str:
    """The kernel that runs the most matrices (all_kernels' order breaks ties, except that i8dot and i16dot come last:
    they round the activations, and only the accuracy probe may admit them): --weights stored where the default
    table dequantizes."""
    order = all_kernels()
    return max(order, key=lambda k: (packable_by_kernel.get(k, 0), k not in (I8DOT, I16DOT), -order.index(k)))


def entry_variant(kernel: str, dtype: torch.dtype) -> str:
    """The cache entry's name part for stored weights: "stored-int4pack-float32" ("stored-Q4_1.int4pack_Q8_0.blocks-
    float32" for a kernel per type)."""
    return f"stored-{kernel.replace(':', '.').replace(',', '_')}-{str(dtype).removeprefix('torch.')}"


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
