"""Mixtral (a mixture of experts: a router sends each token to k of E SwiGLU experts, their outputs summed with the
router's renormalised weights): its config.json and its Mixtral-style 'llama' GGUF (ffn_gate_inp, 3-D ffn_*_exps)
read; greedy ids and logits equal to transformers' MixtralForCausalLM on a tiny random model through the stage
modules, the packed path and the native C step, from the HF folder and from a GGUF of the same weights; the routes
taken and why the others were not.

The matrices are rounded through Q8_0 first (quantized and dequantized by the gguf package), so the Q8_0 GGUF holds
exactly the fp32 values the HF folder holds (gguf's dequantizer is the reference for the GGUF's experts)."""

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
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.config import ModelConfig, MoeSpec
from llmtrace.tracer.core.contract import expected_shapes
from llmtrace.tracer.load.hf_loader import hf_state_dict_from_ours
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.transformer import Transformer
from llmtrace.tracer.run.backends import backend_for
from llmtrace.tracer.run.generate import make_sampler
from llmtrace.tracer.run.select import Request, select
from llmtrace.tracer.trace.records import MODULES, NATIVE, PACKED, RunSettings
from llmtrace.tracer.trace.run_trace import Trace

transformers = pytest.importorskip("transformers")

Q8_0 = gguf.GGMLQuantizationType.Q8_0
PROMPT, STEPS = 7, 8
E, K = 4, 2


pytestmark = pytest.mark.usefixtures("private_dirs")


def mixtral_dict(vocab: dict) -> dict:
    """A MixtralForCausalLM config.json: 4 experts of F=96, 2 per token, GQA 4:2, no sliding window."""
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": len(vocab["tokens"]),
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "num_local_experts": E, "num_experts_per_tok": K, "rms_norm_eps": 1e-5,
        "rope_theta": 1e6, "max_position_embeddings": 128, "tie_word_embeddings": False, "sliding_window": None,
        "router_jitter_noise": 0.0, "hidden_act": "silu", "bos_token_id": vocab["bos"], "eos_token_id": vocab["eos"],
        "torch_dtype": "float32",
    }


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, ModelConfig]:
    """(a MixtralForCausalLM folder, the same weights as a Q8_0 Mixtral-style 'llama' GGUF, the config)."""
    vocab = _bundled_vocab()
    folder = tmp_path_factory.mktemp("tiny-mixtral")
    (folder / "config.json").write_text(json.dumps(mixtral_dict(vocab)), encoding="utf-8")
    config = ModelConfig.from_hf_json(folder)
    weights = random_weights(config, seed=21)
    for name, tensor in weights.items():
        if tensor.dim() >= 2:  # the values a Q8_0 file holds exactly (an expert tensor per expert row)
            array = tensor.numpy().astype(np.float32)
            weights[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, Q8_0), Q8_0).copy())
    save_file({k: v.contiguous() for k, v in hf_state_dict_from_ours(weights, config).items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer_json(folder, vocab)
    gguf_path = write_tiny_gguf(tmp_path_factory.mktemp("tiny-mixtral-gguf") / "mixtral.gguf", config, weights,
                                vocab, matrix_type=Q8_0, tokenizer_model="gpt2",
                                extra_metadata={"llama.expert_count": E, "llama.expert_used_count": K})
    return folder, gguf_path, config


@pytest.fixture(scope="module")
def hf(mixtral: tuple[Path, Path, ModelConfig]) -> torch.nn.Module:
    folder, _, _ = mixtral
    return transformers.MixtralForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                           attn_implementation="eager").eval()


def prompt_ids(config: ModelConfig) -> torch.Tensor:
    return parity.prompt_ids(config.vocab_size, PROMPT)


MARKS_OFF = "a traced mixture of experts runs its expert stages once per expert chosen (a varying count)"
UNWATCHED = "nothing watches them: fewer ops run the same math"


@torch.no_grad()
def greedy(model: Transformer, prompt: torch.Tensor, backend: str = MODULES) -> tuple[list[int], torch.Tensor]:
    """STEPS greedy tokens after `prompt`, and the logits (STEPS, V) they were chosen from, the decode steps on
    `backend`: the stage modules, the packed path, or the native C step (whose prefill is the packed path's)."""
    model.setup_cache(1, PROMPT + STEPS)
    assert model.packed_off_reason() == ""
    run = backend_for(model, Request(backend=backend))
    assert select(model, Request(backend=backend)).route.decode == backend
    return parity.greedy_run(run, prompt, STEPS)


def hf_greedy(hf: torch.nn.Module, prompt: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    return parity.hf_greedy(hf, prompt, STEPS)


def test_config_reads_the_experts_from_config_json_and_gguf(mixtral: tuple[Path, Path, ModelConfig]) -> None:
    folder, gguf_path, config = mixtral
    assert config.moe == MoeSpec(E, K, "renormalised") and config.sliding_window is None
    assert config.ffn_dim == 96  # each expert's
    from_gguf = load_model(str(gguf_path), random_init=False).config
    assert from_gguf.moe == config.moe and from_gguf.ffn_dim == 96
    shapes = expected_shapes(config)
    assert shapes["layers.1.feed_forward.router.weight"] == (E, 64)
    assert shapes["layers.1.feed_forward.w1.weight"] == (E, 96, 64)
    assert shapes["layers.1.feed_forward.w2.weight"] == (E, 64, 96)


@pytest.mark.parametrize("source, backend", [("hf", MODULES), ("gguf", MODULES), ("hf", PACKED), ("gguf", PACKED),
                                             ("gguf", NATIVE)])
def test_greedy_ids_and_logits_equal_transformers(mixtral: tuple[Path, Path, ModelConfig], hf: torch.nn.Module,
                                                  source: str, backend: str) -> None:
    """On the stage modules, the packed path (the GGUF's experts as stored, each chosen expert's gate|up one product)
    and the native C step (decode), each with exact products: the folder's default (fp32), the GGUF's on the exact
    kernel (each chosen expert's products over its bytes; its Q8_0 default is i8dot where the CPU has AVX-512 VNNI,
    llama.cpp's numerics, not transformers')."""
    folder, gguf_path, config = mixtral
    if backend == NATIVE and not native_kernel.available():
        pytest.skip(native_kernel.unavailable_reason())
    exact = "native" if source == "gguf" and native_kernel.available() else "auto"
    loaded = load_model(str(folder if source == "hf" else gguf_path), weights=exact)
    assert loaded.config.moe == MoeSpec(E, K, "renormalised")
    prompt = prompt_ids(config)
    want_ids, want_logits = hf_greedy(hf, prompt)
    ids, logits = greedy(loaded.model, prompt, backend)
    assert ids == want_ids
    assert (logits - want_logits).abs().max().item() < 1e-4
    assert want_logits.abs().max().item() > 1.0  # logits of real size: the bound above is not vacuous


@pytest.mark.parametrize("source", ["hf", "gguf"])
@torch.no_grad()
def test_the_packed_path_equals_the_stage_modules(mixtral: tuple[Path, Path, ModelConfig], source: str) -> None:
    """Two prompts prefilled together, then greedy steps of both: the packed path's logits within 1e-5 of the stage
    modules' (dense experts from the HF folder, experts as stored from the GGUF), and every layer's routing after
    each step (Route.last: the experts and their weights, which the trace's routing record reads) the same."""
    folder, gguf_path, config = mixtral
    model = load_model(str(folder if source == "hf" else gguf_path)).model
    prompts = torch.cat([prompt_ids(config), prompt_ids(config).flip(1)])  # (2, P)
    runs = {}
    for backend in (MODULES, PACKED):
        model.setup_cache(2, PROMPT + 4)
        run = backend_for(model, Request(batch=2, backend=backend))
        assert select(model, Request(batch=2, backend=backend)).route.prefill == backend
        logits, routes = [run.prefill(prompts)], []
        for _ in range(3):
            routes.append([tuple(t.clone() for t in layer.feed_forward.route.last) for layer in model.layers])
            logits.append(run.decode(logits[-1].argmax(-1, keepdim=True)))
        runs[backend] = torch.stack(logits), routes
    (modules, modules_routes), (packed, packed_routes) = runs[MODULES], runs[PACKED]
    assert (packed - modules).abs().max().item() < 1e-5
    assert modules.abs().max().item() > 1.0
    for step_modules, step_packed in zip(modules_routes, packed_routes):
        for (weights, experts), (packed_weights, packed_experts) in zip(step_modules, step_packed):
            assert torch.equal(experts, packed_experts)
            assert torch.allclose(weights, packed_weights, atol=1e-6)
    assert modules_routes[0][0][1].shape == (2 * PROMPT, K)  # the prefill's routing: every token of both prompts


def test_the_experts_are_stacked_per_layer_as_the_files_hold_them(mixtral: tuple[Path, Path, ModelConfig]) -> None:
    """The HF folder's per-expert matrices and the GGUF's 3-D ffn_*_exps give the same (E, F, d) tensors: expert j
    of the HF file is row j of the stack, and the GGUF's dequantized experts equal them exactly, as do its experts
    held as stored (the default), decoded."""
    folder, gguf_path, _ = mixtral
    from_hf = load_model(str(folder)).model.state_dict()
    from_gguf = load_model(str(gguf_path), weights="dense").model.state_dict()
    stored = load_model(str(gguf_path)).model.layers[0].feed_forward
    from safetensors.torch import load_file

    on_disk = load_file(str(folder / "model.safetensors"))
    for j in range(E):
        assert torch.equal(from_hf["layers.1.feed_forward.w2.weight"][j],
                           on_disk[f"model.layers.1.block_sparse_moe.experts.{j}.w2.weight"])
    for name in ("feed_forward.router.weight", "feed_forward.w1.weight", "feed_forward.w3.weight",
                 "feed_forward.w2.weight"):
        assert torch.equal(from_hf[f"layers.0.{name}"], from_gguf[f"layers.0.{name}"]), name
        held = stored.get_submodule(name.split(".")[1]).packed
        assert torch.equal(from_hf[f"layers.0.{name}"], held.dequantize()), name


def test_select_says_why_the_other_paths_are_not_taken(mixtral: tuple[Path, Path, ModelConfig]) -> None:
    """The HF folder's experts are dense: the packed path runs every step, and says why the others did not. The
    GGUF's are held as stored: its one-token steps run on the native C step, its prefill on the packed path. A traced
    run's prefill runs the stage modules (the packed step's marks cannot count the experts that run)."""
    folder, gguf_path, _ = mixtral
    model = load_model(str(folder)).model
    model.setup_cache(1, 16)
    route = select(model, Request()).route
    assert (route.prefill, route.decode) == ("packed", "packed")
    native = ("no native decode step for this model: a product of the step is not held for the native library's "
              "kernels (native, i8dot, i16dot)")
    assert {(n.backend, n.reason) for n in route.not_taken} == {("modules", UNWATCHED), ("native", native)}
    if not native_kernel.available():
        return
    model = load_model(str(gguf_path)).model
    model.setup_cache(1, 16)
    greedy_sampler = make_sampler(RunSettings(model=str(gguf_path), prompt="hi"))
    route = select(model, Request(sampler=greedy_sampler)).route
    assert (route.prefill, route.decode) == ("packed", "native")
    assert (route.ahead, route.ahead_reason) == (True, "")  # untraced: run ahead, each step's choice brought back
    assert {(n.backend, n.reason) for n in route.not_taken} == {
        ("packed", "the native step runs a one-token step as one C call"), ("modules", UNWATCHED)}
    traced = select(model, Request(traced=True, sampler=greedy_sampler)).route
    assert (traced.prefill, traced.decode) == ("modules", "native")
    assert (traced.ahead, traced.ahead_reason) == (False, "a traced mixture of experts' step stamps the stage "
                                                          "modules' stages apart")
    assert {(n.backend, n.reason) for n in traced.not_taken} == {
        ("packed", MARKS_OFF), ("modules", "nothing watches them: fewer ops run the same math")}


def test_the_routing_record_names_the_experts_transformers_routes_to(mixtral: tuple[Path, Path, ModelConfig],
                                                                     hf: torch.nn.Module) -> None:
    """The trace `run --json-file` writes holds every step's routing; its prefill's experts for each prompt token in
    every layer are those HF's MixtralTopKRouter picks (its indices and renormalised scores, caught by a hook on the
    same ids)."""
    folder, _, config = mixtral
    path = folder.parent / "mixtral-run.json"
    result = CliRunner().invoke(app, ["run", "--model", str(folder), "The capital of France is", "--max-new-tokens",
                                      "3", "--json-file", str(path)])
    assert result.exit_code == 0, result.output
    trace = Trace.from_json(path.read_text(encoding="utf-8"))
    assert [(r.phase, r.step) for r in trace.routing] == [(s.phase, s.step) for s in trace.steps]
    ids = torch.tensor([trace.tokenization.ids])
    caught = {}
    handles = [layer.mlp.gate.register_forward_hook(
        lambda module, args, out, i=i: caught.update({i: (out[1].detach(), out[2].detach())}))
        for i, layer in enumerate(hf.model.layers)]
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        for handle in handles:
            handle.remove()
    prefill = trace.routing[0]
    assert prefill.tokens == ids.shape[1]
    for layer in prefill.layers:
        scores, indices = caught[layer.layer]
        assert layer.experts == tuple(map(tuple, indices.tolist()))
        assert torch.allclose(torch.tensor(layer.weights), scores, atol=1e-6)
    assert max(layer.distinct for layer in prefill.layers) > K  # the prompt's tokens spread over the experts


def test_run_tp2_over_the_folder_generates_one_process_tokens(mixtral: tuple[Path, Path, ModelConfig],
                                                              tmp_path: Path) -> None:
    """`run --tp 2` over the HF folder (it refused a mixture of experts until each rank held every expert's F/N
    columns: tests/test_tensor_parallel_moe.py): two ranks, each its slices of the folder's experts, give the
    tokens of one process."""
    folder, _, _ = mixtral
    paths = {tp: tmp_path / f"tp{tp}.json" for tp in (1, 2)}
    for tp, path in paths.items():
        result = CliRunner().invoke(app, ["run", "The capital of France is", "--model", str(folder), "--tp", str(tp),
                                          "--max-new-tokens", "4", "--dtype", "fp32", "--json", str(path),
                                          "--tp-timeout", "120"])
        assert result.exit_code == 0, result.output
    one, two = (Trace.from_json(paths[tp].read_text(encoding="utf-8")) for tp in (1, 2))
    assert two.tensor_parallel.tp == 2 and len(two.generated_ids) == 4
    assert two.generated_ids == one.generated_ids