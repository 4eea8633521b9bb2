"""The HTML report's section for a mixture of experts: the terminal's section 7b (cli/render_experts.py) from the same
functions of tracer/trace/routing.py, with every layer and every expert (a page scrolls where a terminal cannot): the
parameters total and active, the token x layer expert map (a cell's router weights on hover), each expert's load per
layer as a shaded grid, and the experts a step read beside uniform routing's expectation."""

from __future__ import annotations

from html import escape

from llmtrace.cli import formatting as fmt
from llmtrace.tracer.analytic.params import count_params
from llmtrace.tracer.trace.records import PREFILL
from llmtrace.tracer.trace.routing import expert_load, step_reads, token_routes
from llmtrace.tracer.trace.run_trace import Trace


def shared_words(trace: Trace) -> str:
    """", the shared expert" where the model has one (Qwen2-MoE): what a token's active parameters hold besides."""
    return ", the shared expert" if trace.config.shared_expert_dim else ""


def experts_html(trace: Trace) -> str:
    """"" for a dense model (or a trace without routing records)."""
    moe = trace.config.moe
    if moe is None or not trace.routing:
        return ""
    e, k = moe.n_experts, moe.experts_per_token
    params = count_params(trace.config)
    parts = [f"<p class=\"line\">{fmt.count(params.total)} parameters, {fmt.count(params.active)} of them active a "
             f"token ({100 * params.active / params.total:.0f}%: attention, router, head{shared_words(trace)} and {k} of "
             f"the {e} "
             "experts)</p>"]
    if trace.batch is None:
        parts.append(_token_map(trace))
    parts += [_load(trace, e), _reads(trace, e, k)]
    return "".join(parts)


def _token_map(trace: Trace) -> str:
    """Every token row, every layer: its experts, the router's favourite first; hover a cell for their weights."""
    rows = token_routes(trace.routing, trace.tokenization.pieces if trace.tokenization is not None else (),
                        {s.step: s.piece for s in trace.steps})
    weights = [layer.weights[row] for step in trace.routing for row in range(step.tokens) for layer in step.layers]
    n_layers = len(rows[0].experts)
    head = "<tr><th class=\"l\">token</th><th>step</th>" + "".join(f"<th>L{i}</th>" for i in range(n_layers)) + "</tr>"
    body, at = [], 0
    for row in rows:
        cells = []
        for experts in row.experts:
            title = ", ".join(f"expert {x}: {w:.3f}" for x, w in zip(experts, weights[at]))
            cells.append(f"<td title=\"{escape(title)}\">{','.join(map(str, experts))}</td>")
            at += 1
        body.append(f"<tr><td class=\"l\">{escape(fmt.piece(row.piece))}</td><td>{row.step}</td>{''.join(cells)}</tr>")
    return (f"<div class=\"heatwrap\"><table class=\"experts\">{head}{''.join(body)}</table></div>"
            "<p class=\"note\">each token's experts in every layer, the router's favourite first (a decode step's "
            "row is the token the step before chose); hover a cell for the router's weights.</p>")


def _load(trace: Trace, n_experts: int) -> str:
    """Per layer, each expert's share of the run's token rows, shaded against the layer's busiest expert."""
    load = expert_load(trace.routing, n_experts)
    head = "<tr><th class=\"l\">layer</th>" + "".join(f"<th>{i}</th>" for i in range(n_experts)) + "</tr>"
    body = []
    for layer, counts in enumerate(load):
        top, total = max(counts), sum(counts)
        cells = "".join(f"<td style=\"background: rgba(59, 130, 196, {c / top:.2f})\" title=\"expert {i}: {c} rows, "
                        f"{100 * c / total:.1f}%\"></td>" for i, c in enumerate(counts))
        body.append(f"<tr><th class=\"l\">L{layer}</th>{cells}</tr>")
    return (f"<div class=\"heatwrap\"><table class=\"heat\">{head}{''.join(body)}</table></div>"
            "<p class=\"note\">expert load over the run: each cell one expert's token rows, darkest = the layer's "
            "busiest, blank = none; hover for the count.</p>")


def _reads(trace: Trace, n_experts: int, top_k: int) -> str:
    """The terminal's table of experts read a layer, measured beside uniform routing's expectation."""
    head = ("<tr><th class=\"l\">experts read a layer</th><th>rows</th><th>measured</th><th>least-most</th>"
            "<th>uniform</th><th>at most</th></tr>")
    body = "".join(
        f"<tr><td class=\"l\">{'prefill' if r.phase == PREFILL else f'decode step ×{r.steps}'}</td><td>{r.rows}</td>"
        f"<td>{r.measured:.2f}</td><td>{r.least}-{r.most_measured}</td><td>{r.expected:.2f}</td><td>{r.most}</td></tr>"
        for r in step_reads(trace.routing, n_experts, top_k))
    return (f"<table>{head}{body}</table><p class=\"note\">uniform: E·(1 - (1 - k/E)^n) for n rows if every expert "
            "were as likely (a trained router is not uniform).</p>")
