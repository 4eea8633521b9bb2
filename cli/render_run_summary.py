"""`llmtrace run`, section 7: the summary (TTFT, tokens/s, FLOPs, bytes, roofline bound, KV cache, memory, text)."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_run import section
from llmtrace.tracer.roofline.compare import MeasuredVsBound
from llmtrace.tracer.trace.records import MODULES, NATIVE, PACKED, Route, RunAhead
from llmtrace.tracer.trace.run_trace import STOP_CONTEXT_FULL, STOP_EOS, STOP_INTERRUPTED, STOP_MAX_NEW_TOKENS, Trace
from llmtrace.tracer.trace.summary import RunSummary

_STOP_TEXT = {
    STOP_EOS: "the model emitted its end-of-sequence token",
    STOP_MAX_NEW_TOKENS: "--max-new-tokens reached",
    STOP_CONTEXT_FULL: "the model's context is full",
    STOP_INTERRUPTED: "interrupted: everything traced so far is shown",
}


@dataclass(frozen=True, slots=True)
class Cell:
    """One figure of the summary table; `strong` ones are the headline (decode speed, how close to the bound), with
    plain words `after` them."""

    text: str
    strong: bool = False
    after: str = ""


def summary_rows(trace: Trace, summary: RunSummary, roofline: MeasuredVsBound | None) -> list[tuple[str, Cell, Cell]]:
    """The summary table's rows, (name, prefill, decode), for the terminal and the HTML report alike."""
    pre, dec = summary.prefill, summary.decode
    decoded = bool(dec.steps)

    def both(name: str, prefill: str, decode: str, strong: bool = False) -> tuple[str, Cell, Cell]:
        return name, Cell(prefill), Cell(decode if decoded else "-", strong and decoded)

    per = "step" if trace.batch is not None else "token"  # a batched step gives a token to every row
    rows = [both("tokens in", f"{pre.tokens_in}", f"{dec.tokens_in} ({dec.steps} steps)"),
            both("time", f"TTFT {fmt.duration_ns(summary.ttft_ns)}", f"{fmt.duration_ns(dec.step_ns_mean)} / {per}"),
            both("speed", fmt.tokens_per_s(pre.forward_tokens_per_second) if pre.forward_ns else "-",
                 fmt.tokens_per_s(summary.decode_tokens_per_second), strong=True)]
    if trace.stages:
        rows += [both("FLOPs", fmt.flops(pre.totals.flops), f"{fmt.flops(dec.flops_per_step)} / step"),
                 both("achieved", fmt.flops_per_s(pre.flops_per_second), fmt.flops_per_s(dec.flops_per_second)),
                 both("bytes read", fmt.nbytes(pre.totals.bytes_read), f"{fmt.nbytes(dec.bytes_read_per_step)} / step"),
                 both("weights + KV moved", fmt.bytes_per_s(pre.min_bytes_per_second),
                      fmt.bytes_per_s(dec.min_bytes_per_second)),
                 both("arithmetic intensity", fmt.intensity(pre.arithmetic_intensity),
                      fmt.intensity(dec.arithmetic_intensity))]
    if roofline is not None:
        rows += _roofline_rows(roofline)
    return rows


def summary_notes(trace: Trace, roofline: MeasuredVsBound | None, roofline_note: str) -> list[str]:
    """The plain lines under the summary table between the memory lines and the route (route_lines): the roofline's
    ceilings (or why there are none), tracing off, run-ahead."""
    notes = [roofline_line(roofline)] if roofline is not None else [roofline_note] if roofline_note else []
    if not trace.stages:
        notes.append("tracing was off (--no-trace): times only, no per-stage FLOPs or bytes")
    if trace.run_ahead is not None:
        notes.append(run_ahead_line(trace.run_ahead))
    return notes


def render_summary(console: Console, trace: Trace, summary: RunSummary, roofline: MeasuredVsBound | None,
                   roofline_note: str, stopped_by: str = "", detail: str = "") -> None:
    """`stopped_by`: the signal that interrupted this process's run ("Ctrl-C", "SIGTERM"; cli/interrupts.py), named
    after "interrupted"; "" when not known (a saved trace shown again). `detail` "kernels": why each backend not
    taken was not (route_lines)."""
    table = Table(show_edge=False, pad_edge=False, box=None, show_header=True)
    table.add_column("")
    table.add_column("prefill", justify="right")
    table.add_column("decode", justify="right")
    for name, *cells in summary_rows(trace, summary, roofline):
        table.add_row(name, *(f"[bold]{c.text}[/]{c.after}" if c.strong else c.text for c in cells))
    lines = memory_lines(trace, summary)
    notes = summary_notes(trace, roofline, roofline_note) + route_lines(trace.route, detail == "kernels")
    lines += [f"[dim]{escape(line)}[/]" for line in notes]
    stop = stop_text(trace.stop_reason)
    if trace.stop_reason == STOP_INTERRUPTED and stopped_by:
        stop = stop.replace("interrupted", f"interrupted ({stopped_by})", 1)
    lines.append(f"stopped: {stop} · {summary.generated_tokens} tokens generated")
    if trace.batch is not None:  # each sequence's text is in the Sequences table above
        console.print(section("8 · Summary", Group(table, Text.from_markup("\n".join(lines)))))
        return
    generated = trace.generated_text
    cut = generated.endswith("\ufffd")  # stopped inside a multi-byte character (Ctrl-C or the token limit)
    if trace.settings.chat:  # a reply, not a continuation: the two apart, as a chat shows them
        text = Text("\nprompt: ", style="dim")
        text.append(trace.settings.prompt)
        text.append("\nreply:  ", style="dim")
    else:  # the model continued the prompt: one text, the continuation highlighted
        text = Text("\n")
        text.append(trace.settings.prompt, style="dim")
    text.append(generated.rstrip("\ufffd"), style="bold green")
    if cut:
        text.append(" …(an incomplete UTF-8 character)", style="dim")
    console.print(section("8 · Summary", Group(table, Text.from_markup("\n".join(lines)), text)))


def memory_lines(trace: Trace, summary: RunSummary) -> list[str]:
    """The summary's plain lines under its table: the KV cache live of allocated with its formula, peak memory,
    and the seed of a drawn run (the terminal and the HTML report print the same ones)."""
    last = trace.steps[-1] if trace.steps else None
    rows = f"{last.batch} rows × " if last is not None and trace.batch is not None else ""
    lines = [f"KV cache: {fmt.nbytes(summary.kv_live_bytes)} live of {fmt.nbytes(summary.kv_allocated_bytes)} "
             f"allocated ({rows}{last.context_length if last else 0} positions × "
             f"{trace.config.n_layers} layers × 2 (K,V) × {trace.config.n_kv_heads} KV heads × "
             f"{trace.config.head_dim} × {trace.environment.dtype})"]
    memory = f"peak RSS {fmt.nbytes(summary.peak_rss_bytes)}"
    if summary.peak_device_bytes is not None:
        memory += f" · peak device memory {fmt.nbytes(summary.peak_device_bytes)}"
    lines.append(memory)
    settings = trace.settings
    if settings.seed is not None and settings.temperature > 0:
        lines.append(f"seed {settings.seed} (drawn: replay this run with --seed {settings.seed})"
                     if settings.seed_drawn else f"seed {settings.seed}")
        if trace.batch is not None:
            lines[-1] += f"; sequence i samples with seed {settings.seed} + i"
    return lines


def stop_text(reason: str) -> str:
    """Why the run stopped, in the user's words (a reason llmtrace does not know: as recorded)."""
    return _STOP_TEXT.get(reason, reason)


def run_ahead_line(run_ahead: RunAhead) -> str:
    """How a run's decode steps ran several to a C call (Trace.run_ahead), and what their times hold."""
    most = f"up to {run_ahead.most_steps} steps" if run_ahead.most_steps > 1 else "one step"
    return (f"the {run_ahead.steps} decode steps ran ahead in C, {run_ahead.calls} calls of {most}; a step's time "
            "is its forward and choice, without the Python after each call")


_BACKEND_WORDS = {NATIVE: "the C step", PACKED: "packed torch", MODULES: "the stage modules"}


def route_lines(route: Route | None, why: bool = False) -> list[str]:
    """The backends that ran the steps (Trace.route) in one line, and with `why` each backend not taken and why,
    and why each C call ran one step; nothing for a trace without a route (--tp, an older trace)."""
    if route is None:
        return []
    decode = _BACKEND_WORDS.get(route.decode, route.decode)
    calls = (", several steps a call" if route.ahead else ", a step a call") if route.decode == NATIVE else ""
    lines = [f"route: decode on {decode}{calls} · prefill on {_BACKEND_WORDS.get(route.prefill, route.prefill)}"]
    if why:
        lines += [f"  not {_BACKEND_WORDS.get(r.backend, r.backend)}: {r.reason}" for r in route.not_taken]
        if route.ahead_reason:
            lines.append(f"  a step a call: {route.ahead_reason}")
    return lines


def _roofline_rows(cmp: MeasuredVsBound) -> list[tuple[str, Cell, Cell]]:
    """The bound for this machine (llmtrace.tracer.roofline.compare), and how close the measured forward passes came."""
    decoding = cmp.predicted_decode_tokens_per_s is not None
    reached = cmp.decode_percent_of_bound
    return [("roofline bound", Cell(f"{cmp.prefill_bound}-bound"),
             Cell(f"{cmp.decode_bound}-bound" if decoding else "-")),
            ("roofline prediction", Cell(f"TTFT {fmt.duration_s(cmp.predicted_ttft_s)}"),
             Cell(fmt.tokens_per_s(cmp.predicted_decode_tokens_per_s) if cmp.predicted_decode_tokens_per_s else "-")),
            ("run reached", _percent(cmp.ttft_percent_of_bound),
             _percent(reached) if reached is not None else Cell("-"))]


def roofline_line(cmp: MeasuredVsBound) -> str:
    """The ceilings behind the bound, in one line."""
    note = f"; {cmp.compute_note}" if cmp.compute_note else ""
    return (f"roofline ({cmp.kernels} kernels): {cmp.hardware} {cmp.compute_dtype} peak "
            f"{fmt.flops_per_s(cmp.peak_flops)}, {fmt.bytes_per_s(cmp.memory_bandwidth)}, "
            f"ridge {fmt.intensity(cmp.ridge_point)}{note} "
            "(forward passes only; 100% = at the bound)")


def _percent(value: float) -> Cell:
    """How close the run came to the bound (100% = at the roofline)."""
    return Cell(f"{fmt.figures(value)}%", strong=True, after=" of the bound")
