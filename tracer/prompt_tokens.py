"""Count a prompt's tokens with the model's own tokenizer, loading nothing but the tokenizer (no torch).

- HF folder: tokenizer.json through `tokenizers` (its post-processor adds BOS where the model does), else
  tokenizer.model through `sentencepiece` plus BOS when tokenizer_config.json asks for it (LLaMA's default).
- GGUF file: the vocabulary in its header, rebuilt by tracer.gguf_tokenizer (the same tokenizer `run` uses).
- Preset: no tokenizer; the caller must give a prompt length instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tracer.errors import BadArgumentError, ConfigError
from tracer.resolve import ResolvedModel


@dataclass(frozen=True, slots=True)
class PromptTokens:
    n_tokens: int
    tokenizer: str  # which file counted them


def count_prompt_tokens(model: ResolvedModel, text: str) -> PromptTokens:
    if model.kind == "preset" or model.path is None:
        raise BadArgumentError(
            f"model {model.config.name!r} is a preset and has no tokenizer to count --prompt with; "
            "give --prompt-len N instead, or a --model folder or .gguf file"
        )
    path = Path(model.path)
    if model.kind == "gguf":
        n = _count_gguf(path, text)
        return PromptTokens(n, str(path))
    folder = path if path.is_dir() else path.parent
    if (folder / "tokenizer.json").exists():
        return PromptTokens(_count_tokenizer_json(folder / "tokenizer.json", text), str(folder / "tokenizer.json"))
    if (folder / "tokenizer.model").exists():
        return PromptTokens(_count_sentencepiece(folder, text), str(folder / "tokenizer.model"))
    raise ConfigError(f"{folder}: no tokenizer.json or tokenizer.model to count --prompt with; give --prompt-len N")


def _count_tokenizer_json(file: Path, text: str) -> int:
    from tokenizers import Tokenizer  # imported here: only --prompt needs it

    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ConfigError(f"{file}: not a readable tokenizer.json ({exc}); re-download it") from exc
    return len(tokenizer.encode(text).ids)


def _count_sentencepiece(folder: Path, text: str) -> int:
    import sentencepiece  # imported here: only --prompt needs it

    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(str(folder / "tokenizer.model"))
    except (OSError, RuntimeError) as exc:
        raise ConfigError(f"{folder / 'tokenizer.model'}: not a readable SentencePiece model ({exc})") from exc
    add_bos = True  # LlamaTokenizer's default
    settings = folder / "tokenizer_config.json"
    if settings.exists():
        try:
            add_bos = bool(json.loads(settings.read_text(encoding="utf-8")).get("add_bos_token", True))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise ConfigError(f"{settings}: not readable as a JSON object ({exc})") from exc
    bos = 1 if add_bos and processor.bos_id() >= 0 else 0
    return bos + len(processor.EncodeAsIds(text))


def _count_gguf(path: Path, text: str) -> int:
    from tracer.gguf_header import read_gguf_header
    from tracer.gguf_tokenizer import tokenizer_from_gguf  # the GGUF loader's tokenizer, torch-free

    tokenizer = tokenizer_from_gguf(read_gguf_header(path, decode_arrays=True))
    return len(tokenizer.encode(text))
