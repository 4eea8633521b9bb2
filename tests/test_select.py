"""The route a run takes is chosen in one place (tracer/run/select.py) and recorded (Trace.route): the backend of the
decode steps and the prefill, and for every backend not taken, why. Each case runs the real generation loop on a tiny
model and checks the route against what actually ran (the stage records' names, Trace.run_ahead, Trace.staged_decode).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import gguf
import jsonschema
import pytest

from llmtrace.cli.render_run_summary import route_lines
from llmtrace.tracer.core.errors import FileFormatError
from llmtrace.tracer.model.weight_formats import NATIVE as NATIVE_WEIGHTS
from llmtrace.tracer.trace.records import DECODE, MODULES, NATIVE, PACKED, RunSettings
from llmtrace.tracer.trace.run_trace import Trace, load_schema

Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _run(model_path: str, prompts: tuple[str, ...] = (), **settings: Any) -> Trace:
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.run.batch_generate import generation_for

    load = {"weights": NATIVE_WEIGHTS} if model_path.endswith(".gguf") else {}
    loaded = load_model(model_path, **load)
    run = RunSettings(model=model_path, prompt="The sky is", max_new_tokens=4, batch=max(1, len(prompts)),
                      batch_prompts=prompts, **settings)
    return generation_for(loaded, run).run()


def _reasons(trace: Trace) -> dict[str, str]:
    return {r.backend: r.reason for r in trace.route.not_taken}


def _decode_stage_names(trace: Trace) -> list[str]:
    step = next(s.step for s in trace.steps if s.phase == DECODE)
    return [r.stage for r in trace.stages if r.phase == DECODE and r.step == step]


def _check_json(trace: Trace) -> None:
    """Valid against the schema, read back equal, and a derived `ahead` that disagrees refused."""
    data = json.loads(trace.to_json())
    jsonschema.validate(data, load_schema())
    assert Trace.from_json(trace.to_json()).route == trace.route
    data["route"]["ahead"] = not data["route"]["ahead"]
    with pytest.raises(FileFormatError, match="Route.ahead"):
        Trace.from_dict(data)


def test_default_run_takes_the_native_backend_ahead(tiny_quantized: Callable[..., Path]) -> None:
    """Greedy on a model the C step runs: decode native, several steps a call (what Trace.run_ahead saw), prefill
    packed; both other backends named with a reason; the traced decode stages are the packed path's."""
    trace = _run(str(tiny_quantized(Q8_0)))
    route = trace.route
    assert (route.decode, route.prefill, route.ahead, route.ahead_reason) == (NATIVE, PACKED, True, "")
    assert trace.run_ahead is not None and trace.run_ahead.steps == len(trace.decode_steps)
    assert _reasons(trace) == {PACKED: "the native step runs a one-token step as one C call",
                               MODULES: "nothing watches them: fewer ops run the same math"}
    assert "layers.0.attention.wqkv" in _decode_stage_names(trace)
    _check_json(trace)


def test_sampler_filters_run_ahead_too(tiny_quantized: Callable[..., Path]) -> None:
    """C calls the run's sampler for each next token, so a filtered draw runs ahead as greedy does."""
    trace = _run(str(tiny_quantized(Q8_0)), temperature=0.8, top_k=5, seed=3)
    assert (trace.route.decode, trace.route.ahead, trace.route.ahead_reason) == (NATIVE, True, "")
    assert trace.run_ahead is not None and trace.run_ahead.steps == len(trace.decode_steps)


def test_dense_model_takes_the_packed_backend(tiny_llama_dir: Path) -> None:
    trace = _run(str(tiny_llama_dir))
    assert (trace.route.decode, trace.route.prefill, trace.route.ahead) == (PACKED, PACKED, False)
    assert _reasons(trace)[NATIVE].startswith("no native decode step for this model")
    assert trace.run_ahead is None
    _check_json(trace)


def test_lens_sends_every_step_through_the_stage_modules(tiny_quantized: Callable[..., Path]) -> None:
    trace = _run(str(tiny_quantized(Q8_0)), lens=True)
    assert (trace.route.decode, trace.route.prefill) == (MODULES, MODULES)
    reasons = _reasons(trace)
    assert reasons[PACKED] == reasons[NATIVE] == "forward hooks watch the stage modules (--lens, --attention or " \
                                                 "FlopCounterMode)"
    assert "layers.0.attention.wq" in _decode_stage_names(trace)


def test_staged_run_takes_the_native_backend_with_stages_apart(tiny_quantized: Callable[..., Path],
                                                                tiny_llama_dir: Path) -> None:
    """--staged: native where the C step exists (Trace.staged_decode agrees), the stage modules where it does not;
    the prefill on the stage modules either way."""
    native = _run(str(tiny_quantized(Q8_0)), staged=True)
    assert (native.route.decode, native.route.prefill, native.route.ahead) == (NATIVE, MODULES, False)
    assert native.route.ahead_reason == "--staged stamps each step's stages apart"
    assert _reasons(native)[PACKED] == "--staged runs Q, K, V, gate and up apart"
    assert native.staged_decode is not None and native.staged_decode.native
    dense = _run(str(tiny_llama_dir), staged=True)
    assert (dense.route.decode, dense.route.prefill) == (MODULES, MODULES)
    assert _reasons(dense)[NATIVE] == dense.staged_decode.reason
    _check_json(native)


def test_batch_never_takes_the_native_backend(tiny_quantized: Callable[..., Path]) -> None:
    trace = _run(str(tiny_quantized(Q8_0)), prompts=("The sky is", "Hello"))
    assert (trace.route.decode, trace.route.prefill) == (PACKED, PACKED)
    assert _reasons(trace)[NATIVE] == ("a batch of 2 sequences (the native decode step runs one; it may step a last "
                                       "row left alone)")
    _check_json(trace)


def test_route_lines_fit_80_columns_and_older_traces_have_none(tiny_quantized: Callable[..., Path]) -> None:
    trace = _run(str(tiny_quantized(Q8_0)), staged=True)
    short = route_lines(trace.route)
    assert short == ["route: decode on the C step, a step a call · prefill on the stage modules"]
    lines = route_lines(trace.route, why=True)
    assert lines[1:] == ["  not packed torch: --staged runs Q, K, V, gate and up apart",
                         "  not the stage modules: the C step runs the stages apart, timed in C",
                         "  a step a call: --staged stamps each step's stages apart"]
    assert all(len(line) <= 76 for line in lines)  # inside the summary panel's frame at 80 columns
    data = json.loads(trace.to_json())
    del data["route"]
    assert Trace.from_dict(data).route is None and route_lines(None) == []
