"""The HTML report's figures are the terminal's: the header's model, weights and kernels lines, the summary
(section 8, with the roofline's bound and % of it), where a decode step's time goes (section 7), and the attention
sink count and most focused heads (section 5d), compared cell by cell with what the terminal's renderers print for
the same trace, and the headline figures checked against the step and stage records themselves."""

from __future__ import annotations

import html as htmllib
import io
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.cmd_show import read_trace
from llmtrace.cli.render_attention import render_attention
from llmtrace.cli.render_html import html_report
from llmtrace.cli.render_kernels import dtype_name
from llmtrace.cli.render_run import render_header, render_kernel_choice
from llmtrace.cli.render_run_decode import render_decode_stages
from llmtrace.cli.render_run_dry import render_dry_run_summary
from llmtrace.cli.render_run_summary import render_summary, route_lines
from llmtrace.tracer.hardware.profiles import get_profile
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.roofline.compare import MeasuredVsBound, compare_with_measured
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.trace.records import DECODE, RunSettings
from llmtrace.tracer.trace.report import run_report
from llmtrace.tracer.trace.run_trace import Trace

pytest.importorskip("matplotlib", reason="the HTML report needs the html extra: pip install -e '.[html]'")
GOLDEN = Path(__file__).resolve().parent / "golden"


class Capture(Console):
    """A wide console (nothing wraps) that keeps what was printed, to read the terminal's tables cell by cell."""

    def __init__(self) -> None:
        super().__init__(width=400, file=io.StringIO(), color_system=None, record=True)
        self.printed: list[Any] = []

    def print(self, *objects: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.printed.extend(objects)
        super().print(*objects, **kwargs)


@pytest.fixture(scope="module")
def trace(tiny_llama_dir: Path) -> Trace:
    settings = RunSettings(model=str(tiny_llama_dir), prompt="The capital of France is", max_new_tokens=5,
                           attention=True)
    return generate(load_model(str(tiny_llama_dir)), settings)


@pytest.fixture(scope="module")
def roofline(trace: Trace) -> MeasuredVsBound:
    """The run against a catalogue machine's roofline, as `run` makes it (tracer/run/roofline_check.py)."""
    s = run_report(trace).summary
    return compare_with_measured(trace.config, get_profile("h100-sxm"), prompt_len=s.prefill.tokens_in,
                                 new_tokens=s.decode.steps + 1, measured_ttft_s=s.prefill.forward_ns / 1e9,
                                 measured_decode_tokens_per_s=s.decode.steps / (s.decode.forward_ns / 1e9))


@pytest.fixture(scope="module")
def page(trace: Trace, roofline: MeasuredVsBound) -> str:
    return html_report(trace, roofline)


def _plain(cell: Any) -> str:
    return cell.plain if isinstance(cell, Text) else Text.from_markup(str(cell)).plain


def _cells(table: Table) -> list[list[str]]:
    """The terminal table's rows, each cell as plain text."""
    columns = [[_plain(c) for c in column.cells] for column in table.columns]
    return [list(row) for row in zip(*columns)]


def _html_rows(table: str) -> list[list[str]]:
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table, re.S)
    return [[htmllib.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S)]
            for row in rows]


def _html_table(page: str, cls: str) -> str:
    match = re.search(rf'<table class="{cls}">(.*?)</table>', page, re.S)
    assert match, cls
    return match.group(1)


def _text(page: str) -> str:
    return htmllib.unescape(re.sub(r"<[^>]+>", "", page))


def test_header_names_the_model_its_weights_and_kernels_as_the_terminal_does(trace: Trace, page: str) -> None:
    console = Capture()
    env = trace.environment
    render_header(console, trace.config, trace.model.weight_format, trace.model.load_seconds, env.device,
                  env.threads, env.dtype, False)
    render_kernel_choice(console, trace.kernels, dtype_name(env.dtype))
    model, weights, kernels = console.export_text().splitlines()
    found = {key: _text(re.search(rf'<p class="meta" id="{key}">(.*?)</p>', page).group(1))  # type: ignore[union-attr]
             for key in ("model", "weights", "kernels")}
    assert found == {"model": model, "weights": weights, "kernels": kernels}
    assert model.startswith(f"{trace.config.name} · {trace.config.n_layers} layers")
    assert f"loaded in {fmt.duration_s(trace.model.load_seconds)}" in weights
    assert f"<h1 id=\"top\">{htmllib.escape(trace.config.name)}</h1>" in page


def test_summary_is_the_terminals_section_8_with_the_roofline(trace: Trace, roofline: MeasuredVsBound,
                                                              page: str) -> None:
    console = Capture()
    report = run_report(trace)
    render_summary(console, trace, report.summary, roofline, "")
    panel = next(p for p in console.printed if isinstance(p, Panel))
    terminal = _cells(panel.renderable.renderables[0])  # type: ignore[attr-defined]
    shown = _html_rows(_html_table(page, "summary"))
    assert shown[1:] == terminal and shown[0] == ["", "prefill", "decode"]
    rows = {row[0]: row[1:] for row in shown}
    # the figures themselves, from the step and stage records
    prefill = trace.prefill_step
    assert prefill is not None
    assert rows["speed"][0] == fmt.tokens_per_s(prefill.input_tokens / (prefill.forward_ns / 1e9))
    prefill_stages = [s for s in trace.stages if s.phase == "prefill"]
    read = sum(s.weight_bytes_read + s.activation_bytes_read + s.kv_bytes_read for s in prefill_stages)
    assert rows["bytes read"][0] == fmt.nbytes(read)
    assert rows["FLOPs"][0] == fmt.flops(sum(s.flops for s in prefill_stages))
    assert rows["arithmetic intensity"][0] == fmt.intensity(report.summary.prefill.arithmetic_intensity)
    assert rows["run reached"] == [f"{fmt.figures(100 * roofline.predicted_ttft_s / (prefill.forward_ns / 1e9))}% "
                                   "of the bound", f"{fmt.figures(roofline.decode_percent_of_bound)}% of the bound"]
    assert rows["roofline bound"] == [f"{roofline.prefill_bound}-bound", f"{roofline.decode_bound}-bound"]
    lines = _text(page)
    assert f"roofline (eager kernels): h100-sxm {roofline.compute_dtype} peak" in lines
    assert f"stopped: --max-new-tokens reached · {len(trace.steps)} tokens generated" in lines
    route = route_lines(trace.route)  # the backends that ran the steps, in the terminal's words
    assert len(route) == 1 and route[0].startswith("route: decode on ") and route[0] in console.export_text()
    assert route[0] in lines


def test_a_run_without_a_bound_says_why(trace: Trace) -> None:
    note = "roofline: no saved profile, so no bound to judge it by"
    page = html_report(trace, None, note)
    assert "roofline bound" not in page and f"<p class=\"note line\">{note}</p>" in page
    assert f"no ceilings: {note}" in page


def test_decode_by_stage_is_the_terminals_section_7(trace: Trace, page: str) -> None:
    console = Capture()
    d = run_report(trace).decode_stages
    assert d is not None
    render_decode_stages(console, d)
    panel = next(p for p in console.printed if isinstance(p, Panel))
    terminal = _cells(panel.renderable.renderables[0])  # type: ignore[attr-defined]
    shown = _html_rows(_html_table(page, "stages"))
    assert shown[0][:-1] == ["stage", "× / step", "time / step", "share", "FLOPs / step", "bytes / step", "bytes/s",
                             "FLOP/s"]
    assert [row[:-1] for row in shown[1:]] == [row[:-1] for row in terminal]  # the last column: the bars
    # one row against the stage records: the LM head's time, FLOPs and bytes per decode step
    steps = [s for s in trace.steps if s.phase == DECODE]
    head = [s for s in trace.stages if s.phase == DECODE and s.kind == "lm_head"]
    row = next(r for r in shown if r[0] == "LM head")
    assert row[1:4] == ["1", fmt.duration_ns(sum(s.duration_ns for s in head) / len(steps)),
                        fmt.share(sum(s.duration_ns for s in head) / len(steps),
                                  sum(s.forward_ns for s in steps) / len(steps))]
    assert row[4] == fmt.flops(sum(s.flops for s in head) / len(steps))
    assert f"where a step's {fmt.duration_ns(d.forward_ns_per_step)} go" in _text(page)


def test_attention_sinks_and_focused_heads_are_the_terminals(trace: Trace, page: str) -> None:
    console = Capture()
    first = trace.attention[0]
    render_attention(console, first)
    terminal = console.export_text()
    sinks = re.search(r"(\d+ of \d+) heads put most weight on position 0", terminal)
    assert sinks
    focused = [line.strip(" │") for line in terminal.splitlines() if re.match(r"[│ ]*L\d+ head \d+:", line)]
    assert len(focused) == min(6, len(first.heads))
    view = re.search(r'<div id="attention-view">(.*?)</div>\s*<p class="note">', page, re.S)
    assert view
    assert f"<p>{sinks.group(1)} heads put most weight on position 0" in view.group(1)
    assert [htmllib.unescape(x) for x in re.findall(r"<li>(.*?)</li>", view.group(1))] == focused
    # the sink count from the full weights the trace kept for the prefill: heads whose largest weight is position 0
    assert first.weights is not None
    on_sink = sum(1 for layer in first.weights for head in layer if max(range(len(head)), key=head.__getitem__) == 0)
    assert sinks.group(1) == f"{on_sink} of {len(first.heads)}"


def test_a_dry_run_shows_the_terminals_flops_check_and_no_time() -> None:
    """A meta-device trace (`show --html` of one; `run` refuses --html with --dry-run): the traced FLOPs beside the
    estimate, as the terminal shows them, and none of the sections that need a time."""
    trace = read_trace(GOLDEN / "tiny_dry_run.json")
    page = html_report(trace)
    assert re.findall(r'<section id="([^"]+)">', page) == ["tokens", "summary"]
    console = Capture()
    check = run_report(trace).dry_run
    assert check is not None
    render_dry_run_summary(console, check, trace.settings.model)
    panel = next(p for p in console.printed if isinstance(p, Panel))
    terminal = _cells(panel.renderable.renderables[0])  # type: ignore[attr-defined]
    shown = _html_rows(_html_table(page, "dry"))
    assert shown[1:] == terminal
    assert [row[1] for row in shown[1:]] == [fmt.flops(p.traced_flops) for p in check.passes]
    assert all(row[3] == "= equal" for row in shown[1:])
