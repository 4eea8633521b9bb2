"""Turn a `--model` argument (preset name, model folder, config.json, .gguf file) into a ModelConfig, reading no weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import gguf_tensor_flags
from llmtrace.tracer.core.errors import ConfigError
from llmtrace.tracer.core.presets import PRESETS, get_preset

if TYPE_CHECKING:  # the header readers are imported when a path is given: a preset needs none of them
    from llmtrace.tracer.checkpoint.gguf_header import GGUFHeader
    from llmtrace.tracer.checkpoint.weights_summary import WeightsSummary


# Output records, read field by field and through asdict(): eq=False and repr=False spare compiling __eq__,
# __hash__ and __repr__ for each at import, which the analytical commands (answering in a blink) feel.
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ResolvedModel:
    """A --model argument turned into its config, plus what its checkpoint holds (None for a preset)."""

    config: ModelConfig
    weights: WeightsSummary | None
    kind: str  # "preset" | "hf" | "gguf"
    path: str | None  # the model folder, config.json or .gguf file; None for a preset


def config_from_gguf_header(header: GGUFHeader) -> ModelConfig:
    """Config from GGUF metadata; tied embeddings when the file has no separate `output.weight`, biases when its
    layers hold them (contract.gguf_tensor_flags)."""
    names = {t.name for t in header.tensors}
    meta = dict(header.metadata)
    meta["_llmtrace.tied"] = "output.weight" not in names
    meta.update((f"_llmtrace.{flag}", on) for flag, on in gguf_tensor_flags(names).items())
    name = str(meta.get("general.name") or Path(header.path).stem)
    return ModelConfig.from_gguf_metadata(meta, name=name, source=header.path)


def resolve_config(spec: str) -> ModelConfig:
    """A preset name, or a path to a model folder, a config.json or a .gguf file."""
    return resolve_model(spec).config


def _safetensors_weights(folder: Path) -> WeightsSummary | None:
    """What the folder's safetensors headers hold, or None when it has no safetensors files."""
    from llmtrace.tracer.checkpoint.safetensors_header import INDEX_NAME, read_safetensors_checkpoint
    from llmtrace.tracer.checkpoint.weights_summary import summarize_safetensors

    if not ((folder / INDEX_NAME).exists() or any(folder.glob("*.safetensors"))):
        return None
    return summarize_safetensors(read_safetensors_checkpoint(folder))


def _from_gguf(path: Path) -> ResolvedModel:
    from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
    from llmtrace.tracer.checkpoint.weights_summary import summarize_gguf

    header = read_gguf_header(path)
    return ResolvedModel(config_from_gguf_header(header), summarize_gguf(header), "gguf", str(path))


def resolve_model(spec: str) -> ResolvedModel:
    """Like resolve_config, plus the checkpoint's real parameter count and dtypes from its headers (no tensor data)."""
    if spec.strip().lower() in PRESETS:
        return ResolvedModel(get_preset(spec), None, "preset", None)
    from llmtrace.tracer.checkpoint.hub_cache import cached_model_for

    cached = cached_model_for(spec)
    if cached is not None:  # an org/name Hub id: its snapshot in the local HF cache, named by the id
        found = resolve_model(str(cached.path))
        return ResolvedModel(found.config.with_name(cached.name), found.weights, found.kind, found.path)
    path = Path(spec).expanduser()
    if not path.exists():
        if "/" in spec or "\\" in spec or path.suffix in (".json", ".gguf", ".safetensors"):
            raise ConfigError(f"{spec}: no such file or folder; check the path, or pass a preset name")
        return ResolvedModel(get_preset(spec), None, "preset", None)  # raises UnknownPresetError with nearest names
    if path.is_dir():
        if (path / "config.json").exists():
            return ResolvedModel(ModelConfig.from_hf_json(path), _safetensors_weights(path), "hf", str(path))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0])
        raise ConfigError(f"{path}: folder has no config.json (nor a single .gguf file); pass a LLaMA model folder")
    if path.suffix == ".gguf":
        return _from_gguf(path)
    if path.suffix == ".json":
        return ResolvedModel(ModelConfig.from_hf_json(path), _safetensors_weights(path.parent), "hf", str(path))
    raise ConfigError(f"{path}: not a model folder, config.json or .gguf file; pass one of those or a preset name")
