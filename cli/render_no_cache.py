"""Section 8 of `llmtrace run --no-kv-cache`: the run again without a KV cache, step by step beside the cached run
(a NoCacheRun record): measured time, counted FLOPs, the analytic ratio, and the article's "1000x" checked."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_run import section
from llmtrace.tracer.trace.journey_records import NoCacheRun, NoCacheStep

HEAD_ROWS, TAIL_ROWS = 4, 4  # a long run shows its first and last steps


def render_no_cache(console: Console, run: NoCacheRun | None) -> None:
    if run is None or not run.steps:
        return
    table = Table(show_edge=False, pad_edge=False, box=None)
    for name in ("step", "tokens", "cached", "no cache", "×time", "FLOPs", "×FLOPs", "×est."):
        table.add_column(name, justify="right", no_wrap=True)
    steps = run.steps
    shown: list[NoCacheStep | None] = list(steps)
    if len(steps) > HEAD_ROWS + TAIL_ROWS + 1:
        shown = [*steps[:HEAD_ROWS], None, *steps[-TAIL_ROWS:]]
    for s in shown:
        if s is None:
            table.add_row("…", *[""] * 7)
            continue
        mark = "" if s.same_token else " ≠"
        table.add_row(f"{'prefill' if s.step == 0 else s.step}{mark}", str(s.positions),
                      fmt.duration_ns(s.cached_forward_ns), fmt.duration_ns(s.forward_ns), _ratio(s.time_ratio),
                      fmt.flops(s.flops), _ratio(s.flops_ratio), _ratio(s.analytic_ratio))
    table.add_row("all", "", fmt.duration_ns(run.cached_forward_ns), fmt.duration_ns(run.forward_ns),
                  _ratio(run.time_ratio), fmt.flops(run.flops), _ratio(run.flops_ratio),
                  _ratio(run.analytic_generation_ratio), style="bold")
    differ = [s.step for s in steps if not s.same_token]
    notes = [
        "each step recomputes the prompt and every token so far (tokens) in one cache-free pass, instead of one "
        "token reading the cache. cached / no cache: forward time measured; FLOPs: counted by the tracer without "
        f"the cache (with it: {fmt.flops(run.cached_flops)} in all); ×: without / with, ×est. the analytic "
        "estimate (attention dense as executed)." + ("" if run.complete else " [yellow]interrupted: the steps finished so "
                                                                    "far[/]"),
        (f"[yellow]steps {', '.join(map(str, differ))} (≠): the recomputed logits picked another token[/]" if differ
         else "every step's recomputed logits pick the cached run's token."),
        f"\"about 1000x for 1000 tokens\"? For this model the estimate says {fmt.times(run.horizon_step_ratio)} for "
        f"the step at t = {run.horizon_tokens}, but {fmt.times(run.horizon_generation_ratio)} over a whole "
        f"{run.horizon_tokens}-token generation from this prompt: early steps save far less than the last.",
    ]
    console.print(section("8 · Without a KV cache  the same tokens, everything recomputed each step",
                          Group(table, Text.from_markup("\n".join(notes)))))


def _ratio(value: float | None) -> str:
    return "-" if value is None else fmt.times(value)
