"""Parameter counts, weight bytes and per-component FLOPs/bytes against values derived by hand in each test.

Shapes (from each model's config.json): llama-7b V=32000 d=4096 L=32 H=Hkv=32 D=128 F=11008, untied;
llama2-70b V=32000 d=8192 L=80 H=64 Hkv=8 D=128 F=28672, untied; llama3-8b V=128256 d=4096 L=32 H=32 Hkv=8
D=128 F=14336, untied; smollm2-135m V=49152 d=576 L=30 H=9 Hkv=3 D=64 F=1536, tied.
"""

from __future__ import annotations

import pytest

from llmtrace.tracer.analytic import estimate
from llmtrace.tracer.analytic.params import count_params, weight_bytes, weight_bytes_by_dtype
from llmtrace.tracer.core.dtypes import FP16, FP32, INT4, INT8, get_dtype
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.core.presets import get_preset

FP16_ALL = estimate.Dtypes.for_weights(FP16)


# ---- parameters ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "total"),
    [
        # 32000*4096*2 + 32*(4*4096^2 + 3*4096*11008 + 2*4096) + 4096 — the well-known LLaMA-7B figure.
        ("llama-7b", 6_738_415_616),
        # 32000*8192*2 + 80*(2*8192^2 + 2*8192*1024 + 3*8192*28672 + 2*8192) + 8192
        ("llama2-70b", 68_976_648_192),
        # 128256*4096*2 + 32*(2*4096^2 + 2*4096*1024 + 3*4096*14336 + 2*4096) + 4096
        ("llama3-8b", 8_030_261_248),
        # tied: 49152*576 once + 30*(2*576^2 + 2*576*192 + 3*576*1536 + 2*576) + 576 (= the GGUF's tensor total)
        ("smollm2-135m", 134_515_008),
    ],
)
def test_param_counts(preset: str, total: int) -> None:
    assert count_params(get_preset(preset)).total == total


def test_param_breakdown_llama_7b() -> None:
    p = count_params(get_preset("llama-7b"))
    assert p.embedding == 131_072_000
    assert p.lm_head == 131_072_000  # LLaMA-1 does not tie the LM head to the embedding
    assert p.per_layer == 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096 == 202_383_360
    assert p.non_embedding == 6_738_415_616 - 131_072_000


def test_tied_embedding_counted_once() -> None:
    p = count_params(get_preset("smollm2-135m"))
    assert p.tied and p.lm_head == 0
    assert p.embedding == 49152 * 576


def test_weight_bytes_per_dtype_llama_7b() -> None:
    cfg = get_preset("llama-7b")
    params = 6_738_415_616
    norm_values = 4096 * (2 * 32 + 1)  # 266,240 norm weights, kept in fp32 beside quantized matrices
    matrices = params - norm_values
    assert weight_bytes(cfg, FP32) == 4 * params == 26_953_662_464
    assert weight_bytes(cfg, FP16) == 2 * params == 13_476_831_232
    assert weight_bytes(cfg, get_dtype("bf16")) == 2 * params
    assert weight_bytes(cfg, get_dtype("fp8")) == matrices + 4 * norm_values
    # int8: 34 bytes per 32 values (fp16 scale); int4: 18 bytes per 32 values. Every row length divides by 32.
    assert weight_bytes(cfg, INT8) == matrices // 32 * 34 + 4 * norm_values == 7_160_348_672
    assert weight_bytes(cfg, INT4) == matrices // 32 * 18 + 4 * norm_values == 3_791_273_984
    assert set(weight_bytes_by_dtype(cfg)) == {"fp32", "bf16", "fp16", "fp8", "int8", "int4"}


# ---- one decode step ---------------------------------------------------------------------------------------------


def _by_name(phase: estimate.PhaseEstimate) -> dict[str, estimate.ComponentCost]:
    return {c.name: c for c in phase.components}


def test_decode_step_per_layer_matmuls_llama_7b() -> None:
    step = estimate.decode_step(get_preset("llama-7b"), 127, FP16_ALL)  # 128 positions attended
    c = _by_name(step)
    for name in ("attention.wq", "attention.wk", "attention.wv", "attention.wo"):
        assert c[name].flops == 2 * 4096 * 4096 == 33_554_432
    for name in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
        assert c[name].flops == 2 * 4096 * 11008 == 90_177_536
    assert c["attention.scores"].flops == c["attention.pv"].flops == 2 * 32 * 128 * 128 == 1_048_576
    layer_matmuls = sum(x.flops for x in step.components if x.per_layer and x.kind == estimate.MATMUL)
    assert layer_matmuls == 4 * 33_554_432 + 3 * 90_177_536 + 2 * 1_048_576 == 406_847_488
    assert c["output"].flops == 2 * 4096 * 32000 and not c["output"].per_layer
    assert step.totals.matmul_flops == 32 * 406_847_488 + 262_144_000


def test_decode_step_gqa_llama2_70b() -> None:
    step = estimate.decode_step(get_preset("llama2-70b"), 0, FP16_ALL)
    c = _by_name(step)
    assert c["attention.wq"].flops == 2 * 8192 * 8192
    assert c["attention.wk"].flops == c["attention.wv"].flops == 2 * 8192 * 1024  # 8 KV heads x 128
    assert c["attention.scores"].flops == 2 * 64 * 1 * 128  # all 64 query heads, one position
    # One new position written: K and V, 8 heads x 128 values x 2 bytes.
    assert c["attention.kv_cache"].kv_write_bytes == 2 * 8 * 128 * 2
    assert step.totals.kv_write_bytes == 80 * 4096


def test_decode_step_bytes_llama_7b() -> None:
    step = estimate.decode_step(get_preset("llama-7b"), 1023, FP16_ALL)  # 1024 positions attended
    t = step.totals
    # Every weight once except the embedding table, of which one row (4096 fp16 values) is gathered.
    assert t.weight_bytes == 2 * 6_738_415_616 - 2 * 131_072_000 + 2 * 4096 == 13_214_695_424
    # K and V of 1024 positions: 0.5 MiB per position.
    assert t.kv_read_bytes == 1024 * 524_288
    assert t.min_bytes == t.weight_bytes + t.kv_read_bytes + t.kv_write_bytes
    assert t.total_bytes == t.min_bytes + t.activation_bytes
    assert t.arithmetic_intensity == pytest.approx(t.total_flops / t.total_bytes)  # one meaning: all bytes moved
    assert t.weights_kv_intensity == pytest.approx(t.total_flops / t.min_bytes)
    assert 0.9 < t.arithmetic_intensity < t.weights_kv_intensity < 1.1  # decode at batch 1: about one FLOP per byte


def test_batch_scales_flops_not_weight_bytes() -> None:
    cfg = get_preset("llama3-8b")
    one = estimate.decode_step(cfg, 500, FP16_ALL, batch=1)
    eight = estimate.decode_step(cfg, 500, FP16_ALL, batch=8)
    assert eight.totals.matmul_flops == 8 * one.totals.matmul_flops
    assert eight.totals.kv_read_bytes == 8 * one.totals.kv_read_bytes
    c1, c8 = _by_name(one), _by_name(eight)
    assert c8["attention.wq"].weight_bytes == c1["attention.wq"].weight_bytes == 2 * 4096 * 4096
    assert c8["tok_embeddings"].weight_bytes == 8 * c1["tok_embeddings"].weight_bytes


# ---- prefill ------------------------------------------------------------------------------------------------------


def test_prefill_dense_and_causal_attention_llama_7b() -> None:
    pre = estimate.prefill(get_preset("llama-7b"), 128, FP16_ALL)
    c = _by_name(pre)
    dense = 2 * 32 * 128 * 128 * 128  # per layer, per product
    useful = 2 * 32 * (128 * 129 // 2) * 128
    assert c["attention.scores"].flops == dense == 134_217_728
    assert c["attention.scores"].useful_flops == useful == 67_633_152
    assert pre.totals.attention_dense_flops == 2 * 32 * dense
    assert pre.totals.attention_useful_flops == 2 * 32 * useful
    assert pre.totals.total_flops - pre.totals.useful_flops == 2 * 32 * (dense - useful)
    # Projections over all 128 rows; the LM head (and final norm) on the last position only.
    assert c["attention.wq"].flops == 2 * 128 * 4096 * 4096
    assert c["output"].flops == 2 * 1 * 4096 * 32000
    assert c["norm"].flops == 4 * 4096 + 3


def test_prefill_matmul_and_elementwise_are_separate() -> None:
    pre = estimate.prefill(get_preset("smollm2-135m"), 16, FP16_ALL)
    t = pre.totals
    mm = sum(c.total_flops for c in pre.components if c.kind == estimate.MATMUL)
    ew = sum(c.total_flops for c in pre.components if c.kind == estimate.ELEMENTWISE)
    assert (t.matmul_flops, t.elementwise_flops) == (mm, ew)
    assert t.total_flops == mm + ew
    # Hand value of the SwiGLU activation over 16 rows, F=1536, 30 layers.
    assert _by_name(pre)["feed_forward.act"].total_flops == 30 * 6 * 16 * 1536


# ---- whole generation -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["llama-7b", "llama2-70b", "smollm2-135m"])
def test_generation_is_prefill_plus_each_decode_step(preset: str) -> None:
    cfg = get_preset(preset)
    p, n, b = 37, 21, 3
    gen = estimate.generation(cfg, p, n, FP16_ALL, batch=b)
    pre = estimate.prefill(cfg, p, FP16_ALL, batch=b)
    steps = [estimate.decode_step(cfg, cached, FP16_ALL, batch=b) for cached in range(p, p + n - 1)]
    assert gen.decode_steps == len(steps) == 20
    assert gen.final_kv_len == p + n - 1
    for field in ("matmul_flops", "elementwise_flops", "total_flops", "useful_flops", "weight_bytes",
                  "kv_read_bytes", "kv_write_bytes", "activation_bytes", "attention_dense_flops"):
        assert getattr(gen.totals, field) == getattr(pre.totals, field) + sum(getattr(s.totals, f"{field}") for s in steps)
    for i, comp in enumerate(gen.components):
        assert comp.total_flops == pre.components[i].total_flops + sum(s.components[i].total_flops for s in steps)


def test_generation_attention_hand_sum_llama_7b() -> None:
    cfg = get_preset("llama-7b")
    gen = estimate.generation(cfg, 100, 50, FP16_ALL)
    # Decode step at L cached attends to S = L+1 keys: QKᵀ + PV = 2 * (2*H*S*D) per layer.
    decode_attention = sum(32 * 2 * 2 * 32 * s * 128 for s in range(101, 150))
    prefill_attention = 32 * 2 * 2 * 32 * 100 * 100 * 128
    assert gen.totals.attention_dense_flops == prefill_attention + decode_attention


def test_single_new_token_is_prefill_only() -> None:
    gen = estimate.generation(get_preset("smollm2-135m"), 10, 1, FP16_ALL)
    assert gen.decode_steps == 0
    assert gen.totals.total_flops == estimate.prefill(get_preset("smollm2-135m"), 10, FP16_ALL).totals.total_flops


@pytest.mark.parametrize("call", [
    lambda cfg: estimate.prefill(cfg, 0, FP16_ALL),
    lambda cfg: estimate.decode_step(cfg, -1, FP16_ALL),
    lambda cfg: estimate.generation(cfg, 5, 0, FP16_ALL),
    lambda cfg: estimate.prefill(cfg, 5, FP16_ALL, batch=0),
])
def test_bad_sizes_are_rejected(call) -> None:
    with pytest.raises(BadArgumentError):
        call(get_preset("llama-7b"))


def test_quantized_weights_keep_16_bit_activations_and_cache() -> None:
    dt = estimate.Dtypes.for_weights(INT4)
    assert (dt.kv.name, dt.activations.name) == ("fp16", "fp16")
    step = estimate.decode_step(get_preset("llama-7b"), 0, dt)
    assert _by_name(step)["attention.wq"].weight_bytes == 4096 * 4096 // 32 * 18
