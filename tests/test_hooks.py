"""The run tracer's hooks: every stage fires once per layer per step, no hook outlives the tracer, shapes match the
config, and the FLOPs it counts equal FlopCounterMode's count and estimate.py's figure (three views of one number)."""

from __future__ import annotations

import pytest
import torch
from estimate_check import assert_traced_equals_estimate
from torch.utils.flop_counter import FlopCounterMode

from llmtrace.tracer.core import contract
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.model.fused import no_mark
from llmtrace.tracer.model.transformer import build_random_model
from llmtrace.tracer.run.backends import ModulesBackend, PackedBackend, backend_for
from llmtrace.tracer.trace.hooks import MODULE_MECHANISMS, Tracer
from llmtrace.tracer.trace.records import DECODE, MATMUL_KINDS, PREFILL, StageRecord

CONFIGS = {
    "mha": ModelConfig("mha", 128, 64, 2, 4, 4, 96, max_seq_len=64),
    "gqa": ModelConfig("gqa", 128, 64, 3, 4, 2, 96, max_seq_len=64),
    "mqa-tied": ModelConfig("mqa", 128, 48, 2, 6, 1, 80, max_seq_len=64, tie_embeddings=True),
    "head-dim": ModelConfig("hd", 96, 64, 2, 4, 2, 96, max_seq_len=64, explicit_head_dim=24),
}


def _hook_count(model: torch.nn.Module) -> int:
    """Module hooks plus instance-level forward wrappers: what a tracer may leave behind."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + ("forward" in m.__dict__) for m in model.modules())


def _traced_run(config: ModelConfig, prompt_len: int, decode_steps: int,
                mechanism: str = "wrap") -> tuple[Tracer, list[int]]:
    """Prefill `prompt_len` tokens then `decode_steps` decode steps under a Tracer; FlopCounterMode's total per step."""
    model = build_random_model(config, seed=1)
    model.setup_cache(1, prompt_len + decode_steps)
    generator = torch.Generator().manual_seed(0)
    counted = []
    with Tracer(model, mechanism=mechanism) as tracer:
        for step in range(decode_steps + 1):
            n = prompt_len if step == 0 else 1
            ids = torch.randint(0, config.vocab_size, (1, n), generator=generator)
            tracer.begin_step(PREFILL if step == 0 else DECODE, step)
            with FlopCounterMode(display=False) as counter:
                model.prefill(ids) if step == 0 else model.decode_one(ids)
            tracer.end_step()
            counted.append((counter.get_total_flops(), counter.get_flop_counts()))
    return tracer, counted


@pytest.fixture(scope="module", params=[(name, mech) for name in CONFIGS for mech in MODULE_MECHANISMS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def traced(request: pytest.FixtureRequest) -> tuple[ModelConfig, tuple[StageRecord, ...], list]:
    name, mechanism = request.param
    config = CONFIGS[name]
    tracer, counted = _traced_run(config, prompt_len=7, decode_steps=3, mechanism=mechanism)
    return config, tracer.records(), counted


def test_every_stage_fires_once_per_layer_per_step(traced) -> None:
    config, records, _ = traced
    expected = {f"layers.{i}.{s.role}" for i in range(config.n_layers) for s in contract.layer_stages()}
    expected |= {s.role for s in contract.staged_stages() if not s.in_layer}
    for step in range(4):
        names = [r.stage for r in records if r.step == step]
        assert sorted(names) == sorted(expected), f"step {step}"
        assert len(names) == 17 * config.n_layers + 3


def test_records_are_in_call_order_and_timed(traced) -> None:
    _, records, _ = traced
    prefill = [r for r in records if r.step == 0]
    assert prefill[0].stage == "tok_embeddings"
    assert [r.stage for r in prefill[1:18]] == [f"layers.0.{s.role}" for s in contract.layer_stages()]
    assert prefill[-1].stage == "output"
    for earlier, later in zip(records, records[1:]):
        assert earlier.end_ns <= later.start_ns
    assert all(r.duration_ns > 0 for r in records)


def test_shapes_match_the_config(traced) -> None:
    config, records, _ = traced
    h, hkv, d = config.n_heads, config.n_kv_heads, config.head_dim
    by = {(r.step, r.stage): r for r in records}
    # Prefill: T = 7 over S = 7; decode step 2: T = 1 over S = 9.
    for step, t, s in ((0, 7, 7), (2, 1, 9)):
        assert by[step, "tok_embeddings"].output_shapes == ((1, t, config.dim),)
        assert by[step, "layers.0.attention.wq"].output_shapes == ((1, t, h * d),)
        assert by[step, "layers.0.attention.wk"].output_shapes == ((1, t, hkv * d),)
        assert by[step, "layers.0.attention.kv_cache"].output_shapes == ((1, hkv, s, d), (1, hkv, s, d))
        assert by[step, "layers.0.attention.scores"].output_shapes == ((1, h, t, s),)
        assert by[step, "layers.0.attention.pv"].output_shapes == ((1, h, t, d),)
        assert by[step, "layers.0.feed_forward.w1"].output_shapes == ((1, t, config.ffn_dim),)
        assert by[step, f"layers.{config.n_layers - 1}.ffn_residual"].output_shapes == ((1, t, config.dim),)
        assert by[step, "output"].output_shapes == ((1, config.vocab_size),)
        assert by[step, "output"].dtype == "float32"


def test_matmul_flops_equal_flop_counter_mode(traced) -> None:
    """Every matmul FlopCounterMode saw, per step and per stage role, is the one the tracer counted."""
    config, records, counted = traced
    for step, (total, per_module) in enumerate(counted):
        stages = [r for r in records if r.step == step]
        assert sum(r.matmul_flops for r in stages) == total
        assert all(r.matmul_flops == 0 for r in stages if r.kind not in MATMUL_KINDS)
        for role in ("attention.wq", "attention.wk", "attention.wv", "attention.scores", "attention.pv",
                     "attention.wo", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"):
            ours = sum(r.matmul_flops for r in stages if r.short_name == role)
            theirs = sum(per_module[f"TransformerBlock.{role}"].values())
            assert ours == theirs > 0, (step, role)
        head = next(r for r in stages if r.stage == "output")
        assert head.matmul_flops == sum(per_module["Linear"].values())


def test_flops_and_bytes_equal_the_analytical_estimate(traced) -> None:
    """The same prompt and steps through tracer/analytic/estimate.py: equal FLOPs (matmul and elementwise) and equal
    weight and KV traffic."""
    config, records, _ = traced
    assert_traced_equals_estimate(config, records, prompt_len=7, decode_steps=3)


@pytest.mark.parametrize("mechanism", ["fused", "wrap"])
def test_llama7b_decode_flops_by_hand(mechanism: str) -> None:
    """A hand-derived figure: one LLaMA-7B decode step at S positions, on the meta device (no memory), through the
    fused path and stage by stage."""
    from llmtrace.tracer.core.presets import get_preset
    from llmtrace.tracer.model.transformer import build_meta_model

    config = get_preset("llama-7b")
    model = build_meta_model(config)
    model.setup_cache(1, 8)
    with Tracer(model, mechanism=mechanism) as tracer:
        run = backend_for(model).traced(tracer)  # packed, or the stage modules the wrappers watch
        run.prefill(torch.zeros((1, 4), dtype=torch.long, device="meta"))
        tracer.begin_step(DECODE, 1)
        run.decode(torch.zeros((1, 1), dtype=torch.long, device="meta"))
        tracer.end_step()
    records = tracer.records()
    assert len(records) == 32 * (14 if mechanism == "fused" else 17) + 3
    matmul = sum(r.matmul_flops for r in records)
    d, f, v, s, layers = 4096, 11008, 32000, 5, 32
    per_layer = 2 * 4 * d * d + 2 * 3 * d * f + 2 * 2 * 32 * s * 128  # Q,K,V,O + w1,w3,w2 + QKᵀ,PV
    assert matmul == layers * per_layer + 2 * d * v == 13_216_776_192


@pytest.mark.parametrize("mechanism, attached, per_layer", [("hooks", 2 * (17 * 3 + 3), 17), ("wrap", 17 * 3 + 3, 17),
                                                             ("fused", 0, 14)])
def test_nothing_is_left_behind(mechanism: str, attached: int, per_layer: int) -> None:
    model = build_random_model(CONFIGS["gqa"], seed=0)
    model.setup_cache(1, 8)
    tracer = Tracer(model, mechanism=mechanism)
    with tracer:
        assert tracer.attached == attached == _hook_count(model)  # fused: no module touched, the mark is the backend's
        assert (tracer.mark is not no_mark) == (mechanism == "fused")
        run = backend_for(model).traced(tracer)  # the stage modules while hooks or wrappers watch them
        assert isinstance(run, ModulesBackend) == (mechanism != "fused")
        tracer.begin_step(PREFILL, 0)
        run.prefill(torch.tensor([[1, 2, 3]]))
        tracer.end_step()
    assert _hook_count(model) == 0 and isinstance(backend_for(model), PackedBackend)
    with pytest.raises(RuntimeError, match="boom"):
        with Tracer(model, mechanism=mechanism) as failing:
            assert _hook_count(model) > 0 or failing.mark is not no_mark
            raise RuntimeError("boom")
    assert _hook_count(model) == 0 and isinstance(backend_for(model), PackedBackend)
    assert len(tracer.records()) == per_layer * 3 + 3


def test_tracing_off_attaches_nothing() -> None:
    model = build_random_model(CONFIGS["mha"], seed=0)
    model.setup_cache(1, 8)
    with Tracer(model, enabled=False) as tracer:
        assert _hook_count(model) == 0
        tracer.begin_step(PREFILL, 0)
        model.prefill(torch.tensor([[1, 2, 3]]))
        tracer.end_step()
    assert tracer.records() == ()


def test_byte_counts_of_one_decode_step() -> None:
    """Bytes by hand for layer 0 of a decode step: weights once, K/V of S positions read, one position written."""
    config = CONFIGS["gqa"]
    tracer, _ = _traced_run(config, prompt_len=5, decode_steps=1)
    by = {r.stage: r for r in tracer.records() if r.step == 1}
    d, hkv, hd, f = config.dim, config.n_kv_heads, config.head_dim, config.ffn_dim
    assert by["layers.0.attention.wq"].weight_bytes_read == config.q_dim * d * 4
    assert by["layers.0.feed_forward.w2"].weight_bytes_read == f * d * 4
    assert by["layers.0.attention.scores"].kv_bytes_read == hkv * 6 * hd * 4  # K of S = 6 positions
    assert by["layers.0.attention.pv"].kv_bytes_read == hkv * 6 * hd * 4  # V of S = 6 positions
    assert by["layers.0.attention.kv_cache"].kv_bytes_written == 2 * hkv * hd * 4  # one new K and V
    assert by["tok_embeddings"].weight_bytes_read == d * 4  # one row gathered
    assert by["output"].weight_bytes_read == config.vocab_size * d * 4


def test_traced_activation_bytes_are_the_eager_kernel_model(traced) -> None:
    """The stage-by-stage run is eager: each op reads and writes its tensors. Its traced activation bytes are the
    eager estimate's to within 5% (what differs: the traced KV-cache stage, the scaling done inside the scores
    stage, int64 positions), and far from the fused estimate's."""
    from llmtrace.tracer.analytic import estimate
    from llmtrace.tracer.analytic.kernels import Kernels
    from llmtrace.tracer.core.dtypes import FP32
    from llmtrace.tracer.trace.summary import stage_totals

    config, records, _ = traced
    dtypes = estimate.Dtypes.for_weights(FP32)
    for step in range(4):
        totals = stage_totals(r for r in records if r.step == step)
        traced_bytes = totals.activation_bytes_read + totals.activation_bytes_written
        for kernels, close in ((Kernels.EAGER, True), (Kernels.FUSED, False)):
            phase = (estimate.prefill(config, 7, dtypes, kernels=kernels) if step == 0
                     else estimate.decode_step(config, 6 + step, dtypes, kernels=kernels))
            within = abs(traced_bytes - phase.totals.activation_bytes) <= 0.05 * phase.totals.activation_bytes
            assert within == close, (step, kernels, traced_bytes, phase.totals.activation_bytes)
