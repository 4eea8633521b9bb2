"""Rich rendering of a RooflineReport: the passes against the ceilings, the generation, the batch table, memory,
tensor parallelism, and a log-log roofline chart drawn in plain text. Reads the report only."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from llmtrace.tracer.roofline.analysis import BatchRow, PassBound, RooflineReport

GiB = 2**30


# ---- number formatting --------------------------------------------------------------------------------------


def si(value: float, unit: str = "") -> str:
    """1.33e10 -> '13.3 G', 312e12 -> '312 T' (decimal prefixes, three significant figures)."""
    if value == 0:
        return f"0 {unit}".strip()
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".strip()


def gb(n: float) -> str:
    """Bytes in GB (1e9) to three significant figures, MB (1e6) under 0.1 GB."""
    if n >= 1e12:
        return f"{n / 1e9:,.0f} GB"
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def ms(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:,.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def per_s(tokens: float | None) -> str:
    return "—" if tokens is None else f"{tokens:,.1f}"


# ---- tables -----------------------------------------------------------------------------------------------------


def header(report: RooflineReport) -> Text:
    m = report.machine
    tp = report.tensor_parallel.tp
    where = f"{tp} × {m.label}" if tp > 1 else m.label
    text = Text()
    text.append(f"{report.model}", style="bold")
    text.append(f" ({report.parameters / 1e9:.3g} B parameters; weights {report.weights_dtype}, "
                f"KV cache {report.kv_dtype}, activations {report.activation_dtype}) on ")
    text.append(where, style="bold")
    text.append(f"\nceilings per device: {si(m.peak_flops, 'FLOP/s')} ({m.compute_dtype}), "
                f"memory {m.memory_bandwidth / 1e12:.3g} TB/s → ridge point {m.ridge_point:,.1f} FLOPs/byte")
    origin = "--kernels" if report.kernels_from == "option" else f"default for {m.hardware}"
    text.append(f"\n{report.kernels_description} [{origin}]")
    return text


def _g(n: float) -> str:
    """A count in units of 1e9 (GB or GFLOP), three significant figures, no exponent."""
    v = n / 1e9
    if v >= 1000:
        return f"{v:,.0f}"
    if v == 0:
        return "0"
    return f"{v:.3g}" if v >= 0.001 else f"{v:.2g}"


def _ms(seconds: float) -> str:
    v = seconds * 1e3
    if v >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}" if v >= 0.001 or v == 0 else f"{v:.2g}"


def work_table(report: RooflineReport) -> Table:
    """What each pass does and moves (per device)."""
    tp = report.tensor_parallel.tp
    title = (f"What each pass does and moves (batch {report.prefill.batch}; T new tokens over S positions"
             + (f"; per device of {tp}" if tp > 1 else "") + ")")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 0, 0, 1))
    table.add_column("pass", no_wrap=True)
    for name in ("T", "S", "GFLOP", "weights\nGB", "KV read\nGB", "KV write\nGB", "activ.\nGB", "total\nGB"):
        table.add_column(name, justify="right")
    for p in _passes(report):
        table.add_row(_SHORT_NAMES.get(p.name, p.name), f"{p.new_tokens:,}", f"{p.kv_len:,}", _g(p.flops),
                      _g(p.weight_bytes), _g(p.kv_read_bytes), _g(p.kv_write_bytes), _g(p.activation_bytes),
                      _g(p.bytes))
    return table


def bound_table(report: RooflineReport) -> Table:
    """Each pass against the ceilings: intensity vs ridge, both times, the bound."""
    m = report.machine
    tp = report.tensor_parallel.tp
    table = Table(title=f"Against the ceilings (ridge point {m.ridge_point:,.1f} FLOPs/byte)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 0, 0, 1))
    table.add_column("pass", no_wrap=True)
    table.add_column("FLOPs/\nbyte", justify="right")
    table.add_column("÷ ridge", justify="right")
    table.add_column("bound")
    table.add_column("compute\nms", justify="right")
    table.add_column("memory\nms", justify="right")
    if tp > 1:
        table.add_column("all-reduce\nms", justify="right")
    table.add_column("time\nms", justify="right", style="bold")
    for p in _passes(report):
        row = [_SHORT_NAMES.get(p.name, p.name), f"{p.arithmetic_intensity:,.2f}",
               f"{p.arithmetic_intensity / m.ridge_point:.2g}",
               Text(p.bound, style="red" if p.bound == "memory" else "green"),
               _ms(p.compute_seconds), _ms(p.memory_seconds)]
        if tp > 1:
            row.append(_ms(p.comm_seconds))
        row.append(_ms(p.seconds))
        table.add_row(*row)
    return table


_SHORT_NAMES = {"first decode step": "decode 1st", "last decode step": "decode last"}


def _passes(report: RooflineReport) -> list[PassBound]:
    return [p for p in (report.prefill, report.first_decode, report.last_decode) if p is not None]


def generation_table(report: RooflineReport) -> Table:
    g = report.generation
    table = Table(title=f"Predicted generation: prompt {g.prompt_len:,} tokens, {g.new_tokens:,} new tokens, "
                        f"batch {g.batch}", title_justify="left", box=box.SIMPLE_HEAD, show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right", style="bold")
    table.add_column("how")
    table.add_row("time to first token", ms(g.ttft_seconds), f"the prefill, {report.prefill.bound}-bound")
    if g.decode_steps:
        table.add_row("time per output token", ms(g.time_per_output_token_seconds or 0.0),
                      f"mean of {g.decode_steps:,} decode steps ({g.memory_bound_decode_steps:,} memory-bound)")
        table.add_row("tokens/s per sequence", per_s(g.tokens_per_s_per_sequence), "decode steps ÷ decode time")
        table.add_row("tokens/s in total", per_s(g.tokens_per_s_total), f"× batch {g.batch}")
    else:
        table.add_row("decode", "—", "one new token: the prefill yields it, no decode step")
    table.add_row("total time", ms(g.total_seconds), "prefill + every decode step, each bounded on its own")
    return table


def why_line(report: RooflineReport) -> str:
    """The seed's question, answered with this report's numbers."""
    d = report.last_decode
    m = report.machine
    if d is None:
        return ""
    naive = 1 / d.compute_seconds if d.compute_seconds else math.inf
    return (
        f"Why decode is slow: one step does {si(d.flops, 'FLOP')} ({ms(d.compute_seconds)} at {si(m.peak_flops)}"
        f"FLOP/s, i.e. {naive:,.0f} tokens/s per sequence if compute were the limit) but must read {gb(d.bytes)} "
        f"({ms(d.memory_seconds)} at {m.memory_bandwidth / 1e12:.3g} TB/s). Its intensity, "
        f"{d.arithmetic_intensity:,.2f} FLOPs/byte, is {_versus_ridge(d.arithmetic_intensity, m.ridge_point)}: "
        f"the step is {d.bound}-bound."
    )


def _versus_ridge(intensity: float, ridge: float) -> str:
    """'153× below the ridge point' / '1.8× above the ridge point' / 'at the ridge point'."""
    if intensity == ridge:
        return "at the ridge point"
    if intensity < ridge:
        return f"{ridge / intensity:,.3g}× below the ridge point"
    return f"{intensity / ridge:,.3g}× above the ridge point"


def crossover_line(report: RooflineReport) -> str:
    c = report.crossover
    head = (
        f"Batching (decode at S={c.kv_len:,}): each sequence adds {si(c.per_sequence_flops, 'FLOP')} per step against "
        f"{gb(c.shared_bytes)} of weights read once for the whole batch, {c.per_sequence_intensity:.3g} FLOPs per "
        f"weight byte, so weights alone would keep decode memory-bound up to batch ≈ ridge ÷ that = "
        f"{c.crossover_batch_weights_only:,.0f}. "
    )
    if c.crossover_batch is None:
        return head + (
            f"But each sequence also reads its own KV cache ({gb(c.per_sequence_bytes)} per step), which caps the "
            f"intensity at {c.intensity_limit:,.1f} FLOPs/byte, under the ridge: decode stays memory-bound at any "
            f"batch at this context."
        )
    return head + (
        f"Counting each sequence's KV cache ({gb(c.per_sequence_bytes)} per step), decode becomes compute-bound "
        f"from batch {c.crossover_batch:,}."
    )


def batch_table(report: RooflineReport) -> Table:
    tp = report.tensor_parallel.tp
    table = Table(title=f"Decode step at S={report.table_kv_len:,} over batch sizes"
                        + (f" (memory per device of {tp})" if tp > 1 else ""),
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 0, 0, 1))
    for name in ("batch", "step\nms", "bound", "FLOPs/\nbyte", "tok/s\nper seq", "tok/s\ntotal", "KV\nGB",
                 "memory\nGB", "fits"):
        table.add_column(name, justify="left" if name in ("bound", "fits") else "right")
    c = report.crossover.crossover_batch
    for row in report.batch_table:
        style = "dim" if not row.fits else ("bold" if row.batch in (c, report.memory.max_batch) else "")
        table.add_row(*_batch_cells(row), style=style)
    return table


def _batch_cells(row: BatchRow) -> list[str]:
    return [f"{row.batch:,}", _ms(row.step_seconds), row.bound, f"{row.arithmetic_intensity:,.1f}",
            f"{row.tokens_per_s_per_sequence:,.1f}", f"{row.tokens_per_s_total:,.0f}", _g(row.kv_bytes_per_device),
            _g(row.memory_bytes_per_device), "yes" if row.fits else "no"]


def memory_line(report: RooflineReport) -> str:
    f = report.memory
    tp = report.tensor_parallel.tp
    per = f" per device (tp {tp})" if tp > 1 else ""
    return (
        f"Memory{per}: weights {f.weight_bytes_per_device / GiB:,.2f} GiB + KV cache "
        f"{f.kv_bytes_per_device / GiB:,.2f} GiB ({report.generation.batch} × "
        f"{report.generation.prompt_len + report.generation.decode_steps:,} positions) + largest activations "
        f"{f.activation_bytes_per_device / GiB:,.2f} GiB ({report.kernels} kernels) of "
        f"{f.capacity_bytes / GiB:,.0f} GiB; {f.free_bytes / GiB:,.2f} GiB free. "
        f"At most {f.max_batch:,} sequences of this length fit."
    )


def tp_line(report: RooflineReport) -> str:
    t = report.tensor_parallel
    if t.tp == 1:
        return ""
    n = t.tp
    return (
        f"Tensor parallelism over {n} devices ({t.interconnect}, {t.link_bandwidth_one_way * 2 / 1e9:,.0f} GB/s both "
        f"ways): {t.allreduces_per_layer} all-reduces per layer of B·T·d activations; a ring sends 2({n}-1)/{n} of "
        f"each. Prefill: {gb(t.prefill_payload_bytes)} per all-reduce, {gb(t.prefill_comm_bytes)} sent per device, "
        f"{ms(t.prefill_comm_seconds)}. Decode step: {t.decode_payload_bytes:,} B per all-reduce, "
        f"{gb(t.decode_comm_bytes_per_step)} per device, {ms(t.decode_comm_seconds_per_step)}."
    )


# ---- the chart ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChartPoint:
    mark: str
    label: str
    intensity: float
    flops_per_s: float


def chart_points(report: RooflineReport) -> list[ChartPoint]:
    points = [ChartPoint("P", "prefill", report.prefill.arithmetic_intensity, report.prefill.attainable_flops_per_s)]
    if report.first_decode:
        points.append(ChartPoint("D", f"decode step, S={report.first_decode.kv_len:,}",
                                 report.first_decode.arithmetic_intensity,
                                 report.first_decode.attainable_flops_per_s))
    if report.last_decode and report.generation.decode_steps > 1:
        points.append(ChartPoint("d", f"decode step, S={report.last_decode.kv_len:,}",
                                 report.last_decode.arithmetic_intensity, report.last_decode.attainable_flops_per_s))
    biggest = [r for r in report.batch_table if r.fits]
    if biggest and biggest[-1].batch > 1:
        row = biggest[-1]
        m = report.machine
        attainable = min(m.peak_flops, m.memory_bandwidth * row.arithmetic_intensity)
        points.append(ChartPoint("B", f"decode at batch {row.batch:,} (largest that fits), S={report.table_kv_len:,}",
                                 row.arithmetic_intensity, attainable))
    return points


def _decade_label(exponent: int, unit: str = "") -> str:
    value = 10.0**exponent
    return si(value, unit).replace(" ", "")


def roofline_chart(peak: float, bandwidth: float, points: list[ChartPoint], width: int = 60,
                   height: int = 14) -> list[Text]:
    """A log-log roofline: x = FLOPs/byte, y = attainable FLOP/s; the slanted memory roof meets the flat compute
    roof at the ridge point; each pass sits on the roof above its intensity."""
    ridge = peak / bandwidth
    xs = [p.intensity for p in points] + [ridge]
    x_lo = math.floor(math.log10(min(xs) / 2))
    x_hi = math.ceil(math.log10(max(xs) * 2))
    y_hi = math.ceil(math.log10(peak * 1.5))
    y_lo = min(math.floor(math.log10(bandwidth * 10.0**x_lo)), y_hi - 1)

    def col(x: float) -> int:
        return round((math.log10(x) - x_lo) / (x_hi - x_lo) * (width - 1))

    def row(y: float) -> int:  # 0 = bottom
        return round((math.log10(y) - y_lo) / (y_hi - y_lo) * (height - 1))

    grid = [[" "] * width for _ in range(height)]
    styles = [[""] * width for _ in range(height)]
    ridge_col = col(ridge)
    for c in range(width):
        x = 10 ** (x_lo + c / (width - 1) * (x_hi - x_lo))
        r = row(min(peak, bandwidth * x))
        if 0 <= r < height:
            grid[r][c] = "─" if c >= ridge_col else "/"
            styles[r][c] = "cyan"
    peak_row = row(peak)
    for r in range(0, min(peak_row, height)):
        if grid[r][ridge_col] == " ":
            grid[r][ridge_col], styles[r][ridge_col] = "┊", "dim"
    for p in points:
        c, r = col(p.intensity), row(p.flops_per_s)
        while 0 <= c < width - 1 and grid[min(max(r, 0), height - 1)][c] in "PDdB":
            c += 1  # two passes in one cell: put the second beside it
        r = min(max(r, 0), height - 1)
        if 0 <= c < width:
            grid[r][c], styles[r][c] = p.mark, "bold yellow"

    lines: list[Text] = []
    label_rows = {row(10.0**e): _decade_label(e) for e in range(y_lo, y_hi + 1)}
    for r in range(height - 1, -1, -1):
        line = Text(f"{label_rows.get(r, ''):>6} │")
        for c in range(width):
            line.append(grid[r][c], style=styles[r][c] or None)
        lines.append(line)
    lines.append(Text(" " * 7 + "└" + "─" * width))
    axis = [" "] * (width + 8)
    for e in range(x_lo, x_hi + 1):
        label = _decade_label(e)
        start = 8 + col(10.0**e) - len(label) // 2
        for i, ch in enumerate(label):
            if 0 <= start + i < len(axis):
                axis[start + i] = ch
    lines.append(Text("".join(axis).rstrip()))
    lines.append(Text(" " * 8 + "arithmetic intensity (FLOPs per byte moved) → ; ↑ attainable FLOP/s", style="dim"))
    return lines


def render_report(console: Console, report: RooflineReport) -> None:
    console.print(header(report))
    console.print(work_table(report))
    console.print(bound_table(report))
    console.print(generation_table(report))
    line = why_line(report)
    if line:
        console.print(line)
    console.print()
    console.print(crossover_line(report))
    console.print(batch_table(report))
    console.print(memory_line(report))
    tp = tp_line(report)
    if tp:
        console.print(tp)
    console.print()
    m = report.machine
    console.print(Text(f"Roofline of {m.hardware} ({m.compute_dtype}): ridge at {m.ridge_point:,.1f} FLOPs/byte",
                       style="bold"))
    points = chart_points(report)
    for line_text in roofline_chart(m.peak_flops, m.memory_bandwidth, points):
        console.print(line_text, no_wrap=True, overflow="crop")
    for p in points:
        console.print(f"  {p.mark} {p.label}: {p.intensity:,.2f} FLOPs/byte, ≤ {si(p.flops_per_s, 'FLOP/s')}")
    fused = report.kernels == "fused"
    console.print(
        "Times at the ceilings: max(FLOPs ÷ peak, bytes ÷ bandwidth) per pass"
        + (" + all-reduce bytes ÷ link bandwidth" if report.tensor_parallel.tp > 1 else "")
        + "; real kernels reach a share of both. FLOPs as the kernels execute them (2 per multiply-add"
        + ("; attention over the causal pairs only" if fused else "; attention over every pair, masked included")
        + "); bytes = weights once per pass + KV cache read and written + activations "
        + ("between matmul and attention kernels" if fused else "read and written once per operation")
        + ". Arithmetic intensity = FLOPs ÷ all these bytes. GB = 10⁹ bytes, GiB = 2³⁰."
    )
    for note in report.notes:
        console.print(f"Note: {note}")
