"""Everything `llmtrace run` and `llmtrace show` print after the decode stream, computed from a finished trace.

One call (`run_report`) gives the renderers every figure they show: the run's summary, where a decode step's time
went, and for a dry run the traced FLOPs beside the analytical estimate (`embedding_table_bytes` serves the
embedding section, which `run` shows live, before the trace is complete). Pure Python over the records, so a trace
read back from JSON reports the same figures it did live.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrace.tracer.analytic.tensor_parallel import vocab_slice
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import get_dtype
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.trace.dry_run import DryRunCheck, dry_run_check
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.summary import DecodeByStage, RunSummary, decode_by_stage, run_summary


@dataclass(frozen=True, slots=True)
class RunReport:
    summary: RunSummary
    decode_stages: DecodeByStage | None  # None when no decode step was traced
    dry_run: DryRunCheck | None  # a dry run only


def run_report(trace: Trace) -> RunReport:
    summary = run_summary(trace)
    dry = trace.settings.dry_run
    return RunReport(
        summary=summary,
        decode_stages=None if dry else decode_by_stage(trace, summary.decode),
        dry_run=dry_run_check(trace) if dry else None,
    )


def embedding_table_bytes(config: ModelConfig, dtype: str, tp: int = 1) -> int | None:
    """vocab x dim values in `dtype` ("float32", "bfloat16"), or one rank's rows of them under --tp `tp`; None for a
    dtype llmtrace has no size for."""
    try:
        return int(vocab_slice(config, tp) * config.dim * get_dtype(dtype).bytes_per_value)
    except BadArgumentError:
        return None
