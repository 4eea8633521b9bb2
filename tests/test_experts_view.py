"""Section 7b (cli/render_experts.py) of a mixture of experts too big for the terminal: 64 experts, 8 per token,
16 layers at 80 columns. Every line fits; the map shows the layers that fit and names the rest, the load bars the
experts that fit; the measured reads are the records' own and the expectation is E·(1 - (1 - k/E)^n)."""

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
