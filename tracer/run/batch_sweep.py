"""Decode time per step over batch sizes, measured on the real model beside the roofline's prediction.

The roofline predicts that batching is nearly free while decode is memory-bound (every sequence shares one read of
the weights) and costs linearly once it is compute-bound; the batch where the two meet is the crossover
(llmtrace.tracer.roofline.analysis.Crossover). `sweep` checks that on the model itself: for each batch it runs a
prefill of the prompt repeated `batch` times (untimed) and then `steps` decode steps, each timed alone with the
device synchronised around it, greedy (every sequence feeds back its own argmax), without hooks, `repeats` times;
the figure is the median step. The prediction is the roofline's mean decode step over the same contexts, for the
same machine profile and the same kernel model (llmtrace's model runs eager kernels, so `eager` by default).

The measured crossover is read off the measurement the way the roofline draws its two roofs: the memory roof is
the batch-1 step time (flat in the batch), the compute roof is the line through the two largest batches' times;
the crossover is where they meet. When the largest batches add no time (still memory-bound) there is none.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from llmtrace.tracer.analytic.kernels import Kernels
from llmtrace.tracer.core.dtypes import FP32, DType
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.hardware.profiles import HardwareProfile
from llmtrace.tracer.roofline.analysis import roofline
from llmtrace.tracer.trace.hooks import device_synchronizer


@dataclass(frozen=True, slots=True)
class SweepRow:
    batch: int
    measured_step_s: float  # median decode step over every step of every repeat
    measured_min_s: float  # fastest and slowest step: the spread behind the median
    measured_max_s: float
    predicted_step_s: float  # the roofline's mean decode step over the same contexts
    predicted_bound: str  # of the last decode step: "compute" | "memory"
    measured_over_predicted: float  # measured_step_s / predicted_step_s
    measured_tokens_per_s: float  # batch / measured step: all sequences together
    predicted_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class BatchSweep:
    model: str
    hardware: str
    kernels: str  # the kernel model of the prediction
    compute_dtype: str
    peak_flops: float
    memory_bandwidth: float
    ridge_point: float
    prompt_len: int
    decode_steps: int  # per repeat, per batch
    repeats: int
    threads: int
    rows: tuple[SweepRow, ...]
    predicted_crossover: int | None  # the roofline's exact crossover at the last step's context; None = never
    predicted_knee: float | None  # the same two-roof construction applied to the predicted times
    measured_crossover: float | None  # where the measured memory and compute roofs meet; None = not in the sweep


def parse_batches(text: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8); a one-line BadArgumentError for anything else."""
    try:
        batches = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise BadArgumentError(f"--batches must be whole numbers separated by commas, got {text!r}") from None
    if not batches or min(batches) < 1 or list(batches) != sorted(set(batches)):
        raise BadArgumentError(f"--batches must be increasing whole numbers >= 1, got {text!r}")
    return batches


def measure_decode_steps(model: Any, ids: Sequence[int], batch: int, steps: int) -> list[float]:
    """Seconds of each of `steps` greedy decode steps after an untimed prefill of `ids` repeated `batch` times."""
    param = model.norm.weight  # dense, in the compute dtype (stored matrices are meta placeholders)
    sync = device_synchronizer(param.device)
    tokens = torch.tensor([list(ids)] * batch, dtype=torch.long, device=param.device)  # (B, P)
    model.setup_cache(batch, len(ids) + steps)
    times = []
    with torch.no_grad():
        logits = model.prefill(tokens)  # (B, V)
        for _ in range(steps):
            next_ids = logits.argmax(dim=-1, keepdim=True)  # (B, 1): each sequence its own token
            if sync is not None:
                sync()
            start = time.perf_counter()
            logits = model.decode_one(next_ids)
            if sync is not None:
                sync()
            times.append(time.perf_counter() - start)
    return times


def knee(batches: Sequence[int], step_seconds: Sequence[float]) -> float | None:
    """Where the flat roof at the batch-1 time meets the line through the two largest batches' times."""
    if len(batches) < 3:
        return None
    (b1, t1), (b2, t2) = (batches[-2], step_seconds[-2]), (batches[-1], step_seconds[-1])
    slope = (t2 - t1) / (b2 - b1)
    if slope <= 0:
        return None
    crossing = b2 - (t2 - step_seconds[0]) / slope
    return max(crossing, float(batches[0]))


def sweep(loaded: Any, hardware: HardwareProfile, ids: Sequence[int], batches: Sequence[int], steps: int = 16,
          repeats: int = 3, dtype: DType = FP32, kernels: Kernels | str = Kernels.EAGER,
          progress: Callable[[int, int], None] | None = None) -> BatchSweep:
    """Measure and predict the decode step at each batch. Rounds are interleaved (every batch once per repeat), so
    machine noise lands on all batches alike. `progress(done, total)` is called after each measurement."""
    if steps < 2 or repeats < 1:
        raise BadArgumentError(f"a sweep needs at least 2 decode steps and 1 repeat, got {steps} and {repeats}")
    model = loaded.model
    measure_decode_steps(model, ids, batches[-1], 2)  # warm-up at the largest batch: allocator, kernel set-up
    samples: dict[int, list[float]] = {b: [] for b in batches}
    total = len(batches) * repeats
    for r in range(repeats):
        for i, b in enumerate(batches):
            samples[b].extend(measure_decode_steps(model, ids, b, steps))
            if progress is not None:
                progress(r * len(batches) + i + 1, total)
    model.reset_cache()

    rows = []
    report = None
    for b in batches:
        report = roofline(loaded.config, hardware, prompt_len=len(ids), new_tokens=steps + 1, batch=b, dtype=dtype,
                          check_fit=False, kernels=kernels)
        predicted = report.generation.time_per_output_token_seconds
        measured = statistics.median(samples[b])
        rows.append(SweepRow(
            batch=b, measured_step_s=measured, measured_min_s=min(samples[b]), measured_max_s=max(samples[b]),
            predicted_step_s=predicted, predicted_bound=report.last_decode.bound,
            measured_over_predicted=measured / predicted, measured_tokens_per_s=b / measured,
            predicted_tokens_per_s=b / predicted,
        ))
    m = report.machine
    return BatchSweep(
        model=loaded.config.name, hardware=hardware.name, kernels=report.kernels, compute_dtype=m.compute_dtype,
        peak_flops=m.peak_flops, memory_bandwidth=m.memory_bandwidth, ridge_point=m.ridge_point,
        prompt_len=len(ids), decode_steps=steps, repeats=repeats, threads=torch.get_num_threads(), rows=tuple(rows),
        predicted_crossover=report.crossover.crossover_batch,
        predicted_knee=knee(batches, [r.predicted_step_s for r in rows]),
        measured_crossover=knee(batches, [r.measured_step_s for r in rows]),
    )
