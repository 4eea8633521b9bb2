"""`--staged` on the native decode step: a one-token step runs in C with contract.staged_stages apart
(tracer/model/native_step.py with staged=True, FusedPlan.staged_step), and the "wrap" tracer takes C's readings
(FusedMarks(staged=True), tracer/trace/fused_marks.py).

What must hold:
- records: the wrapped torch staged path's records for the same steps, field by field but the times (names, order,
  shapes, FLOPs, bytes, weight formats), on GQA, biases, a sliding window and a tied LM head;
- logits and KV cache: bit for bit the native fused step's. Every row of every product is the same dot_rows call on
  the same prepared input whichever row range (Q, K, V, or Q|K|V whole) and thread computes it, and every other
  stage is the same C code in the same order; only barriers are added. Against the torch staged path they agree
  within the native step's stated tolerance (tests/test_native_step.py: 2^-14 of max |logit|);
- readings: one per stage after the step's start, non-decreasing, the stages' times adding up to the step;
- fallbacks: a forward hook (--lens, --attention) or a model without a native step runs the stage modules, and says
  why (select's route, Trace.staged_decode).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import gguf
import jsonschema
import pytest
import torch
from test_native_step import BASE, TOLERANCE, native_model

from llmtrace.tracer.core import contract
from llmtrace.tracer.core.errors import FileFormatError
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.transformer import Transformer, build_random_model
from llmtrace.tracer.model.weight_formats import NATIVE
from llmtrace.tracer.trace.fused_marks import staged_order
from llmtrace.tracer.trace.hooks import Tracer
from llmtrace.tracer.trace.observe import Observer
from llmtrace.tracer.run.backends import backend_for
from llmtrace.tracer.run.select import Request, select
from llmtrace.tracer.trace.records import DECODE, MODULES, NATIVE, PREFILL, RunSettings, StageRecord
from llmtrace.tracer.trace.run_trace import Trace, load_schema
from tests.stamp_count import STAGED_STAGES_PER_LAYER, stamp_count
from tests.torch_threads import torch_threads

VARIANTS = {
    "gqa": {},  # 4 query heads over 2 KV heads, untied
    "biases": {"qkv_bias": True, "wo_bias": True, "mlp_bias": True},
    "window": {"sliding_window": 4},  # shorter than the sequence: the later steps attend 4 keys
    "tied": {"tie_embeddings": True},
}
PROMPT, STEPS = 5, 6
TOKENS = [7, 31, 2, 90, 45, 12]  # the decode steps' tokens, fixed: both paths see the same inputs


@pytest.fixture(autouse=True)
def native() -> None:
    if not native_kernel.available():
        pytest.skip(f"native kernel not available here: {native_kernel.unavailable_reason()}")


def count_staged_steps(backend: Any) -> list[int]:
    """A list that grows by one per native staged step of the backend's plan (none for the modules backend)."""
    calls: list[int] = []
    plan = getattr(backend, "plan", None)
    if plan is None:
        return calls
    original = plan.staged_step

    def counted(*args: Any) -> torch.Tensor:
        calls.append(1)
        return original(*args)

    plan.staged_step = counted
    return calls


def run_staged(model: Transformer, native: bool, traced: bool = True
               ) -> tuple[tuple[StageRecord, ...], list[torch.Tensor], torch.Tensor, int]:
    """Prefill PROMPT tokens, then the decode steps of TOKENS, under --staged (the stage modules), the one-token steps
    as the native staged step if `native` (else the modules backend asked for): records, each decode step's logits,
    the KV cache after, native steps."""
    model.setup_cache(1, PROMPT + STEPS)
    backend = backend_for(model, Request(staged=True, traced=traced, backend=None if native else MODULES))
    calls = count_staged_steps(backend)
    logits = []
    with Tracer(model, mechanism="wrap", enabled=traced) as tracer:
        run = backend.traced(tracer)
        tracer.begin_step(PREFILL, 0)
        run.prefill(torch.arange(3, 3 + PROMPT).view(1, -1))
        tracer.end_step()
        for step, token in enumerate(TOKENS, start=1):
            tracer.begin_step(DECODE, step)
            logits.append(run.decode(torch.tensor([[token]])).clone())
            tracer.end_step()
    return tracer.records(), logits, model._kv_all.clone(), len(calls)


def staged_native_reason(model: Transformer, request: Request) -> str:
    """Why `request`'s --staged run would not take the native staged step ("" when it would)."""
    return {r.backend: r.reason for r in select(model, request).route.not_taken}.get(NATIVE, "")


def run_fused(model: Transformer) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The same steps on the default backend (the native fused step), untraced."""
    model.setup_cache(1, PROMPT + STEPS)
    run = backend_for(model)
    run.prefill(torch.arange(3, 3 + PROMPT).view(1, -1))
    logits = [run.decode(torch.tensor([[token]])).clone() for token in TOKENS]
    return logits, model._kv_all.clone()


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest) -> Transformer:
    return native_model(dataclasses.replace(BASE, **VARIANTS[request.param]))


def untimed(record: StageRecord) -> StageRecord:
    return dataclasses.replace(record, start_ns=0, duration_ns=0)


def test_records_equal_the_wrapped_stage_modules_records(variant: Transformer) -> None:
    native, _, _, native_steps = run_staged(variant, native=True)
    modules, _, _, module_steps = run_staged(variant, native=False)
    assert (native_steps, module_steps) == (STEPS, 0)
    per_step = 1 + STAGED_STAGES_PER_LAYER * BASE.n_layers + 2
    assert len(native) == len(modules) and len([r for r in native if r.phase == DECODE]) == STEPS * per_step
    assert [untimed(r) for r in native] == [untimed(r) for r in modules]
    decode = [r for r in native if r.step == 1]
    assert [r.stage for r in decode] == staged_order(variant)
    assert any(r.weight_format for r in decode) and all(r.weight_bytes_read > 0 for r in decode if r.kind == "linear")


@pytest.mark.parametrize("threads", [1, 2])
def test_logits_and_cache_are_the_fused_native_steps_bit_for_bit(variant: Transformer, threads: int) -> None:
    with torch_threads(threads):
        _, staged, staged_kv, steps = run_staged(variant, native=True)
        fused, fused_kv = run_fused(variant)
        _, modules, modules_kv, _ = run_staged(variant, native=False, traced=False)
    assert steps == STEPS
    assert all(torch.equal(a, b) for a, b in zip(staged, fused)) and torch.equal(staged_kv, fused_kv)
    for got, want in zip(staged, modules):
        assert float((got - want).abs().max()) <= TOLERANCE * float(want.abs().max())
    assert float((staged_kv - modules_kv).abs().max()) <= TOLERANCE * float(modules_kv.abs().max())


def test_untraced_staged_step_runs_natively_too() -> None:
    model = native_model(BASE)
    _, logits, _, steps = run_staged(model, native=True, traced=False)
    assert steps == STEPS and all(torch.equal(a, b) for a, b in zip(logits, run_fused(model)[0]))


def test_one_reading_per_stage_adding_up_to_the_step() -> None:
    assert STAGED_STAGES_PER_LAYER == len(contract.layer_stages(BASE))
    assert stamp_count(BASE.n_layers, staged=True) == 1 + len(staged_order(native_model(BASE)))
    records, _, _, _ = run_staged(native_model(BASE), native=True)
    for step in range(1, STEPS + 1):
        rows = [r for r in records if r.phase == DECODE and r.step == step]
        assert len(rows) == 1 + STAGED_STAGES_PER_LAYER * BASE.n_layers + 2
        assert all(r.duration_ns >= 0 for r in rows)
        assert all(a.end_ns == b.start_ns for a, b in zip(rows, rows[1:]))  # consecutive readings, no gap
        assert sum(r.duration_ns for r in rows) == rows[-1].end_ns - rows[0].start_ns


def test_a_forward_hook_sends_the_step_through_the_stage_modules() -> None:
    """--lens and --attention hook the stage modules: the one-token steps must run them, and the reason says so."""
    model = native_model(BASE)
    model.setup_cache(1, PROMPT + STEPS)
    observer = Observer(model, lens=True, attention=True)
    observer.attach()
    try:
        assert "forward hooks" in staged_native_reason(model, Request(staged=True, observed=True))
        backend = backend_for(model, Request(staged=True, observed=True))
        calls = count_staged_steps(backend)
        backend.prefill(torch.arange(3, 3 + PROMPT).view(1, -1))
        backend.decode(torch.tensor([[TOKENS[0]]]))
        assert not calls
    finally:
        observer.remove()
    assert staged_native_reason(model, Request(staged=True)) == ""


def test_wrappers_that_take_no_stamps_keep_the_stage_modules() -> None:
    """Wrappers on the stage modules when the run's backend is chosen (another tracer's), or a tracer whose clock is
    not the host clock C stamps with: the wrappers must see every call, so the reason names them."""
    model = native_model(BASE)
    model.setup_cache(1, 8)
    with Tracer(model, mechanism="wrap"):
        assert "forward wrappers" in staged_native_reason(model, Request(staged=True))
    wrong_clock = Request(staged=True, traced=True, host_clock=False)
    assert "forward wrappers" in staged_native_reason(model, wrong_clock)


def test_a_model_without_a_native_step_runs_the_stage_modules() -> None:
    dense = build_random_model(BASE, seed=0)
    dense.setup_cache(1, 8)
    assert staged_native_reason(dense, Request(staged=True)).startswith("no native decode step for this model: ")
    records = []
    with Tracer(dense, mechanism="wrap") as tracer:
        tracer.begin_step(PREFILL, 0)
        dense.prefill(torch.arange(3, 3 + PROMPT).view(1, -1))
        tracer.end_step()
        tracer.begin_step(DECODE, 1)
        dense.decode_one(torch.tensor([[TOKENS[0]]]))
        tracer.end_step()
        records = [r for r in tracer.records() if r.phase == DECODE]
    assert [r.stage for r in records] == staged_order(dense)


def _generate(model_path: str, staged: bool, tokens: int = 4, prompts: tuple[str, ...] = (), **load: Any) -> Trace:
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.run.batch_generate import generation_for

    loaded = load_model(model_path, **load)
    settings = RunSettings(model=model_path, prompt="The sky is", max_new_tokens=tokens, staged=staged,
                           batch=max(1, len(prompts)), batch_prompts=prompts)
    return generation_for(loaded, settings).run()


def test_trace_says_how_staged_ran(tiny_quantized: Callable[[Any], Path], tiny_llama_dir: Path) -> None:
    """Trace.staged_decode: native on a model the native step runs (a tiny Q8_0 GGUF), the reason on one it cannot
    (dense safetensors); absent without --staged; valid against the schema and read back, and a trace whose
    `native` disagrees with its `reason` refused."""
    schema = load_schema()
    native = _generate(str(tiny_quantized(gguf.GGMLQuantizationType.Q8_0)), staged=True, weights=NATIVE)
    assert native.staged_decode is not None and native.staged_decode.native and native.staged_decode.reason == ""
    dense = _generate(str(tiny_llama_dir), staged=True)
    assert dense.staged_decode is not None and not dense.staged_decode.native
    assert dense.staged_decode.reason.startswith("no native decode step")
    batch = _generate(str(tiny_quantized(gguf.GGMLQuantizationType.Q8_0)), staged=True, weights=NATIVE,
                      prompts=("The sky is", "Hello"))
    assert batch.staged_decode is not None and not batch.staged_decode.native
    assert batch.staged_decode.reason.startswith("a batch of 2 sequences")
    plain = _generate(str(tiny_llama_dir), staged=False)
    assert plain.staged_decode is None and "staged_decode" not in json.loads(plain.to_json())
    for trace in (native, dense, batch):
        data = json.loads(trace.to_json())
        jsonschema.validate(data, schema)
        assert Trace.from_json(trace.to_json()).staged_decode == trace.staged_decode
        data["staged_decode"]["native"] = not data["staged_decode"]["native"]  # native is `not reason`, never apart
        with pytest.raises(FileFormatError, match="StagedDecode.native"):
            Trace.from_dict(data)
        decode = [r for r in trace.stages if r.phase == DECODE and r.step == 1]
        assert [r.stage for r in decode][:3] == ["tok_embeddings", "layers.0.attention_norm", "layers.0.attention.wq"]


def test_bundled_model_greedy_ids_match_the_stage_modules() -> None:
    """The bundled SmolLM2 Q4_1 file: 12 greedy tokens of the native staged step, the fused native step and the torch
    stage modules are the same ids."""
    from llmtrace.tracer.load.loader import load_model

    loaded = load_model(None, weights=NATIVE)
    model = loaded.model
    ids = torch.tensor([list(loaded.tokenizer.encode("The capital of France is"))])
    runs = []
    for request in (Request(staged=True), Request(), Request(backend=MODULES)):
        model.setup_cache(1, ids.shape[1] + 13)
        backend = backend_for(model, request)
        assert request.backend or backend.plan.native is not None, backend.plan.native_reason
        calls = count_staged_steps(backend)
        logits = backend.prefill(ids)
        out = []
        for _ in range(12):
            token = logits.argmax(-1, keepdim=True)
            out.append(int(token))
            logits = backend.decode(token)
        assert len(calls) == (12 if request.staged else 0)
        runs.append(out)
    assert runs[0] == runs[1] == runs[2]


def test_a_tensor_parallel_shard_never_runs_it() -> None:
    """A shard holds a slice of each matrix and needs its collectives between stages: stage modules only."""
    from llmtrace.tracer.model.tensor_parallel import TensorParallelTransformer

    assert TensorParallelTransformer.packed_off_reason is not Transformer.packed_off_reason
    assert "tensor-parallel" in TensorParallelTransformer.packed_off_reason(None)  # type: ignore[arg-type]


def test_int8_activation_products_stay_bit_for_bit() -> None:
    """With i8dot products (the input quantized to int8 blocks once per product) a row's value still does not depend
    on the row range computing it: the staged step's logits and cache are the fused step's, bit for bit."""
    from llmtrace.tracer.model.weight_formats import I8DOT

    model = native_model(BASE, qtype=gguf.GGMLQuantizationType.Q4_1, kernel=I8DOT)
    _, staged, staged_kv, steps = run_staged(model, native=True)
    fused, fused_kv = run_fused(model)
    assert steps == STEPS
    assert all(torch.equal(a, b) for a, b in zip(staged, fused)) and torch.equal(staged_kv, fused_kv)


def test_an_i16dot_head_stays_bit_for_bit() -> None:
    """The Q8_0 LM head on i16dot (its input quantized to int16 blocks once per product) beside i8dot layers: the
    staged step's logits and cache are the fused step's, bit for bit."""
    from llmtrace.tracer.model.weight_formats import I8DOT, I16DOT

    model = native_model(BASE, qtype=gguf.GGMLQuantizationType.Q4_1, kernel=I8DOT,
                         head=(gguf.GGMLQuantizationType.Q8_0, I16DOT))
    assert model.stored_weights()["output"].format.kernel == I16DOT
    _, staged, staged_kv, steps = run_staged(model, native=True)
    fused, fused_kv = run_fused(model)
    assert steps == STEPS
    assert all(torch.equal(a, b) for a, b in zip(staged, fused)) and torch.equal(staged_kv, fused_kv)
