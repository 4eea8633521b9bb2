"""Tiny random-weight LLaMA folders for tests: config.json + model.safetensors (HF names) + a SentencePiece
tokenizer trained here on sample_prompts/. No network; each folder takes milliseconds to write."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import expected_shapes
from llmtrace.tracer.load.hf_loader import hf_state_dict_from_ours

SAMPLE_PROMPTS = Path(__file__).resolve().parent.parent / "sample_prompts"


def train_sentencepiece(vocab_size: int = 360) -> bytes:
    """A LLaMA-style SentencePiece BPE model (byte fallback, dummy prefix, <unk>/<s>/</s> = 0/1/2)."""
    import sentencepiece as spm

    text = "".join(p.read_text(encoding="utf-8") for p in sorted(SAMPLE_PROMPTS.glob("*.txt")))
    lines = [line for line in text.splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines * 20), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, character_coverage=1.0, hard_vocab_limit=False, minloglevel=2,
        add_dummy_prefix=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
        split_digits=True, allow_whitespace_only_pieces=True,
    )
    return model.getvalue()


def hf_config_dict(
    vocab_size: int,
    dim: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn_dim: int = 96,
    head_dim: int | None = None,
    tie: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    max_pos: int = 256,
    attention_bias: bool = False,
    mlp_bias: bool = False,
) -> dict[str, Any]:
    """An HF LlamaForCausalLM config.json as a dict."""
    data: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": dim, "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads, "intermediate_size": ffn_dim, "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta, "max_position_embeddings": max_pos, "tie_word_embeddings": tie,
        "hidden_act": "silu", "attention_bias": attention_bias, "mlp_bias": mlp_bias, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    if head_dim is not None:
        data["head_dim"] = head_dim
    if rope_scaling is not None:
        data["rope_scaling"] = rope_scaling
    return data


def random_weights(config: ModelConfig, seed: int, std: float = 0.15) -> dict[str, torch.Tensor]:
    """Our-named fp32 weights, large enough (std 0.15) that attention is far from uniform; norms around 1."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            weights[name] = std * torch.randn(shape, generator=generator)
    return weights


def write_tiny_llama(folder: Path, config_dict: dict[str, Any], seed: int = 0, tokenizer_model: bytes | None = None,
                     shards: int = 1) -> Path:
    """Write config.json, weights (one file or `shards` files + index) and optionally tokenizer.model."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_dict, indent=1), encoding="utf-8")
    config = ModelConfig.from_hf_dict(config_dict)
    tensors = {k: v.contiguous() for k, v in hf_state_dict_from_ours(random_weights(config, seed), config).items()}
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = sorted(tensors)
        weight_map = {}
        for index in range(shards):
            shard_name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[index::shards]}
            save_file(part, str(folder / shard_name), metadata={"format": "pt"})
            weight_map.update({n: shard_name for n in part})
        total = sum(t.numel() * 4 for t in tensors.values())
        index_data = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index_data), encoding="utf-8")
    if tokenizer_model is not None:
        (folder / "tokenizer.model").write_bytes(tokenizer_model)
        settings = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                    "tokenizer_class": "LlamaTokenizer", "legacy": False}
        (folder / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder
