"""Rich rendering of a RooflineReport: the passes against the ceilings, the generation, the batch table, memory,
tensor parallelism, and a log-log roofline chart drawn in plain text. Reads the report only."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.tables import report_table
from llmtrace.tracer.roofline.analysis import BatchRow, PassBound, RooflineReport

_SHORT_NAMES = {"first decode step": "decode 1st", "last decode step": "decode last"}


def _passes(report: RooflineReport) -> list[PassBound]:
    return [p for p in (report.prefill, report.first_decode, report.last_decode) if p is not None]


def header(report: RooflineReport, width: int) -> Text:
    """Model, dtypes and device; the ceilings; the kernels: each line broken only between phrases at `width`."""
    m = report.machine
    tp = report.tensor_parallel.tp
    where = f"{tp} × {m.label}" if tp > 1 else m.label
    whose = {"checkpoint": " (the checkpoint's)", "file": " (the file's, each tensor at its stored size)"}.get(
        report.weights_dtype_from, "")
    active = (f", {fmt.si(report.active_parameters, '')} active" if report.active_parameters != report.parameters
              else "")
    origin = "--kernels" if report.kernels_from == "option" else f"default for {m.hardware}"
    kernels = report.kernels_description.split(", ")
    lines = [
        [f"[bold]{escape(report.model)}[/] ({fmt.si(report.parameters, '')} parameters{active};",
         f"weights {report.weights_dtype}{whose},", f"KV cache {report.kv_dtype},",
         f"activations {report.activation_dtype})", f"on [bold]{escape(where)}[/]"],
        [f"ceilings per device: {fmt.flops_per_s(m.peak_flops)} ({m.compute_dtype}),",
         f"memory {fmt.bytes_per_s(m.memory_bandwidth)}", f"→ ridge point {fmt.intensity(m.ridge_point)}"],
        [*(part + "," for part in kernels[:-1]), f"{kernels[-1]} \\[{escape(origin)}]"],
    ]
    return Text.from_markup("\n".join(fmt.flow(line, width) for line in lines))


def _giga(n: float) -> str:
    """A count in units of 1e9 (a GB or GFLOP column): exact, so four significant figures."""
    return fmt.number_in(n, "G", fmt.EXACT)


def _ms(seconds: float) -> str:
    return fmt.number_in(seconds, "ms")


def work_title(report: RooflineReport) -> str:
    tp = report.tensor_parallel.tp
    return (f"What each pass does and moves (batch {report.prefill.batch}; T new tokens over S positions"
            + (f"; per device of {tp}" if tp > 1 else "") + ")")


def work_table(report: RooflineReport) -> Table:
    """What each pass does and moves (per device)."""
    table = report_table()
    table.add_column("pass", no_wrap=True)
    for name in ("T", "S", "GFLOP", "weights\nGB", "KV read\nGB", "KV write\nGB", "activ.\nGB", "total\nGB"):
        table.add_column(name, justify="right", no_wrap=True)
    for p in _passes(report):
        table.add_row(_SHORT_NAMES.get(p.name, p.name), fmt.count(p.new_tokens), fmt.count(p.kv_len),
                      _giga(p.flops), _giga(p.weight_bytes), _giga(p.kv_read_bytes), _giga(p.kv_write_bytes),
                      _giga(p.activation_bytes), _giga(p.bytes))
    return table


def bound_title(report: RooflineReport) -> str:
    return f"Against the ceilings (ridge point {fmt.intensity(report.machine.ridge_point)})"


def bound_table(report: RooflineReport) -> Table:
    """Each pass against the ceilings: intensity vs ridge, both times, the bound."""
    tp = report.tensor_parallel.tp
    table = report_table()
    table.add_column("pass", no_wrap=True)
    table.add_column("FLOP/B", justify="right", no_wrap=True)
    table.add_column("÷ ridge", justify="right", no_wrap=True)
    table.add_column("bound", no_wrap=True)
    table.add_column("compute\nms", justify="right", no_wrap=True)
    table.add_column("memory\nms", justify="right", no_wrap=True)
    if tp > 1:
        table.add_column("all-reduce\nms", justify="right", no_wrap=True)
    table.add_column("time\nms", justify="right", style="bold", no_wrap=True)
    for p in _passes(report):
        row = [_SHORT_NAMES.get(p.name, p.name), fmt.figures(p.arithmetic_intensity),
               fmt.figures(p.intensity_vs_ridge), Text(p.bound, style="red" if p.bound == "memory" else "green"),
               _ms(p.compute_seconds), _ms(p.memory_seconds)]
        if tp > 1:
            row.append(_ms(p.comm_seconds))
        row.append(_ms(p.seconds))
        table.add_row(*row)
    return table


def generation_title(report: RooflineReport) -> str:
    g = report.generation
    return (f"Predicted generation: prompt {fmt.count(g.prompt_len)} tokens, {fmt.count(g.new_tokens)} new tokens, "
            f"batch {g.batch}")


def generation_table(report: RooflineReport) -> Table:
    g = report.generation
    table = report_table(show_header=False)
    table.add_column("what", no_wrap=True)
    table.add_column("value", justify="right", style="bold", no_wrap=True)
    table.add_column("how")
    table.add_row("time to first token", fmt.duration_s(g.ttft_seconds), f"the prefill, {report.prefill.bound}-bound")
    if g.decode_steps:
        table.add_row("time per output token", fmt.duration_s(g.time_per_output_token_seconds or 0.0),
                      f"mean of {fmt.count(g.decode_steps)} decode steps "
                      f"({fmt.count(g.memory_bound_decode_steps)} memory-bound)")
        table.add_row("tokens/s per sequence", _rate(g.tokens_per_s_per_sequence), "decode steps ÷ decode time")
        table.add_row("tokens/s in total", _rate(g.tokens_per_s_total), f"× batch {g.batch}")
    else:
        table.add_row("decode", "—", "one new token: the prefill yields it, no decode step")
    table.add_row("total time", fmt.duration_s(g.total_seconds), "prefill + every decode step, each bounded on its own")
    return table


def _rate(tokens_per_s: float | None) -> str:
    return "—" if tokens_per_s is None else fmt.figures(tokens_per_s)


def why_line(report: RooflineReport) -> str:
    """The seed's question, answered with this report's numbers."""
    d = report.last_decode
    m = report.machine
    if d is None:
        return ""
    return (
        f"Why decode is slow: one step does {fmt.flops(d.flops)} ({fmt.duration_s(d.compute_seconds)} at "
        f"{fmt.flops_per_s(m.peak_flops)}, i.e. {fmt.figures(d.passes_per_s_at_peak)} tokens/s per sequence if "
        f"compute were the limit) but must read {fmt.nbytes(d.bytes)} ({fmt.duration_s(d.memory_seconds)} at "
        f"{fmt.bytes_per_s(m.memory_bandwidth)}). Its intensity, {fmt.intensity(d.arithmetic_intensity)}, is "
        f"{_versus_ridge(d.intensity_vs_ridge)}: the step is {d.bound}-bound."
    )


def _versus_ridge(intensity_vs_ridge: float) -> str:
    """'153× below the ridge point' / '1.80× above the ridge point' / 'at the ridge point'."""
    if intensity_vs_ridge == 1:
        return "at the ridge point"
    if intensity_vs_ridge < 1:
        return f"{fmt.times(1 / intensity_vs_ridge)} below the ridge point"
    return f"{fmt.times(intensity_vs_ridge)} above the ridge point"


def crossover_line(report: RooflineReport) -> str:
    if report.moe is not None:  # the weights read grow with the batch: no one crossover
        moe = report.moe
        at = ", ".join(f"{fmt.figures(r.expected_experts)} at batch {r.batch}" for r in moe.reads)
        return (f"Batching a mixture of experts (decode at S={fmt.count(report.table_kv_len)}): a step reads the "
                f"experts its batch touches, E·(1 − (1 − k/E)^B) of E = {moe.n_experts} a layer if routing is "
                f"uniform ({at}), so the weights read grow with the batch until every expert is read; the table "
                "below costs each batch with its own.")
    c = report.crossover
    head = (
        f"Batching (decode at S={fmt.count(c.kv_len)}): each sequence adds {fmt.flops(c.per_sequence_flops)} per "
        f"step against {fmt.nbytes(c.shared_bytes)} of weights read once for the whole batch, "
        f"{fmt.intensity(c.per_sequence_intensity)} of weights, so weights alone would keep decode memory-bound up "
        f"to batch ≈ ridge ÷ that = {fmt.figures(c.crossover_batch_weights_only)}. "
    )
    if c.crossover_batch is None:
        return head + (
            f"But each sequence also reads its own KV cache ({fmt.nbytes(c.per_sequence_bytes)} per step), which "
            f"caps the intensity at {fmt.intensity(c.intensity_limit)}, under the ridge: decode stays memory-bound "
            f"at any batch at this context."
        )
    return head + (
        f"Counting each sequence's KV cache ({fmt.nbytes(c.per_sequence_bytes)} per step), decode becomes "
        f"compute-bound from batch {fmt.count(c.crossover_batch)}."
    )


def batch_title(report: RooflineReport) -> str:
    tp = report.tensor_parallel.tp
    return (f"Decode step at S={fmt.count(report.table_kv_len)} over batch sizes"
            + (f" (memory per device of {tp})" if tp > 1 else ""))


def batch_table(report: RooflineReport) -> Table:
    table = report_table()
    for name in ("batch", "step\nms", "bound", "FLOP/B", "tok/s\nper seq", "tok/s\ntotal", "KV\nGB",
                 "memory\nGB", "fits"):
        table.add_column(name, justify="left" if name in ("bound", "fits") else "right", no_wrap=True)
    c = report.crossover.crossover_batch
    for row in report.batch_table:
        style = "dim" if not row.fits else ("bold" if row.batch in (c, report.memory.max_batch) else "")
        table.add_row(*_batch_cells(row), style=style)
    return table


def _batch_cells(row: BatchRow) -> list[str]:
    return [fmt.count(row.batch), _ms(row.step_seconds), row.bound, fmt.figures(row.arithmetic_intensity),
            fmt.figures(row.tokens_per_s_per_sequence), fmt.figures(row.tokens_per_s_total),
            _giga(row.kv_bytes_per_device), _giga(row.memory_bytes_per_device), "yes" if row.fits else "no"]


def kernel_decode_parts(report: RooflineReport) -> list:
    """This machine's decode from kernels measured at decode shapes, or which ceilings the figures above stand on
    (measured profiles only: a datasheet profile has nothing else)."""
    k = report.kernel_decode
    if k is None:
        if not report.machine.measured:
            return []
        return [Text(f"\nDecode ceilings: {report.decode_ceilings} (no kernels measured at decode shapes for this "
                     f"model and weights here; `llmtrace run --batch-sweep 1,2,4,8,16,32,64` measures them)")]
    first, last = k.first_step, k.last_step
    head = Text(f"\nDecode from {k.ceilings} ({k.weights}: {k.formats}; batches "
                f"{', '.join(map(str, k.measured_batches))} measured {k.measured_at})", style="bold")
    step = Text(
        f"batch {fmt.count(first.batch)}, first step: products {_ms(first.products_seconds)} ms + "
        f"{fmt.count(first.ops)} other ops × {fmt.duration_s(first.op_seconds)} = {_ms(first.ops_seconds)} ms + "
        f"context {_ms(first.context_seconds)} ms = {_ms(first.seconds)} ms; last step {_ms(last.seconds)} ms; "
        f"mean {_ms(k.time_per_output_token_seconds)} ms → {fmt.tokens_per_s(k.tokens_per_s_per_sequence)} per "
        f"sequence, {fmt.tokens_per_s(k.tokens_per_s_total)} in all (the copy + GEMM roofline above: "
        f"{_ms(report.generation.time_per_output_token_seconds or 0.0)} ms)")
    table = report_table()
    for name in ("batch", "step\nms", "products\nms", "other ops\nms", "tok/s\nper seq", "tok/s\ntotal",
                 "roofline\nms"):
        table.add_column(name, justify="right", no_wrap=True)
    roof = {row.batch: row.step_seconds for row in report.batch_table}
    for row in k.table:
        table.add_row(fmt.count(row.batch) + ("" if not row.interpolated else "*"), _ms(row.seconds),
                      _ms(row.products_seconds), _ms(row.ops_seconds), fmt.figures(1 / row.seconds),
                      fmt.figures(row.batch / row.seconds), _ms(roof[row.batch]),
                      )
    crossing = ("none within the table" if k.crossover_batch is None else f"batch {fmt.figures(k.crossover_batch)}")
    foot = Text(f"* between or beyond the measured batches (interpolated linearly). Crossover: {crossing} "
                f"({k.crossover_rule}).")
    return [head, step, table, foot]


def memory_line(report: RooflineReport) -> str:
    f = report.memory
    tp = report.tensor_parallel.tp
    per = f" per device (tp {tp})" if tp > 1 else ""
    return (
        f"Memory{per}: weights {fmt.gib(f.weight_bytes_per_device)} + KV cache {fmt.gib(f.kv_bytes_per_device)} "
        f"({f.batch} × {fmt.count(f.positions)} positions) + largest activations "
        f"{fmt.gib(f.activation_bytes_per_device)} ({report.kernels} kernels) of {fmt.gib(f.capacity_bytes)}; "
        f"{fmt.gib(f.free_bytes)} free. At most {fmt.count(f.max_batch)} sequences of this length fit."
    )


def tp_line(report: RooflineReport) -> str:
    t = report.tensor_parallel
    if t.tp == 1:
        return ""
    n = t.tp
    return (
        f"Tensor parallelism over {n} devices ({t.interconnect}, {fmt.bytes_per_s(t.link_bandwidth)} both ways): "
        f"{t.allreduces_per_layer} all-reduces per layer of B·T·d activations; a ring sends 2({n}-1)/{n} of each. "
        f"Prefill: {fmt.nbytes(t.prefill_payload_bytes)} per all-reduce, {fmt.nbytes(t.prefill_comm_bytes)} sent per "
        f"device, {fmt.duration_s(t.prefill_comm_seconds)}. Decode step: {fmt.nbytes(t.decode_payload_bytes)} per "
        f"all-reduce, {fmt.nbytes(t.decode_comm_bytes_per_step)} per device, "
        f"{fmt.duration_s(t.decode_comm_seconds_per_step)}."
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
        points.append(ChartPoint("D", f"decode step, S={fmt.count(report.first_decode.kv_len)}",
                                 report.first_decode.arithmetic_intensity,
                                 report.first_decode.attainable_flops_per_s))
    if report.last_decode and report.generation.decode_steps > 1:
        points.append(ChartPoint("d", f"decode step, S={fmt.count(report.last_decode.kv_len)}",
                                 report.last_decode.arithmetic_intensity, report.last_decode.attainable_flops_per_s))
    biggest = [r for r in report.batch_table if r.fits]
    if biggest and biggest[-1].batch > 1:
        row = biggest[-1]
        points.append(ChartPoint("B", f"decode at batch {fmt.count(row.batch)} (largest that fits), "
                                      f"S={fmt.count(report.table_kv_len)}",
                                 row.arithmetic_intensity, row.attainable_flops_per_s))
    return points


def _decade_label(exponent: int, unit: str = "") -> str:
    value = 10.0**exponent
    return fmt.si(value, unit, digits=1).replace(" ", "")


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
    m = report.machine
    parts: list = [header(report, console.width)]
    for title, table in ((work_title(report), work_table(report)), (bound_title(report), bound_table(report)),
                         (generation_title(report), generation_table(report))):
        parts += [Text("\n" + title), table]
    line = why_line(report)
    if line:
        parts.append(Text("\n" + line))
    parts += [Text("\n" + crossover_line(report)), Text("\n" + batch_title(report)), batch_table(report)]
    parts += kernel_decode_parts(report)
    parts.append(Text(memory_line(report)))
    tp = tp_line(report)
    if tp:
        parts.append(Text(tp))
    parts.append(Text(f"\nRoofline of {m.hardware} ({m.compute_dtype}): ridge at {fmt.intensity(m.ridge_point)}",
                      style="bold"))
    points = chart_points(report)
    chart = roofline_chart(m.peak_flops, m.memory_bandwidth, points)
    for line_text in chart:
        line_text.no_wrap, line_text.overflow = True, "crop"
    parts += chart
    parts += [Text(f"  {p.mark} {p.label}: {fmt.intensity(p.intensity)}, ≤ {fmt.flops_per_s(p.flops_per_s)}")
              for p in points]
    fused = report.kernels == "fused"
    parts.append(Text(
        "Times at the ceilings: max(FLOPs ÷ peak, bytes ÷ bandwidth) per pass"
        + (" + all-reduce bytes ÷ link bandwidth" if report.tensor_parallel.tp > 1 else "")
        + "; real kernels reach a share of both. FLOPs as the kernels execute them (2 per multiply-add"
        + ("; attention over the causal pairs only" if fused else "; attention over every pair, masked included")
        + "); bytes = weights once per pass + KV cache read and written + activations "
        + ("between matmul and attention kernels" if fused else "read and written once per operation")
        + ". Arithmetic intensity = FLOPs ÷ all these bytes. GB = 10⁹ bytes, GiB = 2³⁰."
    ))
    parts += [Text(f"Note: {note}") for note in report.notes]
    console.print(Group(*parts))
