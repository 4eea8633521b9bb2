"""What a `--model` argument names, classified once for every command, and its config read from headers only.

`classify_model` is the one place that decides what a --model argument is: flops, kvmem, roofline, run (with and
without --dry-run) and the loader all start from its ModelSource, so every command accepts the same inputs and
refuses the rest with the same one-line error. Tried in this order:
1. a preset name (llmtrace.tracer.core.presets), case-insensitive;
2. a folder: an HF model folder (config.json inside), else a folder holding exactly one .gguf file;
3. a file: a GGUF file, recognised by its magic bytes whatever its name (a `.gguf` name without them is read as
   GGUF too, so its header reader says what is wrong); a config.json (any `.json`); a `.safetensors` file inside an
   HF model folder, which names that folder;
4. nothing on disk: a Hugging Face Hub id (org/name, org/name@revision, org/name:file.gguf) found in the local HF
   cache (llmtrace.tracer.checkpoint.hub_cache; never downloaded) is the HF folder or GGUF file it stands for, named
   by its id; else "no such file or folder" when it looks like a path, else the nearest preset names.
A new kind of --model is one more branch in `classify_model` (and one in `resolve_model` when its config is read
another way).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import gguf_tensor_flags
from llmtrace.tracer.core.errors import ConfigError, FileFormatError
from llmtrace.tracer.core.presets import PRESETS, get_preset

if TYPE_CHECKING:  # the header readers are imported when a path is given: a preset needs none of them
    from llmtrace.tracer.checkpoint.gguf_header import GGUFHeader
    from llmtrace.tracer.checkpoint.weights_summary import WeightsSummary

# The kinds of model a --model argument can name.
PRESET = "preset"
HF = "hf"  # an HF model folder: config.json + safetensors
GGUF = "gguf"

_PATH_SUFFIXES = (".gguf", ".json", ".safetensors")


# Records read field by field: eq=False and repr=False spare compiling __eq__, __hash__ and __repr__ for each at
# import, which the analytical commands (answering in a blink) feel.
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ModelSource:
    """A --model argument, classified: the kind of model it names and where that lies (read: a stat, 4 bytes)."""

    kind: str  # PRESET | HF | GGUF
    spec: str  # the argument as given
    path: Path | None = None  # GGUF: the file; HF: the model folder; None for a preset
    config_path: Path | None = None  # HF: the config.json to read (the folder's, or the .json file given)
    name: str | None = None  # what to call the model when not what its files say (a Hub id: the repo id)
    origin: str | None = None  # where it was found, when not `path` itself (a Hub id: the cache and commit)

    @property
    def preset(self) -> ModelConfig:
        """A preset's config (its name, matched case-insensitively)."""
        return get_preset(self.spec)


def classify_model(spec: str) -> ModelSource:
    """What `spec` names (see the module docstring), or the one-line error every command gives for it."""
    if spec.strip().lower() in PRESETS:
        return ModelSource(PRESET, spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _folder(spec, path)
    if path.is_file():
        return _file(spec, path)
    if path.exists():  # a device, a FIFO...
        raise ConfigError(f"{path}: not a regular file or folder; pass a model folder, a .gguf file or a preset "
                          "name")
    # Nothing on disk by that name: a kind named otherwise is recognised here, as the folder or file it stands for.
    from llmtrace.tracer.checkpoint.hub_cache import cached_model_for

    cached = cached_model_for(spec)  # an org/name Hub id not in the cache raises, saying how to fetch it
    if cached is not None:
        return replace(classify_model(str(cached.path)), spec=spec, name=cached.name, origin=cached.description)
    if _looks_like_path(spec):
        raise ConfigError(f"{spec}: no such file or folder; check the path, or pass a preset name")
    return ModelSource(PRESET, get_preset(spec).name)  # get_preset raises UnknownPresetError, naming the nearest


def _folder(spec: str, folder: Path) -> ModelSource:
    if (folder / "config.json").is_file():
        return ModelSource(HF, spec, folder, folder / "config.json")
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(GGUF, spec, ggufs[0])
    raise ConfigError(f"{folder}: folder has no config.json (nor a single .gguf file); pass a LLaMA model folder")


def _file(spec: str, file: Path) -> ModelSource:
    if _has_gguf_magic(file) or file.suffix == ".gguf":
        return ModelSource(GGUF, spec, file)
    if file.suffix == ".json":
        return ModelSource(HF, spec, file.parent, file)
    if file.suffix == ".safetensors":
        if (file.parent / "config.json").is_file():
            return ModelSource(HF, spec, file.parent, file.parent / "config.json")
        raise ConfigError(f"{file}: a safetensors file needs the config.json of its model beside it; pass the model "
                          "folder (config.json + safetensors)")
    raise ConfigError(f"{file}: not a model folder, config.json or GGUF file; pass one of those or a preset name")


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or "\\" in spec or spec.startswith((".", "~")) or spec.endswith(_PATH_SUFFIXES)


def _has_gguf_magic(file: Path) -> bool:
    from llmtrace.tracer.checkpoint.gguf_header import GGUF_MAGIC

    try:
        with file.open("rb") as fh:
            return fh.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def bundled_source() -> ModelSource:
    """The bundled default model (SmolLM2-135M-Instruct Q4_1 GGUF), for a `run` without --model."""
    from llmtrace.tracer.checkpoint.bundled import bundled_model_path

    path = bundled_model_path()
    return ModelSource(GGUF, str(path), path)


# ---- the config, from headers only -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ResolvedModel:
    """A --model argument turned into its config, plus what its checkpoint holds (None for a preset)."""

    config: ModelConfig
    weights: WeightsSummary | None
    source: ModelSource
    # GGUF: the header the config came from, parsed once and shared with the tokenizer and the weights loader
    # (with its vocabulary when resolve_model was asked for it); None otherwise.
    gguf_header: GGUFHeader | None = None

    @property
    def kind(self) -> str:
        return self.source.kind

    @property
    def path(self) -> str | None:
        """The GGUF file or the HF model folder; None for a preset."""
        return str(self.source.path) if self.source.path is not None else None


def resolve_model(model: str | ModelSource, vocabulary: bool = False) -> ResolvedModel:
    """The config of what `model` names and its checkpoint's real parameter count and dtypes, from headers only
    (no tensor data). vocabulary: keep a GGUF's arrays (its tokenizer), which a config alone does not need."""
    source = classify_model(model) if isinstance(model, str) else model
    header = None
    if source.kind == PRESET:
        return ResolvedModel(source.preset, None, source)
    if source.kind == HF:
        assert source.path is not None and source.config_path is not None
        config, weights = ModelConfig.from_hf_json(source.config_path), _safetensors_weights(source.path)
    elif source.kind == GGUF:
        from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
        from llmtrace.tracer.checkpoint.packed_tensors import split_gguf
        from llmtrace.tracer.checkpoint.weights_summary import summarize_gguf

        assert source.path is not None
        header = read_gguf_header(source.path, decode_arrays=vocabulary)
        config = config_from_gguf_header(header)
        header = split_gguf(header, config)  # a phi3 file's Q|K|V and gate|up: the members' rows, read as such
        weights = summarize_gguf(header)
    else:  # pragma: no cover
        raise AssertionError(f"unhandled model kind {source.kind!r}")
    if source.name is not None:  # a Hub id: named by its repo id, not by its snapshot's commit hash
        config = config.with_name(source.name)
    return ResolvedModel(config, weights, source, header)


def config_from_gguf_header(header: GGUFHeader) -> ModelConfig:
    """Config from GGUF metadata; tied embeddings when the file has no separate `output.weight`, biases when its
    layers hold them (contract.gguf_tensor_flags)."""
    names = {t.name for t in header.tensors}
    meta = dict(header.metadata)
    meta["_llmtrace.tied"] = "output.weight" not in names
    meta.update((f"_llmtrace.{flag}", on) for flag, on in gguf_tensor_flags(names).items())
    meta.update(_rope_factors(header))
    return ModelConfig.from_gguf_metadata(meta, name=gguf_model_name(header.path), source=header.path)


_FACTOR_TENSORS = {"rope_factors_short.weight": "rope_factors_short", "rope_factors_long.weight": "rope_factors_long",
                   "rope_freqs.weight": "rope_freqs"}


def _rope_factors(header: GGUFHeader) -> dict[str, tuple[float, ...]]:
    """RoPE's per-frequency factors where the file holds them, as `_llmtrace.<name>`: LongRoPE's (Phi-3's 128k models:
    the F32 tensors rope_factors_short.weight and rope_factors_long.weight) and `rope_freqs.weight` (how llama.cpp's
    converter stores Llama 3.1's scaling: no metadata key says it), a few hundred bytes each. The config needs them
    before any weight is read (a dry run reads none)."""
    factors = {}
    for info in header.tensors:
        kind = _FACTOR_TENSORS.get(info.name)
        if kind is None:
            continue
        if info.ggml_type != 0 or len(info.shape) != 1 or info.shape[0] > 4096:  # 0: F32
            raise FileFormatError(f"{header.path}: {info.name} is {info.type_name} {list(info.shape)}; RoPE's "
                                  "factors are one F32 vector")
        with open(header.path, "rb") as file:
            data = os.pread(file.fileno(), 4 * info.shape[0], header.data_offset + info.offset)
        if len(data) != 4 * info.shape[0]:
            raise FileFormatError(f"{header.path}: {info.name} runs past the end of the file")
        factors[f"_llmtrace.{kind}"] = struct.unpack(f"<{info.shape[0]}f", data)
    return factors


# llama.cpp's file names end in the quantization ("SmolLM2-135M-Instruct.Q4_1.gguf", "x-Q4_K_M.gguf"): the header's
# weights line says that part already.
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d[0-9A-Z_]*|T?Q\d_\d|BF16|F16|F32|MXFP4|NVFP4)$", re.I)


def gguf_model_name(path: str | Path) -> str:
    """What to call a GGUF's model: its file name without `.gguf` and the quantization suffix. Not the file's
    `general.name` ("Smollm2 135M 8k Lc100K Mix1 Ep2"): the user named the file, and every view uses one name."""
    stem = Path(path).name.removesuffix(".gguf")
    return _QUANT_SUFFIX.sub("", stem) or stem


def model_name(source: ModelSource) -> str:
    """The model's name in every view and in the loading spinner: a Hub id as given, a preset's name, a GGUF's file
    name (gguf_model_name), an HF folder's name (as ModelConfig.from_hf_json names it)."""
    if source.name is not None:
        return source.name
    if source.kind == PRESET:
        return source.preset.name
    if source.kind == GGUF and source.path is not None:
        return gguf_model_name(source.path)
    if source.config_path is not None:
        file = source.config_path
        return file.parent.name if file.name == "config.json" else file.stem
    return source.spec


def _safetensors_weights(folder: Path) -> WeightsSummary | None:
    """What the folder's safetensors headers hold, or None when it has no safetensors files."""
    from llmtrace.tracer.checkpoint.safetensors_header import INDEX_NAME, read_safetensors_checkpoint
    from llmtrace.tracer.checkpoint.weights_summary import summarize_safetensors

    if not ((folder / INDEX_NAME).exists() or any(folder.glob("*.safetensors"))):
        return None
    return summarize_safetensors(read_safetensors_checkpoint(folder))
