"""Rich rendering of a RepeatSummary (`llmtrace run --repeat K`): medians and spreads. Reads the record only."""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_run import section
from llmtrace.tracer.core.contract import role_label
from llmtrace.tracer.trace.repeat_summary import RepeatSummary, Spread, StageSpread

MAX_STAGE_ROWS = 12


def _cells(s: Spread) -> list[str]:
    return [fmt.duration_s(s.median), fmt.duration_s(s.fastest), fmt.duration_s(s.slowest),
            f"{100 * s.relative_spread:.0f}%"]


def render_repeat(console: Console, r: RepeatSummary) -> None:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name, justify in (("", "left"), ("median", "right"), ("fastest", "right"), ("slowest", "right"),
                          ("spread", "right")):
        table.add_column(name, justify=justify)
    table.add_row("time to first token", *_cells(r.ttft))
    table.add_row("  prefill forward", *_cells(r.prefill_forward))
    if r.decode_steps:
        table.add_row("decode per token", *_cells(r.decode_per_token), style="bold")
        table.add_row("  decode forward per token", *_cells(r.decode_forward_per_token))
    else:
        table.add_row("decode", "—", "", "", "", style="dim")
    body: list[object] = [table]
    if r.stages:
        where = "per decode step" if r.decode_steps else "in the prefill"
        stages = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                       title=f"{where}, all layers (slowest roles first)", title_justify="left")
        for name, justify in (("stage", "left"), ("median", "right"), ("fastest", "right"), ("slowest", "right"),
                              ("spread", "right")):
            stages.add_column(name, justify=justify)
        def spread(s: StageSpread) -> Spread:
            return s.decode_per_step if r.decode_steps else s.prefill

        ranked = sorted(r.stages, key=lambda s: -spread(s).median)
        for s in ranked[:MAX_STAGE_ROWS]:
            stages.add_row(role_label(s.role), *_cells(spread(s)))
        if len(ranked) > MAX_STAGE_ROWS:
            stages.add_row(f"… {len(ranked) - MAX_STAGE_ROWS} more", "", "", "", "")
        body.append(stages)
    body.append(Text("spread = (slowest − fastest) ÷ median over the runs; the same seed in every run, so the same "
                     "tokens and the same work", style="dim"))
    console.print(section(f"Repeated {r.repeats} times", Group(*body)))
