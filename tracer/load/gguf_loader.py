"""Weights from a GGUF file: dequantized to fp32, renamed to Meta's names, Q/K rows put back in HF's RoPE layout.

The descriptors come from `llmtrace.tracer.checkpoint.gguf_header` (pure Python, 0.1 s for the bundled file;
`gguf.GGUFReader` spends seconds decoding every vocabulary string as a numpy array). Each tensor's bytes are read
through one descriptor (llmtrace.tracer.load.gguf_source: pread into private memory, never a map a truncated file
would turn into SIGBUS), in the file's order, so a pass can hash the whole file as it reads it;
`llmtrace.tracer.load.gguf_dequant` decodes every type `gguf` can. Blocks that the C library's kernels read are read
through the file's map instead: held there in place where the kernels read them as they lie, else written from it
into the weight arena in one pass (tracer/load/file_map.py says when and why).
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import numpy as np
import torch

from llmtrace.tracer.checkpoint.gguf_header import GGUFHeader, GGUFTensorInfo
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import PACKS, dims, expected_shapes, gguf_to_ours, held_shape, tensor_of
from llmtrace.tracer.core.errors import CheckpointError, FileFormatError
from llmtrace.tracer.core.ggml_types import GGML_TYPES
from llmtrace.tracer.load import load_progress
from llmtrace.tracer.load.gguf_dequant import check_decodable, dequantize
from llmtrace.tracer.load.file_map import FileMap
from llmtrace.tracer.load.gguf_source import GGUFSource, Reader
from llmtrace.tracer.load.weight_arena import WeightArena
from llmtrace.tracer.model.transformer import Transformer, build_meta_model
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.weight_formats import (BLOCK_KERNELS, I8DOT, NATIVE, ExpertWeights, PackedWeight,
                                                 finite_scales, pack_gguf, reads_groups, rows_scales_finite,
                                                 stored_kernels)

# Derived data llama.cpp writes for Llama 3.1 rope scaling, and Phi-3's LongRoPE factors (read into the config by
# checkpoint/resolve.py): the model computes its RoPE tables from the config.
_IGNORED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


# ---- Q/K row order --------------------------------------------------------------------------------------------


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `permute`), giving HF's rotate_half layout.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3)...; HF rotates (x_i, x_{i+D/2}). The converter interleaves
    each head's two halves: reshape(H, 2, D/2, ...).swapaxes(1, 2). The inverse reads the rows as (H, D/2, 2, ...)
    and swaps back. A bias (1-D) is permuted the same way as its weight's rows.
    """
    rows, rest = weight.shape[0], weight.shape[1:]
    head_dim = rows // n_heads
    per_head = weight.reshape(n_heads, head_dim // 2, 2, *rest)  # (H, D/2, 2, ...): interleaved pairs
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(weight.shape)  # (H*D, ...): halves per head


# ---- the file --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GGUFWeights:
    """A GGUF file's config and state dict under Meta's names (no output.weight when tied)."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    quantization: str  # e.g. "Q4_1+Q8_0": the quantized types found, most common first
    header: GGUFHeader


def quantization_summary(header: GGUFHeader) -> str:
    """The tensor types of the file's matrices, most common first ("Q4_1+Q8_0"); 1-D norms are left out."""
    counts: dict[str, int] = {}
    for info in header.tensors:
        if len(info.shape) > 1:
            counts[info.type_name] = counts.get(info.type_name, 0) + 1
    return "+".join(sorted(counts, key=lambda name: -counts[name])) or "F32"


def _plan(header: GGUFHeader, config: ModelConfig) -> dict[str, GGUFTensorInfo]:
    """Map each expected Meta name to its descriptor; name what is missing, unexpected or mis-shaped."""
    path = header.path
    by_meta: dict[str, GGUFTensorInfo] = {}
    unexpected = []
    for info in header.tensors:
        name = gguf_to_ours(info.name)
        if name is None:
            if info.name not in _IGNORED:
                unexpected.append(info.name)
            continue
        by_meta[name] = info
    expected = expected_shapes(config)
    if config.tie_embeddings:
        by_meta.pop("output.weight", None)  # never present when tied (resolve decides tying from its absence)
    missing = [name for name in expected if name not in by_meta]
    unexpected += [by_meta[name].name for name in by_meta if name not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {_first(missing)}")
        if unexpected:
            parts.append(f"unexpected {_first(unexpected)}")
        raise CheckpointError(f"{path}: tensors do not match the LLaMA config in its header: {'; '.join(parts)}")
    for name, shape in expected.items():
        info = by_meta[name]
        if info.torch_shape != shape and not _one_row(info, shape):
            raise CheckpointError(
                f"{path}: tensor {info.name!r} has shape {info.torch_shape}, the header's config needs {shape}; "
                "the file is corrupt or not a LLaMA model"
            )
        check_decodable(info.ggml_type, info.name)  # before any decoding: nothing converted, nothing cached
    return {name: by_meta[name] for name in expected}


def _one_row(info: GGUFTensorInfo, shape: tuple[int, ...]) -> bool:
    """A (1, n) matrix the file holds as a vector of n (llama.cpp declares Qwen2-MoE's ffn_gate_inp_shexp {n_embd},
    HF's shared_expert_gate is (1, d)): read as the one row it is (`_dequantized`)."""
    return len(shape) == 2 and shape[0] == 1 and info.torch_shape == shape[1:]


def _first(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _reader(stack: ExitStack, header: GGUFHeader, reader: Reader | None) -> Reader:
    """`reader`, or the file opened (and checked against `header`) for as long as `stack` lasts."""
    return reader if reader is not None else stack.enter_context(GGUFSource(header))


def _file_order(plan: Mapping[str, GGUFTensorInfo]) -> list[tuple[str, GGUFTensorInfo]]:
    """The plan's tensors in the order their bytes lie in the file (a pass reading them so hashes the whole file)."""
    return sorted(plan.items(), key=lambda item: item[1].offset)


KernelPlan = str | Mapping[str, str]  # one kernel for every matrix, or {ggml type name: kernel}


def kernel_of(plan: KernelPlan, info: GGUFTensorInfo) -> str | None:
    """The kernel `plan` runs this matrix with, None when it has none that runs its type (dequantized)."""
    kernel = plan if isinstance(plan, str) else plan.get(info.type_name)
    if len(info.shape) == 3 and kernel not in BLOCK_KERNELS:  # experts run as stored on the C library's kernels only
        return None
    return kernel if kernel is not None and kernel in stored_kernels(info.ggml_type) else None


# The matrices the fused path multiplies as one product (contract.PACKS: Q|K|V, gate|up), one PackedWeight of their
# rows (weight_formats.concat_rows): that takes the C library's kernels in any mix, or one torch kernel on one format,
# and no dense matrix, so a group its kernels cannot join is dequantized whole.
_FUSED_GROUPS = tuple(pack.members for pack in PACKS)


def _fused_partners(name: str) -> tuple[str, ...]:
    """The Meta names multiplied in one product with `name` ("layers.3.attention.wk.weight" -> its layer's wq, wv),
    none for a matrix multiplied alone."""
    parts = name.split(".")
    if len(parts) != 5 or parts[0] != "layers":
        return ()
    role = f"{parts[2]}.{parts[3]}"
    group = next((g for g in _FUSED_GROUPS if role in g), ())
    return tuple(f"layers.{parts[1]}.{other}.weight" for other in group if other != role)


def stored_matrices(header: GGUFHeader, config: ModelConfig, kernel: KernelPlan
                    ) -> tuple[dict[str, str], dict[str, str]]:
    """Which of the file's matrices `kernel` (one kernel, or one per ggml type) runs as stored, and which are
    dequantized: ({Meta name: ggml type name} held as stored, {Meta name: ggml type name} dequantized). The 1-D
    tensors (norms, biases) are never packed."""
    packable, no_kernel, partners = matrix_split(header, config, kernel)
    return packable, {**no_kernel, **partners}


def matrix_split(header: GGUFHeader, config: ModelConfig, kernel: KernelPlan
                 ) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """The file's matrices ({Meta name: ggml type name} each) `kernel` runs as stored; those whose type it has no
    kernel for; and those it could run but that share one product with a matrix their kernel cannot join
    (_FUSED_GROUPS: e.g. a Q4_K_M file under int4pack, whose Q and K are Q4_K and V Q6_K, which int4pack does not
    run, or under "Q4_K:int4pack,Q6_K:native": Q|K|V is dequantized whole)."""
    packable, no_kernel, kernels = {}, {}, {}
    for name, info in _plan(header, config).items():
        if len(info.shape) < 2:
            continue
        kernels[name] = kernel_of(kernel, info)
        (packable if kernels[name] is not None else no_kernel)[name] = info.type_name
    partners = {}
    for name, type_name in packable.items():
        held = {(kernels.get(n), packable.get(n)) for n in (name, *_fused_partners(name)) if n in kernels}
        if not (all(k in BLOCK_KERNELS for k, _ in held) or len(held) == 1):
            partners[name] = type_name
    return {n: t for n, t in packable.items() if n not in partners}, no_kernel, partners


def matrix_infos(header: GGUFHeader, config: ModelConfig) -> dict[str, GGUFTensorInfo]:
    """The file's matrices (2-D tensors) under Meta's names, in the file's order of the expected tensors."""
    return {name: info for name, info in _plan(header, config).items() if len(info.shape) >= 2}


def load_gguf_stored(header: GGUFHeader, config: ModelConfig, dtype: torch.dtype, kernel: KernelPlan,
                     reader: Reader | None = None) -> tuple[dict[str, torch.Tensor], dict[str, PackedWeight]]:
    """The file's matrices as stored, for `kernel` (llmtrace.tracer.model.weight_formats), and the rest dense.

    Returns (dense state dict in `dtype`: norms, biases and any matrix whose type `kernel` cannot run, which is
    dequantized as load_gguf_weights does; {Meta name: PackedWeight} for the others, Q/K rows in HF's order).
    `reader`: what the bytes are read through (a gguf_source.TensorReads pass hashes them); by default the file.
    """
    plan = _plan(header, config)
    packable, _ = stored_matrices(header, config, kernel)
    dense: dict[str, torch.Tensor] = {}
    packed: dict[str, PackedWeight] = {}
    with ExitStack() as stack:
        reads = _reader(stack, header, reader)
        mappable = _mappable(header, config, reads, plan, packable, kernel)
        mapped = FileMap(reads) if mappable else None  # type: ignore[arg-type]  # _mappable maps only a GGUFSource
        if mapped is not None and not mapped.guarded:  # no handler would turn a truncation into one line: pread
            mapped, mappable = None, set()
        in_file = {n for n in mappable if _as_stored(header, config, kernel, n, plan[n])}
        arena, slots = _arena_slots(plan, [n for n in packable if _multiplied(n, config) and n not in in_file],
                                    kernel)
        if arena is not None:  # its pages faulted in from the far end while the matrices fill it from the front
            stack.enter_context(arena.populating())
        ranges = {n: (header.data_offset + plan[n].offset, plan[n].n_bytes) for n in mappable}
        if mapped is not None:
            slots.update({n: mapped.view(*ranges[n]) for n in in_file})
            stack.enter_context(mapped.populating([ranges[n] for n, _ in _file_order(plan) if n in in_file]))
        for name, info in _file_order(plan):
            if name not in packable:
                tensor = _dequantized(header, config, reads, name, info)
                dense[name] = tensor if dtype == torch.float32 else tensor.to(dtype)
            else:
                packed[name] = _packed(header, config, reads, name, info,
                                       held_kernel(name, config, kernel_of(kernel, info)),  # type: ignore[arg-type]
                                       slots.get(name), name in in_file,
                                       *_map_of(mapped, ranges.get(name)))
            load_progress.advance(info.n_bytes)
    return {n: dense[n] for n in plan if n in dense}, {n: packed[n] for n in plan if n in packed}


def _map_of(mapped: FileMap | None, where: tuple[int, int] | None
            ) -> tuple[np.ndarray | None, Callable[[int, int], None]]:
    """A mapped matrix's bytes in the file's map and what gives back the pages of a part copied out of them (bytes
    start.. of the matrix: they leave this process's RSS, the page cache keeps them); (None, nothing) unmapped."""
    if mapped is None or where is None:
        return None, lambda start, nbytes: None
    base, nbytes = where
    return mapped.view(base, nbytes), lambda start, length: mapped.release(base + start, length)


def _mappable(header: GGUFHeader, config: ModelConfig, reads: Reader, plan: Mapping[str, GGUFTensorInfo],
              packable: Iterable[str], kernel: KernelPlan) -> set[str]:
    """The matrices read through the file's private map (tracer/load/file_map.py): every 2-D one a block kernel
    runs, when the load reads the file itself (not a pass that hashes it for a cache entry, not a --tp shard) and
    the native library, whose SIGBUS handler guards the map, is loaded on Linux. Those the kernels read as the file
    stores them (_as_stored) are held there in place; the rest (i8dot's interleaved Q4_0/Q4_1, Q/K rows that
    llama.cpp permuted) are written from it into the weight arena in one pass, with no read into a scratch buffer.
    3-D expert tensors are read with pread."""
    if type(reads) is not GGUFSource or reads.header is not header or not sys.platform.startswith("linux"):
        return set()
    held = {name for name in packable if len(plan[name].torch_shape) == 2
            and held_kernel(name, config, kernel_of(kernel, plan[name])) in BLOCK_KERNELS}  # type: ignore[arg-type]
    return held if held and native_kernel.available() else set()  # (a block kernel's plan has the library)


def _as_stored(header: GGUFHeader, config: ModelConfig, kernel: KernelPlan, name: str, info: GGUFTensorInfo) -> bool:
    """Whether a mapped matrix is held in place, its blocks read as the file stores them: not i8dot's interleaved
    Q4_0/Q4_1, not Q/K rows llama.cpp permuted."""
    block = held_kernel(name, config, kernel_of(kernel, info))  # type: ignore[arg-type]
    return not _groups_held(block, info) and _rope_heads(header, config, name) is None


def _multiplied(name: str, config: ModelConfig) -> bool:
    """Whether a run multiplies by this matrix: all but an untied embedding, which is only looked up row by row (a
    copy in the weight arena would hold bytes no product streams)."""
    return name != "tok_embeddings.weight" or config.tie_embeddings


def held_kernel(name: str, config: ModelConfig, kernel: str) -> str:
    """The kernel a matrix is held for: `kernel`, except that an untied embedding under one of the C library's
    kernels is held for "native": it is only looked up, and a lookup dequantizes its rows exactly whichever kernel
    (i8dot's would make an interleaved copy of the whole table for the decode step's description, read by nothing:
    74 MB at 7B, 295 MB at 8B)."""
    return NATIVE if kernel in BLOCK_KERNELS and not _multiplied(name, config) else kernel


def stored_model(config: ModelConfig, dense: Mapping[str, torch.Tensor], packed: Mapping[str, PackedWeight]
                 ) -> Transformer:
    """The model of load_gguf_stored's pair (dense tensors, matrices as stored): a meta shell that adopts them
    (Transformer.load_stored), for inference only: what `run` loads."""
    model = build_meta_model(config)
    model.load_stored(dense, packed)
    model.requires_grad_(False)
    return model.eval()


def pack_matrices(header: GGUFHeader, config: ModelConfig, names: list[str], kernel: KernelPlan | None
                  ) -> dict[str, PackedWeight | torch.Tensor]:
    """The matrices `names` alone (a sample for measuring kernels, tracer/load/stored_candidates.py): packed for
    `kernel`, or with kernel None dequantized exactly to fp32 tensors; Q/K rows in HF's order as the model holds
    them. Only these tensors' bytes are read."""
    plan = _plan(header, config)
    slots = {} if kernel is None else _arena_slots(plan, names, kernel)[1]  # the memory a run reads them from
    out: dict[str, PackedWeight | torch.Tensor] = {}
    with GGUFSource(header) as source:
        for name in names:
            info = plan[name]
            out[name] = (_dequantized(header, config, source, name, info) if kernel is None
                         else _packed(header, config, source, name, info, kernel_of(kernel, info),  # type: ignore[arg-type]
                                      slots.get(name)))
    return out


def exact_rows(header: GGUFHeader, config: ModelConfig, name: str, rows: int) -> torch.Tensor:
    """Matrix `name`'s first `rows` rows in the model's (HF's) order, dequantized exactly to fp32: tune's accuracy
    probe, which need not hold a 7B LM head whole (0.5 GB in fp32). Only those rows' bytes are read, unless llama.cpp
    interleaved the tensor's Q/K rows (then the whole tensor, at most a dim x dim matrix, is read and reordered)."""
    info = _plan(header, config)[name]
    with GGUFSource(header) as source:
        if _rope_heads(header, config, name) is not None or rows >= info.torch_shape[0]:
            return _dequantized(header, config, source, name, info)[:rows].clone()
        row_bytes = info.n_bytes // info.torch_shape[0]
        raw = source.read(header.data_offset + info.offset, rows * row_bytes)
    values = dequantize(raw, info.ggml_type, info.shape[0], info.name)
    return torch.from_numpy(values.reshape(rows, info.torch_shape[1]))


def _raw(header: GGUFHeader, reads: Reader, info: GGUFTensorInfo, out: np.ndarray | None = None) -> np.ndarray:
    return reads.read(header.data_offset + info.offset, info.n_bytes, out)


def _rope_heads(header: GGUFHeader, config: ModelConfig, name: str) -> int | None:
    """The head count whose Q/K rows llama.cpp interleaved in this tensor, None when it did not."""
    rope_heads = tensor_of(name).rope_heads
    if rope_heads is None or header.metadata.get("general.architecture") != "llama":
        return None
    return dims(config)[rope_heads]


def _dequantized(header: GGUFHeader, config: ModelConfig, reads: Reader, name: str,
                 info: GGUFTensorInfo) -> torch.Tensor:
    values = dequantize(_raw(header, reads, info), info.ggml_type, info.shape[0], info.name)
    if not np.isfinite(values).all():
        raise FileFormatError(f"{header.path}: tensor {info.name!r} holds NaN or infinite values; the file is "
                              "corrupt")
    matrix = values.reshape(held_shape(tensor_of(name), config))  # a (1, n) matrix held as n: its one row
    heads = _rope_heads(header, config, name)
    if heads is not None:
        matrix = unpermute_rope_rows(matrix, heads)
    if config.norm_plus_one and tensor_of(name).group in ("norm", "final_norm"):
        # llama.cpp's converter stores a Gemma norm's 1 + w (Gemma3Model.modify_tensors); the model holds HF's w.
        # In fp32, (1 + w) - 1 is exact for 1 + w >= 0.5 (Sterbenz), and the model's 1 + w gives it back
        matrix = matrix - np.float32(1.0)
    return torch.from_numpy(matrix)


def _groups_held(kernel: str, info: GGUFTensorInfo) -> bool:
    """Whether a run reads this matrix's decode products from i8dot's interleaved copy (Q4_0, Q4_1 under i8dot)."""
    return kernel == I8DOT and reads_groups(info.ggml_type, native_kernel.INT8_X)


def _arena_slots(plan: Mapping[str, GGUFTensorInfo], names: Iterable[str], kernel: KernelPlan
                 ) -> tuple[WeightArena | None, dict[str, np.ndarray]]:
    """The arena (None when no matrix needs one) and each matrix of `names` that a block kernel reads as stored (native, i8dot, i16dot: the file's own blocks),
    given its room in one WeightArena (tracer/load/weight_arena.py says why they are copied): its bytes, as the file
    stores them or for i8dot's Q4_0/Q4_1 interleaved in place (the same size). Taken in the order of `names`, the
    model's: the arena's layout does not depend on the order the file is read in."""
    infos = {name: plan[name] for name in names if kernel_of(kernel, plan[name]) in BLOCK_KERNELS}
    if not infos:
        return None, {}
    arena = WeightArena(sum(info.n_bytes for info in infos.values()), len(infos))
    return arena, {name: arena.take(info.n_bytes) for name, info in infos.items()}


# The bytes read at a time into a scratch buffer that stays in the cache while its rows are checked, put in the
# model's row order and (i8dot's Q4_0/Q4_1) interleaved into the arena: one pass over each matrix, one copy of it.
_PIECE_BYTES = 1 << 19


def _packed(header: GGUFHeader, config: ModelConfig, reads: Reader, name: str, info: GGUFTensorInfo,
            kernel: str, slot: np.ndarray | None = None, in_file: bool = False, mapped: np.ndarray | None = None,
            release: Callable[[int, int], None] = lambda start, nbytes: None) -> PackedWeight | ExpertWeights:
    """One matrix packed for `kernel`; a block kernel's blocks read into their `slot` of the weight arena when
    given (_arena_slots), i8dot's Q4_0/Q4_1 interleaved in place there: the only copy the run holds; `in_file`:
    the slot is the matrix's own bytes in the file's map (_as_stored), only checked; `mapped`: the matrix's bytes
    in the file's map, which the arena's copy is written from (else they are read with pread), `release(start,
    nbytes)` giving back the pages of bytes of it copied. A mixture of experts' 3-D tensor (E, N, K):
    `_packed_experts`."""
    if len(info.torch_shape) == 3:
        return _packed_experts(header, reads, info, kernel, slot)
    out_features, in_features = info.torch_shape
    _, block, block_bytes = GGML_TYPES[info.ggml_type]
    row_bytes = in_features // block * block_bytes
    heads = _rope_heads(header, config, name)
    if slot is not None:
        held = slot.reshape(out_features, row_bytes)
        interleaved = _groups_held(kernel, info)
        if in_file:
            if not _scales_finite(info.ggml_type, held):
                raise _nan_scales(header, info)
            return pack_gguf(held, info.ggml_type, in_features, kernel)
        from_map = None if mapped is None else _hold_mapped(info.ggml_type, mapped.reshape(out_features, row_bytes),
                                                            heads, held, in_features, interleaved, release)
        if from_map is False or (from_map is None and not _read_held(header, reads, info, heads, held, interleaved)):
            raise _nan_scales(header, info)
        return pack_gguf(held, info.ggml_type, in_features, kernel, interleaved=interleaved)
    rows = _raw(header, reads, info).reshape(out_features, row_bytes)  # (N, B)
    if heads is not None:
        rows = unpermute_rope_rows(rows, heads)  # whole rows move: the blocks stay intact
    weight = pack_gguf(rows, info.ggml_type, in_features, kernel)
    if not finite_scales(weight):
        raise _nan_scales(header, info)
    return weight


def _scales_finite(code: int, blocks: np.ndarray) -> bool:
    """rows_scales_finite, in the native library's one pass on torch's threads where it reads the type."""
    found = native_kernel.scales_finite(code, blocks) if native_kernel.available() else None
    return rows_scales_finite(code, blocks) if found is None else found


# Rows written from the file's map at a time before their map pages are released (about): a big matrix (Llama 3.2
# 1B's tied 128k-row embedding, 148 MB in Q4_0) is not resident twice, map and arena, at the end of its pass.
_MAP_PIECE_BYTES = 32 << 20


def _hold_mapped(code: int, mapped: np.ndarray, heads: int | None, held: np.ndarray, k: int, interleaved: bool,
                 release: Callable[[int, int], None]) -> bool | None:
    """A matrix's rows from the file's map (`mapped`, (rows, bytes per row)) into `held`, its room in the arena, in
    the model's row order (Q/K rows unpermuted as _read_held does: llama.cpp's rows 2i and 2i+1 of a head are HF's
    rows i and D/2 + i), `interleaved`: i8dot's groups (native_kernel.hold_groups, one C pass), piece by piece,
    each piece's map pages then given back (`release(start, nbytes)`, bytes of the matrix). Whether every scale is
    finite; None when the heads' halves are not whole groups (the caller reads instead)."""
    rows, row_bytes = held.shape
    unit = rows // heads if heads is not None else 0
    if heads is not None and (rows % heads or unit % (2 * native_kernel.GROUP_ROWS if interleaved else 2)):
        return None
    together = unit or native_kernel.GROUP_ROWS  # rows that move together: a head, or a group
    per = max(1, _MAP_PIECE_BYTES // (together * row_bytes)) * together
    finite = True
    for first in range(0, rows, per):
        rows_in, rows_out = mapped[first:first + per], held[first:first + per]
        if interleaved:
            # one thread, as the copy it replaces: the arena's populating thread faults its huge pages in from the
            # far end on the other core, and two writers beside it ran the 7B Q4_0 load no faster (BENCHMARKS.md,
            # issue 31, helper H2; the decode slowdown seen then on a busy host did not hold on a quiet one)
            finite = native_kernel.hold_groups(code, rows_in, k, rows_out, unit, threads=1) and finite
        else:
            for head in range(0, rows_in.shape[0], unit or rows_in.shape[0]):
                if not unit:
                    rows_out[...] = rows_in
                    continue
                half = unit // 2  # HF's first half of a head is llama.cpp's even rows, its second the odd ones
                for h in (0, 1):
                    rows_out[head + h * half:head + (h + 1) * half] = rows_in[head + h:head + unit:2]
            finite = _scales_finite(code, rows_out) and finite
        release(first * row_bytes, rows_in.nbytes)
    return finite


def _packed_experts(header: GGUFHeader, reads: Reader, info: GGUFTensorInfo, kernel: str,
                    slot: np.ndarray | None) -> ExpertWeights:
    """A 3-D ffn_*_exps tensor (E, N, K) for a block kernel: its E*N rows read into `slot` (or a buffer of their own),
    expert by expert, each expert's rows a PackedWeight over its byte range there (i8dot's Q4_0/Q4_1 interleaved in
    groups of sixteen of that expert's rows, as a matrix of its own is). Nothing is dequantized."""
    experts, out_features, in_features = info.torch_shape
    _, block, block_bytes = GGML_TYPES[info.ggml_type]
    row_bytes = in_features // block * block_bytes
    held = (slot if slot is not None else np.empty(info.n_bytes, dtype=np.uint8)).reshape(experts * out_features,
                                                                                        row_bytes)
    interleaved = _groups_held(kernel, info)
    packed = []
    for expert in range(experts):
        rows = held[expert * out_features:(expert + 1) * out_features]
        if not _read_held(header, reads, info, None, rows, interleaved, base=expert * out_features * row_bytes):
            raise _nan_scales(header, info)
        packed.append(pack_gguf(rows, info.ggml_type, in_features, kernel, interleaved=interleaved))
    return ExpertWeights(tuple(packed))


def _nan_scales(header: GGUFHeader, info: GGUFTensorInfo) -> FileFormatError:
    return FileFormatError(f"{header.path}: tensor {info.name!r} holds NaN or infinite scales; the file is corrupt")


def _read_held(header: GGUFHeader, reads: Reader, info: GGUFTensorInfo, heads: int | None, held: np.ndarray,
               interleaved: bool, base: int = 0) -> bool:
    """Read a matrix's rows into `held` ((rows, bytes per row) uint8, its room in the arena) piece by piece, in the
    model's row order (Q/K rows unpermuted: llama.cpp's rows 2i and 2i+1 of a head are HF's rows i and D/2 + i),
    `interleaved`: each whole group of native_kernel.GROUP_ROWS rows in native_kernel.interleave's order, the rows
    after the last as stored. Whether every fp16 scale and min read is finite (checked on each piece while it is in the cache).
    `base`: where the rows start in the tensor's bytes (one expert's of a 3-D tensor; 0 for a matrix)."""
    rows, row_bytes = held.shape
    code = info.ggml_type
    group = native_kernel.GROUP_ROWS
    unit = rows // heads if heads is not None else group  # a head's rows move together; groups are GROUP_ROWS rows
    if heads is not None and (rows % heads or unit % (2 * group if interleaved else 2)):
        # a head whose halves are not whole groups (no LLaMA's): the rows unpermuted first, then placed
        rows_read = unpermute_rope_rows(_raw(header, reads, info).reshape(rows, row_bytes), heads)
        _place(code, rows_read, held, info.torch_shape[-1], interleaved)
        return rows_scales_finite(code, rows_read)
    if heads is None and not interleaved:  # the rows as stored: straight into the arena, checked there
        finite = True
        per = max(1, _PIECE_BYTES // row_bytes)
        for first in range(0, rows, per):
            piece = held[first:first + per]
            _raw_range(header, reads, info, base + first * row_bytes, piece)
            finite = finite and rows_scales_finite(code, piece)
        return finite
    per = max(1, _PIECE_BYTES // (unit * row_bytes)) * unit
    scratch = np.empty((min(per, rows), row_bytes), dtype=np.uint8)
    finite = True
    for first in range(0, rows, per):
        piece = scratch[:min(per, rows - first)]
        _raw_range(header, reads, info, base + first * row_bytes, piece)
        finite = finite and rows_scales_finite(code, piece)
        if heads is None:
            _place(code, piece, held[first:first + piece.shape[0]], info.torch_shape[-1], interleaved)
            continue
        half = unit // 2
        for head in range(0, piece.shape[0], unit):
            for h in (0, 1):  # HF's first half of the head is llama.cpp's even rows, its second the odd ones
                at = first + head + h * half
                _place(code, piece[head + h:head + unit:2], held[at:at + half], info.torch_shape[-1], interleaved)
    return finite


def _place(code: int, rows: np.ndarray, out: np.ndarray, k: int, interleaved: bool) -> None:
    """`rows` (any row stride) into `out` (contiguous rows of the same width): interleaved in groups of GROUP_ROWS
    where `interleaved` (its rows' whole groups; out's first row must start a group of the matrix), else as they
    are."""
    if not interleaved:
        out[...] = rows
        return
    whole = rows.shape[0] // native_kernel.GROUP_ROWS * native_kernel.GROUP_ROWS
    if whole:
        native_kernel.interleave(code, torch.from_numpy(rows[:whole]), k, torch.from_numpy(out[:whole].reshape(-1)))
    out[whole:] = rows[whole:]


def _raw_range(header: GGUFHeader, reads: Reader, info: GGUFTensorInfo, start: int, out: np.ndarray) -> None:
    """Bytes start.. of a tensor's data into `out` (contiguous uint8 rows)."""
    reads.read(header.data_offset + info.offset + start, out.nbytes, out)


def load_gguf_weights(header: GGUFHeader, config: ModelConfig, dtype: torch.dtype = torch.float32,
                      reader: Reader | None = None) -> GGUFWeights:
    """Read, dequantize and rename every tensor of a LLaMA GGUF file; Q/K in HF's rotate_half layout.

    `header` and `config` are the file's, parsed once by the caller (llmtrace.tracer.checkpoint.resolve.resolve_model
    gives both). Values are decoded in fp32 and each tensor is cast to `dtype` as soon as it is decoded, so the peak
    memory is the result plus one fp32 tensor and one tensor's bytes. `reader`: what the bytes are read through, in
    the file's order (a gguf_source.TensorReads pass hashes them); by default the file, opened here.
    """
    plan = _plan(header, config)
    state: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        reads = _reader(stack, header, reader)
        for name, info in _file_order(plan):
            tensor = _dequantized(header, config, reads, name, info)
            state[name] = tensor if dtype == torch.float32 else tensor.to(dtype)
            load_progress.advance(info.n_bytes)
    return GGUFWeights(config=config, state_dict={name: state[name] for name in plan},
                       quantization=quantization_summary(header), header=header)
