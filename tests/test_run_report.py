"""The figures `run` and `show` print after the decode stream (tracer/trace/report.py, summary.py, dry_run.py),
checked against sums taken straight from the raw JSON of the golden fixture trace, and the live decode panel's
height."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtrace.tracer.trace.records import DECODE, PREFILL
from llmtrace.tracer.trace.report import embedding_table_bytes, run_report
from llmtrace.tracer.trace.run_trace import Trace

FIXTURE = Path(__file__).resolve().parent / "golden" / "tiny_trace.json"


@pytest.fixture(scope="module")
def raw() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def trace() -> Trace:
    return Trace.from_json(FIXTURE.read_text(encoding="utf-8"))


def test_phase_rates_from_the_raw_steps(raw: dict, trace: Trace) -> None:
    report = run_report(trace)
    decode_steps = [s for s in raw["steps"] if s["phase"] == DECODE]
    prefill = next(s for s in raw["steps"] if s["phase"] == PREFILL)
    n = len(decode_steps)
    dec, pre = report.summary.decode, report.summary.prefill
    assert dec.steps == n == trace.settings.max_new_tokens - 1
    assert dec.step_ns_mean == pytest.approx(sum(s["duration_ns"] for s in decode_steps) / n)
    assert report.summary.decode_tokens_per_second == pytest.approx(n / (sum(s["duration_ns"] for s in decode_steps) / 1e9))
    assert pre.forward_tokens_per_second == pytest.approx(prefill["input_tokens"] / (prefill["forward_ns"] / 1e9))
    decode_stage_flops = sum(s["matmul_flops"] + s["elementwise_flops"] for s in raw["stages"] if s["phase"] == DECODE)
    assert dec.flops_per_step == pytest.approx(decode_stage_flops / n)
    assert dec.flops_per_second == pytest.approx(decode_stage_flops / (sum(s["forward_ns"] for s in decode_steps) / 1e9))


def test_decode_by_stage_from_the_raw_stages(raw: dict, trace: Trace) -> None:
    d = run_report(trace).decode_stages
    assert d is not None
    decode_stages = [s for s in raw["stages"] if s["phase"] == DECODE]
    n = d.steps
    assert sum(r.ns_per_step for r in d.rows) == pytest.approx(sum(s["duration_ns"] for s in decode_stages) / n)
    assert d.stages_ns_per_step == pytest.approx(sum(s["duration_ns"] for s in decode_stages) / n)
    qkv = next(r for r in d.rows if r.role == "attention.wqkv")
    members = [s for s in decode_stages if s["stage"].endswith("attention.wqkv")]
    assert qkv.calls_per_step == len(members) // n == trace.config.n_layers
    moved = sum(s["weight_bytes_read"] + s["activation_bytes_read"] + s["activation_bytes_written"]
                + s["kv_bytes_read"] + s["kv_bytes_written"] for s in members)
    assert qkv.bytes_moved_per_step == pytest.approx(moved / n)
    assert qkv.bytes_per_second == pytest.approx(moved / (sum(s["duration_ns"] for s in members) / 1e9))
    flops = sum(s["matmul_flops"] + s["elementwise_flops"] for s in members)
    assert qkv.flops_per_second == pytest.approx(flops / (sum(s["duration_ns"] for s in members) / 1e9))
    assert next(r for r in d.rows if r.role == "attention_norm").flops_per_second is None  # not a matmul
    weights = [s for s in decode_stages if s["kind"] in ("linear", "lm_head")]
    assert d.weight_stream_bytes_per_second == pytest.approx(
        sum(s["weight_bytes_read"] for s in weights) / (sum(s["duration_ns"] for s in weights) / 1e9))


def test_token_limit_and_embedding_table(trace: Trace) -> None:
    assert trace.new_token_limit == trace.settings.max_new_tokens  # 6 tokens fit easily in 256 positions
    assert embedding_table_bytes(trace.config, "float32") == trace.config.vocab_size * trace.config.dim * 4
    assert embedding_table_bytes(trace.config, "bfloat16") == trace.config.vocab_size * trace.config.dim * 2


@pytest.mark.parametrize("height", [24, 40])
def test_live_decode_panel_fits_the_terminal_height(trace: Trace, height: int) -> None:
    """While streaming, the bar, tok/s and the text stay on screen however many steps there are."""
    from rich.console import Console

    from llmtrace.cli.render_run_live import DecodeView

    view = DecodeView(200, trace.prefill_step)
    for k in range(60):  # more steps than any terminal has rows
        for step in trace.decode_steps:
            view.add(step, len(view.steps) + 2)
    console = Console(width=80, height=height, record=True, color_system=None)
    with console.capture() as captured:
        console.print(view)
    lines = captured.get().splitlines()
    assert len(lines) <= height - 1  # rich Live keeps a line for the cursor
    assert any("tok/s" in line for line in lines) and any("text so far" in line for line in lines)
    view.finish(interrupted=False)
    with console.capture() as captured:
        console.print(view)
    assert len(captured.get().splitlines()) > len(view.steps)  # finished: every step


def test_redraw_pacer_bounds_the_time_spent_redrawing() -> None:
    """The live view redraws at once, then not within min_interval, and after a slow redraw (d seconds) not for
    d / share: redrawing never takes more than `share` of the run."""
    from llmtrace.cli.render_run_live import RedrawPacer

    now = [100.0]
    cost = [0.001]
    drawn: list[float] = []

    def refresh() -> None:
        drawn.append(now[0])
        now[0] += cost[0]

    pacer = RedrawPacer(min_interval=0.1, share=0.04, clock=lambda: now[0])
    assert pacer.redraw(refresh)  # the first step is shown at once
    now[0] += 0.05
    assert not pacer.redraw(refresh)  # 51 ms later: not yet
    now[0] += 0.06
    assert pacer.redraw(refresh)  # past 100 ms
    cost[0] = 0.02  # a tall terminal: 20 ms a redraw -> next one 0.5 s after it ends
    now[0] += 0.2
    assert pacer.redraw(refresh)
    end = now[0]
    now[0] = end + 0.49
    assert not pacer.redraw(refresh)
    now[0] = end + 0.51
    assert pacer.redraw(refresh)
    assert len(drawn) == 4
