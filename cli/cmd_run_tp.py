"""`llmtrace run --tp N` (N > 1): the generation over N ranks (tracer/run/tp_launch.py), rendered when it ends.

The ranks run in their own processes, so nothing streams live: a status line follows rank 0's steps, then the run is
shown from its merged trace (rank 0's view of every section, as `llmtrace show` would), with the tensor-parallel
section after the summary. A failed rank: the partial trace is saved and shown, then one line on stderr, exit 1.
"""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from typing import Any, Callable

from rich.console import Console

from llmtrace.cli.render_run_report import render_ending, render_journey
from llmtrace.cli.render_tp import render_tensor_parallel
from llmtrace.tracer.trace.records import RunSettings
from llmtrace.tracer.trace.report import run_report
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.summary_block import summary_block
from llmtrace.tracer.trace.tp_records import STATUS_OK
from llmtrace.tracer.trace.tp_summary import tensor_parallel_summary

EXIT_RANK_FAILED = 1


def threads_per_rank(settings: RunSettings, tp: int, cpus: int) -> tuple[int, str]:
    """--threads per rank, or the CPUs shared out (at least 1 each); a note when N ranks oversubscribe them."""
    threads = settings.threads or max(1, cpus // tp)
    note = ""
    if tp * threads > cpus:
        note = (f"{tp} ranks x {threads} thread{'s' if threads > 1 else ''} on {cpus} CPUs: the ranks take turns, "
                "so times (compute and collectives) are longer than on dedicated cores")
    return threads, note


def run_tensor_parallel_cli(console: Console, settings: RunSettings, dtype: Any, detail: str, tp: int,
                            timeout_s: float, cpus: int,
                            save: Callable[[Trace, Any, Any], None]) -> tuple[Trace, int]:
    """The run, its files saved, rendered; (trace, exit code: 0, or 1 when a rank failed)."""
    from llmtrace.tracer.run.tp_launch import (
        check_tensor_parallel,
        run_tensor_parallel,
        run_under_torchrun,
        torchrun_world,
    )

    # the shards' memory together: spawned ranks share this machine; torchrun's may not (each checks its own load)
    launched_here = torchrun_world() is None
    check_tensor_parallel(settings.model or None, tp, settings.device, dtype if launched_here else None,
                          settings.weights or None)
    if settings.temperature > 0 and settings.seed is None:
        # every rank must draw the same tokens: one seed, drawn here, shared (recorded so --seed replays the run)
        settings = replace(settings, seed=random.SystemRandom().randrange(2**31), seed_drawn=True)
    threads, note = threads_per_rank(settings, tp, cpus)
    if note:
        from llmtrace.cli.console import warn

        warn(note, "note")
    if torchrun_world() is not None:
        result = run_under_torchrun(settings, dtype, tp, threads, timeout_s)
        if result is None:  # a rank other than 0: rank 0 renders and saves
            return None, 0  # type: ignore[return-value]
    else:
        with console.status(f"tensor parallel: starting {tp} ranks …") as status:
            result = run_tensor_parallel(settings, dtype, tp, threads, timeout_s,
                                         progress=lambda what: status.update(f"tensor parallel, {tp} ranks: {what} …"))
    trace = result.trace
    report = run_report(trace)
    save(trace, summary_block(trace, None, report.summary), None)
    render_journey(console, trace, detail)
    render_ending(console, trace, detail, report, None, "roofline: the tensor-parallel section compares the "
                                                        "communication; one device's roofline does not apply")
    render_tensor_parallel(console, tensor_parallel_summary(trace))
    if result.status != STATUS_OK:
        print(f"error: tensor-parallel run failed: {result.status}", file=sys.stderr)
        return trace, EXIT_RANK_FAILED
    return trace, 0
