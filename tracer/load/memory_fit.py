"""Whether a model's weights, as this run would hold them, fit in the memory this machine has: checked before any
weight is read, so a request that cannot fit is one line (what it needs, what the machine has) instead of a process
that grows until the kernel's OOM killer ends it (a 7B GGUF dequantized to fp32 needs ~27 GB).

What a run holds, per matrix (the working set a decode step reads, or memory nothing else can reclaim):
- as stored under the C library's kernels (native, i8dot, i16dot): the file's blocks, once: in place in the file's
  map (tracer/load/file_map.py; file pages, but every decode step reads them) or, where they are rearranged, in the
  weight arena (tracer/load/weight_arena.py): Q/K rows in HF's order, i8dot's Q4_0/Q4_1 matrices interleaved in
  place (what every product reads; lookups and dequantization gather rows from their groups);
- as stored under torch's kernels (int4pack, blocks): their tensors (weight_formats' layout: codes, fp32 scales and
  zeros), and for int4pack the kernel's own layout made on the first product (4-bit codes + bf16 scales and zeros);
- dequantized or converted (a GGUF matrix without a kernel, `--weights dense`, an HF tensor in another dtype): its
  values in the compute dtype;
- an HF tensor already in the compute dtype: its bytes of the memory-mapped file (read every step).
The fused path multiplies Q|K|V and gate|up as one product each (tracer/model/fused.py): dense tensors are
concatenated into one copy that replaces them (a mapped HF tensor's file pages are read once for it, then left to
the page cache), torch's stored formats into a copy kept beside them (weight_formats.concat_rows), the C library's
not at all.
The KV cache is checked where it is allocated (Transformer.setup_cache), against what is left then.
"""

from __future__ import annotations

import math

from llmtrace.tracer.checkpoint.resolve import GGUF, HF, ResolvedModel
from llmtrace.tracer.core.contract import PACKS, expected_shapes
from llmtrace.tracer.core.dtypes import DType
from llmtrace.tracer.core.errors import HardwareError
from llmtrace.tracer.hardware.memory import available_memory_bytes
from llmtrace.tracer.load.gguf_loader import kernel_of, matrix_infos, stored_matrices
from llmtrace.tracer.load.stored_weights import STORED, WeightsChoice, kernel_plan
from llmtrace.tracer.model.weight_formats import BLOCK_KERNELS, INT4_OPS, INT4PACK

# A run may take this share of MemAvailable for its weights: the rest is the interpreter, torch, activations and
# the KV cache (checked on its own when allocated), and what other processes need meanwhile.
SHARE = 0.9
_FUSED = frozenset(member for pack in PACKS for member in pack.members)  # "attention.wq", ... (roles)


def _role(name: str) -> str:
    """"layers.3.attention.wq.weight" -> "attention.wq"; top-level names unchanged."""
    parts = name.split(".")
    return ".".join(parts[2:4]) if len(parts) == 5 and parts[0] == "layers" else name


def _torch_kernel_bytes(type_name: str, kernel: str, shape: tuple[int, ...], multiplied: bool, fused: bool) -> int:
    """Bytes torch's kernels hold for one matrix of `values` values stored as `type_name`: weight_formats' tensors
    (Q8_0 int8 codes + fp32 scales; 4-bit types nibbles + fp32 scales and zeros per 32 values), twice for a member
    of a fused product (concat_rows' copy beside it); int4pack adds its layout where a product is made (4-bit codes,
    bf16 scale and zero per 32 values, over rows rounded up to the kernel's multiple; Q8_0 as two 4-bit planes),
    once: a fused product's is the copy's."""
    rows, cols = shape
    values = rows * cols
    planes = 2 if type_name == "Q8_0" else 1
    tensors = values * (1 if planes == 2 else 0.5) + values // 32 * 4 * (1 if planes == 2 else 2)
    multiple = INT4_OPS["cpu"].row_multiple
    padded = -(-rows // multiple) * multiple * cols
    layout = planes * (padded // 2 + padded // 32 * 4) if kernel == INT4PACK and multiplied else 0
    return int(tensors * (2 if fused else 1) + layout)


def weights_held(resolved: ResolvedModel, choice: WeightsChoice, compute: DType) -> tuple[int, str]:
    """(bytes a run holds for the weights of `resolved` loaded as `choice` in `compute`, how they split: "" when
    all are held one way)."""
    config = resolved.config
    shapes = expected_shapes(config)
    per_value = compute.bytes_per_value
    if resolved.kind == GGUF and resolved.gguf_header is not None:
        header = resolved.gguf_header
        plan = kernel_plan(choice.kernel) if choice.mode == STORED and choice.kernel is not None else {}
        packable = stored_matrices(header, config, plan)[0] if plan else {}
        infos = matrix_infos(header, config)
        stored = converted = 0
        for name, shape in shapes.items():
            values = math.prod(shape)
            info = infos.get(name)
            if info is not None and name in packable:
                kernel = kernel_of(plan, info)
                multiplied = name != "tok_embeddings.weight" or config.tie_embeddings  # else only rows looked up
                stored += info.n_bytes if kernel in BLOCK_KERNELS else \
                    _torch_kernel_bytes(info.type_name, kernel or "", shape, multiplied, _role(name) in _FUSED)
            else:
                converted += int(values * per_value)
        both = stored and converted > 1e8  # norms alone are not worth a mention
        return stored + converted, (f"{stored / 1e9:.1f} GB as stored, {converted / 1e9:.1f} GB in {compute.name}"
                                    if both else "")
    if resolved.kind == HF and resolved.weights is not None:
        stored_dtype = resolved.weights.main_dtype  # "BF16", "F16", "F32"
        total = sum(int(math.prod(s) * per_value) for s in shapes.values())
        if {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}.get(stored_dtype) == compute.name:
            return total, ""
        return total, f"converted from {stored_dtype}"
    return 0, ""


def check_fits(resolved: ResolvedModel, choice: WeightsChoice, compute: DType, what: str) -> None:
    """HardwareError (one line: what it needs, what the machine has, what to try) when the weights as this run
    would hold them exceed SHARE of this machine's available memory; nothing where the memory cannot be read."""
    need, split = weights_held(resolved, choice, compute)
    free = available_memory_bytes()
    if free is None or need <= free * SHARE:
        return
    advice = _advice(resolved, choice, compute, free)
    split = f" ({split})" if split else ""
    raise HardwareError(f"{what} needs {need / 1e9:.1f} GB of memory for its weights{split}, this machine has "
                        f"{free / 1e9:.1f} GB available; {advice}")


def _advice(resolved: ResolvedModel, choice: WeightsChoice, compute: DType, free: int) -> str:
    if resolved.kind == GGUF and resolved.gguf_header is not None:
        stored = sum(t.n_bytes for t in resolved.gguf_header.tensors)
        if stored <= free * SHARE and choice.mode != STORED:
            return f"--weights stored holds the file's {stored / 1e9:.1f} GB of blocks as they are"
        if stored <= free * SHARE:
            return (f"a kernel that runs every matrix as stored (--weights native or i8dot) holds the file's "
                    f"{stored / 1e9:.1f} GB")
        return "use a smaller model or a smaller quantization (the file alone is larger than the memory left)"
    if resolved.kind == HF and resolved.weights is not None:
        own = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}.get(resolved.weights.main_dtype)
        if own is not None and own != compute.name:
            return f"--dtype {own} runs it as stored, with no converted copy"
    return "use a smaller model, or close what else is using the memory"

