"""Qwen3-MoE (Qwen3's attention with QK-norm, a mixture of experts in every layer, checkpoints spelled mlp.gate and
mlp.experts.{j}.gate_proj): its config.json (num_experts or num_local_experts, moe_intermediate_size, norm_topk_prob)
and its 'qwen3moe' GGUF read; greedy ids and logits equal to transformers' Qwen3MoeForCausalLM on a tiny random model,
with the router's k weights renormalised (norm_topk_prob) and as the softmax gave them, from the HF folder and from
a Q8_0 GGUF of the same weights (whose values the folder holds exactly), on the stage modules, the packed path and
the C step."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_mixtral import PROMPT, greedy, hf_greedy, prompt_ids
from test_qwen2 import _bundled_vocab, _write_tokenizer_json
from tiny_gguf import write_tiny_gguf
from tiny_llama import random_weights

from llmtrace.tracer.core.config import ModelConfig, MoeSpec
from llmtrace.tracer.core.errors import UnsupportedModelError
from llmtrace.tracer.load.hf_loader import hf_state_dict_from_ours
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.trace.records import MODULES, NATIVE, PACKED

transformers = pytest.importorskip("transformers")

Q8_0 = gguf.GGMLQuantizationType.Q8_0
E, K, F = 4, 2, 96


pytestmark = pytest.mark.usefixtures("private_dirs")


def qwen3_moe_dict(vocab: dict, norm_topk_prob: bool) -> dict:
    """A Qwen3MoeForCausalLM config.json: head_dim 32 with 4 heads of a width-64 model, 4 experts of F=96 (its
    intermediate_size, for dense layers, differs: it must not be read), 2 per token."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": len(vocab["tokens"]),
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 160, "moe_intermediate_size": F, "num_experts": E,
        "num_experts_per_tok": K, "norm_topk_prob": norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 128, "tie_word_embeddings": False,
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "hidden_act": "silu",
        "bos_token_id": vocab["bos"], "eos_token_id": vocab["eos"], "torch_dtype": "float32",
    }


@pytest.fixture(scope="module", params=[True, False], ids=["renormalised", "softmax"])
def qwen3_moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, Path, ModelConfig]:
    """(a Qwen3MoeForCausalLM folder, the same weights as a Q8_0 'qwen3moe' GGUF, the config)."""
    vocab = _bundled_vocab()
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    (folder / "config.json").write_text(json.dumps(qwen3_moe_dict(vocab, request.param)), encoding="utf-8")
    config = ModelConfig.from_hf_json(folder)
    weights = random_weights(config, seed=31)
    generator = torch.Generator().manual_seed(32)
    for name, tensor in weights.items():
        if ".qk_norm." in name:  # not ones: a skipped QK-norm would still pass
            weights[name] = 1.0 + 0.3 * torch.randn(tensor.shape, generator=generator)
        elif tensor.dim() >= 2:  # the values a Q8_0 file holds exactly
            array = tensor.numpy().astype(np.float32)
            weights[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, Q8_0), Q8_0).copy())
    save_file({k: v.contiguous() for k, v in hf_state_dict_from_ours(weights, config, "mlp").items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer_json(folder, vocab)
    gguf_path = write_tiny_gguf(tmp_path_factory.mktemp("tiny-qwen3-moe-gguf") / "qwen3moe.gguf", config, weights,
                                vocab, matrix_type=Q8_0, arch="qwen3moe", tokenizer_model="gpt2",
                                extra_metadata={"qwen3moe.expert_count": E, "qwen3moe.expert_used_count": K,
                                                "qwen3moe.expert_feed_forward_length": F})
    return folder, gguf_path, config


def test_config_reads_the_experts_the_expert_width_and_the_router_norm(
        qwen3_moe: tuple[Path, Path, ModelConfig]) -> None:
    folder, gguf_path, config = qwen3_moe
    norm = json.loads((folder / "config.json").read_text())["norm_topk_prob"]
    assert config.moe == MoeSpec(E, K, "renormalised" if norm else "softmax")
    assert (config.ffn_dim, config.qk_norm, config.head_dim, config.qkv_bias) == (F, True, 32, False)
    from_gguf = load_model(str(gguf_path), dry_run=False).config
    assert (from_gguf.moe.n_experts, from_gguf.moe.experts_per_token, from_gguf.ffn_dim, from_gguf.qk_norm) == (
        E, K, F, True)


@pytest.mark.parametrize("source, backend", [("hf", MODULES), ("gguf", MODULES), ("hf", PACKED), ("gguf", PACKED),
                                             ("gguf", NATIVE)])
def test_greedy_ids_and_logits_equal_transformers(qwen3_moe: tuple[Path, Path, ModelConfig], source: str,
                                                  backend: str) -> None:
    """On the stage modules and (decode) on the native C step, its QK-norm and experts (the exact kernel)."""
    folder, gguf_path, config = qwen3_moe
    if source == "gguf" and config.moe.router_norm == "softmax":
        pytest.skip("llama.cpp's qwen3moe always renormalises (no norm_topk_prob in the file)")
    if backend == NATIVE and not native_kernel.available():
        pytest.skip(native_kernel.unavailable_reason())
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    # the GGUF on the exact kernel: its Q8_0 default is i8dot with AVX-512 VNNI (llama.cpp's numerics)
    loaded = load_model(str(folder if source == "hf" else gguf_path),
                        weights="native" if source == "gguf" and native_kernel.available() else None)
    prompt = prompt_ids(config)
    want_ids, want_logits = hf_greedy(hf, prompt)
    ids, logits = greedy(loaded.model, prompt, backend)
    assert ids == want_ids
    assert (logits - want_logits).abs().max().item() < 1e-4
    assert want_logits.abs().max().item() > 1.0
    assert len(loaded.model.layers[0].feed_forward.route.last[1]) == 1  # the last step's one token row
    assert prompt.shape[1] == PROMPT


def test_dense_layers_among_the_experts_are_refused_in_one_line(tmp_path: Path) -> None:
    data = qwen3_moe_dict(_bundled_vocab(), True) | {"mlp_only_layers": [1]}
    (tmp_path / "config.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(UnsupportedModelError, match="dense FFN layers among the experts'"):
        ModelConfig.from_hf_json(tmp_path)


@torch.no_grad()
def test_transformers_gguf_reading_gives_llmtraces_logits(qwen3_moe: tuple[Path, Path, ModelConfig]) -> None:
    """The same 'qwen3moe' GGUF through transformers' own GGUF loading (its dequantization, its split of the 3-D
    experts) and through llmtrace's reader; the folder's config passed (transformers' qwen3 GGUF mapping takes no
    attention.key_length, as test_qwen3 says)."""
    folder, gguf_path, config = qwen3_moe
    if config.moe.router_norm == "softmax":
        pytest.skip("the GGUF is written for the renormalised router (llama.cpp's qwen3moe)")
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    theirs = transformers.Qwen3MoeForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                              config=hf_config, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    # exact products (the Q8_0 default is i8dot with AVX-512 VNNI: llama.cpp's numerics, not transformers')
    ours = load_model(str(gguf_path), use_cache=False, weights="native" if native_kernel.available() else None).model
    ids = torch.randint(3, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(6))
    expected = theirs(input_ids=ids).logits
    assert expected.abs().max() > 1.0
    assert (ours(ids) - expected).abs().max().item() <= 1e-4
