"""Qwen3 dense (LLaMA plus QK-norm: each q and k head RMS-normalised before RoPE; no biases; head_dim apart from
dim / heads): its config.json and its 'qwen3' GGUF read, logits and greedy ids equal to transformers'
Qwen3ForCausalLM on a tiny random model through every backend (the stage modules, the packed torch path, the C
step fused and staged), and the QK-norm stage's FLOPs and bytes as FlopCounterMode and the tensors say.

One set of weights serves all: the matrices are rounded through Q8_0 first (quantized and dequantized by the gguf
package), so the GGUF the C step multiplies as stored holds exactly the fp32 values the HF folder holds."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import parity
import pytest
import torch
from safetensors.torch import save_file
from test_qwen2 import _bundled_vocab, _write_tokenizer_json
from tiny_gguf import write_tiny_gguf
from tiny_llama import random_weights

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.load.hf_loader import hf_state_dict_from_ours
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.transformer import Transformer
from llmtrace.tracer.run.backends import backend_for
from llmtrace.tracer.run.select import Request, select
from llmtrace.tracer.trace.records import MODULES, NATIVE, PACKED

transformers = pytest.importorskip("transformers")

Q8_0 = gguf.GGMLQuantizationType.Q8_0
PROMPT, STEPS = 7, 8


pytestmark = pytest.mark.usefixtures("private_dirs")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, ModelConfig]:
    """(a Qwen3ForCausalLM folder, the same weights as a Q8_0 'qwen3' GGUF, the config): head_dim 32 with 4 heads
    of a width-64 model (Q is 128 wide), tied embeddings, QK-norm weights random (ones would hide a skipped one)."""
    vocab = _bundled_vocab()
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    data = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": len(vocab["tokens"]),
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 96, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "max_position_embeddings": 128, "tie_word_embeddings": True, "attention_bias": False,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2, "hidden_act": "silu",
        "bos_token_id": vocab["bos"], "eos_token_id": vocab["eos"], "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(data), encoding="utf-8")
    config = ModelConfig.from_hf_json(folder)
    weights = random_weights(config, seed=11)
    generator = torch.Generator().manual_seed(12)
    for name, tensor in weights.items():
        if ".qk_norm." in name:
            weights[name] = 1.0 + 0.3 * torch.randn(tensor.shape, generator=generator)
        elif tensor.dim() == 2:  # the values a Q8_0 file holds exactly
            array = tensor.numpy().astype(np.float32)
            weights[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, Q8_0), Q8_0).copy())
    save_file({k: v.contiguous() for k, v in hf_state_dict_from_ours(weights).items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer_json(folder, vocab)
    gguf_path = write_tiny_gguf(tmp_path_factory.mktemp("tiny-qwen3-gguf") / "qwen3.gguf", config, weights, vocab,
                                matrix_type=Q8_0, arch="qwen3", tokenizer_model="gpt2")
    return folder, gguf_path, config


@pytest.fixture(scope="module")
def hf(qwen3: tuple[Path, Path, ModelConfig]) -> torch.nn.Module:
    folder, _, _ = qwen3
    return transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                         attn_implementation="eager").eval()


def prompt_ids(config: ModelConfig) -> torch.Tensor:
    return parity.prompt_ids(config.vocab_size, PROMPT)


# Each backend as a run asks for it (tracer/run/select.py), and the route (prefill, decode) it must then take.
REQUESTS = {"modules": Request(backend=MODULES), "packed": Request(backend=PACKED), "native": Request(backend=NATIVE),
            "native-staged": Request(staged=True)}
ROUTES = {"modules": (MODULES, MODULES), "packed": (PACKED, PACKED), "native": (PACKED, NATIVE),
          "native-staged": (MODULES, NATIVE)}


@torch.no_grad()
def greedy(model: Transformer, backend: str, prompt: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """STEPS greedy tokens after `prompt` through `backend`, and the logits (STEPS, V) they were chosen from; on a
    native backend every decode step must have been one C call."""
    model.setup_cache(1, PROMPT + STEPS)
    route = select(model, REQUESTS[backend]).route
    assert (route.prefill, route.decode) == ROUTES[backend], route
    run = backend_for(model, REQUESTS[backend])
    c_steps = parity.count_c_steps(run, backend) if backend.startswith("native") else []
    ids, logits = parity.greedy_run(run, prompt, STEPS)
    assert len(c_steps) == (STEPS - 1 if backend.startswith("native") else 0)
    return ids, logits


def hf_greedy(hf: torch.nn.Module, prompt: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    return parity.hf_greedy(hf, prompt, STEPS)


def test_config_reads_qk_norm_head_dim_and_no_biases(qwen3: tuple[Path, Path, ModelConfig]) -> None:
    folder, gguf_path, config = qwen3
    assert (config.qk_norm, config.head_dim, config.q_dim, config.dim) == (True, 32, 128, 64)
    assert not (config.qkv_bias or config.wo_bias or config.mlp_bias) and config.tie_embeddings
    from_gguf = load_model(str(gguf_path), dry_run=True).config
    assert (from_gguf.qk_norm, from_gguf.head_dim, from_gguf.tie_embeddings) == (True, 32, True)


def test_gguf_holds_the_folders_tensors(qwen3: tuple[Path, Path, ModelConfig]) -> None:
    """Dequantized, the Q8_0 file's matrices are the folder's bit for bit (their values were Q8_0's already);
    the QK-norm vectors come from attn_q_norm / attn_k_norm in HF's order (no llama.cpp permutation: qwen3)."""
    folder, gguf_path, _ = qwen3
    from_folder = load_model(str(folder), dtype=FP32, use_cache=False).model.state_dict()
    from_gguf = load_model(str(gguf_path), dtype=FP32, use_cache=False, weights="dense").model.state_dict()
    assert set(from_gguf) == set(from_folder)
    assert from_folder["layers.1.attention.qk_norm.k_weight"].shape == (32,)
    for name, tensor in from_folder.items():
        assert torch.equal(from_gguf[name], tensor), name


@pytest.mark.parametrize("source", ["hf", "gguf"])
@torch.no_grad()
def test_cache_free_logits_equal_qwen3_for_causal_lm(source: str, qwen3: tuple[Path, Path, ModelConfig],
                                                     hf: torch.nn.Module) -> None:
    folder, gguf_path, config = qwen3
    loaded = load_model(str(folder if source == "hf" else gguf_path), dtype=FP32, use_cache=False,
                        weights=None if source == "hf" else "dense")
    ids = torch.randint(3, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(4))
    expected = hf(input_ids=ids).logits
    assert expected.abs().max() > 1.0  # weights large enough that a mismatch would show
    assert (loaded.model(ids) - expected).abs().max().item() <= 1e-4


@torch.no_grad()
def test_transformers_gguf_reading_gives_llmtraces_logits(qwen3: tuple[Path, Path, ModelConfig],
                                                          hf: torch.nn.Module) -> None:
    """The same GGUF through transformers' own GGUF loading (its dequantization and names) and through llmtrace's
    reader. The folder's config is passed: transformers' qwen3 GGUF mapping does not read attention.key_length, so
    alone it would take head_dim 128 and refuse the tensors' shapes."""
    _, gguf_path, config = qwen3
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, config=hf.config,
                                                           dtype=torch.float32, attn_implementation="eager").eval()
    ours = load_model(str(gguf_path), dtype=FP32, use_cache=False, weights="dense").model
    ids = torch.randint(3, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(6))
    expected = theirs(input_ids=ids).logits
    assert expected.abs().max() > 1.0
    assert (ours(ids) - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("backend", ["modules", "packed"])
@torch.no_grad()
def test_torch_backends_greedy_ids_and_logits_equal_hf(backend: str, qwen3: tuple[Path, Path, ModelConfig],
                                                       hf: torch.nn.Module) -> None:
    folder, _, config = qwen3
    model = load_model(str(folder), dtype=FP32, use_cache=False).model
    prompt = prompt_ids(config)
    expected_ids, expected_logits = hf_greedy(hf, prompt)
    ids, logits = greedy(model, backend, prompt)
    assert ids == expected_ids and len(set(ids)) > 1
    assert (logits - expected_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("backend", ["native", "native-staged"])
@torch.no_grad()
def test_c_step_greedy_ids_and_logits_equal_hf(backend: str, qwen3: tuple[Path, Path, ModelConfig],
                                               hf: torch.nn.Module) -> None:
    """The Q8_0 GGUF held as stored for the exact native kernel: every decode step one C call (QK-norm in C),
    fused, or staged with the QK-norm its own phase."""
    if not native_kernel.available():
        pytest.skip(f"native kernel not available here: {native_kernel.unavailable_reason()}")
    _, gguf_path, config = qwen3
    model = load_model(str(gguf_path), dtype=FP32, use_cache=False, weights="native").model
    prompt = prompt_ids(config)
    expected_ids, expected_logits = hf_greedy(hf, prompt)
    ids, logits = greedy(model, backend, prompt)
    assert ids == expected_ids
    assert (logits - expected_logits).abs().max().item() <= 1e-4


def test_presets_have_the_model_cards_parameter_counts() -> None:
    """Qwen3-0.6B: 0.6 B parameters, 0.44 B without the (tied) embedding; Qwen3-8B: 8.2 B, 6.95 B without the
    embedding and the LM head (the model cards' "Number of Parameters (Non-Embedding)")."""
    from llmtrace.tracer.analytic.params import count_params
    from llmtrace.tracer.core.presets import get_preset

    small, large = count_params(get_preset("qwen3-0.6b")), count_params(get_preset("qwen3-8b"))
    assert small.tied and round(small.total / 1e9, 1) == 0.6 and round(small.non_embedding / 1e9, 2) == 0.44
    assert not large.tied and round(large.total / 1e9, 1) == 8.2
    assert round((large.total - large.embedding - large.lm_head) / 1e9, 2) == 6.95
    # per layer: the two QK-norm vectors of 128 beside the block's two norms of d
    assert small.norms_per_layer == 2 * 1024 + 2 * 128 and large.norms_per_layer == 2 * 4096 + 2 * 128


def test_dry_run_of_the_qwen3_preset_traces_the_qk_norm() -> None:
    from typer.testing import CliRunner

    from llmtrace.cli.app import app

    result = CliRunner().invoke(app, ["run", "--model", "qwen3-0.6b", "--dry-run", "--prompt-tokens", "4",
                                      "--detail", "ops"], terminal_width=120)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Transformer layers × 28" in out
    assert out.count("= equal") == 2  # prefill and decode step: traced FLOPs equal estimate.py's
    # each layer's QK-norm on 4 tokens' 16 q and 8 k heads of 128: 4·24·(4·128 + 3) = 49,440 FLOPs; it reads its two
    # vectors (1,024 B) and q, k (49,152 B)
    rows = [line for line in out.splitlines() if "QK-norm" in line]
    assert len(rows) == 28 and all("49.44 kFLOP" in row and "50.18 kB" in row for row in rows)
