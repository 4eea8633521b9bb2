"""`llmtrace run`, from checked options to an exit code: read the prompt, then one of three runs (a batch sweep, a
tensor-parallel run, or the run on one device, rendered live), its files written as soon as it has them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from llmtrace.cli.errors import run_guarded
from llmtrace.cli.run_args import RunArgs, available_cpus
from llmtrace.tracer.core.errors import BadArgumentError

DRY_RUN_DEFAULT_PROMPT = "今天天气真"  # the seed article's example


def run_cli(raw: dict[str, Any]) -> int:
    """`run`'s parameters as typer passed them -> the exit code; bad input is one line and exit 2."""
    return run_guarded(lambda: _run_checked(RunArgs.parse(raw)))


def _run_checked(args: RunArgs) -> int:
    from llmtrace.cli.console import stdout_console
    from llmtrace.cli.pipes import PipeGuard
    from llmtrace.cli.prompt_input import resolve_prompt
    from llmtrace.cli.run_outputs import RunOutputs

    stdout = PipeGuard(sys.stdout)  # a reader that leaves (`| head -1`) must not stop the run (also under a test's main)
    to_stdout = args.outputs.to_stdout
    console = stdout_console(stderr=to_stdout, file=None if to_stdout else stdout)
    given = resolve_prompt(args.input.prompt, args.input.file, args.input.literal,
                           DRY_RUN_DEFAULT_PROMPT if args.model.dry_run else None)
    if given.source:
        console.print(f"[dim]prompt: {given.source}[/]")
    if not args.model.dry_run and not given.text:
        raise BadArgumentError("the prompt is empty; give some text, e.g. llmtrace run \"今天天气真\"")
    batch = args.input.batch
    settings = args.settings(given.text, batch_prompts(given.text, batch, args.input.file) if batch else ())
    outputs = RunOutputs(args.outputs, stdout, args.performance.repeat)
    if args.model.tune:  # time this machine's kernels first (llmtrace tune), then run with the pick
        from dataclasses import replace

        from llmtrace.cli.cmd_tune import tune_with_progress

        tune_with_progress(console, settings.model or None, settings.device, settings.threads)
        settings = replace(settings, weights="tuned")
    if args.performance.batch_sweep is not None:
        return _sweep(console, args, settings, outputs)
    if args.parallel.tp > 1 and not args.model.dry_run:
        return _tensor_parallel(console, args, settings, outputs)
    from llmtrace.cli.interrupts import stop_signals_interrupt
    from llmtrace.cli.run_live import run_live
    from llmtrace.tracer.trace.run_trace import STOP_INTERRUPTED

    with stop_signals_interrupt() as received:
        outputs.received = received
        try:
            trace = run_live(console, args, settings, outputs.save, received)
            outputs.say_written(console)
        except KeyboardInterrupt:  # while loading (nothing to keep) or after `save` (the files are whole)
            return received.exit_code
    return received.exit_code if trace.stop_reason == STOP_INTERRUPTED else 0


def _sweep(console: Any, args: RunArgs, settings: Any, outputs: Any) -> int:
    from llmtrace.cli.cmd_run_sweep import run_batch_sweep_cli
    from llmtrace.cli.interrupts import stop_signals_interrupt

    with stop_signals_interrupt() as received:
        try:
            run_batch_sweep_cli(console, settings, args.dtype, args.performance.batch_sweep or (),
                                args.input.file is not None, args.performance.repeat, outputs)
        except KeyboardInterrupt:
            return received.exit_code
    return 0


def _tensor_parallel(console: Any, args: RunArgs, settings: Any, outputs: Any) -> int:
    from llmtrace.cli.cmd_run_tp import run_tensor_parallel_cli
    from llmtrace.cli.interrupts import stop_signals_interrupt
    from llmtrace.tracer.trace.run_trace import STOP_INTERRUPTED

    with stop_signals_interrupt() as received:
        outputs.received = received
        try:
            trace, code = run_tensor_parallel_cli(console, settings, args.dtype, args.views.detail.value,
                                                  args.parallel.tp, args.parallel.tp_timeout, available_cpus(),
                                                  outputs.save)
        except KeyboardInterrupt:  # before the ranks ran (their own stop goes through the launcher's gate)
            return received.exit_code
        outputs.say_written(console)
        if trace is not None and trace.stop_reason == STOP_INTERRUPTED:
            return received.exit_code
        return code


def batch_prompts(text: str, batch: int, file: Path | None) -> tuple[str, ...]:
    """--batch N's prompts: the first N non-empty lines of --file (or of standard input), else the prompt N times."""
    if file is None:
        return (text,) * batch
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < batch:
        where = "standard input" if str(file) == "-" else str(file)
        raise BadArgumentError(f"--batch {batch} takes one prompt per line, but {where} has {len(lines)} non-empty "
                               f"line{'s' if len(lines) != 1 else ''}; give a smaller --batch or more lines")
    return tuple(lines[:batch])
