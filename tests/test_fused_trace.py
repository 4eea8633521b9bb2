"""Tracing the fused path from inside (tracer/trace/fused_marks.py): every fused stage is marked once per layer per step,
its records agree with the stage-by-stage records of the same steps (packed stages with the sum of their parts),
with FlopCounterMode counting the fused path itself, and with estimate.py; "auto" falls back to the stage modules
when something else watches them; a traced step computes exactly what an untraced one does."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from estimate_check import assert_traced_equals_estimate
from torch.utils.flop_counter import FlopCounterMode

from llmtrace.tracer.core import contract
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.model.transformer import Transformer, build_random_model
from llmtrace.tracer.run.backends import backend_for
from llmtrace.tracer.trace.hooks import Tracer
from llmtrace.tracer.trace.records import DECODE, MATMUL_KINDS, PREFILL, StageRecord
from llmtrace.tracer.trace.summary import stage_totals

CONFIGS = {
    "mha": ModelConfig("mha", 128, 64, 2, 4, 4, 96, max_seq_len=64),
    "gqa": ModelConfig("gqa", 128, 64, 3, 4, 2, 96, max_seq_len=64),
    "mqa-tied": ModelConfig("mqa", 128, 48, 2, 6, 1, 80, max_seq_len=64, tie_embeddings=True),
    "head-dim": ModelConfig("hd", 96, 64, 2, 4, 2, 96, max_seq_len=64, explicit_head_dim=24),
    "biases": ModelConfig("bias", 128, 64, 2, 4, 2, 96, max_seq_len=64, qkv_bias=True, wo_bias=True, mlp_bias=True),
}
PROMPT, DECODE_STEPS = 7, 3


class OrderedFlopCounter(FlopCounterMode):
    """FlopCounterMode that also keeps every op it counts, in call order: (op, FLOPs by its own formula)."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self.calls: list[tuple[str, int]] = []

    def _count_flops(self, func_packet, out, args, kwargs):  # type: ignore[no-untyped-def]
        if func_packet in self.flop_registry:
            self.calls.append((str(func_packet), self.flop_registry[func_packet](*args, **kwargs, out_val=out)))
        return super()._count_flops(func_packet, out, args, kwargs)


def _traced(config: ModelConfig, mechanism: str, counter: bool = False) -> tuple[tuple[StageRecord, ...], list, list]:
    """Prefill PROMPT tokens, then DECODE_STEPS decode steps under a Tracer: records, the logits of each step, and
    (counter=True) the ops FlopCounterMode counted in each step, in order, on the path the model took."""
    model = build_random_model(config, seed=1)
    model.setup_cache(1, PROMPT + DECODE_STEPS)
    generator = torch.Generator().manual_seed(0)
    logits, counted = [], []
    with Tracer(model, mechanism=mechanism) as tracer:
        # the backend is chosen before FlopCounterMode's module tracker registers its global hooks: it counts the
        # fused path's own ops
        run = backend_for(model).traced(tracer)
        for step in range(DECODE_STEPS + 1):
            ids = torch.randint(0, config.vocab_size, (1, PROMPT if step == 0 else 1), generator=generator)
            tracer.begin_step(PREFILL if step == 0 else DECODE, step)
            with OrderedFlopCounter() if counter else nullcontext() as flops:
                logits.append(run.prefill(ids) if step == 0 else run.decode(ids))
            tracer.end_step()
            if counter:
                counted.append(flops.calls)
    return tracer.records(), logits, counted


@pytest.fixture(scope="module", params=list(CONFIGS))
def both(request: pytest.FixtureRequest) -> tuple[ModelConfig, tuple[StageRecord, ...], tuple[StageRecord, ...]]:
    config = CONFIGS[request.param]
    fused, _, _ = _traced(config, "fused")
    staged, _, _ = _traced(config, "wrap")
    return config, fused, staged


def test_every_fused_stage_is_marked_once_per_layer_per_step_in_order(both) -> None:
    config, fused, _ = both
    layer = [s.role for s in contract.fused_stages(config) if s.in_layer]
    assert len(layer) == 14
    layers = [f"layers.{i}.{r}" for i in range(config.n_layers) for r in layer]
    expected = ["tok_embeddings", *layers, "norm", "output"]
    for step in range(DECODE_STEPS + 1):
        records = [r for r in fused if r.step == step]
        assert [r.stage for r in records] == expected
        for earlier, later in zip(records, records[1:]):
            assert earlier.end_ns == later.start_ns  # consecutive clock readings: no time left out inside a step
        assert all(r.duration_ns > 0 for r in records)


def test_fused_records_match_the_stage_by_stage_records(both) -> None:
    """Same steps, same weights: every stage both paths have agrees on shapes, FLOPs and bytes; a packed stage has
    its parts' FLOPs and weights together, and reads its input once."""
    config, fused, staged = both
    for step in range(DECODE_STEPS + 1):
        ours = {r.stage: r for r in fused if r.step == step}
        theirs = {r.stage: r for r in staged if r.step == step}
        shared = set(ours) & set(theirs)
        assert len(shared) == (14 - 2) * config.n_layers + 3
        for name in shared:
            a, b = ours[name], theirs[name]
            assert (a.input_shapes, a.output_shapes, a.flops, a.matmul_flops, a.weight_bytes_read,
                    a.activation_bytes_read, a.activation_bytes_written, a.kv_bytes_read, a.kv_bytes_written) == (
                    b.input_shapes, b.output_shapes, b.flops, b.matmul_flops, b.weight_bytes_read,
                    b.activation_bytes_read, b.activation_bytes_written, b.kv_bytes_read, b.kv_bytes_written), name
        for i in range(config.n_layers):
            for pack in contract.PACKS:
                if not set(pack.members) <= {s.role for s in contract.staged_stages(config)}:
                    continue  # a pack this model has not (a shared expert's gate|up: Qwen2-MoE's)
                packed, parts = pack.role, pack.members
                whole = ours[f"layers.{i}.{packed}"]
                pieces = [theirs[f"layers.{i}.{p}"] for p in parts]
                assert whole.matmul_flops == sum(p.matmul_flops for p in pieces) > 0
                assert whole.weight_bytes_read == sum(p.weight_bytes_read for p in pieces)
                assert whole.activation_bytes_written == sum(p.activation_bytes_written for p in pieces)
                assert whole.activation_bytes_read == pieces[0].activation_bytes_read
                assert whole.output_shapes[0][-1] == sum(p.output_shapes[0][-1] for p in pieces)
        totals_ours = stage_totals(ours.values())
        totals_theirs = stage_totals(theirs.values())
        for field in ("flops", "matmul_flops", "weight_bytes_read", "kv_bytes_read", "kv_bytes_written"):
            assert getattr(totals_ours, field) == getattr(totals_theirs, field), (step, field)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matmul_flops_equal_flop_counter_mode_on_the_fused_path(name: str) -> None:
    """Every matmul FlopCounterMode counts on the fused path, in call order, is one traced matmul stage with the
    same FLOPs: the weight products as mm, QKᵀ and probs·V as bmm, and nothing else it counts ran."""
    records, _, counted = _traced(CONFIGS[name], "fused", counter=True)
    op_of = {"linear": "aten.mm", "lm_head": "aten.mm", "attention_scores": "aten.bmm", "attention_values": "aten.bmm"}
    for step, calls in enumerate(counted):
        stages = [r for r in records if r.step == step]
        assert all(r.matmul_flops == 0 for r in stages if r.kind not in MATMUL_KINDS)
        ours = [(op_of[r.kind], r.matmul_flops) for r in stages if r.kind in MATMUL_KINDS]
        assert ours == [(op.replace("addmm", "mm"), n) for op, n in calls]  # a bias makes mm an addmm
        assert len(calls) == 6 * CONFIGS[name].n_layers + 1 and all(n > 0 for _, n in calls)


def test_fused_flops_and_bytes_equal_the_analytical_estimate(both) -> None:
    config, fused, _ = both
    assert_traced_equals_estimate(config, fused, PROMPT, DECODE_STEPS)


def test_a_traced_step_computes_what_an_untraced_one_does() -> None:
    config = CONFIGS["gqa"]
    _, traced, _ = _traced(config, "fused")
    model = build_random_model(config, seed=1)
    model.setup_cache(1, PROMPT + DECODE_STEPS)
    run = backend_for(model)
    generator = torch.Generator().manual_seed(0)
    for step in range(DECODE_STEPS + 1):
        ids = torch.randint(0, config.vocab_size, (1, PROMPT if step == 0 else 1), generator=generator)
        untraced = run.prefill(ids) if step == 0 else run.decode(ids)
        assert torch.equal(untraced, traced[step])  # bit for bit: the same ops ran


def _model() -> Transformer:
    model = build_random_model(CONFIGS["mha"], seed=0)
    model.setup_cache(1, 8)
    return model


def test_auto_traces_the_fused_path_unless_something_else_watches_the_modules() -> None:
    model = _model()
    with Tracer(model) as tracer:
        assert tracer.mechanism == "fused"
    handle = model.layers[0].attention.wq.register_forward_hook(lambda m, a, o: None)
    with Tracer(model) as tracer:
        assert tracer.mechanism == "wrap"  # the model runs stage by stage now: trace that
        tracer.begin_step(PREFILL, 0)
        model.prefill(torch.tensor([[1, 2, 3]]))
        tracer.end_step()
    handle.remove()
    assert {r.short_name for r in tracer.records()} >= {"attention.wq", "attention.wk", "attention.wv"}
    model._caches = None
    model.layers[0].attention.kv_cache.kv = None  # no cache set up: the packed path cannot run
    with Tracer(model) as tracer:
        assert tracer.mechanism == "wrap"


def test_a_step_that_left_the_fused_path_is_a_clear_error() -> None:
    model = _model()
    with Tracer(model, mechanism="fused") as tracer:
        tracer.begin_step(PREFILL, 0)
        model.prefill(torch.tensor([[1, 2, 3]]))  # the stage modules, not a backend the tracer traces
        with pytest.raises(RuntimeError, match="ran stage by stage"):
            tracer.end_step()
