"""A finished trace, rendered as `llmtrace run` prints it: `render_journey` for sections 1-6 (what `run` shows live
as the events arrive, here from the records), `render_ending` for what follows the decode stream."""

from __future__ import annotations

from rich.console import Console

from llmtrace.cli.render_attention import render_attention
from llmtrace.cli.render_experts import render_experts
from llmtrace.cli.render_kernels import dtype_name, numerics_note
from llmtrace.cli.render_lens import render_lens
from llmtrace.cli.render_no_cache import render_no_cache
from llmtrace.cli.render_run import (
    render_embedding,
    render_header,
    render_kernel_choice,
    render_layers,
    render_lm_head,
    render_positions,
    render_tokenization,
)
from llmtrace.cli.render_run_batch import (
    BatchDecodeView,
    render_batch_first_tokens,
    render_batch_summary,
    render_batch_tokenization,
)
from llmtrace.cli.render_run_decode import render_decode_stages
from llmtrace.cli.render_run_dry import render_dry_run_summary
from llmtrace.cli.render_run_live import DecodeView
from llmtrace.cli.render_run_summary import render_summary
from llmtrace.cli.render_sampling_lesson import render_sampling_lesson
from llmtrace.tracer.roofline.compare import MeasuredVsBound
from llmtrace.tracer.trace.records import PREFILL
from llmtrace.tracer.trace.report import RunReport
from llmtrace.tracer.trace.run_trace import STOP_INTERRUPTED, Trace


def render_journey(console: Console, trace: Trace, detail: str) -> None:
    """Header and sections 1-6 of a finished trace, from its records."""
    config, env, settings = trace.config, trace.environment, trace.settings
    dry_run = settings.dry_run
    render_header(console, config, trace.model.weight_format, trace.model.load_seconds, env.device, env.threads,
                  env.dtype, dry_run)
    render_kernel_choice(console, trace.kernels, dtype_name(env.dtype), detail)
    prefill = trace.prefill_step
    batch = trace.batch
    if batch is not None:
        render_batch_tokenization(console, [s.tokenization for s in batch.sequences], [s.pad for s in batch.sequences])
    else:
        render_tokenization(console, trace.tokenization, prefill.input_tokens if prefill else 0,
                            settings.prompt_tokens is not None)
    if prefill is None:
        return
    stages = trace.stages_of(PREFILL)
    tp = trace.tensor_parallel.tp if trace.tensor_parallel is not None else 1  # the stages are rank 0's
    render_embedding(console, config, stages, dry_run, tp)
    render_positions(console, trace.rope, None if batch is not None else trace.tokenization, config)
    render_layers(console, stages, prefill, detail, dry_run)
    if batch is not None:
        render_batch_first_tokens(console, prefill)
    else:
        render_lm_head(console, stages, prefill, settings, config, dry_run, tp)
    numerics = numerics_note(trace.kernels)
    render_sampling_lesson(console, trace.sampling_lesson, prefill, settings, numerics)
    render_lens(console, trace.lens[0] if trace.lens else None, numerics)
    render_attention(console, trace.attention[0] if trace.attention else None, numerics)
    if dry_run:
        return
    if batch is not None:
        batch_view = BatchDecodeView(len(batch.sequences), trace.new_token_limit, prefill)
        for step in trace.decode_steps:
            batch_view.add(step)
        batch_view.finish(trace.stop_reason == STOP_INTERRUPTED)
        console.print(batch_view)
        return
    view = DecodeView(trace.new_token_limit, prefill)
    for generated, step in enumerate(trace.decode_steps, start=2):  # the prefill produced token 1
        view.add(step, generated)
    view.finish(trace.stop_reason == STOP_INTERRUPTED)
    console.print(view)


def render_ending(console: Console, trace: Trace, detail: str, report: RunReport,
                  roofline: MeasuredVsBound | None, roofline_note: str, stopped_by: str = "") -> None:
    """After the decode stream: where a decode step's time went (unless --detail summary) and the summary; for a
    dry run, the traced figures beside the analytical estimate."""
    if report.dry_run is not None:
        moe = trace.config.moe
        note = "" if moe is None else (
            f"experts: each token row's {moe.experts_per_token} routed round-robin over the {moe.n_experts} (a meta "
            "model has no router weights): the FLOPs are exact, the weights read the bound with min(E, k·n) experts; "
            "`llmtrace flops` gives the expected count")
        render_dry_run_summary(console, report.dry_run, trace.settings.model or trace.config.name, note)
        return
    if detail != "summary":
        render_decode_stages(console, report.decode_stages, trace.staged_decode)
        render_experts(console, trace)
    if trace.batch is not None:
        render_batch_summary(console, trace.batch)
    render_summary(console, trace, report.summary, roofline, roofline_note, stopped_by, detail)
    render_no_cache(console, trace.no_kv_cache)

