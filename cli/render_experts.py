"""Section 7b of `llmtrace run` for a mixture of experts (the trace's routing records): its parameters, total and
active a token (tracer/analytic/params.py), the experts each token went to in every layer (a token x layer map), each
expert's load per layer over the run, and the experts a step read beside what uniform routing expects,
E·(1 - (1 - k/E)^n) for n token rows (tracer/analytic/moe.py)."""

from __future__ import annotations

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.html_experts import shared_words
from llmtrace.cli.render_run import section
from llmtrace.tracer.analytic.params import count_params
from llmtrace.tracer.trace.records import PREFILL
from llmtrace.tracer.trace.routing import RoutingStep, expert_load, step_reads, token_routes
from llmtrace.tracer.trace.run_trace import Trace

PIECE_WIDTH = 8
MOST_ROWS = 24  # a longer run shows its first and last token rows
DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
LEVELS = " ▁▂▃▄▅▆▇█"  # an expert's load, as a share of its layer's busiest expert's
FRAME = 4  # the panel's borders and padding


def render_experts(console: Console, trace: Trace) -> None:
    """Nothing for a dense model (or a trace without routing records)."""
    moe = trace.config.moe
    if moe is None or not trace.routing:
        return
    e, k = moe.n_experts, moe.experts_per_token
    width = console.width - FRAME
    params = count_params(trace.config)
    parts: list[object] = [Text(
        f"{fmt.count(params.total)} parameters, {fmt.count(params.active)} of them active a token "
        f"({100 * params.active / params.total:.0f}%: attention, router, head{shared_words(trace)} and {k} of the {e} "
        "experts)"), Text("")]
    if trace.batch is None:  # a batch's rows are several sequences' at once: its load and reads say it
        parts += [_token_map(trace, e, width), Text("")]
    parts += [_load(trace.routing, e, width), Text(""), _reads(trace.routing, e, k)]
    norm = "renormalised to sum 1" if moe.router_norm == "renormalised" else "as the softmax gave them"
    parts.append(Text.from_markup(
        f"each token row goes to {k} of the {e} experts of every layer, its weights {norm}; a step reads the "
        "matrices of the experts its rows chose, each once. Expected: E·(1 - (1 - k/E)^n) for n rows if every "
        "expert were as likely (a trained router is not uniform); the trace's JSON has every step's choices."))
    console.print(section(f"7b · Experts  {e} a layer, {k} per token", Group(*parts)))


def _label(expert: int, n_experts: int) -> str:
    """An expert's name in the map: one character up to 36 experts, else its number."""
    return DIGITS[expert] if n_experts <= len(DIGITS) else str(expert)


def _token_map(trace: Trace, n_experts: int, width: int) -> Group:
    """One row per token fed (the prompt's, then each decode step's input), one column per layer: its experts, the
    router's favourite first. The layers that fit the width; the rest are in the JSON."""
    rows = token_routes(trace.routing, trace.tokenization.pieces if trace.tokenization is not None else (),
                        {s.step: s.piece for s in trace.steps})
    sep = "" if n_experts <= len(DIGITS) else ","
    cell = len(sep.join(_label(n_experts - 1, n_experts) for _ in rows[0].experts[0]))
    n_layers = len(rows[0].experts)
    shown = max(1, min(n_layers, (width - PIECE_WIDTH - 6) // (cell + 1)))
    table = Table(show_edge=False, pad_edge=False, box=None, padding=(0, 1, 0, 0))
    table.add_column("token", no_wrap=True)
    table.add_column("step", justify="right")
    for layer in range(shown):
        table.add_column(f"L{layer}", no_wrap=True)
    if len(rows) > MOST_ROWS:
        half = MOST_ROWS // 2
        rows = (*rows[:half], None, *rows[-half:])
    for row in rows:
        if row is None:
            table.add_row("…", "", *("" for _ in range(shown)))
            continue
        cells = [sep.join(_label(x, n_experts) for x in experts) for experts in row.experts[:shown]]
        table.add_row(escape(fmt.piece(row.piece)[:PIECE_WIDTH]), str(row.step), *cells)
    note = f"; layers {shown}-{n_layers - 1} in the JSON" if shown < n_layers else ""
    return Group(table, Text(f"each token's experts in every layer, the router's favourite first (a decode step's row "
                             f"is the token the step before chose){note}"))


def _load(steps: tuple[RoutingStep, ...], n_experts: int, width: int) -> Group:
    """Per layer: every expert's share of the run's token rows as one bar character (scaled to the layer's busiest
    expert), the busiest one and the experts no token chose."""
    load = expert_load(steps, n_experts)
    shown = max(1, min(n_experts, width - 34))
    table = Table(show_edge=False, pad_edge=False, box=None, padding=(0, 1, 0, 0))
    table.add_column("layer")
    table.add_column(f"load of experts 0-{shown - 1}", no_wrap=True)
    table.add_column("busiest", justify="right")
    table.add_column("share", justify="right")
    table.add_column("idle", justify="right")
    for layer, counts in enumerate(load):
        top = max(counts)
        bars = "".join(LEVELS[0 if c == 0 else max(1, round(8 * c / top))] for c in counts[:shown])
        busiest = counts.index(top)
        table.add_row(f"L{layer}", bars, _label(busiest, n_experts), f"{100 * top / sum(counts):.0f}%",
                      str(sum(1 for c in counts if c == 0)))
    more = f"; experts {shown}-{n_experts - 1} in the JSON" if shown < n_experts else ""
    return Group(table, Text(f"expert load over the run: each bar one expert's share of the token rows, "
                             f"{LEVELS[-1]} = the layer's busiest, blank = none{more}"))


def _reads(steps: tuple[RoutingStep, ...], n_experts: int, top_k: int) -> Table:
    """The experts a layer read, measured (the mean over layers, and over steps for decode) beside uniform
    routing's expectation and the bound for the step's token rows."""
    table = Table(show_edge=False, pad_edge=False, box=None, padding=(0, 1, 0, 0))
    table.add_column("experts read a layer")
    table.add_column("rows", justify="right")
    table.add_column("measured", justify="right")
    table.add_column("uniform", justify="right")
    table.add_column("at most", justify="right")
    for reads in step_reads(steps, n_experts, top_k):
        spread = f" ({reads.least}-{reads.most_measured})" if reads.least != reads.most_measured else ""
        what = "prefill" if reads.phase == PREFILL else f"decode step ×{reads.steps}"
        table.add_row(what, str(reads.rows), f"{reads.measured:.2f}{spread}", f"{reads.expected:.2f}",
                      str(reads.most))
    return table
