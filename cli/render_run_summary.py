"""`llmtrace run`, section 7: the summary (TTFT, tokens/s, FLOPs, bytes, roofline bound, KV cache, memory, text)."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from llmtrace.cli import render_run_format as fmt
from llmtrace.cli.render_run import section
from llmtrace.tracer.roofline.compare import MeasuredVsBound
from llmtrace.tracer.trace.run_trace import STOP_CONTEXT_FULL, STOP_EOS, STOP_INTERRUPTED, STOP_MAX_NEW_TOKENS, Trace
from llmtrace.tracer.trace.summary import RunSummary

_STOP_TEXT = {
    STOP_EOS: "the model emitted its end-of-sequence token",
    STOP_MAX_NEW_TOKENS: "--max-new-tokens reached",
    STOP_CONTEXT_FULL: "the model's context is full",
    STOP_INTERRUPTED: "interrupted (Ctrl-C): everything traced so far is shown",
}


def render_summary(console: Console, trace: Trace, summary: RunSummary, roofline: MeasuredVsBound | None,
                   roofline_note: str) -> None:
    table = Table(show_edge=False, pad_edge=False, box=None, show_header=True)
    table.add_column("")
    table.add_column("prefill", justify="right")
    table.add_column("decode", justify="right")
    pre, dec = summary.prefill, summary.decode
    traced = bool(trace.stages)
    table.add_row("tokens in", f"{pre.tokens_in}", f"{dec.tokens_in} ({dec.steps} steps)")
    table.add_row("time", f"TTFT {fmt.ms(summary.ttft_ns)}",
                  f"{fmt.ms(dec.step_ns / dec.steps) if dec.steps else '-'} / token")
    table.add_row("speed", f"{pre.tokens_in / (pre.forward_ns / 1e9):.0f} tok/s" if pre.forward_ns else "-",
                  f"[bold]{summary.decode_tokens_per_second:.1f} tok/s[/]" if dec.steps else "-")
    if traced:
        table.add_row("FLOPs", fmt.flops(pre.totals.flops),
                      f"{fmt.flops(dec.totals.flops / dec.steps)} / step" if dec.steps else "-")
        table.add_row("achieved", fmt.flops_per_second(pre.flops_per_second),
                      fmt.flops_per_second(dec.flops_per_second) if dec.steps else "-")
        table.add_row("bytes read", fmt.nbytes(pre.totals.bytes_read),
                      f"{fmt.nbytes(dec.bytes_read_per_step)} / step" if dec.steps else "-")
        table.add_row("weights + KV moved", fmt.bytes_per_second(pre.min_bytes_per_second),
                      fmt.bytes_per_second(dec.min_bytes_per_second) if dec.steps else "-")
        table.add_row("arithmetic intensity", f"{pre.arithmetic_intensity:.1f} FLOP/B",
                      f"{dec.arithmetic_intensity:.2f} FLOP/B" if dec.steps else "-")
    if roofline is not None:
        _roofline_rows(table, roofline)
    kv_line = (f"KV cache: {fmt.nbytes(summary.kv_live_bytes)} live of {fmt.nbytes(summary.kv_allocated_bytes)} "
               f"allocated ({trace.steps[-1].context_length if trace.steps else 0} positions × "
               f"{trace.config.n_layers} layers × 2 (K,V) × {trace.config.n_kv_heads} KV heads × "
               f"{trace.config.head_dim} × {trace.environment.dtype})")
    memory = f"peak RSS {fmt.nbytes(summary.peak_rss_bytes)}"
    if summary.peak_device_bytes is not None:
        memory += f" · peak device memory {fmt.nbytes(summary.peak_device_bytes)}"
    lines = [kv_line, memory]
    settings = trace.settings
    if settings.seed is not None and settings.temperature > 0:
        lines.append(f"seed {settings.seed} (drawn: replay this run with --seed {settings.seed})"
                     if settings.seed_drawn else f"seed {settings.seed}")
    if roofline is not None:
        lines.append(f"[dim]{roofline_line(roofline)}[/]")
    if roofline is None and roofline_note:
        lines.append(f"[dim]{roofline_note}[/]")
    if not traced:
        lines.append("[dim]tracing was off (--no-trace): times only, no per-stage FLOPs or bytes[/]")
    stop = _STOP_TEXT.get(trace.stop_reason, trace.stop_reason)
    lines.append(f"stopped: {stop} · {summary.generated_tokens} tokens generated")
    text = Text("\n")
    text.append(trace.settings.prompt, style="dim")
    generated = trace.generated_text
    cut = generated.endswith("\ufffd")  # stopped inside a multi-byte character (Ctrl-C or the token limit)
    text.append(generated.rstrip("\ufffd"), style="bold green")
    if cut:
        text.append(" …(an incomplete UTF-8 character)", style="dim")
    console.print(section("7 · Summary", Group(table, Text.from_markup("\n".join(lines)), text)))


def _roofline_rows(table: Table, cmp: MeasuredVsBound) -> None:
    """The bound for this machine (llmtrace.tracer.roofline.compare), and how close the measured forward passes came."""
    decoding = cmp.predicted_decode_tokens_per_s is not None
    table.add_row("roofline bound", f"{cmp.prefill_bound}-bound", f"{cmp.decode_bound}-bound" if decoding else "-")
    table.add_row("roofline prediction", f"TTFT {fmt.ms(cmp.predicted_ttft_s * 1e9)}",
                  f"{cmp.predicted_decode_tokens_per_s:.1f} tok/s" if decoding else "-")
    table.add_row("run reached", _percent(cmp.ttft_percent_of_bound),
                  _percent(cmp.decode_percent_of_bound) if cmp.decode_percent_of_bound is not None else "-")


def roofline_line(cmp: MeasuredVsBound) -> str:
    """The ceilings behind the bound, in one line."""
    note = f"; {cmp.compute_note}" if cmp.compute_note else ""
    return (f"roofline ({cmp.kernels} kernels): {cmp.hardware} {cmp.compute_dtype} peak {fmt.flops_per_second(cmp.peak_flops)}, "
            f"{fmt.bytes_per_second(cmp.memory_bandwidth)}, ridge {cmp.ridge_point:.1f} FLOP/B{note} "
            "(forward passes only; 100% = at the bound)")


def _percent(value: float) -> str:
    """How close the run came to the bound (100% = at the roofline)."""
    return f"[bold]{value:.0f}%[/] of the bound"
