"""`llmtrace run --batch-sweep 1,2,4,…`: decode time per step at each batch, measured on the real model beside the
prediction from this machine's kernels measured at decode's shapes, with the crossover of each.

For every batch B the measurement is a real batched generation (tracer/run/batch_generate.py, what `run --batch B`
runs: the prompts left-padded, per-sequence positions, greedy sampling, no hooks) with its untimed warm-up pass,
then `steps` decode steps; each step's forward pass is timed alone (StepRecord.forward_ns, the device synchronised
around it). Only steps that still hold all B sequences count (a sequence that stops early leaves the batch). The
batches are interleaved over `repeats` rounds, so machine noise lands on all of them alike; a row reports the
median step and the fastest and slowest.

The prediction is llmtrace.tracer.roofline.kernel_decode over ceilings measured in the same process
(tracer/run/decode_measure.py: the model's own products at (B, N, K), the step's other operations counted and
timed), each batch's right after each of its generations (on a shared machine the speed drifts over minutes, and
measuring all generations first and all kernels after put 1.5x between them), combined as medians over the rounds
(decode_ceilings.combine) and saved for `llmtrace roofline` to read back. Beside it, for reference, the two-roof roofline of this
machine's profile (copy bandwidth and square-GEMM FLOP/s, eager kernels: what llmtrace's model runs). The three
crossovers (measured, predicted, roofline) are read off their step times by one rule (kernel_decode.CROSSOVER_RULE).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from llmtrace.tracer.analytic.kernels import Kernels
from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, get_dtype
from llmtrace.tracer.core.errors import BadArgumentError, HardwareError
from llmtrace.tracer.hardware.decode_ceilings import DecodeCeilings, combine, save_ceilings
from llmtrace.tracer.hardware.profiles import HardwareProfile
from llmtrace.tracer.roofline.analysis import RooflineReport, roofline
from llmtrace.tracer.roofline.kernel_decode import (
    COPY_AND_GEMM,
    CROSSOVER_RULE,
    MEASURED_KERNELS,
    KernelStep,
    growth_crossover,
    mean_step_seconds,
)
from llmtrace.tracer.run.batch_generate import BatchGeneration
from llmtrace.tracer.trace.records import DECODE, RunSettings

Progress = Callable[[str], None]
GOAL_RATIO = 1.5  # issue 14: measured within 1.5x of the prediction at every batch
GOAL_CROSSOVER = 2.0  # and the crossover within 2x
BATCH_SWEEP_SCHEMA = "llmtrace.batch-sweep/1"  # `run --batch-sweep --json` (batch_sweep_schema.json)


@dataclass(frozen=True, slots=True)
class SweepRow:
    batch: int
    steps_timed: int  # decode steps that held all `batch` sequences, over every repeat
    measured_step_s: float  # median forward pass of those steps
    measured_min_s: float  # the fastest and slowest of them: the spread behind the median
    measured_max_s: float
    predicted_step_s: float  # measured kernels: mean over the same contexts
    predicted_products_s: float  # of which the weight products
    predicted_ops: int  # the step's other tensor operations
    predicted_ops_s: float  # their measured time
    predicted_context_s: float  # attention/KV traffic of the sweep's contexts beyond the measured one
    measured_over_predicted: float
    roofline_step_s: float  # the two-roof roofline (copy bandwidth, square GEMM), eager kernels
    roofline_bound: str  # "compute" | "memory", of the last decode step
    measured_over_roofline: float
    measured_tokens_per_s: float  # batch / measured step: all sequences together
    predicted_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class BatchSweep:
    model: str
    weights: str  # "dense fp32" or "stored"
    formats: str  # the products' formats as run ("fp32", "q4_1 (int4pack)+q8_0 (int4pack)")
    compute_dtype: str
    device_name: str
    machine: str  # product_timing.machine_key: what the ceilings are saved under
    prompts: int  # distinct prompts (the prompt repeated, or --file's lines)
    prompt_tokens: int  # the longest prompt's tokens: where every row's decode starts
    decode_steps: int  # timed per generation
    repeats: int
    ceilings: str  # kernel_decode.MEASURED_KERNELS: what the prediction stands on
    roofline_ceilings: str  # kernel_decode.COPY_AND_GEMM: what the reference roofline stands on
    roofline_weights: str  # how the reference roofline costs the weights: "fp32", "fp32 (matrices as stored)"
    peak_flops: float  # the reference roofline's ceilings
    memory_bandwidth: float
    rows: tuple[SweepRow, ...]
    crossover_rule: str
    measured_crossover: float | None  # by crossover_rule over the measured steps; None = not within the sweep
    predicted_crossover: float | None  # the same rule over the predicted steps
    roofline_crossover: float | None  # the same rule over the reference roofline's steps
    roofline_exact_crossover: int | None  # the roofline's own: the smallest compute-bound batch
    worst_ratio: float  # the largest of measured/predicted and predicted/measured over the rows
    goal_met: bool  # worst_ratio <= GOAL_RATIO and the crossovers within GOAL_CROSSOVER of each other
    ceilings_saved_to: str  # where the ceilings were saved ("" when they could not be)
    note: str  # why they were not saved, or ""
    schema: str = BATCH_SWEEP_SCHEMA  # `--json` writes it first


def sweep_prompts(prompts: Sequence[str], batches: Sequence[int], from_file: bool) -> tuple[str, ...]:
    """The prompts batch B takes its first B from: --file's lines (there must be one per sequence of the largest
    batch), or the one prompt repeated."""
    if not from_file:
        return (prompts[0],) * batches[-1]
    if len(prompts) < batches[-1]:
        raise BadArgumentError(f"--batch-sweep up to {batches[-1]} takes one prompt per sequence, but --file has "
                               f"{len(prompts)}; give more lines or a smaller largest batch")
    return tuple(prompts[: batches[-1]])


def _generation_steps(loaded: Any, prompts: Sequence[str], batch: int, steps: int, dtype: str) -> list[float]:
    """Forward seconds of the decode steps of one greedy generation of `batch` sequences that held all of them."""
    settings = RunSettings(model="", prompt=prompts[0], max_new_tokens=steps + 1, trace=False, warmup=True,
                           temperatures=(), batch=batch, batch_prompts=tuple(prompts[:batch]), dtype=dtype)
    generation = BatchGeneration(loaded, settings)
    try:
        trace = generation.run()
    finally:
        generation.close()
    return [s.forward_ns / 1e9 for s in trace.steps if s.phase == DECODE and s.batch == batch]


def sweep(loaded: Any, hardware: HardwareProfile, prompts: Sequence[str], batches: Sequence[int],
          measure_ceilings: Callable[..., DecodeCeilings], steps: int = 8, repeats: int = 3,
          stored: tuple[tuple[str, int, int], ...] = (),
          progress: Progress | None = None, save: bool = True) -> BatchSweep:
    """Measure and predict the decode step at each of `batches` (see the module docstring). `prompts` holds at
    least the largest batch's prompts (sweep_prompts). `measure_ceilings(loaded, ids, batches, bandwidth)` measures
    the kernels (tracer/run/decode_measure.measure_decode_ceilings; a stand-in in tests): once per batch and round,
    right after that batch's generation, so the two see the same machine; the rounds' medians are combined.
    `stored`: a GGUF's tensors as stored (estimate.Dtypes.stored) when the run multiplies them as stored, so the
    reference roofline costs their stored bytes (its FLOP/s ceiling is the compute dtype's either way)."""
    if steps < 2 or repeats < 1:
        raise BadArgumentError(f"a sweep needs at least 2 decode steps and 1 repeat, got {steps} and {repeats}")
    if not batches or len(prompts) < batches[-1]:
        raise BadArgumentError("a sweep needs batch sizes and a prompt for every sequence of the largest")
    config, tokenizer = loaded.config, loaded.tokenizer
    dtype_name = _compute_dtype(loaded)
    ids = tokenizer.encode(prompts[0])
    longest = max(len(tokenizer.encode(p)) for p in set(prompts[: batches[-1]]))
    samples, measured = _rounds(loaded, hardware, prompts, batches, measure_ceilings, steps, repeats, ids,
                                dtype_name, progress)
    for b in batches:
        if not samples[b]:
            raise BadArgumentError(f"no decode step at batch {b} held all {b} sequences (one stopped at once); "
                                   "use other prompts or a larger --max-new-tokens")
    ceilings = combine(measured)
    saved_to, note = "", ""
    if save:
        try:
            saved_to = str(save_ceilings(ceilings))
        except HardwareError as exc:
            note = str(exc)
    weights = get_dtype(dtype_name, COMPUTE_DTYPES)
    rows, roofline_steps = [], []
    report = None
    for b in batches:
        first, last, predicted = mean_step_seconds(ceilings, config, b, longest, steps)
        report = roofline(config, hardware, prompt_len=longest, new_tokens=steps + 1, batch=b, dtype=weights,
                          check_fit=False, kernels=Kernels.EAGER, stored=stored)
        reference = report.generation.time_per_output_token_seconds or 0.0
        roofline_steps.append(reference)
        rows.append(_row(b, samples[b], first, last, predicted, report))
    assert report is not None
    measured_x = growth_crossover(batches, [r.measured_step_s for r in rows])
    predicted_x = growth_crossover(batches, [r.predicted_step_s for r in rows])
    worst = max(max(r.measured_over_predicted, 1 / r.measured_over_predicted) for r in rows)
    crossover_ok = (measured_x == predicted_x or (measured_x is not None and predicted_x is not None
                                                   and max(measured_x, predicted_x) / min(measured_x, predicted_x)
                                                   <= GOAL_CROSSOVER))
    return BatchSweep(
        model=config.name, weights=ceilings.weights, formats=ceilings.formats, compute_dtype=dtype_name,
        device_name=ceilings.device_name, machine=ceilings.machine, prompts=len(set(prompts[: batches[-1]])),
        prompt_tokens=longest, decode_steps=steps, repeats=repeats, ceilings=MEASURED_KERNELS,
        roofline_ceilings=COPY_AND_GEMM, roofline_weights=weights.name + (" (matrices as stored)" if stored else ""),
        peak_flops=report.machine.peak_flops,
        memory_bandwidth=report.machine.memory_bandwidth, rows=tuple(rows), crossover_rule=CROSSOVER_RULE,
        measured_crossover=measured_x, predicted_crossover=predicted_x,
        roofline_crossover=growth_crossover(batches, roofline_steps),
        roofline_exact_crossover=report.crossover.crossover_batch, worst_ratio=worst,
        goal_met=worst <= GOAL_RATIO and crossover_ok, ceilings_saved_to=saved_to, note=note,
    )


def _rounds(loaded: Any, hardware: HardwareProfile, prompts: Sequence[str], batches: Sequence[int],
            measure_ceilings: Callable[..., DecodeCeilings], steps: int, repeats: int, ids: list[int],
            dtype_name: str, progress: Progress | None) -> tuple[dict[int, list[float]], list[DecodeCeilings]]:
    """`repeats` rounds over `batches`: each batch's decode steps timed, then its kernels measured right after
    (the same machine's state); the step times per batch and every round's ceilings."""
    samples: dict[int, list[float]] = {b: [] for b in batches}
    measured: list[DecodeCeilings] = []
    total = len(batches) * repeats
    for r in range(repeats):
        for i, b in enumerate(batches):
            where = f"batch {b} ({r * len(batches) + i + 1} of {total})"
            if progress is not None:
                progress(f"decode at {where}")
            samples[b].extend(_generation_steps(loaded, prompts, b, steps, dtype_name))
            if progress is not None:
                progress(f"kernels at {where}")
            measured.append(measure_ceilings(loaded, ids, (b,), hardware.memory_bandwidth))
    return samples, measured


def _row(batch: int, samples: list[float], first: KernelStep, last: KernelStep, predicted: float,
         report: RooflineReport) -> SweepRow:
    """One batch's row: its measured steps beside the kernel model's prediction and the roofline's reference."""
    measured = statistics.median(samples)
    reference = report.generation.time_per_output_token_seconds or 0.0
    return SweepRow(
        batch=batch, steps_timed=len(samples), measured_step_s=measured, measured_min_s=min(samples),
        measured_max_s=max(samples), predicted_step_s=predicted,
        predicted_products_s=(first.products_seconds + last.products_seconds) / 2,
        predicted_ops=first.ops, predicted_ops_s=(first.ops_seconds + last.ops_seconds) / 2,
        predicted_context_s=(first.context_seconds + last.context_seconds) / 2,
        measured_over_predicted=measured / predicted, roofline_step_s=reference,
        roofline_bound=report.last_decode.bound if report.last_decode else "",
        measured_over_roofline=measured / reference if reference else 0.0,
        measured_tokens_per_s=batch / measured, predicted_tokens_per_s=batch / predicted,
    )


def _compute_dtype(loaded: Any) -> str:
    from llmtrace.tracer.hardware.dtype_policy import dtype_of

    return dtype_of(loaded.model.norm.weight.dtype).name
