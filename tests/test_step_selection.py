"""--trace-steps: the chosen decode steps keep every stage record, the others their sums; totals stay exact."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.trace.records import DECODE, PREFILL, RunSettings
from llmtrace.tracer.trace.run_trace import Trace, load_schema
from llmtrace.tracer.trace.step_selection import StepSelection, prune_steps
from llmtrace.tracer.trace.summary import phase_summary, run_summary, stage_totals


@pytest.fixture(scope="module")
def full(tiny_llama_dir: Path) -> Trace:
    settings = RunSettings(model=str(tiny_llama_dir), prompt="The sky is", max_new_tokens=9, warmup=False)
    return generate(load_model(str(tiny_llama_dir)), settings)


def test_parse_and_keeps() -> None:
    assert StepSelection.parse("all") is None
    selection = StepSelection.parse("first, last,every:3,7")
    assert selection == StepSelection(first=True, last=True, every=3, steps=frozenset({7}))
    assert [s for s in range(1, 11) if selection.keeps(s, last_step=10)] == [1, 3, 6, 7, 9, 10]
    assert selection.describe() == "first,last,every:3,7"
    assert StepSelection.parse(selection.describe()) == selection
    for bad in ("every:0", "0", "middle", "every:x", ""):
        with pytest.raises(BadArgumentError, match="--trace-steps"):
            StepSelection.parse(bad)


def test_pruned_trace_keeps_chosen_steps_and_exact_totals(full: Trace) -> None:
    decode = [s.step for s in full.decode_steps]
    assert decode == list(range(1, 9))  # the prefill gives token 1, eight decode steps give the rest
    pruned = prune_steps(full, StepSelection.parse("first,last,every:4"))
    kept = sorted({s.step for s in pruned.stages_of(DECODE)})
    assert kept == [1, 4, 8]
    assert [t.step for t in pruned.pruned_steps] == [2, 3, 5, 6, 7]
    assert pruned.stages_of(PREFILL) == full.stages_of(PREFILL)
    assert [s.step for s in pruned.traced_steps(DECODE)] == kept
    for t in pruned.pruned_steps:  # each step's sums are its own records' sums
        own = stage_totals(s for s in full.stages if s.phase == DECODE and s.step == t.step)
        assert (t.calls, t.matmul_flops + t.elementwise_flops, t.kv_bytes_read, t.stage_ns) == (
            own.calls, own.flops, own.kv_bytes_read, own.stage_ns)
    for phase in (PREFILL, DECODE):
        assert phase_summary(pruned, phase) == phase_summary(full, phase)
    assert run_summary(pruned) == run_summary(full)
    assert prune_steps(full, None) is full


def test_pruned_trace_round_trips_through_json_and_the_schema(full: Trace) -> None:
    pruned = prune_steps(full, StepSelection.parse("last"))
    data = json.loads(pruned.to_json())
    jsonschema.validate(data, load_schema())
    assert Trace.from_json(pruned.to_json()) == pruned
    assert len(pruned.stages) == len(full.stages) - sum(t.calls for t in pruned.pruned_steps)
    assert len(pruned.to_json()) < len(full.to_json())
    assert "pruned_steps" not in json.loads(full.to_json())  # a whole trace reads as before


def test_show_renders_a_pruned_trace(full: Trace, tmp_path: Path) -> None:
    pruned = prune_steps(replace(full, settings=replace(full.settings, trace_steps="first")),
                         StepSelection.parse("first"))
    path = tmp_path / "pruned.json"
    path.write_text(pruned.to_json())
    result = CliRunner().invoke(app, ["show", str(path), "--detail", "ops"])
    assert result.exit_code == 0, result.output
    assert "mean of 1 decode steps (the 1 of 8 whose stages --trace-steps kept)" in " ".join(result.stdout.split())


def test_run_option_prunes_and_records_the_selection(tiny_llama_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    result = CliRunner().invoke(app, ["run", "sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "5",
                                      "--no-roofline", "--trace-steps", "last,first", "--json", "-"])
    assert result.exit_code == 0, result.stderr
    trace = Trace.from_json(result.stdout)
    assert trace.settings.trace_steps == "first,last"
    assert sorted({s.step for s in trace.stages_of(DECODE)}) == [1, 4]
    assert [t.step for t in trace.pruned_steps] == [2, 3]
    bad = CliRunner().invoke(app, ["run", "sky", "--model", str(tiny_llama_dir), "--trace-steps", "every:0"])
    assert bad.exit_code == 2 and "--trace-steps: 'every:0'" in bad.stderr
