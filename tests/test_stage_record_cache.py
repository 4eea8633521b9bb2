"""The stage-by-stage tracer keeps a call's shapes as an id (ShapeTable) and costs each (stage, shapes) once: its
records must equal, field for field, records built the plain way from every call's own tensors (forward hooks
beside the tracer, tracer/trace/stage_cost.py per call, StageRecord by keyword), for a prefill and decode steps, a
batch of left-padded prompts, a sliding window, GQA and projection biases; and what is cached follows the shapes
(S grows every decode step) and the tracer's model, never another's."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import INDEX_ARGUMENTS
from llmtrace.tracer.model.transformer import build_random_model
from llmtrace.tracer.trace.hooks import MODULE_MECHANISMS, ShapeTable, Tracer, stage_modules
from llmtrace.tracer.trace.records import DECODE, PREFILL, StageRecord
from llmtrace.tracer.trace.stage_cost import INDEX_ITEMSIZE, stage_cost

CONFIGS = {
    "gqa": ModelConfig("gqa", 96, 64, 2, 4, 2, 96, max_seq_len=64),
    "window": ModelConfig("window", 96, 64, 2, 4, 1, 96, max_seq_len=64, sliding_window=4),
    "bias": ModelConfig("bias", 96, 64, 2, 4, 2, 96, max_seq_len=64, qkv_bias=True, wo_bias=True, mlp_bias=True),
}


def _run(config: ModelConfig, mechanism: str, pads: list[int] | None, decode_steps: int = 6,
         seed: int = 1) -> tuple[list[StageRecord], list[StageRecord]]:
    """A traced prefill of a (B, 7) prompt (`pads` left pads per row) and `decode_steps` decode steps: the tracer's
    records, and the same records built the plain way from forward hooks on the stage modules."""
    model = build_random_model(config, seed=seed)
    batch = 1 if pads is None else len(pads)
    model.setup_cache(batch, 7 + decode_steps)
    stages = stage_modules(model)
    seen: list[tuple[int, list, list]] = []

    def hook(index: int):
        def record(module: torch.nn.Module, args: tuple, output: object) -> None:
            outs = output if isinstance(output, tuple) else (output,)
            seen.append((index, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)],
                         [tuple(o.shape) for o in outs]))
        return record

    handles = [module.register_forward_hook(hook(i)) for i, (_, module) in enumerate(stages)]
    generator = torch.Generator().manual_seed(0)
    steps = []
    try:
        with Tracer(model, mechanism=mechanism) as tracer:
            for step in range(decode_steps + 1):
                ids = torch.randint(0, config.vocab_size, (batch, 7 if step == 0 else 1), generator=generator)
                phase = PREFILL if step == 0 else DECODE
                tracer.begin_step(phase, step)
                start = len(seen)
                model.prefill(ids, pads) if step == 0 else model.decode_one(ids)
                tracer.end_step()
                steps.append((phase, step, seen[start:]))
    finally:
        for handle in handles:
            handle.remove()
    traced = list(tracer.records())
    act = model.norm.weight.element_size()
    expected = []
    for phase, step, calls in steps:
        for index, ins, outs in calls:
            stage = stages[index][0]
            index_arg = INDEX_ARGUMENTS.get(stage.kind)
            cost = stage_cost(stage, [(s, INDEX_ITEMSIZE if i == index_arg else act) for i, s in enumerate(ins)],
                              [(s, act) for s in outs])
            expected.append(StageRecord(
                phase=phase, step=step, layer=stage.layer, stage=stage.name, kind=stage.kind, input_shapes=tuple(ins),
                output_shapes=tuple(outs), dtype="float32", matmul_flops=cost.matmul_flops,
                elementwise_flops=cost.elementwise_flops, weight_bytes_read=cost.weight_bytes_read,
                activation_bytes_read=cost.activation_bytes_read,
                activation_bytes_written=cost.activation_bytes_written, kv_bytes_read=cost.kv_bytes_read,
                kv_bytes_written=cost.kv_bytes_written, start_ns=0, duration_ns=0,
                weight_format=stage.weight_format))
    return traced, expected


def _untimed(record: StageRecord) -> StageRecord:
    return replace(record, start_ns=0, duration_ns=0)


@pytest.mark.parametrize("mechanism", MODULE_MECHANISMS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_records_equal_the_plain_computation(name: str, mechanism: str) -> None:
    traced, expected = _run(CONFIGS[name], mechanism, pads=None)
    assert len(traced) == len(expected) == 7 * (17 * CONFIGS[name].n_layers + 3)
    assert [_untimed(r) for r in traced] == expected
    # every field typed as the plain constructor types it (a positional build in the wrong order would show here)
    for got, want in zip(traced[:40], expected[:40]):
        for f in fields(StageRecord):
            assert type(getattr(got, f.name)) is type(getattr(want, f.name)), f.name


def test_a_left_padded_batch() -> None:
    traced, expected = _run(CONFIGS["gqa"], "wrap", pads=[0, 3, 5])
    assert [_untimed(r) for r in traced] == expected
    assert traced[0].input_shapes == ((3, 7),)  # tok_embeddings: the batch's ids


def test_what_is_cached_follows_the_step_shapes() -> None:
    """Decode steps repeat stage shapes across layers but not across steps (S grows): each step's attention
    records read one more cached position, under a sliding window no more than the window."""
    for name, window in (("gqa", None), ("window", 4)):
        traced, _ = _run(CONFIGS[name], "wrap", pads=None)
        scores = [r for r in traced if r.stage == "layers.1.attention.scores"]
        seen = [r.output_shapes[0][-1] for r in scores]
        assert seen[0] == 7  # the prefill: T = S = 7
        full = [8 + i for i in range(6)]
        assert seen[1:] == (full if window is None else [min(s, window) for s in full])
        assert len({r.kv_bytes_read for r in scores[1:]}) == (6 if window is None else 1)


def test_a_tracer_costs_its_own_model() -> None:
    """Two models whose stages have the same shapes but different weights (one with biases): each tracer's records
    are its own model's, though the shapes (and so the shape ids) are the same."""
    plain, _ = _run(CONFIGS["gqa"], "wrap", pads=None, decode_steps=1)
    biased_config = replace(CONFIGS["gqa"], qkv_bias=True)
    biased, _ = _run(biased_config, "wrap", pads=None, decode_steps=1)
    wq = [(p, b) for p, b in zip(plain, biased) if p.stage.endswith("attention.wq")]
    assert wq and all(p.input_shapes == b.input_shapes for p, b in wq)
    assert all(b.weight_bytes_read == p.weight_bytes_read + 64 * 4 for p, b in wq)  # + the (q_dim,) fp32 bias
    assert all(b.elementwise_flops > p.elementwise_flops == 0 for p, b in wq)


def test_shape_table_interns_each_set_once() -> None:
    table = ShapeTable()
    first = table.add((torch.Size([1, 1, 64]), None, torch.Size([1, 1, 128])))
    assert table.add(((1, 1, 64), None, (1, 1, 128))) == first  # torch.Size and tuple: one key
    assert table.add(((1, 1, 64), None, (1, 1, 64))) == first + 1
    assert table.add(((1, 5), (1, 5), None, (1, 5, 64), (2,))) == first + 2
    assert table.shapes[first] == (((1, 1, 64),), ((1, 1, 128),))
    assert table.shapes[first + 2] == (((1, 5), (1, 5)), ((1, 5, 64), (2,)))
    assert all(type(s) is tuple for ins, outs in table.shapes for s in (*ins, *outs))
