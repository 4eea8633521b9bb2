"""`llmtrace run` on one device (or a --dry-run, --tp N included): load the model, show its header, stream the
journey (cli/run_stream.py), compare with this machine's roofline, save the outputs, then render the ending and
any --repeat runs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from rich.console import Console

    from llmtrace.cli.run_args import RunArgs
    from llmtrace.tracer.roofline.compare import MeasuredVsBound
    from llmtrace.tracer.trace.records import RunSettings
    from llmtrace.tracer.trace.repeat_summary import RepeatSummary
    from llmtrace.tracer.trace.report import RunReport
    from llmtrace.tracer.trace.run_trace import Trace
    from llmtrace.tracer.trace.summary_block import SummaryBlock

Save = Callable[..., None]  # RunOutputs.save: (trace, summary block, comparison[, repeated, again, roofline_note])


def run_live(console: Console, args: RunArgs, settings: RunSettings, save: Save, received: Any = None) -> Trace:
    """The run, rendered as it goes; `save` gets its trace, summary block and roofline comparison (None: none)
    before the ending is rendered, and with --repeat once more after the repeats, with their spreads. `received`:
    the stop-signal gate (cli/interrupts.py Received), whose signal the summary names."""
    from llmtrace.cli.run_stream import JourneyStream
    from llmtrace.tracer.checkpoint.resolve import bundled_source, classify_model

    # Classified before torch is imported: a wrong --model fails in a blink, with the error every command gives.
    source = classify_model(settings.model) if settings.model else bundled_source()
    loaded, tp_dry = _load(console, args, settings, source)
    if settings.dry_run and settings.prompt_tokens is not None and loaded.tokenizer is None:
        from llmtrace.tracer.run.generate import check_prompt_fits

        check_prompt_fits(loaded.config, settings.prompt_tokens)  # before the header: nothing printed, then refused
    _show_header(console, loaded, settings, args.views.detail.value)

    from llmtrace.tracer.run.batch_generate import generation_for

    generation = generation_for(loaded, settings)
    trace = JourneyStream(console, loaded, settings, args.views.detail.value).run(generation)
    if tp_dry is not None:  # --dry-run --tp N: rank 0's pass, one device's estimate check does not apply
        from llmtrace.cli.render_tp import render_tp_dry_run
        from llmtrace.tracer.trace.tp_summary import tp_dry_run_passes

        trace = tp_dry.finish(trace, generation.origin_ns)
        _finish(console, args, trace, None, save)
        render_tp_dry_run(console, tp_dry_run_passes(trace), args.parallel.tp)
        return trace
    _finish(console, args, trace, (source, loaded), save, received.name if received is not None else "")
    return trace


def _load(console: Console, args: RunArgs, settings: RunSettings, source: Any) -> tuple[Any, Any]:
    """(the loaded model, the --dry-run --tp N shard builder or None), with a status line while loading: said
    before torch is imported (a second or more), then the weights' bar in bytes (cli/render_run_progress.py)."""
    from llmtrace.cli.render_run_progress import LoadingBar
    from llmtrace.tracer.checkpoint.resolve import model_name

    what = model_name(source)
    with console.status(f"loading {what} …", refresh_per_second=4) as status:
        import torch

        from llmtrace.tracer.load.loader import load_model

        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        if args.parallel.tp > 1:  # rank 0's shard on the meta device (tracer/run/tp_dry_run.py)
            from llmtrace.tracer.run.tp_dry_run import TensorParallelDryRun

            tp_dry = TensorParallelDryRun(settings.model or None, args.dtype, args.parallel.tp,
                                          settings.weights or None)
            return tp_dry.loaded, tp_dry
        loaded = load_model(source, dtype=args.dtype, device=settings.device, dry_run=settings.dry_run,
                            weights=settings.weights or None, loading=LoadingBar(status, what))
    return loaded, None


def _show_header(console: Console, loaded: Any, settings: RunSettings, detail: str) -> None:
    import torch

    from llmtrace.cli.console import warn
    from llmtrace.cli.render_run import render_header, render_kernel_choice
    from llmtrace.tracer.hardware.dtype_policy import dtype_of

    for note in (loaded.cache_note, loaded.kernel_note):
        if note:
            warn(note, "note")
    weights = loaded.weights
    weights_note = (f"weights {weights.label}: {weights.reason}"
                    if weights.reason and weights.news and not settings.dry_run else "")
    param = loaded.model.norm.weight  # dense in the compute dtype (a stored matrix's parameter is a placeholder)
    render_header(console, loaded.config, loaded.weight_format, loaded.load_seconds, str(param.device),
                  torch.get_num_threads(), str(param.dtype).removeprefix("torch."), settings.dry_run, weights_note)
    render_kernel_choice(console, loaded.kernels, dtype_of(param.dtype).name, detail)


def _finish(console: Console, args: RunArgs, trace: Trace, model: tuple[Any, Any] | None, save: Save,
            stopped_by: str = "") -> None:
    """The roofline comparison (a real run on one device: `model` is its (source, loaded)), the outputs saved, then
    the ending and the --repeat runs; a --tp dry run (`model` None) only saves. `stopped_by`: the stop signal's
    name, "" when none came."""
    from llmtrace.cli.render_run_report import render_ending
    from llmtrace.tracer.trace.report import run_report
    from llmtrace.tracer.trace.run_trace import STOP_INTERRUPTED
    from llmtrace.tracer.trace.summary_block import summary_block

    report = run_report(trace)
    comparison, note = (None, "")
    if model is not None and not args.performance.no_roofline and not args.model.dry_run:
        try:
            comparison, note = _roofline_for(console, trace, report, *model)
        except KeyboardInterrupt:  # stopped while measuring: the run itself is kept
            note = "roofline: skipped (interrupted)"
    block = summary_block(trace, comparison, report.summary)
    save(trace, block, comparison, roofline_note=note)
    if model is None:
        return
    render_ending(console, trace, args.views.detail.value, report, comparison, note, stopped_by)
    if args.performance.repeat > 1:  # the JSON again, with the runs' spreads
        repeated = (_repeat(console, model[1], trace, args.performance.repeat)
                    if trace.stop_reason != STOP_INTERRUPTED else None)
        save(trace, block, comparison, repeated, again=True)


def _repeat(console: Console, loaded: object, first: Trace, repeat: int) -> RepeatSummary | None:
    """K - 1 more runs of the same generation (same seed, so the same tokens; no second warm-up), then the
    medians and spreads of all K (llmtrace.tracer.trace.repeat_summary)."""
    from dataclasses import replace

    from llmtrace.cli.render_run_repeat import render_repeat
    from llmtrace.tracer.run.batch_generate import generation_for
    from llmtrace.tracer.trace.repeat_summary import repeat_summary

    # the repeats time the generation itself: no second sampling lesson or no-cache replay (both after the timed steps)
    settings = replace(first.settings, warmup=False, seed_drawn=False, temperatures=(), no_kv_cache=False)
    traces = [first]
    try:
        with console.status(f"repeating the generation: 2 of {repeat} …") as status:
            for k in range(2, repeat + 1):
                status.update(f"repeating the generation: {k} of {repeat} …")
                generation = generation_for(loaded, settings)
                try:
                    traces.append(generation.run())
                finally:
                    generation.close()
    except KeyboardInterrupt:
        console.print(f"[dim]--repeat interrupted after {len(traces)} runs[/]")
    if len(traces) == 1:
        return None
    summary = repeat_summary(traces)
    render_repeat(console, summary)
    return summary


def _roofline_for(console: Console, trace: Trace, report: RunReport, source: Any = None,
                  loaded: Any = None) -> tuple[MeasuredVsBound | None, str]:
    """The run against this machine's roofline (llmtrace.tracer.run.roofline_check), or why there is none; says so
    when a first run measured this machine for it. A run that read its weights as stored is bounded by those bytes."""
    from llmtrace.cli import formatting as fmt
    from llmtrace.cli.console import warn
    from llmtrace.tracer.load.stored_weights import tensors_as_read
    from llmtrace.tracer.run.roofline_check import run_roofline

    try:
        stored = () if loaded is None else tensors_as_read(source, loaded.weights)
        with console.status("roofline …") as status:
            result = run_roofline(trace, report.summary,
                                  progress=lambda what: status.update(f"measuring this machine for the roofline "
                                                                      f"(first run only): {what} …"), stored=stored)
    except Exception as exc:  # optional: the run and its files stand whatever fails here
        if os.environ.get("LLMTRACE_DEBUG") == "1":
            raise
        return None, f"roofline: skipped after an internal error ({type(exc).__name__}: {exc})"
    if result.measured is not None and result.not_saved:  # a busy machine, a read-only or full home: this run still
        #                                                     has its bound
        warn(f"roofline: measured this machine in {fmt.duration_s(result.measured.seconds)} "
             f"({', '.join(result.measured.dtypes)} GEMMs, copy); not saved: {result.not_saved}")
    if result.measured is not None and result.saved_to is not None:
        home = str(Path.home())
        shown = "~" + result.saved_to[len(home):] if result.saved_to.startswith(home + os.sep) else result.saved_to
        console.print(f"[dim]roofline: measured this machine in {fmt.duration_s(result.measured.seconds)} "
                      f"({', '.join(result.measured.dtypes)} GEMMs, copy); saved as 'this-machine' in {shown}[/]")
    return result.comparison, result.note
