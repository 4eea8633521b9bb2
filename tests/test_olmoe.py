"""OLMoE (QK-norm over each token's whole q and k projections, H·D and Hkv·D wide, before the heads are split; a
mixture of experts in every layer whose k weights stay as the softmax gave them): its config.json and its 'olmoe'
GGUF read; greedy ids and logits equal to transformers' OlmoeForCausalLM on a tiny random model from the HF folder and
from a Q8_0 GGUF of the same weights, on the stage modules, the packed path and the C step; the QK-norm stage's
FLOPs are two whole-row RMSNorms a token."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_mixtral import greedy, hf_greedy, prompt_ids
from test_qwen2 import _bundled_vocab, _write_tokenizer_json
from tiny_gguf import write_tiny_gguf
from tiny_llama import random_weights

from llmtrace.tracer.core import flop_formulas as ff
from llmtrace.tracer.core.config import ModelConfig, MoeSpec
from llmtrace.tracer.core.errors import UnsupportedModelError
from llmtrace.tracer.load.hf_loader import hf_state_dict_from_ours
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.trace.hooks import Tracer
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.run.select import Request, select
from llmtrace.tracer.trace.records import MODULES, NATIVE, PACKED, PREFILL

transformers = pytest.importorskip("transformers")

Q8_0 = gguf.GGMLQuantizationType.Q8_0
E, K, F = 4, 2, 96


pytestmark = pytest.mark.usefixtures("private_dirs")


def olmoe_dict(vocab: dict) -> dict:
    """An OlmoeForCausalLM config.json: 4 heads of 16 (2 KV), so q_norm is 64 wide and k_norm 32; 4 experts of 96."""
    return {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": len(vocab["tokens"]),
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": F, "num_experts": E, "num_experts_per_tok": K, "norm_topk_prob": False,
        "clip_qkv": None, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "bos_token_id": vocab["bos"],
        "eos_token_id": vocab["eos"], "pad_token_id": 1, "torch_dtype": "float32",
    }


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, ModelConfig]:
    """(an OlmoeForCausalLM folder, the same weights as a Q8_0 'olmoe' GGUF, the config)."""
    vocab = _bundled_vocab()
    folder = tmp_path_factory.mktemp("tiny-olmoe")
    (folder / "config.json").write_text(json.dumps(olmoe_dict(vocab)), encoding="utf-8")
    config = ModelConfig.from_hf_json(folder)
    weights = random_weights(config, seed=41)
    generator = torch.Generator().manual_seed(42)
    for name, tensor in weights.items():
        if ".qk_norm." in name:  # not ones: a skipped or per-head QK-norm would still pass
            weights[name] = 1.0 + 0.3 * torch.randn(tensor.shape, generator=generator)
        elif tensor.dim() >= 2:  # the values a Q8_0 file holds exactly
            array = tensor.numpy().astype(np.float32)
            weights[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, Q8_0), Q8_0).copy())
    save_file({k: v.contiguous() for k, v in hf_state_dict_from_ours(weights, config, "mlp").items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer_json(folder, vocab)
    gguf_path = write_tiny_gguf(tmp_path_factory.mktemp("tiny-olmoe-gguf") / "olmoe.gguf", config, weights, vocab,
                                matrix_type=Q8_0, arch="olmoe", tokenizer_model="gpt2",
                                extra_metadata={"olmoe.expert_count": E, "olmoe.expert_used_count": K})
    return folder, gguf_path, config


def test_config_reads_whole_projection_qk_norm_and_the_softmax_router(olmoe: tuple[Path, Path, ModelConfig]) -> None:
    folder, gguf_path, config = olmoe
    assert config.moe == MoeSpec(E, K, "softmax") and config.ffn_dim == F
    assert (config.qk_norm, config.qk_norm_whole, config.q_dim, config.kv_dim) == (True, True, 64, 32)
    from_gguf = load_model(str(gguf_path)).config
    assert (from_gguf.moe, from_gguf.qk_norm_whole, from_gguf.ffn_dim) == (config.moe, True, F)


@pytest.mark.parametrize("source, backend", [("hf", MODULES), ("gguf", MODULES), ("hf", PACKED), ("gguf", PACKED),
                                             ("gguf", NATIVE)])
def test_greedy_ids_and_logits_equal_transformers(olmoe: tuple[Path, Path, ModelConfig], source: str,
                                                  backend: str) -> None:
    """On the stage modules, the packed path (the whole-q, whole-k norm in place on views of the Q|K|V product) and
    (decode) on the native C step: its whole-q, whole-k norm, its softmax router's weights as they are, its experts as
    stored (the exact kernel)."""
    folder, gguf_path, config = olmoe
    if backend == NATIVE and not native_kernel.available():
        pytest.skip(native_kernel.unavailable_reason())
    hf = transformers.OlmoeForCausalLM.from_pretrained(folder, dtype=torch.float32,
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


def test_the_qk_norm_stage_normalises_each_tokens_whole_q_and_k(olmoe: tuple[Path, Path, ModelConfig]) -> None:
    folder, _, config = olmoe
    model = load_model(str(folder)).model
    model.setup_cache(1, 8)
    with Tracer(model, mechanism="wrap") as tracer:
        tracer.begin_step(PREFILL, 0)
        model.prefill(torch.arange(3, 9).view(1, 6))
        tracer.end_step()
    norm = next(r for r in tracer.records() if r.stage == "layers.0.attention.qk_norm")
    assert norm.input_shapes == ((1, 6, 64), (1, 6, 32))  # before the heads are split
    assert norm.elementwise_flops == ff.rmsnorm_flops(6, 64) + ff.rmsnorm_flops(6, 32)
    assert norm.weight_bytes_read == (64 + 32) * 4


def test_clip_qkv_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(olmoe_dict(_bundled_vocab()) | {"clip_qkv": 8.0}),
                                          encoding="utf-8")
    with pytest.raises(UnsupportedModelError, match="clip_qkv"):
        ModelConfig.from_hf_json(tmp_path)


@pytest.mark.parametrize("staged", [False, True])
def test_the_c_steps_traced_records_are_the_stage_modules(olmoe: tuple[Path, Path, ModelConfig], staged: bool) -> None:
    """Traced, the C step stamps the stage modules' stages apart, OLMoE's QK-norm between K and V as they run it:
    its records are the wrapped modules' field by field but the times, and its routes theirs."""
    if not native_kernel.available():
        pytest.skip(native_kernel.unavailable_reason())
    from test_moe_native import assert_same_routes, steps, untimed

    _, gguf_path, _ = olmoe
    model = load_model(str(gguf_path), weights="native").model
    model.setup_cache(1, 16)
    assert select(model, Request(staged=staged)).route.decode == NATIVE
    _, routes, native = steps(model, Request(staged=staged, traced=True), traced=True)
    _, want_routes, modules = steps(model, Request(staged=staged, traced=True, backend=MODULES), traced=True)
    assert [untimed(r) for r in native] == [untimed(r) for r in modules]
    assert_same_routes(routes, want_routes)
    stages = [r.stage for r in native if r.step == 1 and r.layer == 0]
    assert stages[1:5] == [f"layers.0.attention.{s}" for s in ("wq", "wk", "qk_norm", "wv")]
