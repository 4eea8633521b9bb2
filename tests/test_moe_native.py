"""A mixture of experts on the native C decode step (issue 29, items 1, 2 and 5): the router's product, softmax and
top-k with the family's normalisation, each chosen expert's gate|up, silu*up and down over its bytes of the file's
3-D tensors, and the weighted sum, in C (decode_step.c); its prefill on the stage modules (no packed path routes).

What must hold:
- logits and ids: the stage modules' (the exact kernel: within 1e-4, greedy ids equal), fused and staged, on one
  thread and two, with a router held as stored (Q8_0, Q4_0) or dense F32 (as llama.cpp writes it);
- routing: every step's experts, per layer, the modules' exactly, their weights within 1e-6, written back where the
  trace reads them (Route.last) and so into the run's routing records;
- records: a traced step's records (the stage modules' stages apart, each expert's gate, up, silu*up and down once
  per chosen expert) are the wrapped stage modules' records field by field but the times;
- readings: one per stage, stamp_count's number, non-decreasing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_mixtral import mixtral_dict
from test_qwen2 import _bundled_vocab
from tiny_gguf import write_tiny_gguf
from tiny_llama import random_weights

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.transformer import Transformer
from llmtrace.tracer.run.backends import backend_for
from llmtrace.tracer.run.generate import Generation
from llmtrace.tracer.run.select import Request, select
from llmtrace.tracer.trace.fused_marks import staged_order
from llmtrace.tracer.trace.hooks import Tracer
from llmtrace.tracer.trace.records import DECODE, MODULES, NATIVE, PACKED, PREFILL, RunSettings, StageRecord
from llmtrace.tracer.trace.routing import routing_step
from tests.stamp_count import stamp_count
from tests.torch_threads import torch_threads

E, K, PROMPT, STEPS = 4, 2, 6, 7
TOKENS = [7, 31, 2, 90, 45, 12, 1000]  # the decode steps' tokens, fixed: every path sees the same inputs

pytestmark = [pytest.mark.skipif(not native_kernel.available(), reason="llmtrace's C kernels are not built here"),
              pytest.mark.usefixtures("private_dirs")]


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0", "F32 router"])
def moe_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mixtral-style 'llama' GGUF (4 experts of FFN 96, 2 a token): every matrix Q8_0 or Q4_0, or Q8_0 with
    the routers F32 (llama.cpp keeps ffn_gate_inp F32: the C step's dense router)."""
    vocab = _bundled_vocab()
    folder = tmp_path_factory.mktemp("moe-native")
    (folder / "config.json").write_text(json.dumps(mixtral_dict(vocab)), encoding="utf-8")
    config = ModelConfig.from_hf_json(folder)
    weights = random_weights(config, seed=9)
    qtype = gguf.GGMLQuantizationType["Q4_0" if request.param == "Q4_0" else "Q8_0"]
    raw = {} if request.param != "F32 router" else {
        f"blk.{i}.ffn_gate_inp.weight": (weights[f"layers.{i}.feed_forward.router.weight"].numpy().astype(np.float32),
                                         gguf.GGMLQuantizationType.F32) for i in range(config.n_layers)}
    return write_tiny_gguf(folder / "moe.gguf", config, weights, vocab, matrix_type=qtype, tokenizer_model="gpt2",
                           raw_blocks=raw, extra_metadata={"llama.expert_count": E, "llama.expert_used_count": K})


@pytest.fixture(scope="module")
def model(moe_file: Path) -> Transformer:
    return load_model(str(moe_file), weights="native").model


Routes = list[list[tuple[tuple[int, ...], tuple[float, ...]]]]  # per step, per layer: (experts, weights)


@torch.no_grad()
def steps(model: Transformer, request: Request, traced: bool = False
          ) -> tuple[list[torch.Tensor], Routes, tuple[StageRecord, ...]]:
    """A PROMPT-token prefill, then TOKENS one step each, on `request`'s backend: each decode step's logits, its
    routing (per layer: the experts and weights of its one token), and the records when `traced`."""
    model.setup_cache(1, PROMPT + STEPS)
    backend = backend_for(model, request)
    logits, routes = [], []
    with Tracer(model, mechanism="wrap", enabled=traced) as tracer:
        run = backend.traced(tracer)
        tracer.begin_step(PREFILL, 0)
        run.prefill(torch.arange(3, 3 + PROMPT).view(1, -1))
        tracer.end_step()
        for step, token in enumerate(TOKENS, start=1):
            tracer.begin_step(DECODE, step)
            logits.append(run.decode(torch.tensor([[token]]))[0].clone())
            tracer.end_step()
            routed = routing_step(model, DECODE, step)
            routes.append([(layer.experts[0], layer.weights[0]) for layer in routed.layers])
    return logits, routes, tracer.records()


def assert_same_routes(got: list, want: list) -> None:
    for step_got, step_want in zip(got, want, strict=True):
        for (experts, weights), (want_experts, want_weights) in zip(step_got, step_want, strict=True):
            assert experts == want_experts
            assert max(abs(a - b) for a, b in zip(weights, want_weights)) < 1e-6


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("staged", [False, True])
def test_the_c_step_gives_the_stage_modules_logits_and_routes(model: Transformer, staged: bool, threads: int) -> None:
    model.setup_cache(1, PROMPT + STEPS)
    assert select(model, Request(staged=staged)).route.decode == NATIVE
    with torch_threads(threads):
        want, want_routes, _ = steps(model, Request(staged=staged, backend=MODULES))
        got, routes, _ = steps(model, Request(staged=staged))
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert int(a.argmax()) == int(b.argmax()), step
        assert (a - b).abs().max().item() < 1e-4, step
    assert max(b.abs().max().item() for b in want) > 1.0
    assert_same_routes(routes, want_routes)
    assert len({experts for step in routes for experts, _ in step}) > 1  # the tokens do not all go one way


def test_the_softmax_routers_weights_are_not_renormalised(moe_file: Path) -> None:
    """OLMoE's route (the k weights as the softmax gave them, not rescaled): the same model with its Route modules
    switched, on the C step and on the stage modules alike (ExpertsPlan reads the route's router_norm)."""
    model = load_model(str(moe_file), weights="native").model
    for layer in model.layers:
        layer.feed_forward.route.router_norm = "softmax"
    want, want_routes, _ = steps(model, Request(backend=MODULES))
    got, routes, _ = steps(model, Request())
    assert max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)) < 1e-4
    assert_same_routes(routes, want_routes)
    assert all(sum(weights) < 0.999 for step in routes for _, weights in step)  # k of E softmax weights: below 1


def untimed(record: StageRecord) -> StageRecord:
    return dataclasses.replace(record, start_ns=0, duration_ns=0)


@pytest.mark.parametrize("staged", [False, True])
def test_a_traced_steps_records_are_the_wrapped_stage_modules_records(model: Transformer, staged: bool) -> None:
    """Traced, the C step runs the stage modules' stages apart, the experts' once per chosen expert (the "wrap"
    tracer takes its readings), --staged or not: the records are the modules', names, order, shapes, FLOPs, bytes."""
    _, _, native = steps(model, Request(staged=staged, traced=True), traced=True)
    _, _, modules = steps(model, Request(staged=staged, traced=True, backend=MODULES), traced=True)
    assert [untimed(r) for r in native] == [untimed(r) for r in modules]
    decode = [r.stage for r in native if r.step == 1]
    assert decode == staged_order(model)
    per_layer = [r.stage.split(".", 2)[2] for r in native if r.step == 1 and r.layer == 0]
    experts = ["feed_forward.w1", "feed_forward.w3", "feed_forward.act", "feed_forward.w2"]
    assert per_layer[per_layer.index("feed_forward.route") + 1:per_layer.index("feed_forward.combine")] == experts * K
    assert len(decode) == stamp_count(model.config.n_layers, staged=True, experts=K) - 1


@pytest.mark.parametrize("staged", [False, True])
def test_one_reading_per_stage(model: Transformer, staged: bool) -> None:
    model.setup_cache(1, PROMPT + STEPS)
    backend = backend_for(model)
    backend.prefill(torch.arange(3, 3 + PROMPT).view(1, -1))
    step = backend.plan.native
    step(TOKENS[0], PROMPT, stamps=True, staged=staged)
    readings = step.readings()
    assert len(readings) == stamp_count(model.config.n_layers, staged, experts=K)
    assert readings == sorted(readings)
    assert len(readings) == 1 + 1 + model.config.n_layers * ((16 + 4 * K) if staged else (14 + 3 * K)) + 2


def test_a_runs_routing_records_are_the_stage_modules(moe_file: Path) -> None:
    """A whole run, traced and not: the C step's decode (route native; the prefill packed, or the stage modules when
    traced) generates the modules backend's ids, and the trace's routing records name the same experts in every step
    and layer."""
    loaded = load_model(str(moe_file), weights="native")
    runs = {}
    for trace in (True, False):
        for backend in (None, MODULES):
            settings = RunSettings(model=str(moe_file), prompt="The capital of France is", max_new_tokens=6,
                                   temperatures=(), trace=trace)
            runs[trace, backend] = Generation(loaded, settings, backend=backend).run()
    for trace in (True, False):
        native, modules = runs[trace, None], runs[trace, MODULES]
        prefill = MODULES if trace else PACKED  # (the packed step's marks cannot count a traced step's experts)
        assert (native.route.prefill, native.route.decode, native.route.ahead) == (prefill, NATIVE, not trace)
        assert (native.run_ahead is not None and native.run_ahead.steps == 5) == (not trace)  # untraced: ahead
        assert modules.route.decode == MODULES
        assert native.generated_ids == modules.generated_ids
        assert [(r.phase, r.step) for r in native.routing] == [(s.phase, s.step) for s in native.steps]
        for a, b in zip(native.routing, modules.routing, strict=True):
            assert_same_routes([[(layer.experts[0], layer.weights[0]) for layer in a.layers]],
                               [[(layer.experts[0], layer.weights[0]) for layer in b.layers]])
