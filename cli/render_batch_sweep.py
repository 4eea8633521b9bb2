"""Rich rendering of a BatchSweep (`llmtrace run --batch-sweep`): measured decode steps beside the prediction from
this machine's kernels at decode shapes and the copy + GEMM roofline, and the three crossovers. Reads the record
only; readable at 80 columns."""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_run import section
from llmtrace.tracer.run.batch_sweep import GOAL_RATIO, BatchSweep


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def _crossover(batch: float | None) -> str:
    return "none in the sweep" if batch is None else f"batch {fmt.figures(batch)}"


def render_batch_sweep(console: Console, s: BatchSweep) -> None:
    main = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                 title="decode step in ms, all sequences together: measured (median, min–max) ÷ predicted",
                 title_justify="left")
    for name in ("batch", "measured", "min–max", "kernels", "÷ kern.", "roofline", "÷ roof.", "tok/s"):
        main.add_column(name, justify="right", no_wrap=True)
    for r in s.rows:
        off = max(r.measured_over_predicted, 1 / r.measured_over_predicted) > GOAL_RATIO
        main.add_row(
            str(r.batch), _ms(r.measured_step_s), f"{r.measured_min_s * 1e3:.0f}–{r.measured_max_s * 1e3:.0f}",
            _ms(r.predicted_step_s), Text(f"{r.measured_over_predicted:.2f}", style="red" if off else "green"),
            _ms(r.roofline_step_s), f"{r.measured_over_roofline:.2f}", fmt.figures(r.measured_tokens_per_s),
        )
    parts = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                  title="the kernels' prediction, part by part (ms per step)", title_justify="left")
    for name in ("batch", "products", "other ops", "× per op", "+ context"):
        parts.add_column(name, justify="right", no_wrap=True)
    for r in s.rows:
        per_op = r.predicted_ops_s / r.predicted_ops if r.predicted_ops else 0.0
        # The context term corrects the ops' time for the sweep's contexts: it is negative where those are shorter
        # than the one the ops were measured at, so it is shown added to them, never as a time of its own.
        parts.add_row(str(r.batch), _ms(r.predicted_products_s), f"{r.predicted_ops:,}", fmt.duration_s(per_op),
                      _ms(r.predicted_ops_s + r.predicted_context_s))
    lines = [
        f"kernels: predicted from {s.ceilings} ({s.formats} products, {s.compute_dtype} activations), measured "
        f"in this run; other ops × per op + context = their time, with the attention and KV traffic of the "
        f"sweep's contexts",
        f"roofline: {s.roofline_ceilings} ({fmt.flops_per_s(s.peak_flops)}, {fmt.bytes_per_s(s.memory_bandwidth)}; "
        f"weights {s.roofline_weights}, eager kernels)",
        f"crossover: measured {_crossover(s.measured_crossover)}, predicted {_crossover(s.predicted_crossover)}, "
        f"roofline {_crossover(s.roofline_crossover)} (its exact compute = memory batch: "
        f"{s.roofline_exact_crossover if s.roofline_exact_crossover is not None else 'never'})",
        f"crossover rule: {s.crossover_rule}",
        f"worst ratio of measured to predicted: {s.worst_ratio:.2f}",
    ]
    if s.ceilings_saved_to:
        lines.append(f"ceilings saved to {s.ceilings_saved_to} (llmtrace roofline -H this-machine reads them)")
    if s.note:
        lines.append(f"ceilings not saved: {s.note}")
    body = Group(main, Text(""), parts, Text("\n".join(lines), style="dim"))
    subtitle = (f"{s.model} · {s.weights} · prompt {s.prompt_tokens} tokens · {s.decode_steps} steps × "
                f"{s.repeats} rounds")
    console.print(section("Batch sweep: decode time per step", body, subtitle=subtitle))
