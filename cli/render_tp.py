"""The tensor-parallel section of `llmtrace run --tp N`: measured communication beside roofline --tp's prediction,
each rank's work; for `--dry-run --tp N`, rank 0's pass beside the analytic per-device figures and each collective's
bytes. Renders engine records only (tracer/trace/tp_summary.py)."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_run import section
from llmtrace.tracer.trace.records import PREFILL
from llmtrace.tracer.trace.tp_records import STATUS_OK
from llmtrace.tracer.trace.tp_summary import RankPass, TensorParallelSummary


def _phase_name(phase: str) -> str:
    return "prefill" if phase == PREFILL else "decode"


def render_tensor_parallel(console: Console, summary: TensorParallelSummary | None) -> None:
    if summary is None:
        return
    comm = Table(box=None, pad_edge=False, show_edge=False)
    comm.add_column("communication")
    for phase in summary.phases:
        comm.add_column(f"{_phase_name(phase.phase)} (per step)", justify="right")
    rows = [
        ("collectives", lambda p: str(p.collectives_per_step)),
        ("all-reduce payload", lambda p: fmt.nbytes(p.layer_allreduce_payload_bytes)),
        ("one layer all-reduce, measured", lambda p: fmt.duration_ns(p.measured_layer_allreduce_ns)),
        ("  roofline --tp predicts", lambda p: fmt.duration_ns(p.predicted_layer_allreduce_ns)),
        ("  with measured latency", lambda p: fmt.duration_ns(p.latency_aware_layer_allreduce_ns)),
        ("layer all-reduces, measured", lambda p: fmt.duration_ns(p.measured_layer_ns_per_step)),
        ("  roofline --tp predicts", lambda p: fmt.duration_ns(p.predicted_layer_ns_per_step)),
        ("all collectives, measured", lambda p: fmt.duration_ns(p.measured_comm_ns_per_step)),
        ("  share of the forward", lambda p: f"{100 * p.comm_share:.0f} %"),
        ("per token, measured", lambda p: fmt.duration_ns(p.measured_comm_ns_per_token)),
        ("per token, roofline --tp", lambda p: fmt.duration_ns(p.predicted_comm_ns_per_token)),
    ]
    for label, cell in rows:
        comm.add_row(label, *(cell(p) for p in summary.phases))
    ranks = Table(box=None, pad_edge=False, show_edge=False)
    for name in ("rank", "prefill FLOPs", "decode FLOPs/step", "weights read/step", "sent/step", "peak RSS"):
        ranks.add_column(name, justify="right")
    for r in summary.ranks:
        ranks.add_row(str(r.rank), fmt.flops(r.prefill_flops), fmt.flops(r.decode_flops_per_step),
                      fmt.nbytes(r.weight_bytes_per_decode_step), fmt.nbytes(r.bytes_sent_per_decode_step),
                      fmt.nbytes(r.peak_rss_bytes) if r.peak_rss_bytes else "-")
    backend = "shared memory (gloo past 1 MiB)" if summary.backend == "shm" else summary.backend
    link = (f"link: {backend}, measured in this run: {fmt.bytes_per_s(summary.bus_bandwidth)} bus bandwidth "
            f"(4 MiB all-reduce), {fmt.duration_s(summary.small_allreduce_seconds)} per decode-sized all-reduce. "
            "roofline --tp counts bandwidth only (no latency), two all-reduces per layer.")
    parts: list[object] = [comm, Text(""), ranks, Text(link, style="dim")]
    if summary.status != STATUS_OK:
        parts.append(Text(summary.status, style="bold red"))
    console.print(section(f"Tensor parallel · {summary.tp} ranks", Group(*parts)))


def render_tp_dry_run(console: Console, passes: tuple[RankPass, ...], tp: int) -> None:
    if not passes:
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    table.add_column("per rank")
    for p in passes:
        table.add_column(f"{_phase_name(p.phase)} (T={p.new_tokens})", justify="right")
    table.add_row("FLOPs traced (rank 0)", *(fmt.flops(p.traced_flops) for p in passes))
    table.add_row("FLOPs, roofline --tp", *(fmt.flops(p.analytic_flops) for p in passes))
    table.add_row("  equal", *("yes" if p.equal else "NO" for p in passes))
    table.add_row("  of which replicated", *(fmt.flops(p.replicated_flops) for p in passes))
    table.add_row("one device's FLOPs", *(fmt.flops(p.single_device_flops) for p in passes))
    table.add_row("weights read", *(fmt.nbytes(p.weight_bytes) for p in passes))
    coll = Table(box=None, pad_edge=False, show_edge=False)
    for name in ("collective", "after", "per pass", "payload", "sent/rank"):
        coll.add_column(name, justify="left" if name in ("collective", "after") else "right")
    for p in passes:
        coll.add_row(Text(_phase_name(p.phase), style="bold"), "", "", "", "")
        for c in p.collectives:
            coll.add_row(c.kind, c.after, str(c.per_pass), fmt.nbytes(c.payload_bytes), fmt.nbytes(c.bytes_sent))
    note = Text(f"every rank holds rank 0's shapes (shown above); N x per-rank FLOPs minus (N-1) x the replicated "
                f"norms and residual adds is one device's count. Sent: a ring's 2(N-1)/N of an all-reduce, (N-1) "
                f"slices of an all-gather.", style="dim")
    console.print(section(f"Tensor parallel · {tp} ranks (dry run)", Group(table, Text(""), coll, note)))
