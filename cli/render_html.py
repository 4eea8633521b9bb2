"""`run --html` / `show --html`: one self-contained HTML page of a trace, to look at rather than read.

Inline CSS, inline SVG figures from matplotlib (llmtrace.cli.html_figures), heat maps as tables whose cells say
their value on hover, and one small inline script: the token selector of the logit lens and attention
(llmtrace.cli.html_journey). No font, no library, nothing fetched: the file opens offline and can be mailed; with
JavaScript off it shows the first generated token's lens and attention.

The page, in order: the header (the model as the terminal's header names it, its weights, kernels and load time),
the contents, the token stream, the summary (section 8's figures), where a decode step's time goes (section 7), a
mixture of experts' routing (section 7b, llmtrace.cli.html_experts), time per layer x stage, the roofline, decode time per step, the sampling lesson, then for every generated token
the logit lens and the attention, and the no-KV-cache comparison. Every figure comes from the trace's records
through the functions the terminal uses (llmtrace.cli.html_tables).
"""

from __future__ import annotations

from html import escape
from typing import Any, Callable

from llmtrace.cli import formatting as fmt
from llmtrace.cli import html_journey, html_tables
from llmtrace.cli.html_experts import experts_html
from llmtrace.cli.render_kernels import detail_lines, dtype_name, kernel_line, numerics_note
from llmtrace.tracer.core.contract import short_label
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.roofline.compare import MeasuredVsBound
from llmtrace.tracer.trace.records import DECODE, PREFILL
from llmtrace.tracer.trace.report import RunReport, run_report
from llmtrace.tracer.trace.report_data import layer_stage_grid, roofline_points
from llmtrace.tracer.trace.run_trace import Trace

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; padding: 0 1em; color: #222; }
h1 { font-size: 1.4em; margin-bottom: .2em; } h2 { font-size: 1.15em; border-bottom: 1px solid #ccc;
  padding-bottom: .2em; margin-top: 1.6em; }
.meta { color: #555; font-size: .9em; margin: .15em 0; } details { font-size: .85em; color: #555; }
details pre { margin: .3em 0; }
nav ol { columns: 2; font-size: .9em; } nav a { color: #0b5cad; }
.stream span { display: inline-block; margin: 1px; padding: 1px 3px; border-radius: 3px; font-family: monospace;
  white-space: pre; }
.stream .prompt { background: #e8e8e8; color: #555; } .stream [data-token] { cursor: pointer; }
table { border-collapse: collapse; font-size: .85em; } td, th { padding: 2px 6px; text-align: right; }
th { background: #f0f0f0; } td.l, th.l { text-align: left; } .chosen { font-weight: bold; text-decoration: underline; }
tr.dim td { color: #777; } tr.top td { color: #1a7f37; font-weight: bold; }
td.barcell { width: 130px; text-align: left; } .bar { display: inline-block; height: .8em; background: #3b82c4; }
.note, .caption { color: #555; font-size: .85em; } svg { max-width: 100%; height: auto; }
.text .prompt { color: #777; } .text .reply { color: #1a7f37; font-weight: bold; white-space: pre-wrap; }
.heatwrap { overflow-x: auto; } table.heat td { width: 14px; min-width: 14px; height: 12px; padding: 0;
  border: 1px solid #fff; } table.heat th { font-size: .8em; font-weight: normal; padding: 0 4px; }
table.heat th.col { vertical-align: bottom; padding: 2px 0; }
table.heat th.col span { writing-mode: vertical-rl; transform: rotate(180deg); white-space: pre; }
table.heat td:hover { outline: 2px solid #000; } table.heat.time td { width: 24px; height: 16px; }
table.experts td { font-family: monospace; white-space: nowrap; }
p.line { margin: .2em 0; }
.picker { position: sticky; top: 0; background: #fff; padding: .4em 0; border-bottom: 1px solid #ccc; z-index: 1; }
.picker select { font-family: monospace; } ul.heads { font-family: monospace; font-size: .85em; }
"""


Section = tuple[str, str, str]  # (anchor, title, body)


def html_report(trace: Trace, roofline: MeasuredVsBound | None = None, roofline_note: str = "") -> str:
    """The page for `trace`; `roofline` is the run's comparison with this machine's ceilings (a live run), or
    `roofline_note` says why there is none."""
    try:
        from llmtrace.cli import html_figures as figs
    except ImportError as exc:  # matplotlib is the `html` extra
        raise BadArgumentError(f"the HTML report draws its figures with matplotlib ({exc}); install it with "
                               "pip install 'llmtrace[html]'") from exc
    sections = _run_sections(trace, run_report(trace), roofline, roofline_note, figs)
    steps = html_journey.journey_steps(trace)
    journey = _journey_sections(trace, steps)
    after = _no_cache_section(trace, figs)
    title = f"llmtrace · {trace.config.name} · {trace.settings.prompt[:60]}"
    parts = [f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
             f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{escape(title)}</title>"
             f"<style>{_CSS}{_palettes(figs.palette)}</style></head><body>",
             _header(trace), _toc(sections + journey + after)]
    parts += [_section(*s) for s in sections]
    if journey:
        parts.append("<div class=\"journey\">" + html_journey.picker(steps)
                     + "".join(_section(*s) for s in journey) + "</div>")
        parts.append(html_journey.journey_data(steps) + html_journey.script())
    parts += [_section(*s) for s in after]
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _run_sections(trace: Trace, report: RunReport, roofline: MeasuredVsBound | None, roofline_note: str,
                  figs: Any) -> list[Section]:
    """The token stream, the summary (or the dry run's check), decode by stage, the heat maps, the roofline, the
    decode times and the sampling lesson: each when the trace has it."""
    summary, dry = report.summary, report.dry_run
    sections: list[Section] = [
        ("tokens", "Token stream", _token_stream(trace) + _note(
            "prompt in grey; each generated token coloured by the model's probability for it (green: sure, red: "
            "unlikely); hover for the figures, click one for its lens and attention.")),
    ]
    if dry is not None:  # nothing was computed: the FLOPs against the estimate, and no time anywhere
        sections.append(("summary", "Dry run: FLOPs traced on the meta device vs the analytical estimate",
                         html_tables.dry_run_table(dry, trace.settings.model or trace.config.name)))
    else:
        sections.append(("summary", "Summary", html_tables.summary_table(trace, summary, roofline, roofline_note)))
    if report.decode_stages is not None:
        d = report.decode_stages
        sections.append(("stages", f"Decode by stage: where a step's {fmt.duration_ns(d.forward_ns_per_step)} go",
                         html_tables.decode_stage_table(d) + _staged_note(trace)))
    experts = experts_html(trace)
    if experts:
        moe = trace.config.moe
        sections.append(("experts", f"Experts: {moe.n_experts} a layer, {moe.experts_per_token} per token", experts))
    grids = () if dry is not None else (layer_stage_grid(trace, PREFILL), layer_stage_grid(trace, DECODE))
    maps = [html_tables.time_heat_map(grid, [_label(r) for r in grid.roles]) for grid in grids if grid is not None]
    if maps:
        sections.append(("heat", "Time per layer × stage", "".join(maps) + _note(
            "each cell: that stage's own time in that layer (decode: the mean over the traced steps); hover a cell "
            "for its time.")))
    points = roofline_points(trace) if dry is None else ()
    if points:
        ceiling = (roofline.peak_flops, roofline.memory_bandwidth, roofline.hardware) if roofline else (None, None, "")
        sections.append(("roofline", "Roofline", figs.roofline(points, *ceiling) + _note(
            "measured FLOP/s against FLOPs per byte of weights and KV moved; "
            + (f"ceilings: {escape(roofline.hardware)} ({escape(roofline.compute_dtype)} peak)" if roofline
               else "no ceilings: " + escape(roofline_note or "this run was not compared with a machine")))))
    if trace.decode_steps and dry is None:
        sections.append(("decode", "Decode time per step", figs.decode_times(trace.decode_steps) + _note(
            f"mean forward {fmt.duration_ns(summary.decode.forward_ns / max(summary.decode.steps, 1))} per step "
            f"over {summary.decode.steps} steps.")))
    if trace.sampling_lesson is not None:
        sections.append(("sampling", "Sampling lesson", html_tables.lesson_table(trace.sampling_lesson) + _note(
            "the first token's logits at several temperatures; struck out: filtered out.")))
    return sections


def _journey_sections(trace: Trace, steps: list) -> list[Section]:
    """The logit lens and attention of the first journey step (the token selector swaps in the others')."""
    if not steps:
        return []
    first, numerics = steps[0], escape(numerics_note(trace.kernels))
    journey = []
    if trace.lens:
        journey.append(("lens", "Logit lens", "<div id=\"lens-view\">" + html_journey.lens_html(first["lens"])
                        + "</div>" + _note(numerics)))
    if trace.attention:
        journey.append(("attention", "Attention", "<div id=\"attention-view\">"
                        + html_journey.attention_html(first["attention"]) + "</div>" + _note(
                            "the predicted position's attention weights over every cached position (the staged "
                            "model's softmax output); hover a cell for its weight. " + numerics)))
    return journey


def _no_cache_section(trace: Trace, figs: Any) -> list[Section]:
    run = trace.no_kv_cache
    if run is None:
        return []
    return [("no-cache", "Without a KV cache", figs.no_cache_ratios(run) + _note(
        f"whole run: {run.time_ratio or 0:.1f}× the time, {run.flops_ratio or 0:.1f}× the FLOPs (estimate "
        f"{run.analytic_generation_ratio:.1f}×); a {run.horizon_tokens}-token generation: "
        f"{run.horizon_generation_ratio:.0f}× (its last step {run.horizon_step_ratio:.0f}×)."))]


def _header(trace: Trace) -> str:
    """The terminal's header lines (cli/render_run.py's render_header, render_kernel_choice), the environment, and
    the kernel details that `--detail kernels` prints."""
    cfg, env = trace.config, trace.environment
    window = f" {fmt.window_label(cfg)}" if cfg.sliding_window is not None else ""
    shape = (f"{cfg.n_layers} layers · dim {cfg.dim} · {cfg.n_heads} heads ({cfg.n_kv_heads} KV) · "
             f"FFN {cfg.ffn_dim}{window}")
    weight_format = trace.model.weight_format
    if trace.settings.dry_run:
        how = weight_format
    else:
        short = dtype_name(env.dtype)
        shown = "" if short in weight_format else f" · {short}"
        how = (f"{weight_format}{shown} · {env.device} · {env.threads} thread{'s' if env.threads != 1 else ''} · "
               f"loaded in {fmt.duration_s(trace.model.load_seconds)}")
    lines = [f"<h1 id=\"top\">{escape(cfg.name)}</h1>",
             f"<p class=\"meta\" id=\"model\"><b>{escape(cfg.name)}</b> · {escape(shape)}</p>",
             f"<p class=\"meta\" id=\"weights\">{escape(how)}</p>"]
    kernels = kernel_line(trace.kernels, dtype_name(env.dtype))
    if kernels:
        lines.append(f"<p class=\"meta\" id=\"kernels\">{escape(kernels)}</p>")
    numerics = numerics_note(trace.kernels)
    if numerics:
        lines.append(f"<p class=\"meta\" id=\"numerics\">{escape(numerics)}</p>")
    details = detail_lines(trace.kernels)
    if details:
        lines.append(f"<details><summary>kernel details (--detail kernels)</summary>"
                     f"<pre>{escape(chr(10).join(details))}</pre></details>")
    lines.append(f"<p class=\"meta\">{escape(env.device_name)} · llmtrace {escape(env.llmtrace_version)} · "
                 f"torch {escape(env.torch_version)} · prompt {escape(repr(trace.settings.prompt))}</p>")
    return "<header>" + "".join(lines) + "</header>"


def _toc(contents: list[tuple[str, str, str]]) -> str:
    items = "".join(f"<li><a href=\"#{anchor}\">{escape(title)}</a></li>" for anchor, title, _ in contents)
    return f"<nav id=\"contents\"><h2>Contents</h2><ol>{items}</ol></nav>"


def _palettes(palette: Callable[[str, int], tuple[str, ...]]) -> str:
    """The heat maps' colours (`palette`: html_figures.palette): .v0 .. (viridis, times) and .m0 .. (magma,
    attention weights)."""
    rules = []
    for cls, name in (("v", "viridis"), ("m", "magma")):
        rules += [f".{cls}{i}{{background:{c}}}" for i, c in enumerate(palette(name, html_tables.LEVELS))]
    return "\n" + "".join(rules) + "\n"


def _section(anchor: str, title: str, body: str) -> str:
    return f"<section id=\"{anchor}\"><h2>{escape(title)}</h2>{body}</section>"


def _note(text: str) -> str:
    return f"<p class=\"note\">{text}</p>" if text else ""


def _staged_note(trace: Trace) -> str:
    staged = trace.staged_decode
    if staged is None:
        return ""
    if staged.native:
        return _note("--staged: each decode step ran the native step's stages apart in C, every stage its own phase "
                     "ended by a barrier and timed there; the prefill ran the stage modules.")
    return _note(escape(f"--staged: the decode steps ran the stage modules, each wrapped ({staged.reason})."))


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
    journey = {s.step for s in trace.lens} | {a.step for a in trace.attention}
    for step in trace.steps:
        p = step.sampling.probability_raw if step.sampling is not None else step.probability
        hue = round(120 * p)  # 0 red .. 120 green
        tip = (f"token {step.step + 1} · step {step.step} ({step.phase}) · id {step.token_id} · p model "
               f"{100 * p:.1f}% · forward {fmt.duration_ns(step.forward_ns)}")
        link = f" data-token=\"{step.step + 1}\"" if step.step in journey else ""
        spans.append(f"<span style=\"background: hsl({hue}, 70%, 82%)\" title=\"{escape(tip)}\"{link}>"
                     f"{escape(fmt.piece(step.piece))}</span>")
    return f"<div class=\"stream\">{''.join(spans)}</div>"
