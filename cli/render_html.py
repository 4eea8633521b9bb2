"""`run --html` / `show --html`: one self-contained HTML page of a trace, to look at rather than read.

Inline SVG figures from matplotlib (llmtrace.cli.html_figures), inline CSS, no script, no font, nothing fetched: the
file opens offline and can be mailed. Sections: the token stream with probabilities, time per layer x stage as a
heat map (prefill and decode), the roofline with the measured points, decode time per step, and, when the run
recorded them, the attention strip, the logit lens, the sampling lesson and the no-KV-cache comparison.
"""

from __future__ import annotations

from html import escape

from llmtrace.cli import formatting as fmt
from llmtrace.tracer.core.contract import short_label
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.roofline.compare import MeasuredVsBound
from llmtrace.tracer.trace.journey_records import LensStep, SamplingLesson
from llmtrace.tracer.trace.records import DECODE, PREFILL
from llmtrace.tracer.trace.report_data import layer_stage_grid, roofline_points
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.summary import run_summary

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; border-bottom: 1px solid #ccc; padding-bottom: .2em; }
.meta { color: #555; font-size: .9em; }
.stream span { display: inline-block; margin: 1px; padding: 1px 3px; border-radius: 3px; font-family: monospace;
               white-space: pre; }
.stream .prompt { background: #e8e8e8; color: #555; }
table { border-collapse: collapse; font-size: .85em; } td, th { padding: 2px 6px; text-align: right; }
th { background: #f0f0f0; } td.l, th.l { text-align: left; } .chosen { font-weight: bold; }
.note { color: #555; font-size: .85em; } svg { max-width: 100%; height: auto; }
"""


def html_report(trace: Trace, roofline: MeasuredVsBound | None = None) -> str:
    """The page for `trace`; `roofline` adds this machine's ceilings to the roofline (a live run only)."""
    summary = run_summary(trace)
    cfg, env = trace.config, trace.environment
    title = f"llmtrace · {cfg.name} · {trace.settings.prompt[:60]}"
    parts = [f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
             f"<style>{_CSS}</style></head><body>",
             f"<h1>{escape(cfg.name)}: one token's journey</h1>",
             f"<p class=\"meta\">{cfg.n_layers} layers · dim {cfg.dim} · {cfg.n_heads} heads ({cfg.n_kv_heads} KV) · "
             f"vocab {cfg.vocab_size:,} · {escape(env.device_name)} · {env.threads} threads · {escape(env.dtype)} · "
             f"llmtrace {escape(env.llmtrace_version)} · torch {escape(env.torch_version)}</p>",
             _section("tokens", "Token stream", _token_stream(trace),
                      "prompt in grey; each generated token coloured by the model's probability for it "
                      "(green: sure, red: unlikely); hover for the figures."),
             _section("summary", "Summary", _summary_table(trace))]
    figures = []
    try:
        from llmtrace.cli import html_figures as figs
    except ImportError as exc:  # matplotlib is the `html` extra
        raise BadArgumentError(f"the HTML report draws its figures with matplotlib ({exc}); install it with "
                               "pip install 'llmtrace[html]'") from exc
    for phase in (PREFILL, DECODE):
        grid = layer_stage_grid(trace, phase)
        if grid is not None:
            figures.append(figs.heat_map(grid, [_label(r) for r in grid.roles]))
    if figures:
        parts.append(_section("heat", "Time per layer × stage", "".join(figures),
                              "each cell: that stage's own time in that layer (decode: mean per step)."))
    points = roofline_points(trace)
    if points:
        ceiling = (roofline.peak_flops, roofline.memory_bandwidth, roofline.hardware) if roofline else (None, None, "")
        parts.append(_section("roofline", "Roofline", figs.roofline(points, *ceiling),
                              "measured FLOP/s against FLOPs per byte of weights and KV moved; "
                              + (f"ceilings: {escape(roofline.hardware)} ({escape(roofline.compute_dtype)} peak)"
                                 if roofline else "a saved trace shows the points only (it may come from another "
                                                  "machine)")))
    if trace.decode_steps:
        parts.append(_section("decode", "Decode time per step", figs.decode_times(trace.decode_steps),
                              f"mean forward {fmt.duration_ns(summary.decode.forward_ns / max(summary.decode.steps, 1))} "
                              f"per step over {summary.decode.steps} steps."))
    if trace.attention:
        first = trace.attention[0]
        parts.append(_section("attention", "Attention", figs.attention_strip(first, [fmt.piece(p) for p in
                                                                                    first.pieces]),
                              "where the first token's predicted position looks, every layer's heads averaged "
                              "(the staged model's softmax output)."))
    if trace.lens:
        parts.append(_section("lens", "Logit lens", _lens_table(trace.lens[0]),
                              "the residual stream after each layer through the final norm and the LM head."))
    if trace.sampling_lesson is not None:
        parts.append(_section("sampling", "Sampling lesson", _lesson_table(trace.sampling_lesson),
                              "the first token's logits at several temperatures; struck out: filtered out."))
    if trace.no_kv_cache is not None:
        run = trace.no_kv_cache
        parts.append(_section("no-cache", "Without a KV cache", figs.no_cache_ratios(run),
                              f"whole run: {run.time_ratio or 0:.1f}× the time, {run.flops_ratio or 0:.1f}× the "
                              f"FLOPs (estimate {run.analytic_generation_ratio:.1f}×); a {run.horizon_tokens}-token "
                              f"generation: {run.horizon_generation_ratio:.0f}× (its last step "
                              f"{run.horizon_step_ratio:.0f}×)."))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _section(anchor: str, title: str, body: str, note: str = "") -> str:
    note_html = f"<p class=\"note\">{note}</p>" if note else ""
    return f"<section id=\"{anchor}\"><h2>{escape(title)}</h2>{body}{note_html}</section>"


def _label(role: str) -> str:
    label = short_label(role)
    if role in ("attention_norm", "attn_residual"):
        return label + " (attn)"
    if role in ("ffn_norm", "ffn_residual"):
        return label + " (FFN)"
    return label


def _token_stream(trace: Trace) -> str:
    spans = []
    if trace.tokenization is not None:
        spans += [f"<span class=\"prompt\" title=\"prompt token {i}\">{escape(fmt.piece(p))}</span>"
                  for i, p in enumerate(trace.tokenization.pieces)]
    for step in trace.steps:
        p = step.sampling.probability_raw if step.sampling is not None else step.probability
        hue = round(120 * p)  # 0 red .. 120 green
        tip = (f"step {step.step} ({step.phase}) · id {step.token_id} · p model {100 * p:.1f}% · "
               f"forward {fmt.duration_ns(step.forward_ns)}")
        spans.append(f"<span style=\"background: hsl({hue}, 70%, 82%)\" title=\"{escape(tip)}\">"
                     f"{escape(fmt.piece(step.piece))}</span>")
    return f"<div class=\"stream\">{''.join(spans)}</div>"


def _summary_table(trace: Trace) -> str:
    s = run_summary(trace)
    rows = [("prompt tokens", str(s.prompt_tokens)), ("generated tokens", str(s.generated_tokens)),
            ("time to first token", fmt.duration_ns(s.ttft_ns)),
            ("decode", f"{s.decode_tokens_per_second:.1f} tokens/s" if s.decode.steps else "-"),
            ("prefill FLOPs", fmt.flops(s.prefill.totals.flops)),
            ("decode FLOPs / step", fmt.flops(s.decode.totals.flops / s.decode.steps) if s.decode.steps else "-"),
            ("KV cache", f"{fmt.nbytes(s.kv_live_bytes)} live of {fmt.nbytes(s.kv_allocated_bytes)}"),
            ("text", escape(trace.generated_text))]
    body = "".join(f"<tr><th class=\"l\">{k}</th><td class=\"l\">{v}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _lens_table(lens: LensStep) -> str:
    head = "<tr><th class=\"l\">after</th><th class=\"l\">top 1</th><th class=\"l\">top 2</th>" \
           f"<th class=\"l\">top 3</th><th>{escape(fmt.piece(lens.piece))} rank</th><th>p</th></tr>"
    rows = []
    for layer in lens.layers:
        name = "embed" if layer.layer is None else f"L{layer.layer}"
        tops = "".join(f"<td class=\"l{' chosen' if t.token_id == lens.token_id else ''}\">"
                       f"{escape(fmt.piece(t.piece))} {100 * t.probability:.0f}%</td>" for t in layer.top)
        shade = f"hsl(120, 60%, {100 - 25 * layer.chosen_probability:.0f}%)"
        mark = " ◀ first top" if layer.layer is not None and layer.layer == lens.first_top_layer else ""
        rows.append(f"<tr><td class=\"l\">{name}</td>{tops}<td>{layer.chosen_rank:,}</td>"
                    f"<td style=\"background: {shade}\">{100 * layer.chosen_probability:.1f}%{mark}</td></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def _lesson_table(lesson: SamplingLesson) -> str:
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
