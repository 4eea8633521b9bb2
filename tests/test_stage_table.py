"""The trace file's stage table (schema version 2): every stage record written as a short row indexing a distinct
work entry, read back into equal records; version 1's whole records still read; malformed rows refused by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from llmtrace.tracer.core.errors import FileFormatError
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.trace.records import RunSettings
from llmtrace.tracer.trace.run_trace import Trace, load_schema
from llmtrace.tracer.trace.tp_records import RankStages, RankStep

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(scope="module")
def trace(tiny_llama_dir: Path) -> Trace:
    settings = RunSettings(model=str(tiny_llama_dir), prompt="The capital of France is", max_new_tokens=12)
    return generate(load_model(str(tiny_llama_dir)), settings)


def _version_1(trace: Trace) -> dict[str, Any]:
    """The trace as version 1 wrote it: each stage record a whole object (asdict, no rank on one device)."""
    data = trace.to_dict()
    del data["stage_work"]
    data["schema_version"] = 1
    data["stages"] = [{k: v for k, v in dataclasses.asdict(s).items() if not (k == "rank" and v is None)}
                      for s in trace.stages]
    return json.loads(json.dumps(data))


def test_rows_read_back_into_the_same_records_and_share_their_work(trace: Trace) -> None:
    data = json.loads(trace.to_json())
    assert data["schema_version"] == 2 and Trace.from_dict(data) == trace
    rows, work = data["stages"], data["stage_work"]
    assert len(rows) == len(trace.stages)
    # the 2 layers' same stages share a work entry; attention's KV bytes change with the position
    assert len(work) < len(rows) / 3
    first = trace.stages[1]  # layer 0's first stage of the prefill
    index, step, layer, start_ns, duration_ns = rows[1]
    assert (step, layer, start_ns, duration_ns) == (first.step, first.layer, first.start_ns, first.duration_ns)
    assert f"layers.{layer}.{work[index]['stage']}" == first.stage
    assert work[index]["matmul_flops"] == first.matmul_flops and work[index]["input_shapes"] == \
        [list(s) for s in first.input_shapes]


def test_a_trace_of_version_1_reads_into_the_same_records(trace: Trace) -> None:
    assert Trace.from_dict(_version_1(trace)) == trace
    golden = json.loads((GOLDEN / "tiny_trace.json").read_text(encoding="utf-8"))
    assert golden["schema_version"] == 1 and Trace.from_dict(golden).stages[3].stage == golden["stages"][3]["stage"]


def test_the_table_is_a_tenth_of_whole_records(trace: Trace) -> None:
    """Version 1 wrote ~450 bytes a stage call; the rows are a few dozen, with the work entries once each."""
    whole = len(json.dumps(_version_1(trace)["stages"]))
    data = json.loads(trace.to_json())
    table = len(json.dumps(data["stages"])) + len(json.dumps(data["stage_work"]))
    assert table * 4 < whole
    assert len(json.dumps(data["stages"])) / len(data["stages"]) < 40


def test_a_name_outside_its_layer_and_other_ranks_rows_round_trip(trace: Trace) -> None:
    odd = dataclasses.replace(trace.stages[1], stage="mlp_sidecar")  # layer 0, a name not under layers.0.
    ranked = tuple(dataclasses.replace(s, rank=1) for s in trace.stages[:4])
    other = RankStages(rank=1, steps=(RankStep(phase="prefill", step=0, start_ns=0, forward_ns=5),), stages=ranked)
    changed = dataclasses.replace(trace, stages=(trace.stages[0], odd, *trace.stages[2:]), rank_stages=(other,))
    data = json.loads(changed.to_json())
    assert [row[1:] for row in data["rank_stages"][0]["stages"]] == [
        [s.step, s.layer, s.start_ns, s.duration_ns] for s in ranked]
    assert data["stage_work"][data["rank_stages"][0]["stages"][1][0]]["rank"] == 1
    assert {"stage": "mlp_sidecar", "whole_name": True}.items() <= data["stage_work"][data["stages"][1][0]].items()
    assert Trace.from_dict(data) == changed
    jsonschema.validate(data, load_schema())


@pytest.mark.parametrize("row, message", [
    ([10_000, 0, None, 0, 5], "names work entry 10000"),
    ([0, 0, None, 0], r"is not \[work, step, layer, start_ns, duration_ns\]"),
    ("0,0", r"is not \[work"),
    ([True, 0, None, 0, 5], "names work entry True"),
    ([0, "zero", None, 0, 5], "wrong type"),
])
def test_a_malformed_row_is_refused_naming_it(trace: Trace, row: Any, message: str) -> None:
    data = json.loads(trace.to_json())
    data["stages"][2] = row
    with pytest.raises(FileFormatError, match=message):
        Trace.from_dict(data)


def test_a_version_this_llmtrace_does_not_read_is_one_line() -> None:
    with pytest.raises(FileFormatError, match=r"trace schema version 3 is not one this llmtrace reads \(1, 2\)"):
        Trace.from_dict({"schema": "llmtrace.trace", "schema_version": 3})
