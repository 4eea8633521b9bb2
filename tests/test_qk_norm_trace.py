"""The QK-norm stage (Qwen3) as the tracer sees it: one stage per layer between the Q|K|V products and RoPE, on the
stage modules and on the packed path alike; its FLOPs the RMSNorm formula over the H + Hkv heads of every token, its
bytes the real sizes of its two weight vectors and of the q and k it reads and writes; FlopCounterMode counts no
product in it (the step's matmul FLOPs are exactly the traced ones); and the analytical estimate agrees, in total
and per stage."""

from __future__ import annotations

import pytest
import torch
from estimate_check import assert_traced_equals_estimate
from torch.utils.flop_counter import FlopCounterMode

from llmtrace.tracer.core import flop_formulas as ff
from llmtrace.tracer.core import contract
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.model.transformer import Transformer, build_random_model
from llmtrace.tracer.run.backends import PackedBackend, backend_for
from llmtrace.tracer.run.select import Request
from llmtrace.tracer.trace.hooks import Tracer
from llmtrace.tracer.trace.records import DECODE, PACKED, PREFILL, StageRecord

# head_dim 32 with 4 heads of a width-64 model: QK-norm's rows are head_dim wide, not dim wide
CONFIG = ModelConfig("tiny-qwen3", 96, 64, 2, 4, 2, 96, max_seq_len=32, explicit_head_dim=32, qk_norm=True)
PROMPT, DECODE_STEPS = 6, 2


def _model() -> Transformer:
    model = build_random_model(CONFIG, seed=2)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # not ones: a stage that skipped its weights would still pass a ones-only check
        for layer in model.layers:
            for weight in (layer.attention.qk_norm.q_weight, layer.attention.qk_norm.k_weight):
                weight.copy_(1.0 + 0.3 * torch.randn(weight.shape, generator=generator))
    return model


def _traced(mechanism: str, count: bool = False) -> tuple[Transformer, tuple[StageRecord, ...], list[int]]:
    """Records of a PROMPT-token prefill and DECODE_STEPS decode steps, and (count) FlopCounterMode's total of each
    step (its module tracker's hooks send the step through the stage modules, as the "wrap" tracer sees it)."""
    model = _model()
    model.setup_cache(1, PROMPT + DECODE_STEPS)
    generator = torch.Generator().manual_seed(0)
    counted = []
    with Tracer(model, mechanism=mechanism) as tracer:
        # chosen before FlopCounterMode's module tracker hooks the modules: "fused" runs the packed backend
        run = backend_for(model).traced(tracer)
        for step in range(DECODE_STEPS + 1):
            ids = torch.randint(0, CONFIG.vocab_size, (1, PROMPT if step == 0 else 1), generator=generator)
            tracer.begin_step(PREFILL if step == 0 else DECODE, step)
            counter = FlopCounterMode(display=False)
            with counter if count else torch.no_grad():
                run.prefill(ids) if step == 0 else run.decode(ids)
            tracer.end_step()
            counted.append(counter.get_total_flops())
    return model, tracer.records(), counted


@pytest.mark.parametrize("mechanism", ["wrap", "fused"])
def test_qk_norm_is_a_stage_with_the_flops_and_bytes_of_its_tensors(mechanism: str) -> None:
    model, records, _ = _traced(mechanism)
    layer_roles = [s.role for s in contract.fused_stages(CONFIG, packed=mechanism == "fused") if s.in_layer]
    at = layer_roles.index("attention.qk_norm")
    assert layer_roles[at - 1] in ("attention.wv", "attention.wqkv") and layer_roles[at + 1] == "attention.rope"
    qk = model.layers[0].attention.qk_norm
    vector_bytes = qk.q_weight.numel() * qk.q_weight.element_size() + qk.k_weight.numel() * qk.k_weight.element_size()
    assert vector_bytes == 2 * 32 * 4
    heads, kv_heads, d = CONFIG.n_heads, CONFIG.n_kv_heads, CONFIG.head_dim
    for step, tokens in enumerate([PROMPT] + [1] * DECODE_STEPS):
        ours = [r for r in records if r.step == step and r.short_name == "attention.qk_norm"]
        assert [r.layer for r in ours] == list(range(CONFIG.n_layers))
        q, k = torch.empty(1, tokens, heads, d), torch.empty(1, tokens, kv_heads, d)  # what the stage module sees
        activations = (q.numel() + k.numel()) * q.element_size()
        for record in ours:
            assert record.kind == "qk_norm"
            assert record.input_shapes == record.output_shapes == (tuple(q.shape), tuple(k.shape))
            assert record.matmul_flops == 0
            assert record.elementwise_flops == ff.rmsnorm_flops(tokens * (heads + kv_heads), d) \
                == tokens * (heads + kv_heads) * (4 * d + 3)
            assert (record.weight_bytes_read, record.activation_bytes_read, record.activation_bytes_written) == (
                vector_bytes, activations, activations)


def test_matmul_flops_equal_flop_counter_mode_and_everything_the_estimate() -> None:
    _, records, counted = _traced("wrap", count=True)
    for step in range(DECODE_STEPS + 1):
        assert sum(r.matmul_flops for r in records if r.step == step) == counted[step] > 0
    assert_traced_equals_estimate(CONFIG, records, PROMPT, DECODE_STEPS)
    _, fused, _ = _traced("fused")
    assert_traced_equals_estimate(CONFIG, fused, PROMPT, DECODE_STEPS)


@torch.no_grad()
def test_the_packed_path_and_the_modules_give_the_same_logits() -> None:
    model = _model()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    expected = model(ids)[:, -1]  # cache-free, stage by stage
    model.setup_cache(2, 9)
    run = backend_for(model, Request(batch=2, backend=PACKED))
    assert isinstance(run, PackedBackend)
    assert (run.prefill(ids) - expected).abs().max().item() <= 1e-5
