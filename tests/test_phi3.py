"""Phi-3 (LLaMA's layer with Q|K|V and gate|up each stored as one matrix): its config.json and 'phi3' GGUF read, the
packed matrices split into the contract's at the name map (tracer/checkpoint/packed_tensors.py), logits equal to
transformers' Phi3ForCausalLM on a tiny random model with a sliding window, and a Q8_0 'phi3' GGUF equal to the same
file read by transformers' GGUF loading."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import save_file
from tiny_gguf import sentencepiece_vocab, write_tiny_gguf
from tiny_llama import random_weights
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import ours_to_hf
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.core.errors import CheckpointError, UnsupportedModelError
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.run.backends import backend_for
from llmtrace.tracer.run.select import Request
from llmtrace.tracer.trace.records import MODULES

transformers = pytest.importorskip("transformers")

WINDOW = 8  # shorter than the 13-token prompts: the window's mask is exercised


pytestmark = pytest.mark.usefixtures("private_dirs")


def _config_dict(vocab_size: int) -> dict:
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": vocab_size, "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64,
            "original_max_position_embeddings": 64, "sliding_window": WINDOW, "tie_word_embeddings": False,
            "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32"}


def _packed(weights: dict[str, torch.Tensor], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q|K|V, gate|up) of one layer, rows stacked as Phi-3 stores them."""
    p = f"layers.{layer}."
    qkv = torch.cat([weights[p + f"attention.{w}.weight"] for w in ("wq", "wk", "wv")])
    return qkv, torch.cat([weights[p + "feed_forward.w1.weight"], weights[p + "feed_forward.w3.weight"]])


_UNPACKED = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")


def _write_gguf(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor], vocab: dict) -> Path:
    """A 'phi3' GGUF as llama.cpp's converter writes one: attn_qkv and a 2F-row ffn_up, Q/K rows in HF's order;
    matrices Q8_0 (so each member is a range of whole blocks), vectors F32."""
    members = {n: t for n, t in weights.items() if not any(f".{u}." in n for u in _UNPACKED)}
    packed = {}
    for layer in range(config.n_layers):
        packed[f"blk.{layer}.attn_qkv.weight"], packed[f"blk.{layer}.ffn_up.weight"] = _packed(weights, layer)
    return write_tiny_gguf(path, config, members, vocab, matrix_type=gguf.GGMLQuantizationType.Q8_0, arch="phi3",
                           extra_metadata={"phi3.attention.sliding_window": WINDOW}, extra_tensors=packed)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory, sp_model_bytes: bytes,
         sp_vocab_size: int) -> tuple[Path, Path, ModelConfig, dict[str, torch.Tensor]]:
    """(a Phi3ForCausalLM folder, a Q8_0 'phi3' GGUF of the same weights, the config, our-named weights)."""
    folder = tmp_path_factory.mktemp("tiny-phi3")
    (folder / "config.json").write_text(json.dumps(_config_dict(sp_vocab_size)), encoding="utf-8")
    config = ModelConfig.from_hf_json(folder)
    weights = random_weights(config, seed=11)
    hf = {ours_to_hf(n): t.contiguous() for n, t in weights.items() if not any(f".{u}." in n for u in _UNPACKED)}
    for layer in range(config.n_layers):
        qkv, gate_up = _packed(weights, layer)
        hf[f"model.layers.{layer}.self_attn.qkv_proj.weight"] = qkv
        hf[f"model.layers.{layer}.mlp.gate_up_proj.weight"] = gate_up
    save_file(hf, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "tokenizer.model").write_bytes(sp_model_bytes)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
        "tokenizer_class": "LlamaTokenizer", "legacy": False}), encoding="utf-8")
    gguf_dir = tmp_path_factory.mktemp("tiny-phi3-gguf")
    gguf_path = _write_gguf(gguf_dir / "phi3.gguf", config, weights, sentencepiece_vocab(sp_model_bytes))
    return folder, gguf_path, config, weights


def test_config_is_llama_with_its_window(phi3: tuple[Path, Path, ModelConfig, dict]) -> None:
    folder, gguf_path, config, _ = phi3
    assert (config.sliding_window, config.qkv_bias, config.mlp_bias, config.head_dim) == (WINDOW, False, False, 16)
    assert load_model(str(gguf_path), dry_run=True).config.sliding_window == WINDOW


def test_packed_matrices_split_into_the_contracts(phi3: tuple[Path, Path, ModelConfig, dict]) -> None:
    """The folder's qkv_proj and gate_up_proj come out as wq, wk, wv, w1, w3, bit for bit."""
    folder, _, config, weights = phi3
    state = load_model(str(folder), dtype=FP32, use_cache=False).model.state_dict()
    for name in ("layers.1.attention.wq.weight", "layers.1.attention.wk.weight", "layers.1.attention.wv.weight",
                 "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w3.weight"):
        assert torch.equal(state[name], weights[name]), name


def _ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(3, vocab_size, (2, 13), generator=torch.Generator().manual_seed(4))


@torch.no_grad()
def test_logits_equal_phi3_for_causal_lm(phi3: tuple[Path, Path, ModelConfig, dict]) -> None:
    folder, _, _, _ = phi3
    hf = transformers.Phi3ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    loaded = load_model(str(folder), dtype=FP32, use_cache=False)
    ids = _ids(loaded.config.vocab_size)
    expected = hf(input_ids=ids).logits
    assert expected.abs().max() > 1.0
    assert (loaded.model(ids) - expected).abs().max().item() <= 1e-4  # staged, cache-free
    for backend in (None, MODULES):  # the fused path (Q|K|V and gate|up packed again), the stage modules
        loaded.model.setup_cache(max_batch=2, max_seq=32)
        run = backend_for(loaded.model, Request(batch=2, backend=backend))
        cached = [run.prefill(ids[:, :9])] + [run.decode(ids[:, t : t + 1]) for t in range(9, 13)]
        assert (torch.stack(cached, dim=1) - expected[:, 8:]).abs().max().item() <= 1e-4, backend


@torch.no_grad()
def test_q8_gguf_equals_transformers_reading_it(phi3: tuple[Path, Path, ModelConfig, dict]) -> None:
    """The Q8_0 'phi3' file through llmtrace's reader (its packed rows split as whole blocks) and through
    transformers' GGUF loading (which dequantizes and keeps them packed) give the same logits. transformers' phi3
    GGUF mapping reads no sliding window, so the comparison runs within the window's reach too (8 tokens)."""
    _, gguf_path, _, _ = phi3
    hf = transformers.AutoModelForCausalLM.from_pretrained(  # Phi3Config's pad id 32000 is past this vocabulary
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager",
        pad_token_id=0).eval()
    loaded = load_model(str(gguf_path), dtype=FP32, weights="dense", use_cache=False)
    ids = _ids(loaded.config.vocab_size)[:, :WINDOW]
    expected = hf(input_ids=ids).logits
    assert (loaded.model(ids) - expected).abs().max().item() <= 1e-4
    stored = load_model(str(gguf_path), dtype=FP32, weights="stored", use_cache=False)  # blocks multiplied as read
    if stored.kernels.numerics == "exact":  # a kernel that rounds activations (i8dot) is compared in its own tests
        assert (stored.model(ids) - expected).abs().max().item() <= 1e-4


def test_run_a_phi3_gguf(phi3: tuple[Path, Path, ModelConfig, dict]) -> None:
    _, gguf_path, _, _ = phi3
    result = CliRunner().invoke(app, ["run", "The sky", "--model", str(gguf_path), "--max-new-tokens", "2",
                                      "--no-roofline", "--detail", "summary"])
    assert result.exit_code == 0, result.output
    assert "2 tokens generated" in result.output


def test_a_packed_matrix_of_the_wrong_rows_is_one_line(phi3: tuple[Path, Path, ModelConfig, dict],
                                                       tmp_path: Path) -> None:
    folder, _, _, _ = phi3
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("config.json", "tokenizer.model", "tokenizer_config.json"):
        (bad / name).write_bytes((folder / name).read_bytes())
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.1.mlp.gate_up_proj.weight"] = tensors["model.layers.1.mlp.gate_up_proj.weight"][:-1]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError) as exc:
        load_model(str(bad))
    assert str(exc.value) == (f"{bad}: model.layers.1.mlp.gate_up_proj.weight is [191, 64], config.json wants 192 "
                              "rows (feed_forward.w1 96 + feed_forward.w3 96 stacked)")


@pytest.mark.parametrize(("extra", "message"), [
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}},
     "rope scaling type 'yarn' is not supported; llmtrace handles 'llama3' and 'longrope'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not modelled"),
])
def test_what_phi3_configs_llmtrace_does_not_model_are_one_line(extra: dict, message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_hf_dict({**_config_dict(100), **extra})


def test_the_phi3_mini_preset_is_as_published_and_dry_runs() -> None:
    from llmtrace.tracer.analytic.params import count_params
    from llmtrace.tracer.core.presets import PRESETS

    config = PRESETS["phi3-mini-4k"]
    # d 3072, 32 layers of MHA (4·d²) and a SwiGLU FFN of 8192 (3·d·F), two norms; embedding and head 32064 x d
    by_hand = 2 * 32064 * 3072 + 32 * (4 * 3072**2 + 3 * 3072 * 8192 + 2 * 3072) + 3072
    assert count_params(config).total == by_hand == 3_821_079_552  # the model card's 3.8B
    result = CliRunner().invoke(app, ["run", "The sky", "--model", "phi3-mini-4k", "--dry-run", "--max-new-tokens",
                                      "2", "--detail", "summary"])
    assert result.exit_code == 0, result.output
