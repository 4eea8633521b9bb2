"""`llmtrace run`, after section 6: where a decode step's time goes, stage by stage (every layer's instance of a
stage together, averaged over the decode steps), with the bytes each moved and the rate it reached.

Readable at 80 columns: where the one table would not fit, the time (with its bars) and the traffic (FLOPs, bytes,
rates) become two tables with one line per stage each.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_run import PANEL_FRAME, section
from llmtrace.cli.tables import natural_width
from llmtrace.tracer.core.contract import role_label
from llmtrace.tracer.trace.records import MATMUL_KINDS, StagedDecode
from llmtrace.tracer.trace.summary import DecodeByStage


def render_decode_stages(console: Console, d: DecodeByStage | None, staged: StagedDecode | None = None) -> None:
    """`d`: tracer.trace.summary.decode_by_stage's record; nothing when the run traced no decode step. `staged`:
    how a --staged run ran its decode steps (Trace.staged_decode), said under the table."""
    if d is None:
        return
    whole = _table(d, time=True, traffic=True)
    if natural_width(console, whole) <= console.width - PANEL_FRAME:
        tables: list = [whole]
    else:  # an 80-column terminal: the time and the traffic as two tables, one line per stage in each
        tables = [_table(d, time=True, traffic=False), Text(""), _table(d, time=False, traffic=True)]
    streamed = fmt.bytes_per_s(d.weight_stream_bytes_per_second) if d.weight_stream_bytes_per_second else "-"
    note = (
        f"mean of {d.steps} decode steps{_of_all(d)}, every layer's instance of a stage together; rates = bytes "
        f"moved (weights, activations, KV) and FLOPs over the stage's own time.\n"
        f"the weight products (projections, FFN, LM head) take "
        f"{fmt.share(d.weight_products_ns_per_step, d.forward_ns_per_step)} of the forward and stream their weights "
        f"at {streamed}; the other stages move little and cost their launch overhead.\n"
        f"stages add up to {fmt.duration_ns(d.stages_ns_per_step)} of the {fmt.duration_ns(d.forward_ns_per_step)} "
        f"forward per step (the rest: Python between them)."
        + _staged_note(staged)
    )
    console.print(section(f"7 · Decode by stage  where a step's {fmt.duration_ns(d.forward_ns_per_step)} go",
                          Group(*tables, Text(note, style="dim"))))


def _table(d: DecodeByStage, time: bool, traffic: bool) -> Table:
    table = Table(show_edge=False, pad_edge=False, box=None)
    columns = [("stage", "left")]
    if time:
        columns += [("× / step", "right"), ("time / step", "right"), ("share", "right")]
    if traffic:
        columns += [("FLOPs / step", "right"), ("bytes / step", "right"), ("bytes/s", "right"), ("FLOP/s", "right")]
    if time:
        columns.append(("", "left"))
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    slowest = max(r.ns_per_step for r in d.rows) or 1
    for row in d.rows:
        style = "" if row.kind in MATMUL_KINDS else "dim"
        cells: list = [Text(role_label(row.role), style=style)]
        if time:
            cells += [str(row.calls_per_step), fmt.duration_ns(row.ns_per_step),
                      fmt.share(row.ns_per_step, d.forward_ns_per_step)]
        if traffic:
            cells += [fmt.flops(row.flops_per_step), fmt.nbytes(row.bytes_moved_per_step),
                      Text(fmt.bytes_per_s(row.bytes_per_second) if row.bytes_per_second else "-", style=style),
                      Text(fmt.flops_per_s(row.flops_per_second) if row.flops_per_second else "", style=style)]
        if time:
            cells.append(fmt.bar(row.ns_per_step / slowest, 16))
        table.add_row(*cells)
    return table


def _of_all(d: DecodeByStage) -> str:
    return f" (the {d.steps} of {d.all_steps} whose stages --trace-steps kept)" if d.steps != d.all_steps else ""


def _staged_note(staged: StagedDecode | None) -> str:
    if staged is None:
        return ""
    if staged.native:
        return ("\n--staged: each decode step ran the native step's stages apart in C, every stage its own phase "
                "ended by a barrier and timed there; the prefill ran the stage modules.")
    return f"\n--staged: the decode steps ran the stage modules, each wrapped ({staged.reason})."
