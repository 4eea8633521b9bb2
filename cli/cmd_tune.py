"""`llmtrace tune`: time this model's products on this machine, once, and save the fastest acceptable kernels for
`llmtrace run --weights tuned` (tracer/load/kernel_pick.py's tune). A run never measures by itself: without
`--weights tuned` it runs the default table (README "Default kernels")."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console

from llmtrace.cli.app import app
from llmtrace.cli.errors import run_guarded


@app.command("tune", epilog="\b\nExamples:\n  llmtrace tune\n  llmtrace tune --model llama-7b.Q4_0.gguf\n"
                            "  llmtrace run capital --weights tuned")
def tune_command(
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m", metavar="<path>",
        help="A .gguf file or HF model folder (default: the bundled SmolLM2-135M-Instruct).")] = None,
    device: Annotated[str, typer.Option(metavar="<cpu|cuda>", help="Where the products run.")] = "cpu",
    threads: Annotated[Optional[int], typer.Option(
        metavar="<n>", help="torch CPU threads (the saved pick is for this count).")] = None,
) -> None:
    """Time this model's kernels on this machine (seconds; one layer's products and the LM head, each candidate)
    and save the fastest acceptable for `run --weights tuned`."""

    def body() -> None:
        from llmtrace.cli.console import stdout_console

        tune_with_progress(stdout_console(), model, device, threads)

    run_guarded(body)


def tune_with_progress(console: Console, model: str | None, device: str, threads: int | None) -> None:
    """Tune with a progress bar (candidates done of all), then the pick in a few lines and where it was saved."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    import torch

    from llmtrace.cli.render_kernels import detail_lines
    from llmtrace.tracer.checkpoint.resolve import bundled_source, classify_model, resolve_model
    from llmtrace.tracer.core.errors import BadArgumentError
    from llmtrace.tracer.load import kernel_pick

    source = classify_model(model) if model else bundled_source()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise BadArgumentError(f"unknown device {device!r}; use cpu or cuda") from exc
    resolved = resolve_model(source, vocabulary=True)
    columns = (TextColumn("tune"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("", total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        tuned = kernel_pick.tune(resolved, target, progress)
    if tuned.note:
        console.print(f"[yellow]note:[/] {tuned.note}", soft_wrap=True)
    for line in detail_lines(tuned.choice):
        console.print(line, markup=False, highlight=False)
    where = f"saved to {tuned.saved_to}" if tuned.saved_to else "not saved"
    console.print(f"[dim]{where}; `llmtrace run --weights tuned` runs it (a run without it runs the defaults)[/]")
