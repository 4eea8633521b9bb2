"""Trace: JSON round trip and schema, Chrome trace validity and nesting, summary figures from the records."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from llmtrace.tracer.core.errors import FileFormatError
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.trace.chrome import chrome_trace
from llmtrace.tracer.trace.records import RunSettings
from llmtrace.tracer.trace.run_trace import Trace, load_schema
from llmtrace.tracer.trace.summary import layer_rows, role_rows, run_summary, stage_totals

INSTRUMENTATION_KEYS = {"sampling_lesson", "no_kv_cache", "lens", "attention"}


@pytest.fixture(scope="module")
def trace(tiny_llama_dir: Path) -> Trace:
    loaded = load_model(str(tiny_llama_dir))
    settings = RunSettings(model=str(tiny_llama_dir), prompt="The capital of France is", max_new_tokens=5,
                           temperature=0.8, top_k=20, seed=3)
    return generate(loaded, settings)


def test_json_round_trips_to_an_equal_trace(trace: Trace) -> None:
    back = Trace.from_json(trace.to_json())
    assert back == trace
    assert back.to_json() == trace.to_json()


def test_json_validates_against_the_schema(trace: Trace) -> None:
    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(json.loads(trace.to_json()), schema)
    broken = json.loads(trace.to_json())
    broken["stage_work"][0]["kind"] = "teleport"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


LATER_FIELDS = {"StageWork": {"weight_format"}}


def test_schema_lists_every_record_field(trace: Trace) -> None:
    """The schema's `required` lists match the dataclasses (additionalProperties is false, so both ways)."""
    schema = load_schema()
    data = json.loads(trace.to_json())
    # the instrumentation keys came later and may be absent from older traces: listed, not required
    # kernels, route: optional (absent in older traces), written by every run since the default kernel table and
    # since select() chose the route (tracer/run/select.py)
    assert set(schema["required"]) | INSTRUMENTATION_KEYS | {"kernels", "route"} == set(data)
    assert "kernels" in schema["properties"] and "route" in schema["properties"]
    assert INSTRUMENTATION_KEYS <= set(schema["properties"])
    lesson = data["sampling_lesson"]
    assert set(schema["$defs"]["SamplingLesson"]["required"]) == set(lesson)
    assert set(schema["$defs"]["LessonColumn"]["required"]) == set(lesson["columns"][0])
    assert set(schema["$defs"]["LessonToken"]["required"]) == set(lesson["tokens"][0])
    for key, definition in (("stage_work", "StageWork"), ("steps", "StepRecord")):
        # fields added later are written always but not required, so older traces still validate
        assert set(schema["$defs"][definition]["required"]) | LATER_FIELDS.get(definition, set()) == set(data[key][0])
        assert LATER_FIELDS.get(definition, set()) <= set(schema["$defs"][definition]["properties"])
    assert set(schema["$defs"]["CandidateRecord"]["required"]) == set(data["steps"][0]["candidates"][0])


def test_traces_written_before_the_newer_settings_still_load(trace: Trace) -> None:
    """seed_drawn, warmup, staged and trace_steps came later: a trace without them validates and reads back with
    defaults."""
    data = json.loads(trace.to_json())
    for key in ("seed_drawn", "warmup", "staged", "trace_steps", "temperatures", "no_kv_cache", "lens", "attention",
                "attention_steps"):
        del data["settings"][key]
    for key in INSTRUMENTATION_KEYS:
        del data[key]
    jsonschema.validate(data, load_schema())
    old = Trace.from_json(json.dumps(data))
    settings = old.settings
    assert (settings.seed_drawn, settings.warmup, settings.staged, settings.trace_steps) == (False, True, False, "all")
    assert settings.temperatures == (0.1, 1.0, 2.0) and not settings.no_kv_cache
    assert old.sampling_lesson is None and old.no_kv_cache is None and old.lens == old.attention == ()


def test_indented_json_is_the_same_document_with_one_line_per_stage(trace: Trace) -> None:
    text = trace.to_json(indent=1)
    assert json.loads(text) == json.loads(trace.to_json()) == trace.to_dict()
    work_lines = [line for line in text.splitlines() if line.lstrip().startswith('{"phase": ')]
    assert len(work_lines) == len(json.loads(text)["stage_work"]) > 10
    row_lines = [line for line in text.splitlines() if re.fullmatch(r" {2}\[\d+, \d+, (\d+|null), \d+, \d+\],?", line)]
    assert len(row_lines) == len(trace.stages) > 100
    assert Trace.from_json(text) == trace


def test_from_json_rejects_what_is_not_a_trace() -> None:
    with pytest.raises(FileFormatError, match="not valid JSON"):
        Trace.from_json("{")
    with pytest.raises(FileFormatError, match="not an llmtrace trace"):
        Trace.from_json('{"traceEvents": []}')
    with pytest.raises(FileFormatError, match="does not match the schema"):
        Trace.from_json('{"schema": "llmtrace.trace", "schema_version": 1}')


def test_chrome_trace_is_valid_json_with_well_nested_spans(trace: Trace) -> None:
    doc = json.loads(json.dumps(chrome_trace(trace)))
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    assert {"tokenize", "prefill", "decode step 1", "layer 0", "layer 1", "attention", "ffn", "lm_head", "sample",
            "detokenize", "wqkv", "scores", "softmax", "w13", "w2"} <= {n.split(".")[-1] if n.startswith("attention.") or
                                                               n.startswith("feed_forward.") else n for n in names}
    # Nesting on the single thread: sorted by start (longest first on ties), each span ends inside the enclosing one.
    intervals = sorted(((round(e["ts"] * 1000), round(e["dur"] * 1000), e["name"]) for e in spans),
                       key=lambda x: (x[0], -x[1]))
    stack: list[tuple[int, int, str]] = []
    for start, dur, name in intervals:
        while stack and start >= stack[-1][0] + stack[-1][1]:
            stack.pop()
        if stack:
            parent_end = stack[-1][0] + stack[-1][1]
            assert start + dur <= parent_end, f"{name} overlaps the end of {stack[-1][2]}"
        stack.append((start, dur, name))
    # Every stage span sits inside its step's span and carries FLOPs and bytes.
    prefill = next(e for e in spans if e["name"] == "prefill")
    layer0 = next(e for e in spans if e["name"] == "layer 0" and e["ts"] >= prefill["ts"])
    assert layer0["args"]["flops"] > 0 and layer0["args"]["bytes_read"] > 0
    assert prefill["args"]["flops"] == stage_totals(trace.stages_of("prefill")).flops


def test_summary_numbers_follow_from_the_records(trace: Trace) -> None:
    summary = run_summary(trace)
    assert summary.prompt_tokens == len(trace.tokenization.ids)
    assert summary.generated_tokens == len(trace.generated_ids) == 5
    assert summary.decode.steps == 4
    decode_ns = sum(s.duration_ns for s in trace.decode_steps)
    assert summary.decode_tokens_per_second == pytest.approx(4 / (decode_ns / 1e9))
    prefill = trace.prefill_step
    assert summary.ttft_ns == trace.tokenization.duration_ns + prefill.forward_ns + prefill.sample_ns + prefill.detokenize_ns
    assert summary.ttft_ns < prefill.end_ns - trace.tokenization.start_ns  # set-up and warm-up are not charged
    assert summary.kv_live_bytes == trace.steps[-1].kv_live_bytes
    rows = layer_rows(trace.stages_of("prefill"))
    assert [r.layer for r in rows] == list(range(trace.config.n_layers))
    assert sum(r.totals.flops for r in rows) + sum(
        s.flops for s in trace.stages_of("prefill") if s.layer is None) == summary.prefill.totals.flops


def test_role_rows_group_every_layers_instance_of_a_stage(trace: Trace) -> None:
    decode = trace.stages_of("decode")
    rows = role_rows(decode)
    assert [r.role for r in rows][:3] == ["tok_embeddings", "attention_norm", "attention.wqkv"]
    assert [r.role for r in rows][-2:] == ["norm", "output"]
    by = {r.role: r for r in rows}
    steps = len(trace.decode_steps)
    assert by["attention.wqkv"].totals.calls == steps * trace.config.n_layers
    assert by["output"].totals.calls == steps
    assert by["feed_forward.w2"].totals.flops == sum(s.flops for s in decode if s.short_name == "feed_forward.w2")
    total = stage_totals(decode)
    assert sum(r.totals.stage_ns for r in rows) == total.stage_ns
    assert sum(r.totals.bytes_moved for r in rows) == total.bytes_moved
