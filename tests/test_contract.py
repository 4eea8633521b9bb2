"""The model contract (tracer/core/contract.py) is the one list of stages and tensors: adding a tensor or a stage
to it reaches the checkpoint shapes, both loaders' names, parameter counts and weight bytes, the estimate and its
tensor-parallel split, the tracer's stages (staged and fused), the cost of each traced stage, the model itself
(a projection's bias) and the labels the CLI prints."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from estimate_check import assert_traced_equals_estimate

from llmtrace.tracer.analytic import estimate
from llmtrace.tracer.analytic.params import count_params, weight_bytes
from llmtrace.tracer.analytic.tensor_parallel import replicated_components
from llmtrace.tracer.core import contract
from llmtrace.tracer.core.config import ModelConfig, MoeSpec
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.model.transformer import build_random_model
from llmtrace.tracer.run.backends import backend_for
from llmtrace.tracer.run.select import Request
from llmtrace.tracer.trace.hooks import Tracer
from llmtrace.tracer.trace.records import DECODE, MODULES, PREFILL

CONFIG = ModelConfig("tiny", 96, 64, 2, 4, 2, 96, max_seq_len=32)
DTYPES = estimate.Dtypes.for_weights(FP32)


def _trace(config: ModelConfig, mechanism: str, prompt: int = 5, steps: int = 2) -> tuple:
    model = build_random_model(config, seed=3)
    model.setup_cache(max_batch=1, max_seq=16)
    generator = torch.Generator().manual_seed(0)
    logits = []
    with Tracer(model, mechanism=mechanism) as tracer:
        run = backend_for(model).traced(tracer)  # packed, or the stage modules the wrappers watch
        for step in range(steps + 1):
            ids = torch.randint(0, config.vocab_size, (1, prompt if step == 0 else 1), generator=generator)
            tracer.begin_step(PREFILL if step == 0 else DECODE, step)
            logits.append(run.prefill(ids) if step == 0 else run.decode(ids))
            tracer.end_step()
    return model, tracer.records(), torch.stack(logits)


@pytest.fixture
def lm_head_bias(monkeypatch: pytest.MonkeyPatch) -> contract.TensorSpec:
    """The contract with one tensor more: a bias on the LM head (GPT-J and some fine-tunes have one)."""
    bias = contract.TensorSpec("output.bias", "lm_head.bias", "output.bias", ("V",), "lm_head")
    stages = tuple(dataclasses.replace(s, tensors=(*s.tensors, bias)) if s.role == "output" else s
                   for s in contract.STAGES)
    monkeypatch.setattr(contract, "STAGES", stages)
    return bias


def test_a_tensor_added_to_the_contract_reaches_every_consumer(lm_head_bias: contract.TensorSpec) -> None:
    with pytest.MonkeyPatch.context() as undo:  # the same figures without the new tensor
        undo.setattr(contract, "STAGES", tuple(
            dataclasses.replace(s, tensors=tuple(t for t in s.tensors if t is not lm_head_bias)) for s in contract.STAGES))
        before = {"params": count_params(CONFIG).total, "bytes": weight_bytes(CONFIG, FP32)}
        _, plain_records, plain_logits = _trace(CONFIG, "fused")
    v = CONFIG.vocab_size
    # checkpoints: the shapes a loader expects, both loaders' names
    assert contract.expected_shapes(CONFIG)["output.bias"] == (v,)
    assert contract.hf_to_ours("lm_head.bias") == "output.bias" and contract.ours_to_hf("output.bias") == "lm_head.bias"
    assert contract.gguf_to_ours("output.bias") == "output.bias"
    # parameters and weight bytes
    assert count_params(CONFIG).total == before["params"] + v
    assert count_params(CONFIG).lm_head == v * CONFIG.dim + v
    assert weight_bytes(CONFIG, FP32) == before["bytes"] + 4 * v
    # the estimate: a bias-add component after the LM head, split over tensor-parallel devices
    prefill = estimate.prefill(CONFIG, 5, DTYPES)
    names = [c.name for c in prefill.components]
    assert names[-2:] == ["output", "output.bias"]
    bias_row = prefill.components[-1]
    assert (bias_row.kind, bias_row.flops, bias_row.weight_bytes, bias_row.formula) == (
        estimate.ELEMENTWISE, v, 4 * v, f"B·V = 1·{v}")
    assert "output.bias" not in replicated_components()  # vocabulary-parallel, like the LM head
    # the model builds it (random weights included) and both paths apply it
    for mechanism in ("fused", "wrap"):
        model, records, logits = _trace(CONFIG, mechanism)
        assert model.output.bias is not None and model.output.bias.shape == (v,)
        assert (logits - plain_logits).abs().max() > 0  # the random bias changed the logits...
        head = [r for r in records if r.stage == "output"]
        assert [r.step for r in head] == [0, 1, 2]  # one LM head per step: the checks below see each
        assert all(r.elementwise_flops == v for r in head)  # ...and the traced LM head adds it: B·V FLOPs
        assert all(r.weight_bytes_read == 4 * (v * CONFIG.dim + v) for r in head)
        assert_traced_equals_estimate(CONFIG, records, prompt_len=5, decode_steps=2)
        if mechanism == "fused":
            assert [r.stage for r in records] == [r.stage for r in plain_records]  # no stage more: inside the head


def test_the_bias_is_applied_exactly(lm_head_bias: contract.TensorSpec) -> None:
    """Logits with the new bias are the bias-free model's logits plus the bias, on both paths."""
    model = build_random_model(CONFIG, seed=3)
    ids = torch.randint(0, CONFIG.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    bias = model.output.bias.detach().clone()
    for backend in (None, MODULES):
        model.setup_cache(1, 8)
        with_bias = backend_for(model, Request(backend=backend)).prefill(ids)
        with torch.no_grad():
            model.output.bias.zero_()
        model.setup_cache(1, 8)
        without = backend_for(model, Request(backend=backend)).prefill(ids)
        with torch.no_grad():
            model.output.bias.copy_(bias)
        torch.testing.assert_close(with_bias, without + bias, rtol=0, atol=1e-6)


def test_a_stage_added_to_the_contract_reaches_tracer_lists_estimate_and_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new parameter-bearing stage (a post-attention norm, as Gemma-2 has): every derived list holds it. (The
    model would still need the module and its math; the parameter-free consumers need nothing else.)"""
    norm = contract.StageSpec(
        "post_attention_norm", "rmsnorm", "RMSNorm (after attention)", "RMSNorm", True, block="post-attention",
        replicated=True, tensors=(contract.TensorSpec("post_attention_norm.weight", "post_attention_norm.weight",
                                                      "post_attention_norm.weight", ("d",), "norm"),))
    stages = list(contract.STAGES)
    stages.insert([s.role for s in stages].index("attn_residual"), norm)
    norms_before = count_params(CONFIG).norms_per_layer
    monkeypatch.setattr(contract, "STAGES", tuple(stages))
    assert "layers.1.post_attention_norm.weight" in contract.expected_shapes(CONFIG)
    assert contract.hf_to_ours("model.layers.1.post_attention_norm.weight") == "layers.1.post_attention_norm.weight"
    assert contract.gguf_to_ours("blk.1.post_attention_norm.weight") == "layers.1.post_attention_norm.weight"
    assert count_params(CONFIG).norms_per_layer == norms_before + CONFIG.dim
    fused = [s.role for s in contract.fused_stages(CONFIG) if s.in_layer]
    assert fused[fused.index("attention.wo") + 1] == "post_attention_norm" and len(fused) == 15
    assert "post_attention_norm" in [s.role for s in contract.layer_stages(CONFIG)]
    components = {c.name: c for c in estimate.prefill(CONFIG, 5, DTYPES).components}
    assert components["post_attention_norm"].formula == f"BT·(4d+3) = 5·(4·{CONFIG.dim}+3)"
    assert "post_attention_norm" in replicated_components()
    assert contract.role_label("post_attention_norm") == "RMSNorm (post-attention)"  # three RMSNorms: say which
    assert contract.role_label("ffn_norm") == "RMSNorm (FFN)"


def _runs(pack: contract.PackSpec, config: ModelConfig) -> bool:
    """Whether `config` runs every member of the pack (a dense FFN's gate|up, a shared expert's)."""
    return set(pack.members) <= {s.role for s in contract.staged_stages(config)}


def test_derived_lists_agree_with_the_model() -> None:
    """Every stage role is a module of the model and every tensor a parameter of it, with the declared shape."""
    config = dataclasses.replace(CONFIG, qkv_bias=True, wo_bias=True, mlp_bias=True)
    model = build_random_model(config)
    modules = dict(model.named_modules())
    for spec in contract.staged_stages(config):
        assert (f"layers.0.{spec.role}" if spec.in_layer else spec.role) in modules, spec.role
    params = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    assert params == contract.expected_shapes(config)
    assert [p.role for p in contract.PACKS if _runs(p, config)] == [
        s.role for s in contract.fused_stages(config) if len(s.members) > 1]
    # Qwen2-MoE: a mixture of experts beside a shared expert, whose gate|up is a pack of its own
    shared = dataclasses.replace(config, mlp_bias=False, moe=MoeSpec(4, 2, "softmax"), shared_expert_dim=80)
    model = build_random_model(shared)
    modules = dict(model.named_modules())
    assert all(f"layers.0.{s.role}" in modules for s in contract.layer_stages(shared))
    assert {name: tuple(p.shape) for name, p in model.state_dict().items()} == contract.expected_shapes(shared)
    assert [s.role for s in contract.fused_stages(shared) if len(s.members) > 1] == [
        "attention.wqkv", "feed_forward.shared_w13", "feed_forward.w13"] == [
        p.role for p in contract.PACKS if _runs(p, shared)]
    assert contract.gguf_tensor_flags({"blk.0.attn_q.bias", "blk.0.ffn_up.bias"}) == {
        "qkv_bias": True, "wo_bias": False, "mlp_bias": True}
