"""Mixture-of-experts presets in the analytical commands, each figure against a source of its own: Mixtral's
parameters and one decode step derived by hand here from its published config.json, the published totals of all
three presets, and the expected-distinct-experts formula against a seeded simulation of uniform routing."""

from __future__ import annotations

import json
import math
import random

import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.analytic import estimate
from llmtrace.tracer.core import flop_formulas as ff
from llmtrace.tracer.analytic.moe import expected_distinct_experts, most_distinct_experts
from llmtrace.tracer.analytic.params import count_params, weight_bytes
from llmtrace.tracer.analytic.tensor_parallel import device_cost, replicated_components
from llmtrace.tracer.core.config import ModelConfig, MoeSpec
from llmtrace.tracer.core.dtypes import BF16
from llmtrace.tracer.core.errors import ConfigError
from llmtrace.tracer.core.presets import PRESETS

MIXTRAL = PRESETS["mixtral-8x7b"]
runner = CliRunner()

# mistralai/Mixtral-8x7B-v0.1/config.json: hidden 4096, 32 layers, 32 heads, 8 KV heads (head dim 128),
# intermediate 14336, 8 local experts, 2 per token, vocab 32000, embeddings not tied.
D, LAYERS, Q, KV, F, E, K, V = 4096, 32, 32 * 128, 8 * 128, 14336, 8, 2, 32000
ATTENTION = D * Q + 2 * D * KV + Q * D  # wq, wk, wv, wo
EXPERT = 3 * D * F  # w1, w3, w2
ROUTER = D * E
NORMS = 2 * D
MIXTRAL_TOTAL = 2 * V * D + LAYERS * (ATTENTION + E * EXPERT + ROUTER + NORMS) + D
MIXTRAL_ACTIVE = 2 * V * D + LAYERS * (ATTENTION + K * EXPERT + ROUTER + NORMS) + D


def test_mixtral_parameters_by_hand_and_as_published() -> None:
    assert MIXTRAL_TOTAL == 46_702_792_704 and MIXTRAL_ACTIVE == 12_879_925_248
    p = count_params(MIXTRAL)
    assert (p.total, p.active) == (MIXTRAL_TOTAL, MIXTRAL_ACTIVE)
    assert (p.n_experts, p.experts_per_token, p.expert_per_layer, p.router_per_layer) == (E, K, EXPERT, ROUTER)
    assert p.ffn_per_layer == E * EXPERT + ROUTER
    # Mistral AI's announcement: "46.7B total parameters but only uses 12.9B parameters per token".
    assert round(p.total / 1e9, 1) == 46.7 and round(p.active / 1e9, 1) == 12.9
    # bf16: every value 2 bytes (the norms too: bf16 is not a quantized format)
    assert weight_bytes(MIXTRAL, BF16) == 2 * MIXTRAL_TOTAL


def test_qwen3_and_olmoe_totals_as_published() -> None:
    qwen = count_params(PRESETS["qwen3-30b-a3b"])
    # Qwen/Qwen3-30B-A3B/config.json: 48 layers, d 2048, 32 heads / 4 KV of 128, 128 experts of 768, top 8, QK-norm
    attention, expert, norms = 2048 * 4096 * 2 + 2 * 2048 * 512, 3 * 2048 * 768, 2 * 2048 + 2 * 128
    layer = attention + 128 * expert + 2048 * 128 + norms
    assert qwen.total == 2 * 151936 * 2048 + 48 * layer + 2048 == 30_532_122_624
    assert qwen.active == qwen.total - 48 * 120 * expert == 3_353_032_704
    # Qwen3-30B-A3B's model card: 30.5B in total, 3.3B activated, 29.9B non-embedding (embedding and LM head out).
    assert round(qwen.total / 1e9, 1) == 30.5
    assert 3.3e9 <= qwen.active < 3.4e9  # "3.3B": 3,353,032,704 (the card's figure is cut, not rounded)
    assert round((qwen.total - qwen.embedding - qwen.lm_head) / 1e9, 1) == 29.9
    olmoe = count_params(PRESETS["olmoe-1b-7b"])
    # allenai/OLMoE-1B-7B-0924/config.json: 16 layers, d 2048, 16 heads of 128 (MHA), 64 experts of 1024, top 8;
    # q_norm and k_norm over the whole 2048-wide q and k
    layer = 4 * 2048 * 2048 + 64 * 3 * 2048 * 1024 + 2048 * 64 + 2 * 2048 + 2 * 2048
    assert olmoe.total == 2 * 50304 * 2048 + 16 * layer + 2048 == 6_919_161_856
    assert olmoe.active == olmoe.total - 16 * 56 * 3 * 2048 * 1024 == 1_282_017_280
    # OLMoE paper (Muennighoff et al. 2024), table 1: 6.9B total, 1.3B active.
    assert round(olmoe.total / 1e9, 1) == 6.9 and round(olmoe.active / 1e9, 1) == 1.3


def test_a_dense_model_is_all_active() -> None:
    p = count_params(PRESETS["llama3-8b"])
    assert p.active == p.total and (p.n_experts, p.experts_per_token, p.router_per_layer) == (1, 1, 0)


@pytest.mark.parametrize(("n_experts", "top_k", "tokens"), [(8, 2, 1), (8, 2, 4), (8, 2, 16), (64, 8, 4),
                                                            (128, 8, 16), (128, 8, 64)])
def test_expected_distinct_experts_against_uniform_routing(n_experts: int, top_k: int, tokens: int) -> None:
    """Each token draws k distinct experts of E uniformly; the mean distinct count over seeded trials lies within
    four standard errors of E·(1 - (1 - k/E)^n)."""
    rng = random.Random(1234 + n_experts * 1000 + tokens)
    trials = 4000
    counts = []
    for _ in range(trials):
        touched: set[int] = set()
        for _ in range(tokens):
            touched.update(rng.sample(range(n_experts), top_k))
        counts.append(len(touched))
    mean = sum(counts) / trials
    spread = math.sqrt(sum((c - mean) ** 2 for c in counts) / (trials - 1) / trials)
    formula = expected_distinct_experts(n_experts, top_k, tokens)
    assert abs(mean - formula) <= 4 * spread + 1e-9, (mean, formula, spread)
    assert max(counts) <= most_distinct_experts(n_experts, top_k, tokens)


def test_expected_distinct_experts_closed_values() -> None:
    assert expected_distinct_experts(8, 2, 1) == 2.0  # one token reads exactly its k
    assert expected_distinct_experts(8, 2, 4) == 8 * (1 - 0.75**4) == 5.46875
    assert most_distinct_experts(8, 2, 4) == 8 and most_distinct_experts(128, 8, 4) == 32


def _component(phase: estimate.PhaseEstimate, name: str) -> estimate.ComponentCost:
    return next(c for c in phase.components if c.name == name)


def test_mixtral_decode_step_by_hand() -> None:
    """One bf16 decode step at context 128: each expert product runs k times a dense one; the weights read are the
    non-expert weights (one embedding row per sequence), plus the experts the batch touches."""
    dtypes = estimate.Dtypes.for_weights(BF16)
    one = estimate.decode_step(MIXTRAL, 128, dtypes, batch=1)
    assert _component(one, "feed_forward.w1").flops == 2 * D * F * K
    assert _component(one, "feed_forward.w2").flops == 2 * F * D * K
    assert _component(one, "feed_forward.act").flops == 6 * F * K
    assert _component(one, "feed_forward.router").flops == 2 * D * E
    assert _component(one, "feed_forward.route").flops == 5 * E + K * E + 2 * K  # softmax, top-k, renormalise
    assert _component(one, "feed_forward.combine").flops == D * (2 * K - 1)
    other = 2 * (MIXTRAL_TOTAL - V * D - LAYERS * E * EXPERT)  # all but the embedding table and the experts
    assert one.totals.weight_bytes == other + 2 * D + LAYERS * K * 2 * EXPERT
    four = estimate.decode_step(MIXTRAL, 128, dtypes, batch=4)
    experts_read = 8 * (1 - (3 / 4) ** 4)  # 5.46875: every product's bytes times it come out whole
    assert four.totals.weight_bytes == other + 4 * 2 * D + round(LAYERS * experts_read * 2 * EXPERT)


def test_router_flops_by_norm() -> None:
    assert ff.route_flops(3, 64, 8, renormalised=False) == 3 * (5 * 64 + 8 * 64)  # OLMoE keeps the softmax weights
    assert ff.route_flops(1, 128, 8, renormalised=True) == 5 * 128 + 8 * 128 + 16
    assert ff.expert_combine_flops(5, 2048, 8) == 5 * 2048 * 15


def test_prefill_experts_run_k_times_a_dense_ffn() -> None:
    dense = ModelConfig("dense", V, D, LAYERS, 32, 8, F)
    dtypes = estimate.Dtypes.for_weights(BF16)
    moe_pass, dense_pass = estimate.prefill(MIXTRAL, 64, dtypes), estimate.prefill(dense, 64, dtypes)
    for name in ("feed_forward.w1", "feed_forward.w3", "feed_forward.w2", "feed_forward.act"):
        assert _component(moe_pass, name).flops == K * _component(dense_pass, name).flops
    # 64 tokens touch 8·(1 - 0.75^64) of 8 experts: all but 1e-7 of them
    assert _component(moe_pass, "feed_forward.w1").weight_bytes == round(
        2 * D * F * expected_distinct_experts(E, K, 64))


def test_tensor_parallel_replicates_the_router() -> None:
    """Over 2 devices each runs the router, its top-k and the weighted sum in full (as the norms and residual
    adds), and half of everything else."""
    assert {"feed_forward.router", "feed_forward.route", "feed_forward.combine"} <= replicated_components()
    step = estimate.decode_step(MIXTRAL, 128, estimate.Dtypes.for_weights(BF16))
    whole, half = device_cost(MIXTRAL, step, 2, 1), device_cost(MIXTRAL, step, 2, 2)
    full = sum(c.total_flops for c in step.components if c.name in replicated_components())
    assert _component(step, "feed_forward.router").total_flops == LAYERS * 2 * D * E
    assert abs(half.flops - (full + (whole.flops - full) / 2)) <= len(step.components)  # each share rounded up


def test_flops_json_reports_the_routing() -> None:
    result = runner.invoke(app, ["flops", "--model", "mixtral-8x7b", "--dtype", "bf16", "--batch", "2", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    moe = doc["moe"]
    assert (moe["n_experts"], moe["experts_per_token"], moe["router_norm"]) == (8, 2, "renormalised")
    assert moe["expert_bytes"] == 2 * EXPERT
    assert [r["batch"] for r in moe["reads"]] == [1, 2, 4, 16, 64]
    by_batch = {r["batch"]: r for r in moe["reads"]}
    assert by_batch[2]["expected_weight_bytes"] == doc["decode"]["totals"]["weight_bytes"]
    assert by_batch[16]["expected_experts"] == pytest.approx(8 * (1 - 0.75**16))
    assert by_batch[64]["all_experts_weight_bytes"] - by_batch[64]["expected_weight_bytes"] == pytest.approx(
        LAYERS * 2 * EXPERT * (8 - expected_distinct_experts(8, 2, 64)), abs=LAYERS * 3)
    assert doc["two_x_params"] == 2 * MIXTRAL_ACTIVE
    assert doc["params"]["active"] == MIXTRAL_ACTIVE


def test_a_dry_run_of_a_mixture_of_experts_traces_the_estimates_flops(tmp_path) -> None:
    """The model code routes tokens now (tests/test_mixtral.py); a meta model, which has no router weights, routes
    each token row round-robin (tracer/model/moe.py dry_routes): its FLOPs are the estimate's exactly (they do not
    depend on the routing), and a decode step's weights read its 2 experts a layer, the estimate's too (one token
    touches k experts whatever the router)."""
    from llmtrace.tracer.core.dtypes import FP32
    from llmtrace.tracer.trace.dry_run import dry_run_check
    from llmtrace.tracer.trace.run_trace import Trace

    path = tmp_path / "dry.json"
    result = runner.invoke(app, ["run", "--model", "mixtral-8x7b", "--dry-run", "--dtype", "fp32", "--json-file",
                                 str(path)])
    assert result.exit_code == 0, result.output
    assert "routed round-robin over the 8" in " ".join(result.stdout.split())
    trace = Trace.from_json(path.read_text(encoding="utf-8"))
    check = dry_run_check(trace)
    assert [p.equal for p in check.passes] == [True, True]
    decode = check.passes[1]
    step = estimate.decode_step(trace.config, decode.context_length - 1, estimate.Dtypes.for_weights(FP32))
    assert decode.weight_bytes_read == step.totals.weight_bytes


def test_more_experts_per_token_than_experts_is_refused() -> None:
    with pytest.raises(ConfigError, match="k cannot exceed E"):
        ModelConfig("bad", V, D, 2, 32, 8, F, moe=MoeSpec(4, 8, "softmax"))
    with pytest.raises(ConfigError, match="router_norm"):
        ModelConfig("bad", V, D, 2, 32, 8, F, moe=MoeSpec(8, 2, "sparsemax"))
