"""Weights from an HF model folder: `model.safetensors` or shards listed in `model.safetensors.index.json`.

The safetensors headers (8-byte little-endian length, then JSON: name -> dtype, shape, byte offsets) are parsed by
tracer/checkpoint/safetensors_header.py (the one reader, shared with the analytical commands) and checked against the config
here before any tensor is touched; each tensor is a view into a private memory map of its file: no second copy in
RAM unless a dtype or device change asks for one. The torch dtype mapping and the memory maps live here only.

HF LLaMA checkpoints already store Q and K rows in the half-split RoPE layout our model uses (HF's conversion
script permuted Meta's interleaved rows once), so no permutation is applied here.
"""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import torch

from llmtrace.tracer.checkpoint.packed_tensors import split_safetensors
from llmtrace.tracer.checkpoint.safetensors_header import (
    INDEX_NAME,
    SafetensorsFile,
    SafetensorsTensor,
    read_safetensors_header,
    read_safetensors_index,
)
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import (
    HF_MOE_FAMILIES,
    PACKS,
    expected_shapes,
    hf_moe_family,
    ours_to_hf,
    ours_to_hf_experts,
    per_expert,
    tensor_of,
)
from llmtrace.tracer.core.dtypes import DType
from llmtrace.tracer.core.errors import CheckpointError, ConfigError, FileFormatError
from llmtrace.tracer.hardware.dtype_policy import torch_dtype
from llmtrace.tracer.load import load_progress, mapped_pages

SINGLE_FILE = "model.safetensors"
INDEX_FILE = INDEX_NAME

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}

# Buffers older HF checkpoints saved that carry no weights (HF recomputes them too).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _shard_headers(folder: Path) -> list[SafetensorsFile]:
    """The folder's model.safetensors, else the shards its index lists (read and cross-checked by the index)."""
    single, index = folder / SINGLE_FILE, folder / INDEX_FILE
    if single.exists():
        return [read_safetensors_header(single)]
    if not index.exists():
        found = sorted(p.name for p in folder.glob("*.safetensors"))[:3]
        hint = f" (found {', '.join(found)})" if found else ""
        bins = list(folder.glob("*.bin")) + list(folder.glob("*.pth"))
        pickle_hint = "; pickled .bin/.pth weights are not read (unsafe): convert them to safetensors" if bins else ""
        raise CheckpointError(f"{folder}: no {SINGLE_FILE} nor {INDEX_FILE}{hint}{pickle_hint}")
    return list(read_safetensors_index(index).shards)


def _format_list(items: list[str], limit: int = 3) -> str:
    return "; ".join(items[:limit]) + (f"; ... {len(items) - limit} more" if len(items) > limit else "")


def _expected(config: ModelConfig, family: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{HF name: (our name, shape)} of every tensor the folder must hold, a mixture of experts' spelled as its
    `family` does (contract.HF_MOE_FAMILIES): a stacked (E, ...) tensor is E tensors there, one per expert
    (`block_sparse_moe.experts.{j}.w1.weight`), in expert order."""
    expected = {}
    for ours, shape in expected_shapes(config).items():
        one = shape[1:] if per_expert(tensor_of(ours), config) else shape
        expected.update((name, (ours, one)) for name in ours_to_hf_experts(ours, config, family))
    return expected


def _found(headers: list[SafetensorsFile]) -> dict[str, tuple[SafetensorsFile, SafetensorsTensor]]:
    """Every tensor of the files by its HF name."""
    found: dict[str, tuple[SafetensorsFile, SafetensorsTensor]] = {}
    for header in headers:  # no name twice: the index reader refuses a tensor in two shards
        for entry in header.tensors:
            if entry.dtype not in _ST_DTYPES:
                raise FileFormatError(f"{header.path}: tensor {entry.name!r} has unsupported dtype {entry.dtype!r}")
            found[entry.name] = (header, entry)
    return found


def _plan(
    config: ModelConfig, found: dict[str, tuple[SafetensorsFile, SafetensorsTensor]], folder: Path, family: str
) -> dict[str, tuple[SafetensorsFile, SafetensorsTensor]]:
    """Match the files' tensors to the config's, by HF name; CheckpointError naming every mismatch."""
    found = split_safetensors(found, config, str(folder))  # Phi-3's Q|K|V and gate|up: the members' row ranges
    expected = {name: shape for name, (_, shape) in _expected(config, family).items()}
    # A tied model's checkpoint may still carry lm_head.weight (a copy of the embedding); HF ignores it too.
    ignorable = {"lm_head.weight"} if config.tie_embeddings else set()
    missing = [name for name in expected if name not in found]
    unexpected = [n for n in found if n not in expected and n not in ignorable and not _IGNORED.fullmatch(n)]
    misshaped = [
        f"{name} is {list(found[name][1].shape)}, config wants {list(shape)}"
        for name, shape in expected.items()
        if name in found and found[name][1].shape != shape
    ]
    problems = [
        f"{len(items)} {label}: {_format_list(items)}"
        for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped))
        if items
    ]
    if problems:
        raise CheckpointError(
            f"{folder}: weights do not match config.json ({' | '.join(problems)}); "
            "check that the safetensors and config.json belong to the same LLaMA model"
        )
    return {name: found[name] for name in expected}


def _mapped_bytes(path: Path) -> tuple[torch.Tensor, mmap.mmap]:
    """The whole file as a uint8 tensor over a private (copy-on-write) memory map (pages load on first touch), and
    the map (for giving pages back: tracer/load/mapped_pages.py)."""
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mapped, dtype=torch.uint8), mapped  # the tensor keeps `mapped` alive


def _tensor_view(file_bytes: torch.Tensor, header: SafetensorsFile, entry: SafetensorsTensor) -> torch.Tensor:
    dtype = _ST_DTYPES[entry.dtype]
    start = header.data_start + entry.begin
    raw = file_bytes[start : header.data_start + entry.end]  # (nbytes,) view, no copy
    if start % dtype.itemsize:
        raw = raw.clone()  # misaligned for its dtype (the writer did not pad): one copy of this tensor only
    return raw.view(dtype).view(entry.shape)


def load_hf_state_dict(
    folder: str | Path,
    config: ModelConfig,
    dtype: DType | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Our-named tensors of an HF LLaMA folder, strictly checked against `config`.

    With dtype None and device cpu, every tensor is a view of a memory-mapped file (no copy). Asking for another
    dtype or device converts each tensor once. Tied models get no `output.weight` (the model ties it).
    """
    target = torch_dtype(dtype) if dtype is not None else None
    state: dict[str, torch.Tensor] = {}
    for name, parts in _views(folder, config).items():
        tensor = torch.stack([view for view, _, _, _ in parts]) if per_expert(tensor_of(name), config) else parts[0][0]
        if (target is not None and tensor.dtype != target) or torch.device(device) != tensor.device:
            tensor = tensor.to(device=device, dtype=target or tensor.dtype)
        state[name] = tensor
    return state


View = tuple[torch.Tensor, mmap.mmap, int, int]  # a view of the mapped file, the map, its offset there, its bytes


def mapped_views(folder: str | Path, config: ModelConfig) -> dict[str, list[View]]:
    """{our name: its tensor's View (a mixture of experts': one per expert)}, checked against `config`, nothing
    read yet: for a reader that copies out part of each tensor and gives the map's pages back itself (a
    tensor-parallel rank's shard: tracer/load/tensor_parallel.py)."""
    return _views(folder, config)


def _views(folder: str | Path, config: ModelConfig) -> dict[str, list[View]]:
    """{our name: its tensor's View, or a mixture of experts' E Views of one expert each}, checked."""
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise CheckpointError(f"{folder}: no such folder; pass an HF model folder (config.json + model.safetensors)")
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder; pass an HF model folder (config.json + model.safetensors)")
    if not (folder / "config.json").exists():
        raise ConfigError(f"{folder}: no config.json; pass an HF LLaMA model folder")
    found = _found(_shard_headers(folder))
    family = hf_moe_family(frozenset(found))
    plan = _plan(config, found, folder, family)
    ours = _expected(config, family)
    files: dict[str, tuple[torch.Tensor, mmap.mmap]] = {}
    out: dict[str, list[View]] = {}
    for hf_name, (header, entry) in plan.items():  # in _expected's order: an expert's after the one before it
        if header.path not in files:
            files[header.path] = _mapped_bytes(Path(header.path))
        data, mapped = files[header.path]
        out.setdefault(ours[hf_name][0], []).append((_tensor_view(data, header, entry), mapped,
                                                     header.data_start + entry.begin, entry.end - entry.begin))
    return out


def load_hf_for_run(folder: str | Path, config: ModelConfig, dtype: DType) -> dict[str, torch.Tensor]:
    """load_hf_state_dict's tensors in `dtype` on the CPU, held as a run holds them, so that the checkpoint's bytes
    are resident once: the matrices the fused path multiplies as one product (contract.PACKS: Q|K|V, gate|up) are
    written, converted where `dtype` differs, into one tensor per layer and pack, rows in the members' order (the
    model finds them consecutive at load and makes no copy of its own: tracer/model/packing.py);
    every other tensor stays a view of the mapped file when it is in `dtype`, else is converted. The map's pages of
    every tensor copied out are given back (tracer/load/mapped_pages.py). So a bf16 7B folder run in bf16 holds its
    13.5 GB once (9 GB of Q|K|V and gate|up copies + 4.5 GB mapped), never an fp32 copy, and a conversion holds the
    converted tensors only."""
    target = torch_dtype(dtype)
    views = _views(folder, config)
    state: dict[str, torch.Tensor] = {}
    for layer in range(config.n_layers):
        for pack in PACKS:
            names = [f"layers.{layer}.{member}.weight" for member in pack.members]
            if names[0] not in views:
                continue  # a pack the model has not (a shared expert's gate|up, Qwen2-MoE's only)
            if any(per_expert(tensor_of(n), config) for n in names):
                continue  # a mixture of experts' gate and up: stacked by expert below (each expert's multiplied apart)
            first = views[names[0]][0][0]
            packed = torch.empty((sum(views[n][0][0].shape[0] for n in names), first.shape[1]), dtype=target)
            row = 0
            for name in names:
                (tensor, mapped, start, nbytes), = views.pop(name)
                packed[row:row + tensor.shape[0]].copy_(tensor)
                mapped_pages.release(mapped, start, nbytes)
                load_progress.advance(nbytes)
                state[name] = packed[row:row + tensor.shape[0]]
                row += tensor.shape[0]
    for name, parts in views.items():
        if per_expert(tensor_of(name), config):  # E experts' matrices, one (E, ...) tensor (tracer/model/moe.py says why)
            first = parts[0][0]
            stacked = torch.empty((len(parts), *first.shape), dtype=target)
            for expert, (tensor, mapped, start, nbytes) in enumerate(parts):
                stacked[expert].copy_(tensor)
                mapped_pages.release(mapped, start, nbytes)
                load_progress.advance(nbytes)
            state[name] = stacked
            continue
        (tensor, mapped, start, nbytes), = parts
        if tensor.dtype == target:
            state[name] = tensor
        else:
            state[name] = tensor.to(target)
            mapped_pages.release(mapped, start, nbytes)
        load_progress.advance(nbytes)
    return state


def hf_state_dict_from_ours(state_dict: dict[str, torch.Tensor], config: ModelConfig | None = None,
                            family: str = HF_MOE_FAMILIES[0]) -> dict[str, torch.Tensor]:
    """Rename our tensors to HF's (for writing a folder HF transformers can read, as the tests do); with a mixture
    of experts' `config`, spelled as `family` does, each stacked expert tensor its E per-expert tensors."""
    out = {}
    for name, tensor in state_dict.items():
        names = ours_to_hf_experts(name, config, family) if config is not None else (ours_to_hf(name),)
        if config is not None and per_expert(tensor_of(name), config):
            out.update(zip(names, tensor.unbind(0)))
        else:
            out[names[0]] = tensor
    return out
