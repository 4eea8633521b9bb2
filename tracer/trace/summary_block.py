"""A run's headline figures in one flat record: the `summary` block of the trace JSON and `run --summary-json`'s one
line (in the manner of llama-bench's JSON output: what ran, where, and the rates), so that no consumer has to
re-derive TTFT or tokens/s from the step records.

Every figure comes from tracer/trace/summary.py (run_summary) and, for the verdict against this machine's roofline,
tracer/roofline/compare.py (MeasuredVsBound); nothing is computed twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrace.tracer.roofline.compare import MeasuredVsBound
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.summary import RunSummary, run_summary

# `run --summary-json`'s line (tracer/trace/summary_schema.json: the trace schema's SummaryBlock, "schema" required)
SUMMARY_SCHEMA = "llmtrace.run-summary/1"


@dataclass(frozen=True, slots=True)
class RooflineVerdict:
    """The run against the roofline bound of the machine it ran on (MeasuredVsBound's figures, flattened)."""

    hardware: str  # the profile whose ceilings bounded the run ("this-machine": measured here)
    compute_dtype: str
    prefill_bound: str  # "compute" | "memory"
    decode_bound: str | None  # None without decode steps
    predicted_ttft_ns: int  # the prefill's bound
    ttft_percent_of_bound: float  # 100 = at the roofline
    predicted_decode_tokens_per_second: float | None
    decode_percent_of_bound: float | None


@dataclass(frozen=True, slots=True)
class SummaryBlock:
    """One run in one flat record. FLOP and byte figures are None when the run was not traced (--no-trace)."""

    llmtrace_version: str
    torch_version: str
    model: str  # where the weights came from (ModelInfo.source)
    weight_format: str
    parameters: int
    device: str
    device_name: str
    dtype: str
    threads: int
    prompt_tokens: int
    generated_tokens: int
    stop_reason: str
    ttft_ns: int  # tokenization + the prefill step (RunSummary.ttft_ns)
    prefill_tokens_per_second: float  # prompt tokens / prefill forward time
    decode_tokens_per_second: float  # decode tokens (every sequence's) / the decode steps' wall time, sampling included
    prefill_flops: int | None
    decode_flops: int | None
    prefill_bytes_read: int | None
    decode_bytes_read: int | None
    bytes_written: int | None  # both phases
    kv_allocated_bytes: int
    kv_live_bytes: int
    peak_rss_bytes: int
    peak_device_bytes: int | None  # cuda only
    roofline: RooflineVerdict | None  # None: not compared (dry run, --no-roofline, no profile for the dtype)
    sequences: int = 1  # run --batch N: N (prompt and generated tokens are then all sequences' together)
    schema: str = SUMMARY_SCHEMA  # `--summary-json` writes it first


def summary_block(trace: Trace, comparison: MeasuredVsBound | None = None,
                  summary: RunSummary | None = None) -> SummaryBlock:
    """`trace`'s headline figures; `comparison` is the run's roofline comparison when it made one; `summary` saves
    recomputing run_summary(trace) when the caller has it."""
    s = summary or run_summary(trace)
    traced = trace.settings.trace and not trace.settings.dry_run
    env = trace.environment
    pre, dec = s.prefill, s.decode
    return SummaryBlock(
        llmtrace_version=env.llmtrace_version, torch_version=env.torch_version, model=trace.model.source,
        weight_format=trace.model.weight_format, parameters=trace.model.parameters, device=env.device,
        device_name=env.device_name, dtype=env.dtype, threads=env.threads,
        prompt_tokens=s.prompt_tokens, generated_tokens=s.generated_tokens, stop_reason=trace.stop_reason,
        ttft_ns=s.ttft_ns,
        prefill_tokens_per_second=pre.forward_tokens_per_second,
        decode_tokens_per_second=s.decode_tokens_per_second,
        prefill_flops=pre.totals.flops if traced else None,
        decode_flops=dec.totals.flops if traced else None,
        prefill_bytes_read=pre.totals.bytes_read if traced else None,
        decode_bytes_read=dec.totals.bytes_read if traced else None,
        bytes_written=pre.totals.bytes_written + dec.totals.bytes_written if traced else None,
        kv_allocated_bytes=s.kv_allocated_bytes, kv_live_bytes=s.kv_live_bytes,
        peak_rss_bytes=s.peak_rss_bytes, peak_device_bytes=s.peak_device_bytes,
        roofline=None if comparison is None else RooflineVerdict(
            hardware=comparison.hardware, compute_dtype=comparison.compute_dtype,
            prefill_bound=comparison.prefill_bound, decode_bound=comparison.decode_bound,
            predicted_ttft_ns=round(comparison.predicted_ttft_s * 1e9),
            ttft_percent_of_bound=comparison.ttft_percent_of_bound,
            predicted_decode_tokens_per_second=comparison.predicted_decode_tokens_per_s,
            decode_percent_of_bound=comparison.decode_percent_of_bound,
        ),
        sequences=len(trace.batch.sequences) if trace.batch is not None else 1,
    )
