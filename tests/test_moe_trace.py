"""A mixture of experts as the tracer sees it: the SwiGLU stages run once per chosen expert, on the tokens routed to
it; the traced matmul FLOPs of every step are FlopCounterMode's, and all its FLOPs the analytical estimate's; a step's
weight bytes are the real sizes of what it read (attention, norms, router, head and the distinct experts the step's
routing names, each expert once), the estimate's but for the experts (measured against uniform routing's expected
count); the routing record is the router's top-k of the logits the router stage wrote."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llmtrace.tracer.analytic import estimate
from llmtrace.tracer.core import flop_formulas as ff
from llmtrace.tracer.analytic.moe import expected_distinct_experts
from llmtrace.tracer.core.config import ModelConfig, MoeSpec
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.model.functional import route_top_k
from llmtrace.tracer.model.transformer import Transformer, build_random_model
from llmtrace.tracer.trace.hooks import Tracer
from llmtrace.tracer.trace.records import DECODE, PREFILL, StageRecord
from llmtrace.tracer.trace.routing import RoutingStep, expert_load, routing_step
from llmtrace.tracer.trace.summary import stage_totals

E, K = 8, 2
CONFIG = ModelConfig("tiny-moe", 96, 64, 2, 4, 2, 48, max_seq_len=32, moe=MoeSpec(E, K, "renormalised"))
PROMPT, DECODE_STEPS = 6, 3


def _traced() -> tuple[Transformer, tuple[StageRecord, ...], list[int], list[RoutingStep]]:
    """Records of a PROMPT-token prefill and DECODE_STEPS decode steps, FlopCounterMode's total of each step and
    each step's routing."""
    model = build_random_model(CONFIG, seed=4)
    with torch.no_grad():  # a sharper router than N(0, 0.02) gives: tokens that differ pick different experts
        for layer in model.layers:
            layer.feed_forward.router.weight.mul_(20)
    model.setup_cache(1, PROMPT + DECODE_STEPS)
    generator = torch.Generator().manual_seed(0)
    counted, routed = [], []
    with Tracer(model, mechanism="wrap") as tracer:
        for step in range(DECODE_STEPS + 1):
            ids = torch.randint(0, CONFIG.vocab_size, (1, PROMPT if step == 0 else 1), generator=generator)
            tracer.begin_step(PREFILL if step == 0 else DECODE, step)
            with FlopCounterMode(display=False) as counter:
                model.prefill(ids) if step == 0 else model.decode_one(ids)
            tracer.end_step()
            counted.append(counter.get_total_flops())
            routed.append(routing_step(model, PREFILL if step == 0 else DECODE, step))
    return model, tracer.records(), counted, routed


def test_each_chosen_expert_runs_once_on_its_tokens_and_flops_equal_flop_counter_mode() -> None:
    model, records, counted, routed = _traced()
    for step, routing in enumerate(routed):
        mine = [r for r in records if r.step == step]
        assert sum(r.matmul_flops for r in mine) == counted[step]
        for layer in routing.layers:
            gate = [r for r in mine if r.stage == f"layers.{layer.layer}.feed_forward.w1"]
            tokens_of = {e: sum(row.count(e) for row in layer.experts) for e in range(E)}
            ran = sorted(r.input_shapes[0][0] for r in gate)  # each call's rows: one expert's tokens
            assert ran == sorted(n for n in tokens_of.values() if n)
            assert len(gate) == layer.distinct
            assert sum(r.matmul_flops for r in gate) == ff.linear_flops(routing.tokens * K, CONFIG.dim, CONFIG.ffn_dim)
            route = next(r for r in mine if r.stage == f"layers.{layer.layer}.feed_forward.route")
            assert route.elementwise_flops == routing.tokens * (5 * E + K * E + 2 * K)
            combine = next(r for r in mine if r.stage == f"layers.{layer.layer}.feed_forward.combine")
            assert combine.elementwise_flops == routing.tokens * CONFIG.dim * (2 * K - 1)
    assert routed[0].tokens == PROMPT and all(r.tokens == 1 for r in routed[1:])
    assert max(layer.distinct for layer in routed[0].layers) > K  # the prompt's tokens went to different experts


def test_a_steps_weight_bytes_are_attention_the_distinct_experts_it_touched_and_the_head() -> None:
    model, records, _, routed = _traced()
    state = dict(model.named_parameters())
    nbytes = {name: p.numel() * p.element_size() for name, p in state.items()}
    expert = 3 * CONFIG.ffn_dim * CONFIG.dim * 4  # one expert's w1, w3 and w2 in fp32
    for step, routing in enumerate(routed):
        read = sum(r.weight_bytes_read for r in records if r.step == step)
        rows = PROMPT if step == 0 else 1
        want = rows * CONFIG.dim * 4 + nbytes["norm.weight"] + nbytes["output.weight"]  # embedding rows, head
        for layer in routing.layers:
            prefix = f"layers.{layer.layer}."
            dense = [n for n in nbytes if n.startswith(prefix) and ".w1." not in n and ".w2." not in n
                     and ".w3." not in n]  # attention, norms, router
            want += sum(nbytes[n] for n in dense) + layer.distinct * expert
        assert read == want, step
    decode_reads = [sum(r.weight_bytes_read for r in records if r.step == s) for s in range(1, DECODE_STEPS + 1)]
    assert all(read < nbytes["output.weight"] + E * expert for read in decode_reads)  # far from every expert


def test_the_routing_record_is_the_routers_choice_on_the_stage_inputs() -> None:
    """The record's experts and weights are the top-k of the router logits the router stage wrote (softmax,
    renormalised), recomputed here from its input; and the load over the run counts each token row k times."""
    model = build_random_model(CONFIG, seed=4)
    model.setup_cache(1, PROMPT)
    kept = {}
    handle = model.layers[1].feed_forward.router.register_forward_hook(
        lambda module, args, out: kept.update(logits=out.detach().clone()))
    try:
        with torch.no_grad():
            model.prefill(torch.arange(3, 3 + PROMPT).view(1, PROMPT))
    finally:
        handle.remove()
    routing = routing_step(model, PREFILL, 0)
    probs = torch.softmax(kept["logits"], dim=-1)
    top = torch.topk(probs, K, dim=-1)
    assert routing.layers[1].experts == tuple(map(tuple, top.indices.tolist()))
    want = top.values / top.values.sum(dim=-1, keepdim=True)
    assert torch.allclose(torch.tensor(routing.layers[1].weights), want, atol=1e-7)
    assert all(abs(sum(row) - 1.0) < 1e-6 for row in routing.layers[1].weights)
    load = expert_load((routing,), E)
    assert [sum(layer) for layer in load] == [PROMPT * K] * CONFIG.n_layers
    softmax_only = route_top_k(kept["logits"], K, renormalise=False)[0]
    assert torch.allclose(softmax_only, top.values)  # OLMoE's: the softmax's own values, not rescaled


def test_flops_equal_the_estimates_and_weight_bytes_differ_only_by_the_experts_read() -> None:
    """FLOPs do not depend on the routing (each token row runs k experts), so the traced FLOPs equal the analytical
    estimate's, in total and per stage of layer 0 (an expert stage's calls summed); its weight bytes differ from the
    estimate's only by the experts: the measured distinct ones against uniform routing's expectation."""
    _, records, _, routed = _traced()
    dtypes = estimate.Dtypes.for_weights(FP32)
    expert = 3 * CONFIG.ffn_dim * CONFIG.dim * 4
    for step, routing in enumerate(routed):
        stages = [r for r in records if r.step == step]
        phase = (estimate.prefill(CONFIG, PROMPT, dtypes) if step == 0
                 else estimate.decode_step(CONFIG, PROMPT - 1 + step, dtypes))
        ours = stage_totals(stages)
        assert (ours.flops, ours.matmul_flops) == (phase.totals.total_flops, phase.totals.matmul_flops)
        components = {c.name: c for c in phase.components}
        by_role: dict[str, int] = {}
        for record in (r for r in stages if r.layer == 0):
            by_role[record.short_name] = by_role.get(record.short_name, 0) + record.flops
        for role, flops in by_role.items():
            assert flops == sum(components[part].flops for part in estimate.stage_components(role, CONFIG)), role
        expected = expected_distinct_experts(E, K, routing.tokens)
        measured = sum(layer.distinct for layer in routing.layers)
        assert ours.weight_bytes_read - phase.totals.weight_bytes == pytest.approx(
            (measured - CONFIG.n_layers * expected) * expert, abs=CONFIG.n_layers)
