"""Qwen2 / Qwen2.5 (LLaMA plus a bias on Q, K and V): its config.json recognised, its GGUF ('qwen2' architecture,
Q/K rows in HF's order, byte-level BPE with Qwen2's split regex) loaded, logits equal to transformers'
Qwen2ForCausalLM on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_gguf import write_tiny_gguf
from tiny_llama import random_weights
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.checkpoint.bundled import bundled_model_path
from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
from llmtrace.tracer.checkpoint.gguf_tokenizer import _pre_tokenizer
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.core.errors import UnsupportedModelError
from llmtrace.tracer.load.hf_loader import hf_state_dict_from_ours
from llmtrace.tracer.load.loader import load_model

transformers = pytest.importorskip("transformers")

SAMPLES = ["The year 2024 had 366 days.", "It's what we'll do, isn't it?\n\n  indented  code()", "价格是12345元",
           "tabs\tand   spaces   ", "emoji 😀 and ünïcödé"]


pytestmark = pytest.mark.usefixtures("private_dirs")


def _bundled_vocab() -> dict:
    """A real byte-level BPE vocabulary (the bundled SmolLM2's 49,152 tokens and merges), to stand in for Qwen2's."""
    meta = read_gguf_header(bundled_model_path(), decode_arrays=True).metadata
    return {"tokens": meta["tokenizer.ggml.tokens"], "types": meta["tokenizer.ggml.token_type"],
            "merges": meta["tokenizer.ggml.merges"], "bos": meta["tokenizer.ggml.bos_token_id"],
            "eos": meta["tokenizer.ggml.eos_token_id"], "pre": "qwen2"}


def _write_tokenizer_json(folder: Path, vocab: dict) -> None:
    """tokenizer.json the way Qwen2's is built (transformers' Qwen2 PRETOKENIZE_REGEX split, then byte-level)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    merges = [tuple(m.split(" ", 1)) for m in vocab["merges"]]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab["tokens"])}, merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    bos, eos = vocab["tokens"][vocab["bos"]], vocab["tokens"][vocab["eos"]]
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos,
                                                              "add_bos_token": False}), encoding="utf-8")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, ModelConfig]:
    """(a Qwen2ForCausalLM folder, the same weights as a 'qwen2' GGUF, the config) with a real BPE vocabulary."""
    vocab = _bundled_vocab()
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    data = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": len(vocab["tokens"]),
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 128,
        "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 2,
        "hidden_act": "silu", "bos_token_id": vocab["bos"], "eos_token_id": vocab["eos"], "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(data), encoding="utf-8")
    config = ModelConfig.from_hf_json(folder)
    weights = random_weights(config, seed=9)
    save_file({k: v.contiguous() for k, v in hf_state_dict_from_ours(weights).items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer_json(folder, vocab)
    gguf_path = write_tiny_gguf(tmp_path_factory.mktemp("tiny-qwen2-gguf") / "qwen2.gguf", config, weights, vocab,
                                arch="qwen2", tokenizer_model="gpt2")
    return folder, gguf_path, config


def test_config_is_llama_with_qkv_biases(qwen2: tuple[Path, Path, ModelConfig]) -> None:
    _, _, config = qwen2
    assert (config.qkv_bias, config.wo_bias, config.mlp_bias, config.sliding_window) == (True, False, False, None)
    assert config.tie_embeddings and config.rope_theta == 1e6


@pytest.mark.parametrize("source", ["hf", "gguf"])
@torch.no_grad()
def test_logits_equal_qwen2_for_causal_lm(source: str, qwen2: tuple[Path, Path, ModelConfig]) -> None:
    folder, gguf_path, _ = qwen2
    hf = transformers.Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    loaded = load_model(str(folder if source == "hf" else gguf_path), dtype=FP32, use_cache=False)
    assert loaded.config.qkv_bias and not loaded.config.wo_bias
    ids = torch.randint(3, loaded.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(4))
    expected = hf(input_ids=ids).logits
    assert expected.abs().max() > 1.0
    assert (loaded.model(ids) - expected).abs().max().item() <= 1e-4  # staged, cache-free
    model = loaded.model
    model.setup_cache(2, 32)
    cached = [model.prefill(ids[:, :9])]  # fused path, biases included
    for t in range(9, 13):
        cached.append(model.decode_one(ids[:, t : t + 1]))
    assert (torch.stack(cached, dim=1) - expected[:, 8:]).abs().max().item() <= 1e-4


def test_gguf_keeps_hf_row_order_and_the_biases(qwen2: tuple[Path, Path, ModelConfig]) -> None:
    folder, gguf_path, _ = qwen2
    from_folder = load_model(str(folder), use_cache=False).model.state_dict()
    from_gguf = load_model(str(gguf_path), use_cache=False).model.state_dict()
    assert "layers.0.attention.wq.bias" in from_gguf and "layers.0.attention.wo.bias" not in from_gguf
    for name, tensor in from_folder.items():
        assert torch.equal(from_gguf[name], tensor), name


def test_qwen2_split_regex_is_transformers(qwen2: tuple[Path, Path, ModelConfig]) -> None:
    """Pieces of the 'qwen2' pre-tokenizer equal transformers' Qwen2 PRETOKENIZE_REGEX, byte-level encoded."""
    import regex
    from tokenizers import pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    ours = _pre_tokenizer("qwen2", "test")
    for text in SAMPLES:
        expected = [byte_level.pre_tokenize_str(piece)[0][0] for piece in regex.findall(PRETOKENIZE_REGEX, text)]
        assert [piece for piece, _ in ours.pre_tokenize_str(text)] == expected, text
    assert len([p for p, _ in ours.pre_tokenize_str("12345")]) == 5  # one digit per piece, unlike Llama 3's 3


def test_gguf_tokenizer_encodes_as_the_folders_tokenizer_json(qwen2: tuple[Path, Path, ModelConfig]) -> None:
    folder, gguf_path, _ = qwen2
    from_folder = load_model(str(folder), dry_run=True).tokenizer
    from_gguf = load_model(str(gguf_path), dry_run=True).tokenizer
    for text in SAMPLES:
        ids = from_folder.encode(text, add_bos=False)
        assert from_gguf.encode(text, add_bos=False) == ids, text
        assert from_gguf.decode(ids) == text


def test_run_a_qwen2_gguf(qwen2: tuple[Path, Path, ModelConfig]) -> None:
    _, gguf_path, _ = qwen2
    result = CliRunner().invoke(app, ["run", "The year 2024", "--model", str(gguf_path), "--max-new-tokens", "2",
                                      "--dtype", "fp32", "--no-roofline", "--detail", "summary"])
    assert result.exit_code == 0, result.output
    assert "2 tokens generated" in result.output


def test_per_layer_windows_are_refused_in_one_line() -> None:
    data = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 100, "hidden_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 96, "use_sliding_window": True,
            "sliding_window": 16, "max_window_layers": 2}
    with pytest.raises(UnsupportedModelError, match="sliding window on layers 2 and up only"):
        ModelConfig.from_hf_dict(data)
    assert ModelConfig.from_hf_dict({**data, "max_window_layers": 0}).sliding_window == 16
    assert ModelConfig.from_hf_dict({**data, "max_window_layers": 4}).sliding_window is None


def test_a_bias_of_the_wrong_shape_is_one_line(qwen2: tuple[Path, Path, ModelConfig], tmp_path: Path) -> None:
    """A 'qwen2' GGUF whose blk.1.attn_k.bias has 31 values instead of Hkv·D = 32: named, exit 2, nothing cached."""
    from tiny_gguf import write_tiny_gguf as write

    from llmtrace.tracer.core.errors import CheckpointError

    _, _, config = qwen2
    weights = random_weights(config, seed=9)
    weights["layers.1.attention.wk.bias"] = weights["layers.1.attention.wk.bias"][:31]
    path = write(tmp_path / "bad-bias.gguf", config, weights, _bundled_vocab(), arch="qwen2", tokenizer_model="gpt2")
    with pytest.raises(CheckpointError) as exc:
        load_model(str(path))
    assert "blk.1.attn_k.bias" in str(exc.value) and "\n" not in str(exc.value)
    result = CliRunner().invoke(app, ["run", "hi", "--model", str(path), "--no-roofline"])
    assert result.exit_code == 2 and "blk.1.attn_k.bias" in result.output
    assert not any((tmp_path / "cache").rglob("*.safetensors"))
