"""Turn a `--model` argument (preset name, model folder, config.json, .gguf file) into a ModelConfig, reading no weights."""

from __future__ import annotations

from pathlib import Path

from tracer.config import ModelConfig
from tracer.errors import ConfigError
from tracer.gguf_header import GGUFHeader, read_gguf_header
from tracer.presets import PRESETS, get_preset


def config_from_gguf_header(header: GGUFHeader) -> ModelConfig:
    """Config from GGUF metadata; tied embeddings when the file has no separate `output.weight`."""
    names = {t.name for t in header.tensors}
    meta = dict(header.metadata)
    meta["_llmtrace.tied"] = "output.weight" not in names
    name = str(meta.get("general.name") or Path(header.path).stem)
    return ModelConfig.from_gguf_metadata(meta, name=name, source=header.path)


def resolve_config(spec: str) -> ModelConfig:
    """A preset name, or a path to a model folder, a config.json or a .gguf file."""
    if spec.strip().lower() in PRESETS:
        return get_preset(spec)
    path = Path(spec).expanduser()
    if not path.exists():
        return get_preset(spec)  # raises UnknownPresetError with the nearest names
    if path.is_dir():
        if (path / "config.json").exists():
            return ModelConfig.from_hf_json(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return config_from_gguf_header(read_gguf_header(ggufs[0]))
        raise ConfigError(f"{path}: folder has no config.json (nor a single .gguf file); pass a LLaMA model folder")
    if path.suffix == ".gguf":
        return config_from_gguf_header(read_gguf_header(path))
    if path.suffix == ".json":
        return ModelConfig.from_hf_json(path)
    raise ConfigError(f"{path}: not a model folder, config.json or .gguf file; pass one of those or a preset name")
