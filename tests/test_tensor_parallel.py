"""Tensor parallelism without processes: the sharded model's numbers (ranks as threads, tests/tp_threads.py), the
split's errors, and `--dry-run --tp N` on the meta device against roofline --tp's per-device figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tp_threads import run_ranks
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.config import ModelConfig, MoeSpec
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.load.tensor_parallel import shard_state_dict
from llmtrace.tracer.model.tensor_parallel import build_meta_shard, shard_config
from llmtrace.tracer.model.transformer import build_random_model
from llmtrace.tracer.run.tp_launch import StopGate
from llmtrace.tracer.trace.hooks import Tracer
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.tp_summary import tp_dry_run_passes

runner = CliRunner()


def _config(**overrides) -> ModelConfig:
    base = dict(name="tiny", vocab_size=101, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, norm_eps=1e-5,
                rope_theta=10000.0, max_seq_len=64, tie_embeddings=False)
    return ModelConfig(**{**base, **overrides})


TOKENS = torch.tensor([[3, 50, 99, 7, 60, 98]])  # ids in both vocabulary slices (of 101: the last one padded)


def _whole_and_ranks(config: ModelConfig, tp: int):
    whole = build_random_model(config, seed=1)
    whole.setup_cache(1, 16)
    reference = (whole.prefill(TOKENS), whole.decode_one(torch.tensor([[64]])), whole(TOKENS))
    state = whole.state_dict()

    def body(rank, comm):
        model = build_meta_shard(config, tp, rank, comm)
        model.load_weights(shard_state_dict(config, state, rank, tp))
        model.setup_cache(1, 16)
        with torch.no_grad():
            out = (model.prefill(TOKENS), model.decode_one(torch.tensor([[64]])), model(TOKENS))
        return out, comm.log

    return reference, run_ranks(tp, body)


@pytest.mark.parametrize("overrides", [
    {},  # 101 = 2 x 51 - 1: the last vocabulary slice padded
    {"tie_embeddings": True, "vocab_size": 100},
    {"qkv_bias": True, "wo_bias": True, "mlp_bias": True},  # column biases split, row biases added once
    {"n_kv_heads": 4},  # MHA
    # a mixture of experts: every expert's columns split, the router whole on each rank (each routes alike)
    {"moe": MoeSpec(4, 2, "renormalised")},
    # Qwen2-MoE's shape: the softmax's weights, a shared expert split as the experts, its gate whole; Q/K/V biases
    {"moe": MoeSpec(4, 2, "softmax"), "shared_expert_dim": 64, "qkv_bias": True},
])
def test_tp2_logits_equal_one_device_in_fp32(overrides) -> None:
    reference, ranks = _whole_and_ranks(_config(**overrides), 2)
    for outputs, _ in ranks:
        for got, want in zip(outputs, reference):
            assert got.shape == want.shape
            assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
            assert torch.equal(got.argmax(-1), want.argmax(-1))  # the greedy token


def test_collectives_per_forward_and_their_payloads() -> None:
    config = _config()
    _, ranks = _whole_and_ranks(config, 2)
    log = ranks[0][1]
    per_forward = 2 * config.n_layers + 2  # wo and w2 of each layer, the embedding, the LM head
    assert len(log) == 3 * per_forward  # prefill, decode, cache-free forward
    prefill = log[:per_forward]
    assert prefill[0] == ("all_reduce", None, "tok_embeddings", 6 * 64 * 4)  # B*T*dim fp32
    assert prefill[1:3] == [("all_reduce", 0, "attention.wo", 6 * 64 * 4), ("all_reduce", 0, "feed_forward.w2", 6 * 64 * 4)]
    assert prefill[-1] == ("all_gather", None, "output", 51 * 4)  # the last position's 51-row vocabulary slice
    assert log[per_forward][3] == 64 * 4  # decode: one token's hidden vector


def test_flops_per_rank_sum_to_the_single_device_count() -> None:
    """Split stages' FLOPs add up to the whole model's exactly; replicated ones (norms, residuals) run on each rank."""
    config = _config(vocab_size=100)
    whole = build_random_model(config, seed=1)
    whole.setup_cache(1, 16)
    with Tracer(whole, mechanism="wrap") as tracer:
        tracer.begin_step("prefill", 0)
        whole.prefill(TOKENS)
        tracer.end_step()
    single = {s.stage: s.flops for s in tracer.records()}
    state = whole.state_dict()

    def body(rank, comm):
        model = build_meta_shard(config, 2, rank, comm)
        model.load_weights(shard_state_dict(config, state, rank, 2))
        model.setup_cache(1, 16)
        with Tracer(model, mechanism="wrap") as t:
            t.begin_step("prefill", 0)
            model.prefill(TOKENS)
            t.end_step()
        return {s.stage: s.flops for s in t.records()}

    ranks = run_ranks(2, body)
    replicated = ("attention_norm", "ffn_norm", "attn_residual", "ffn_residual", "norm")
    assert set(ranks[0]) == set(single)
    for stage, flops in single.items():
        if stage.split(".")[-1] in replicated:
            assert ranks[0][stage] == ranks[1][stage] == flops
        else:
            assert ranks[0][stage] + ranks[1][stage] == flops, stage
    assert sum(single.values()) > 0


def test_a_tp_that_does_not_divide_the_kv_heads_names_the_valid_ones() -> None:
    with pytest.raises(BadArgumentError, match=r"--tp 4 does not divide tiny's 2 KV heads.*use --tp 1, 2$"):
        shard_config(_config(), 4)
    assert shard_config(_config(), 2).n_kv_heads == 1


def test_cli_one_line_and_exit_2_when_tp_does_not_split(tiny_llama_dir: Path) -> None:
    result = runner.invoke(app, ["run", "hi", "--model", str(tiny_llama_dir), "--tp", "3"])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0
    assert "--tp 3 does not divide" in result.stderr and "use --tp 1, 2" in result.stderr


def test_dry_run_tp_on_a_preset_matches_roofline_per_device(tmp_path: Path) -> None:
    out = tmp_path / "dry.json"
    result = runner.invoke(app, ["run", "--model", "llama-7b", "--dry-run", "--tp", "4", "--prompt-tokens", "8",
                                 "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "Tensor parallel · 4 ranks (dry run)" in result.output
    trace = Trace.from_json(out.read_text(encoding="utf-8"))
    assert trace.tensor_parallel.tp == 4 and trace.tensor_parallel.launcher == "meta"
    q = next(s for s in trace.stages if s.stage == "layers.0.attention.wq" and s.phase == "prefill")
    assert q.output_shapes == ((1, 8, 1024),)  # 32 heads / 4 ranks x head dim 128
    passes = tp_dry_run_passes(trace)
    assert [p.phase for p in passes] == ["prefill", "decode"]
    for p in passes:
        assert p.equal  # the traced shard's FLOPs are roofline --tp's per-device FLOPs, counted independently
        assert 4 * p.traced_flops - 3 * p.replicated_flops == p.single_device_flops
        sizes = {(c.kind, c.after): c for c in p.collectives}
        hidden = p.new_tokens * 4096 * 4  # B*T*dim fp32 (the dry run's dtype)
        assert sizes[("all_reduce", "attention.wo")].per_pass == 32
        assert sizes[("all_reduce", "attention.wo")].payload_bytes == hidden
        assert sizes[("all_reduce", "attention.wo")].bytes_sent == 2 * 3 * hidden // 4
        assert sizes[("all_gather", "output")].payload_bytes == 8000 * 4  # the last position's vocabulary slice


def test_stop_gate_stops_every_rank_before_the_same_step() -> None:
    import multiprocessing

    gate = StopGate(3, multiprocessing.get_context("spawn"))
    assert gate.may_start(0, 0) and gate.may_start(0, 1) and gate.may_start(1, 0)
    gate.stop()  # furthest begun: step 1 -> every rank stops before step 2
    assert gate.may_start(1, 1) and gate.may_start(2, 0) and gate.may_start(2, 1)
    assert not gate.may_start(0, 2) and not gate.may_start(1, 2) and not gate.may_start(2, 2)
