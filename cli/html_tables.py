"""The HTML report's tables: the summary (the terminal's section 8), where a decode step's time goes (section 7),
time per layer x stage as heat maps whose cells say their value on hover, and the sampling lesson.

Every figure is the terminal's: the same records and functions (tracer/trace/summary.py's run_summary and
decode_by_stage, tracer/roofline/compare.py's MeasuredVsBound), written by the same cli/formatting.py functions;
tests/test_html_report.py compares them with the terminal's rendering of the same trace, cell by cell.
"""

from __future__ import annotations

from html import escape
from typing import Sequence

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_run_summary import memory_lines, route_lines, stop_text, summary_notes, summary_rows
from llmtrace.tracer.core.contract import role_label
from llmtrace.tracer.roofline.compare import MeasuredVsBound
from llmtrace.tracer.trace.dry_run import DryRunCheck
from llmtrace.tracer.trace.journey_records import SamplingLesson
from llmtrace.tracer.trace.records import MATMUL_KINDS, PREFILL
from llmtrace.tracer.trace.report_data import LayerStageGrid
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.summary import DecodeByStage, RunSummary

LEVELS = 32  # colours of a heat map's scale (html_figures.palette); a cell's value is in its title


def summary_table(trace: Trace, summary: RunSummary, roofline: MeasuredVsBound | None, roofline_note: str) -> str:
    """The terminal's summary: prefill and decode side by side, then the KV cache, memory, roofline and stop
    lines, then the text."""
    cells = lambda row: "".join(f"<td><b>{escape(c.text)}</b>{escape(c.after)}</td>" if c.strong  # noqa: E731
                                else f"<td>{escape(c.text)}</td>" for c in row)
    body = "".join(f"<tr><th class=\"l\">{escape(name)}</th>{cells(row)}</tr>"
                   for name, *row in summary_rows(trace, summary, roofline))
    table = f"<table class=\"summary\"><tr><th></th><th>prefill</th><th>decode</th></tr>{body}</table>"
    lines = memory_lines(trace, summary)
    settings = trace.settings
    route, *why = route_lines(trace.route, True) or [""]  # --detail kernels's lines go under a <details>
    notes = summary_notes(trace, roofline, roofline_note) + ([route] if route else [])
    stop = f"stopped: {stop_text(trace.stop_reason)} · {summary.generated_tokens} tokens generated"
    paragraphs = ([f"<p class=\"line\">{escape(line)}</p>" for line in lines]
                  + [f"<p class=\"note line\">{escape(n)}</p>" for n in notes])
    if why:  # what `--detail kernels` adds under the route: the backends not taken, and why
        paragraphs.append(f"<details><summary>why this route</summary><pre>{escape(chr(10).join(why))}</pre>"
                          "</details>")
    paragraphs.append(f"<p class=\"line\">{escape(stop)}</p>")
    generated = trace.generated_text
    cut = generated.endswith("\ufffd")  # stopped inside a multi-byte character (Ctrl-C or the token limit)
    reply = (f"<span class=\"reply\">{escape(generated.rstrip(chr(0xFFFD)))}</span>"
             + (" <span class=\"note\">…(an incomplete UTF-8 character)</span>" if cut else ""))
    if trace.batch is not None:  # every sequence: its prompt, its continuation and why it stopped
        text = "".join(
            f"<p class=\"text\"><span class=\"prompt\">{seq.index}: {escape(seq.tokenization.text)}</span>"
            f"<span class=\"reply\">{escape(seq.generated_text.rstrip(chr(0xFFFD)))}</span> "
            f"<span class=\"note\">({escape(stop_text(seq.stop_reason))})</span></p>" for seq in trace.batch.sequences)
    elif settings.chat:  # a reply, not a continuation: the two apart, as a chat shows them
        text = (f"<p class=\"text\"><span class=\"prompt\">prompt: </span>{escape(settings.prompt)}</p>"
                f"<p class=\"text\"><span class=\"prompt\">reply: </span>{reply}</p>")
    else:  # the model continued the prompt: one text, the continuation highlighted
        text = f"<p class=\"text\"><span class=\"prompt\">{escape(settings.prompt)}</span>{reply}</p>"
    return table + "".join(paragraphs) + text


def dry_run_table(check: DryRunCheck, model: str) -> str:
    """A meta-device run instead of the summary, as the terminal shows it (cli/render_run_dry.py): the traced FLOPs
    beside the analytical estimate; no time, since nothing was computed. `model`: for `llmtrace roofline --model`."""
    head = "<th class=\"l\">pass</th>" + "".join(f"<th>{name}</th>" for name in (
        "traced FLOPs", "estimate.py FLOPs", "", "matmul share", "weights read", "KV read + written"))
    rows = "".join(
        f"<tr><td class=\"l\">{f'prefill T={p.new_tokens}' if p.phase == PREFILL else f'decode S={p.context_length}'}"
        f"</td><td>{fmt.flops(p.traced_flops)}</td><td>{fmt.flops(p.estimated_flops)}</td>"
        f"<td class=\"l\">{'= equal' if p.equal else '≠ differs'}</td><td>{fmt.share(p.matmul_flops, p.traced_flops)}"
        f"</td><td>{fmt.nbytes(p.weight_bytes_read)}</td><td>{fmt.nbytes(p.kv_bytes_moved)}</td></tr>"
        for p in check.passes)
    exact = ", ".join(("prefill " if p.phase == PREFILL else "decode step ") + fmt.count(p.traced_flops)
                      for p in check.passes)
    kv = fmt.nbytes(check.kv_live_bytes_after_prefill) if check.kv_live_bytes_after_prefill is not None else "-"
    lines = [f"{check.n_layers} layers, each turning {' / '.join(fmt.shape(s) for s in check.layer_output_shapes)} "
             "into the same shape (the residual stream); nothing was computed: the model lives on the meta device.",
             f"exact FLOPs: {exact}", f"KV cache after the prefill: {kv} in {check.dtype}"]
    return (f"<table class=\"dry\"><tr>{head}</tr>{rows}</table>"
            + "".join(f"<p class=\"line\">{escape(line)}</p>" for line in lines)
            + f"<p class=\"note line\">for times on real hardware: llmtrace roofline --model {escape(model)}</p>")


def decode_stage_table(d: DecodeByStage) -> str:
    """Section 7: every stage role's time, FLOPs, bytes and rates per decode step, with a bar of its time."""
    head = "<th class=\"l\">stage</th>" + "".join(f"<th>{name}</th>" for name in (
        "× / step", "time / step", "share", "FLOPs / step", "bytes / step", "bytes/s", "FLOP/s", ""))
    slowest = max(r.ns_per_step for r in d.rows) or 1
    rows = []
    for row in d.rows:
        dim = "" if row.kind in MATMUL_KINDS else " class=\"dim\""
        cells = [fmt.duration_ns(row.ns_per_step), fmt.share(row.ns_per_step, d.forward_ns_per_step),
                 fmt.flops(row.flops_per_step), fmt.nbytes(row.bytes_moved_per_step),
                 fmt.bytes_per_s(row.bytes_per_second) if row.bytes_per_second else "-",
                 fmt.flops_per_s(row.flops_per_second) if row.flops_per_second else ""]
        bar = f"<span class=\"bar\" style=\"width: {100 * row.ns_per_step / slowest:.1f}%\"></span>"
        rows.append(f"<tr{dim}><td class=\"l\">{escape(role_label(row.role))}</td><td>{row.calls_per_step}</td>"
                    + "".join(f"<td>{c}</td>" for c in cells) + f"<td class=\"barcell\">{bar}</td></tr>")
    streamed = fmt.bytes_per_s(d.weight_stream_bytes_per_second) if d.weight_stream_bytes_per_second else "-"
    of_all = (f" (the {d.steps} of {d.all_steps} whose stages --trace-steps kept)" if d.steps != d.all_steps
              else "")
    notes = [f"mean of {d.steps} decode steps{of_all}, every layer's instance of a stage together; rates = bytes "
             "moved (weights, activations, KV) and FLOPs over the stage's own time.",
             f"the weight products (projections, FFN, LM head) take "
             f"{fmt.share(d.weight_products_ns_per_step, d.forward_ns_per_step)} of the forward and stream their "
             f"weights at {streamed}; the other stages move little and cost their launch overhead.",
             f"stages add up to {fmt.duration_ns(d.stages_ns_per_step)} of the "
             f"{fmt.duration_ns(d.forward_ns_per_step)} forward per step (the rest: Python between them)."]
    return (f"<table class=\"stages\"><tr>{head}</tr>{''.join(rows)}</table>"
            + "".join(f"<p class=\"note line\">{escape(n)}</p>" for n in notes))


def level(value: float, top: float) -> int:
    """A value's colour on a scale from 0 to `top`: 0 .. LEVELS - 1."""
    return min(LEVELS - 1, max(0, int(LEVELS * value / top))) if top > 0 else 0


def heat_table(cls: str, corner: str, columns: Sequence[str], rows: Sequence[str],
               cells: Sequence[Sequence[tuple[int, str]]], kind: str) -> str:
    """A heat map as a table: `cells[row][column]` = (colour level, the value's title); the colours are CSS classes
    `{cls}0` .. (render_html's style sheet), the titles what a pointer over the cell shows."""
    head = "".join(f"<th class=\"col\"><span>{escape(c)}</span></th>" for c in columns)
    body = "".join(
        f"<tr><th>{escape(name)}</th>" + "".join(f"<td class=\"{cls}{lv}\" title=\"{escape(title)}\"></td>"
                                                 for lv, title in row) + "</tr>"
        for name, row in zip(rows, cells))
    return (f"<div class=\"heatwrap\"><table class=\"heat {kind}\"><tr><th>{escape(corner)}</th>{head}</tr>{body}"
            "</table></div>")


def time_heat_map(grid: LayerStageGrid, labels: Sequence[str]) -> str:
    """One phase's time per layer x stage; a cell's title: its layer, its stage and the time."""
    top = max(max(row) for row in grid.ns)
    mean = f", mean of {grid.steps} steps" if grid.steps > 1 else ""
    cells = [[(level(ns, top), f"L{layer} · {label}: {fmt.duration_ns(ns)}") for ns, label in zip(row, labels)]
             for layer, row in zip(grid.layers, grid.ns)]
    caption = (f"<p class=\"caption\">{grid.phase}: time per layer × stage{mean}; darkest 0, brightest "
               f"{fmt.duration_ns(top)}</p>")
    return caption + heat_table("v", "layer", labels, [f"L{layer}" for layer in grid.layers], cells, "time")


def lesson_table(lesson: SamplingLesson) -> str:
    head = "<tr><th class=\"l\">token</th><th>logit</th>" + "".join(
        f"<th>T={c.temperature:g}</th>" for c in lesson.columns) + "</tr>"
    rows = []
    for i, token in enumerate(lesson.tokens):
        cells = "".join((f"<td>{100 * c.probabilities[i]:.1f}%</td>" if c.final_probabilities[i] > 0
                         else f"<td><s>{100 * c.probabilities[i]:.1f}%</s></td>") for c in lesson.columns)
        rows.append(f"<tr><td class=\"l\">{escape(fmt.piece(token.piece))}</td><td>{token.logit:.2f}</td>{cells}</tr>")
    rows.append("<tr><th class=\"l\">entropy, bits</th><td></td>" + "".join(
        f"<td>{c.entropy_bits:.2f}</td>" for c in lesson.columns) + "</tr>")
    for name, on, field in (("top-k", lesson.top_k > 0, "n_after_top_k"), ("top-p", lesson.top_p < 1, "n_after_top_p"),
                            ("min-p", lesson.min_p > 0, "n_after_min_p")):
        if on:
            rows.append(f"<tr><th class=\"l\">after {name}</th><td></td>" + "".join(
                f"<td>{getattr(c, field):,}</td>" for c in lesson.columns) + "</tr>")
    return f"<table>{head}{''.join(rows)}</table>"
