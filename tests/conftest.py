"""Shared fixtures. Each owner adds a section; keep fixtures cheap or session-scoped."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from tiny_llama import hf_config_dict, train_sentencepiece, write_tiny_llama

# ---- tiny LLaMA folders (model engineer) -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def sp_model_bytes() -> bytes:
    """A SentencePiece BPE tokenizer.model trained on sample_prompts/ (byte fallback; ids 0/1/2 = unk/bos/eos)."""
    return train_sentencepiece()


@pytest.fixture(scope="session")
def sp_vocab_size(sp_model_bytes: bytes) -> int:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_proto=sp_model_bytes).get_piece_size()


@pytest.fixture(scope="session")
def make_tiny_llama(
    tmp_path_factory: pytest.TempPathFactory, sp_model_bytes: bytes, sp_vocab_size: int
) -> Callable[..., Path]:
    """make_tiny_llama(name, seed=0, shards=1, **config) -> a folder with config.json, safetensors, tokenizer.model.

    `config` takes tiny_llama.hf_config_dict's keywords (dim, n_heads, n_kv_heads, head_dim, tie, rope_scaling...).
    Folders are written once per session and name; tests must not modify them (copy first).
    """
    made: dict[str, Path] = {}

    def make(name: str, seed: int = 0, shards: int = 1, **config: Any) -> Path:
        if name not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{name}")
            made[name] = write_tiny_llama(folder, hf_config_dict(sp_vocab_size, **config), seed=seed,
                                          tokenizer_model=sp_model_bytes, shards=shards)
        return made[name]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(make_tiny_llama: Callable[..., Path]) -> Path:
    """The default tiny model: 2 layers, dim 64, 4 heads over 2 KV heads (GQA), untied, SentencePiece tokenizer."""
    return make_tiny_llama("default")
