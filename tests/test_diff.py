"""`llmtrace diff`: the fused and staged paths of one model compared (same FLOPs, Q|K|V = Q + K + V), where two
sampled generations part, a different model named, and the command without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.trace.diff import PHASE_ROLE, diff_traces
from llmtrace.tracer.trace.records import DECODE, PREFILL, RunSettings
from llmtrace.tracer.trace.run_trace import Trace

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


@pytest.fixture(scope="module")
def runs(tiny_llama_dir: Path) -> dict[str, Trace]:
    loaded = load_model(str(tiny_llama_dir))
    base = RunSettings(model=str(tiny_llama_dir), prompt="The capital of France is", max_new_tokens=4,
                       temperatures=())
    return {
        "fused": generate(loaded, base),
        "staged": generate(loaded, replace(base, staged=True)),
        "seed1": generate(loaded, replace(base, temperature=1.5, seed=1, max_new_tokens=8)),
        "seed2": generate(loaded, replace(base, temperature=1.5, seed=2, max_new_tokens=8)),
    }


def test_fused_against_staged_same_model_same_flops_and_qkv_split(runs: dict[str, Trace]) -> None:
    a, b = runs["fused"], runs["staged"]
    diff = diff_traces(a, b)
    assert diff.same_model and not diff.model_differences and not diff.environment_differences
    assert [(d.name, d.a, d.b) for d in diff.setting_differences] == [("settings.staged", "False", "True")]
    rows = {(r.phase, r.role): r for r in diff.rows}
    for phase in (PREFILL, DECODE):
        forward = rows[(phase, PHASE_ROLE)]
        assert forward.a.flops == forward.b.flops and forward.flops_ratio == 1.0  # the same math either way
        steps = [s for s in a.steps if s.phase == phase]
        assert forward.a.steps == len(steps)
        assert forward.a.time_ns == sum(s.forward_ns for s in steps) / len(steps)
        assert forward.time_ratio == pytest.approx(forward.b.time_ns / forward.a.time_ns)
        # the fused path's packed product is the staged path's three: only A has one, only B the others
        packed = rows[(phase, "attention.wqkv")]
        assert packed.b is None and packed.time_ratio is None
        split = [rows[(phase, f"attention.{w}")] for w in ("wq", "wk", "wv")]
        assert all(r.a is None for r in split)
        assert packed.a.flops == sum(r.b.flops for r in split)
        assert rows[(phase, "feed_forward.w13")].a.flops == sum(
            rows[(phase, f"feed_forward.{w}")].b.flops for w in ("w1", "w3"))
    # greedy on the same model: the same tokens
    d = diff.divergence
    assert d.index is None and d.common_tokens == d.a_tokens == d.b_tokens == len(a.steps)


def test_the_token_where_two_sampled_runs_part(runs: dict[str, Trace]) -> None:
    a, b = runs["seed1"], runs["seed2"]
    ids_a, ids_b = [s.token_id for s in a.steps], [s.token_id for s in b.steps]
    assert ids_a != ids_b  # seeds 1 and 2 at T = 1.5 on a random model: they part
    first = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
    d = diff_traces(a, b).divergence
    assert (d.index, d.common_tokens, d.a_token_id, d.b_token_id) == (first, first, ids_a[first], ids_b[first])
    assert d.common_text == "".join(s.text for s in a.steps[:first])
    assert d.a_probability == a.steps[first].probability


def test_a_different_model_is_named(runs: dict[str, Trace], make_tiny_llama: Callable[..., Path]) -> None:
    folder = make_tiny_llama("diff-mha", n_kv_heads=4)
    other = generate(load_model(str(folder)), RunSettings(model=str(folder), prompt="The capital of France is",
                                                          max_new_tokens=2, temperatures=()))
    diff = diff_traces(runs["fused"], other)
    assert not diff.same_model
    assert ("config.n_kv_heads", "2", "4") in [(d.name, d.a, d.b) for d in diff.model_differences]


def test_cli_renders_and_dumps_json(runs: dict[str, Trace], tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(runs["seed1"].to_json())
    b.write_text(runs["seed2"].to_json())
    shown = runner.invoke(app, ["diff", str(a), str(b)])
    assert shown.exit_code == 0, shown.output
    assert "same model" in shown.output and "seed 1 vs 2" in shown.output
    assert "Decode  per step, mean of A" in shown.output and "Where the generations part" in shown.output
    dumped = runner.invoke(app, ["diff", str(a), str(b), "--json"])
    assert dumped.exit_code == 0
    data = json.loads(dumped.stdout)
    assert data["same_model"] is True and data["divergence"]["index"] == diff_traces(
        runs["seed1"], runs["seed2"]).divergence.index


def test_cli_bad_file_is_one_line_and_exit_2(runs: dict[str, Trace], tmp_path: Path) -> None:
    a = tmp_path / "a.json"
    a.write_text(runs["fused"].to_json())
    result = runner.invoke(app, ["diff", str(a), str(tmp_path / "missing.json")])
    assert result.exit_code == 2 and "no file" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_diff_needs_no_torch(runs: dict[str, Trace], tmp_path: Path) -> None:
    a = tmp_path / "a.json"
    a.write_text(runs["fused"].to_json())
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "from llmtrace.cli.app import main; main()",
                           "diff", str(a), str(a)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "identical generations" in proc.stdout
    modules = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "llmtrace.tracer.trace.diff" in modules
    assert not {m for m in modules if m.split(".")[0] in ("torch", "numpy")}
