"""Section 7b (cli/render_experts.py) of a mixture of experts too big for the terminal: 64 experts, 8 per token,
16 layers at 80 columns. Every line fits; the map shows the layers that fit and names the rest, the load bars the
experts that fit; the measured reads are the records' own and the expectation is E·(1 - (1 - k/E)^n). The HTML
report's section (cli/html_experts.py) shows every layer and expert of the records."""

from __future__ import annotations

import io
import random
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from llmtrace.cli.render_experts import render_experts
from llmtrace.tracer.core.config import MoeSpec
from llmtrace.tracer.trace.routing import LayerRouting, RoutingStep
from llmtrace.tracer.trace.run_trace import Trace

FIXTURE = Path(__file__).resolve().parent / "golden" / "tiny_moe_trace.json"
E, K, LAYERS = 64, 8, 16


def _routing(phase: str, step: int, tokens: int, rng: random.Random) -> RoutingStep:
    layers = tuple(LayerRouting(layer, tuple(tuple(rng.sample(range(E), K)) for _ in range(tokens)),
                                tuple((1.0 / K,) * K for _ in range(tokens))) for layer in range(LAYERS))
    return RoutingStep(phase, step, layers)


def _render(trace: Trace, width: int) -> str:
    out = io.StringIO()
    render_experts(Console(file=out, width=width, color_system=None, legacy_windows=False), trace)
    return out.getvalue()


def test_a_wide_mixture_of_experts_fits_80_columns_and_names_what_it_leaves_out() -> None:
    trace = Trace.from_json(FIXTURE.read_text(encoding="utf-8"))
    rng = random.Random(0)
    prompt = trace.routing[0].tokens
    routing = (_routing("prefill", 0, prompt, rng),
               *(_routing("decode", s.step, 1, rng) for s in trace.decode_steps))
    wide = replace(trace, config=replace(trace.config, n_layers=LAYERS, moe=MoeSpec(E, K, "softmax")),
                   routing=routing)
    text = _render(wide, 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "7b · Experts  64 a layer, 8 per token" in text
    assert "layers 2-15 in the JSON" in text  # 8 experts of two digits a cell: L0 and L1 fit
    assert "experts 42-63 in the JSON" in text and "load of experts 0-41" in text
    prose = " ".join(line.strip("│ ") for line in text.splitlines())  # the notes, unwrapped
    assert "its weights as the softmax gave them" in prose
    measured = sum(r.distinct_mean for r in routing[1:]) / len(routing[1:])
    assert measured == K  # one row a decode step: its k experts
    decode = next(line for line in text.splitlines() if "decode step ×" in line).strip("│ ").split()
    assert decode == ["decode", "step", f"×{len(routing) - 1}", "1", "8.00", "8.00", "8"]
    prefill = next(line for line in text.splitlines() if line.strip("│ ").startswith("prefill")).strip("│ ").split()
    low = min(layer.distinct for layer in routing[0].layers)
    high = max(layer.distinct for layer in routing[0].layers)
    assert prefill[1:4] == [str(prompt), f"{routing[0].distinct_mean:.2f}", f"({low}-{high})"]
    assert prefill[4:] == [f"{E * (1 - (1 - K / E) ** prompt):.2f}", str(min(E, K * prompt))]


def test_the_html_section_shows_every_layer_and_expert_of_the_records() -> None:
    """The HTML report's experts section (cli/html_experts.py): a cell per token row and layer holding the records'
    experts, their router weights on hover, a load cell per expert; the reads table's figures the terminal's."""
    import re

    from llmtrace.cli.html_experts import experts_html
    from llmtrace.tracer.trace.routing import step_reads

    trace = Trace.from_json(FIXTURE.read_text(encoding="utf-8"))
    page = experts_html(trace)
    cells = re.findall(r'<td title="([^"]*)">([0-9,]+)</td>', page)
    records = [(layer.experts[row], layer.weights[row]) for step in trace.routing for row in range(step.tokens)
               for layer in step.layers]
    assert len(cells) == len(records) == sum(s.tokens for s in trace.routing) * trace.config.n_layers
    for (title, text), (experts, weights) in zip(cells, records):
        assert text == ",".join(map(str, experts))
        assert title == ", ".join(f"expert {x}: {w:.3f}" for x, w in zip(experts, weights))
    load_cells = re.findall(r'title="expert (\d+): (\d+) rows', page)
    assert len(load_cells) == trace.config.n_layers * trace.config.moe.n_experts
    assert sum(int(n) for _, n in load_cells) == sum(len(c) for c, _ in records)
    terminal = _render(trace, 120)
    for reads in step_reads(trace.routing, trace.config.moe.n_experts, trace.config.moe.experts_per_token):
        assert f"<td>{reads.measured:.2f}</td>" in page and f"{reads.measured:.2f}" in terminal
        assert f"<td>{reads.expected:.2f}</td>" in page and f"{reads.expected:.2f}" in terminal
    assert experts_html(replace(trace, config=replace(trace.config, moe=None))) == ""
