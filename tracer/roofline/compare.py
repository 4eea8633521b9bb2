"""A measured generation next to its roofline bound: how close to the physical limit a run came. Pure Python.

`llmtrace run` calls `compare_with_measured` with what it timed; the percentages say what share of the bound's
speed the run reached (100% = at the roofline). The bound is costed under the kernels the run executed: llmtrace's
own model runs eager kernels (llmtrace.tracer.analytic.kernels), so that is the default here whatever the hardware.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrace.tracer.analytic.kernels import Kernels
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import FP32, DType
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.hardware.profiles import HardwareProfile
from llmtrace.tracer.roofline.analysis import roofline


@dataclass(frozen=True, slots=True)
class MeasuredVsBound:
    hardware: str
    kernels: str  # the kernel model the bound is costed under ("eager": what llmtrace's model runs)
    compute_dtype: str  # whose peak FLOP/s bounded the matmuls
    compute_note: str  # why that dtype's peak applies ("" when it is the dtype's own)
    weights_dtype: str
    kv_dtype: str
    prompt_len: int
    new_tokens: int
    batch: int
    peak_flops: float  # the ceilings used
    memory_bandwidth: float
    ridge_point: float
    prefill_bound: str  # "compute" | "memory"
    predicted_ttft_s: float  # the prefill's bound
    measured_ttft_s: float
    ttft_percent_of_bound: float  # 100 * predicted / measured
    decode_bound: str | None  # bound of the last decode step; None when new_tokens == 1
    predicted_time_per_output_token_s: float | None  # mean over the decode steps
    predicted_decode_tokens_per_s: float | None  # per sequence: decode steps / bounded decode time
    measured_decode_tokens_per_s: float | None
    decode_percent_of_bound: float | None  # 100 * measured / predicted tokens/s


def compare_with_measured(
    config: ModelConfig,
    hardware: HardwareProfile,
    prompt_len: int,
    new_tokens: int,
    measured_ttft_s: float,
    measured_decode_tokens_per_s: float | None,
    dtype: DType = FP32,
    kv_dtype: DType | None = None,
    batch: int = 1,
    kernels: str | Kernels = Kernels.EAGER,
    stored: tuple[tuple[str, int, int], ...] = (),
) -> MeasuredVsBound:
    """Roofline bound for this generation on `hardware`, next to what was measured.

    measured_ttft_s: wall time of the prefill forward pass (prompt_len tokens per sequence, empty cache).
    measured_decode_tokens_per_s: per sequence, (new_tokens - 1) / wall time of the decode forward passes; the
    prefill yields the first new token, so a run of N new tokens has N - 1 decode steps. None when N == 1.
    dtype: the dtype the weights were multiplied in (the activations' dtype when they were read as stored).
    stored: a GGUF's tensors as the run read them (flops_report.weights_as_stored) when it ran them at their stored
    precision, so the bound counts the bytes the run moved; () when the weights were converted to `dtype`.
    Memory fit is not checked: the run already happened.
    """
    if not measured_ttft_s > 0:
        raise BadArgumentError(f"measured TTFT must be > 0 seconds, got {measured_ttft_s!r}")
    if new_tokens > 1 and not (measured_decode_tokens_per_s and measured_decode_tokens_per_s > 0):
        raise BadArgumentError(
            f"measured decode tokens/s must be > 0 when there are decode steps, got {measured_decode_tokens_per_s!r}"
        )
    report = roofline(config, hardware, prompt_len=prompt_len, new_tokens=new_tokens, batch=batch, dtype=dtype,
                      kv_dtype=kv_dtype, check_fit=False, kernels=kernels, stored=stored)
    g = report.generation
    predicted_tps = g.tokens_per_s_per_sequence
    decoding = predicted_tps is not None
    return MeasuredVsBound(
        hardware=hardware.name, kernels=report.kernels, compute_dtype=report.machine.compute_dtype, compute_note=report.machine.compute_note,
        weights_dtype=report.weights_dtype,
        kv_dtype=report.kv_dtype, prompt_len=prompt_len, new_tokens=new_tokens, batch=batch,
        peak_flops=report.machine.peak_flops, memory_bandwidth=report.machine.memory_bandwidth,
        ridge_point=report.machine.ridge_point, prefill_bound=report.prefill.bound,
        predicted_ttft_s=g.ttft_seconds, measured_ttft_s=measured_ttft_s,
        ttft_percent_of_bound=100.0 * g.ttft_seconds / measured_ttft_s,
        decode_bound=report.last_decode.bound if report.last_decode else None,
        predicted_time_per_output_token_s=g.time_per_output_token_seconds,
        predicted_decode_tokens_per_s=predicted_tps,
        measured_decode_tokens_per_s=measured_decode_tokens_per_s if decoding else None,
        decode_percent_of_bound=(100.0 * measured_decode_tokens_per_s / predicted_tps
                                 if decoding and measured_decode_tokens_per_s else None),
    )
