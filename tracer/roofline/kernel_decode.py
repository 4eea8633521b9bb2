"""Decode time per step from kernels measured at decode's own shapes (llmtrace.tracer.hardware.decode_ceilings).
Pure Python.

The roofline bounds a decode step by max(FLOPs / square-GEMM peak, bytes / copy bandwidth). Here a step costs what
this machine's kernels were measured to take at the step's shapes:

    step(B, S) = Σ_products calls × t_product(B)            the model's own product call at (B, N, K), measured
               + ops(B) × t_op(B)                           the step's other tensor operations: counted on a real
                                                            step, time per op measured (the step, products out)
               + (bytes(B, S) − bytes(B, S₀)) / bandwidth    attention and KV traffic of a context S other than the
                                                            measured S₀, at the machine's copy bandwidth

calls = the layer count for a per-layer product, 1 for the LM head. Between measured batches every term is
interpolated linearly in the batch; past the largest it is extended along the line through the last two (a
product that already grows with the batch keeps growing), below the smallest it is the smallest's.

The crossover is read the same way off any step-time curve, predicted or measured (`growth_crossover`). On two
roofs, t(B) = max(M, c·B), it is the batch B* = M / c where they meet; read off points, the memory roof M is the
smallest step at a batch >= 2, the curve is followed (linearly in log batch and log time between the swept
batches) to where it first reaches √2·M, and that batch divided by √2 is the crossover: exactly B* on two roofs
sampled at B* and 2B*, and, on a real curve, not moved by noise within √2 of the floor. Batch 1 is left out of
the floor because it runs another kernel (torch.mv: a matrix-vector product) than every larger batch (mm), which
on some CPUs is 2x faster per weight byte: that jump is a kernel switch, not a crossover.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from llmtrace.tracer.analytic import estimate
from llmtrace.tracer.analytic.kernels import Kernels
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, get_dtype
from llmtrace.tracer.hardware.decode_ceilings import BatchCeilings, DecodeCeilings

MEASURED_KERNELS = "measured kernels at decode shapes"
COPY_AND_GEMM = "memcpy + square GEMM"
DATASHEET = "datasheet peak + bandwidth"
SQRT2 = math.sqrt(2.0)  # the crossover rule's margin above the memory roof


@dataclass(frozen=True, slots=True)
class KernelStep:
    """One decode step of `batch` sequences at `kv_len` attended positions, from measured kernels."""

    batch: int
    kv_len: int
    products_seconds: float  # every weight product of the step
    ops: int  # the step's other tensor operations
    op_seconds: float  # measured time per such operation at this batch
    ops_seconds: float  # ops x op_seconds: their time at the measured context
    context_bytes: int  # attention + KV bytes beyond (or short of, < 0) the measured context
    context_seconds: float  # context_bytes / bandwidth
    seconds: float  # products + ops + context
    interpolated: bool  # the batch was not measured: its terms come from the measured batches around it


@dataclass(frozen=True, slots=True)
class KernelDecode:
    """A generation's decode under measured kernels, as `llmtrace roofline` shows it beside the two-roof figures."""

    ceilings: str  # MEASURED_KERNELS
    machine: str  # what they were measured on (product_timing.machine_key)
    measured_at: str
    weights: str  # "dense fp32" or "stored"
    formats: str  # the products' formats as measured
    measured_batches: tuple[int, ...]
    first_step: KernelStep
    last_step: KernelStep
    time_per_output_token_seconds: float  # mean decode step (every step is affine in its context)
    tokens_per_s_per_sequence: float
    tokens_per_s_total: float
    table: tuple[KernelStep, ...]  # the batch table's batches at its context
    crossover_batch: float | None  # growth_crossover over the table's batches; None = not within them
    crossover_rule: str


CROSSOVER_RULE = ("the batch where the step time first reaches sqrt(2) x its floor (the smallest step at batch >= 2; "
                  "log-log between swept batches), divided by sqrt(2): where two roofs max(M, cB) meet")


def growth_crossover(batches: Sequence[int], seconds: Sequence[float]) -> float | None:
    """The crossover by the rule of the module docstring over (batch, step seconds) points; None when the step
    never reaches √2 times its floor within them."""
    points = [(b, t) for b, t in zip(batches, seconds) if b >= 2 and t > 0]
    if len(points) < 2:
        return None
    target = SQRT2 * min(t for _, t in points)
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if t1 >= target > t0:
            where = math.log(target / t0) / math.log(t1 / t0)  # of the way from b0 to b1, in log batch
            return b0 * (b1 / b0) ** where / SQRT2
    return None


def _interpolate(batch: int, xs: Sequence[int], ys: Sequence[float]) -> float:
    """Piecewise linear in the batch; flat below the first point, extended along the last segment past the last."""
    if batch <= xs[0] or len(xs) == 1:
        return ys[0] if batch <= xs[0] else ys[-1]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if batch <= x1:
            return y0 + (y1 - y0) * (batch - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = (xs[-2], ys[-2]), (xs[-1], ys[-1])
    return max(y1, y1 + (y1 - y0) * (batch - x1) / (x1 - x0))


def _products_seconds(entry: BatchCeilings, n_layers: int) -> float:
    return sum(p.seconds * (n_layers if p.per_layer else 1) for p in entry.products)


def _context_bytes(config: ModelConfig, dtypes: estimate.Dtypes, batch: int, kv_len: int, measured: int) -> int:
    """Bytes an eager decode step at kv_len attended positions moves beyond one at `measured` (attention and KV:
    every other figure of the step does not depend on the context)."""
    at = estimate.decode_step(config, kv_len - 1, dtypes, batch, Kernels.EAGER).totals.total_bytes
    base = estimate.decode_step(config, measured - 1, dtypes, batch, Kernels.EAGER).totals.total_bytes
    return at - base


def kernel_step(ceilings: DecodeCeilings, config: ModelConfig, batch: int, kv_len: int) -> KernelStep:
    """One decode step's time from the measured ceilings (the formula of the module docstring)."""
    xs = ceilings.batch_sizes
    entries = ceilings.batches
    products = _interpolate(batch, xs, [_products_seconds(e, ceilings.n_layers) for e in entries])
    ops = round(_interpolate(batch, xs, [float(e.ops) for e in entries]))
    other = _interpolate(batch, xs, [e.other_seconds for e in entries])
    measured_context = round(_interpolate(batch, xs, [float(e.context) for e in entries]))
    dtypes = estimate.Dtypes.for_weights(get_dtype(ceilings.compute_dtype, COMPUTE_DTYPES))
    extra = _context_bytes(config, dtypes, batch, kv_len, measured_context)
    context_s = extra / ceilings.memory_bandwidth
    return KernelStep(
        batch=batch, kv_len=kv_len, products_seconds=products, ops=ops, op_seconds=other / ops if ops else 0.0,
        ops_seconds=other, context_bytes=extra, context_seconds=context_s,
        seconds=max(products, products + other + context_s), interpolated=batch not in xs,
    )


def mean_step_seconds(ceilings: DecodeCeilings, config: ModelConfig, batch: int, prompt_len: int,
                      steps: int) -> tuple[KernelStep, KernelStep, float]:
    """First and last of `steps` decode steps after a `prompt_len` prompt, and their mean time: every term is
    affine in the context (only the attention/KV bytes depend on it), so the mean is that of the first and last."""
    first = kernel_step(ceilings, config, batch, prompt_len + 1)
    last = kernel_step(ceilings, config, batch, prompt_len + steps)
    return first, last, (first.seconds + last.seconds) / 2


def kernel_decode(ceilings: DecodeCeilings, config: ModelConfig, batch: int, prompt_len: int, new_tokens: int,
                  table_batches: Sequence[int], table_kv_len: int) -> KernelDecode | None:
    """A generation's decode steps under measured kernels; None without decode steps (new_tokens == 1)."""
    steps = new_tokens - 1
    if steps < 1:
        return None
    first, last, mean = mean_step_seconds(ceilings, config, batch, prompt_len, steps)
    table = tuple(kernel_step(ceilings, config, b, table_kv_len) for b in table_batches)
    return KernelDecode(
        ceilings=MEASURED_KERNELS, machine=ceilings.machine, measured_at=ceilings.measured_at,
        weights=ceilings.weights, formats=ceilings.formats, measured_batches=ceilings.batch_sizes,
        first_step=first, last_step=last, time_per_output_token_seconds=mean,
        tokens_per_s_per_sequence=1 / mean, tokens_per_s_total=batch / mean, table=table,
        crossover_batch=growth_crossover([r.batch for r in table], [r.seconds for r in table]),
        crossover_rule=CROSSOVER_RULE,
    )


def ceilings_label(measured_profile: bool, kernels_found: bool) -> str:
    """Which ceilings a decode figure stands on: measured kernels, the measured copy + GEMM, or a datasheet's."""
    if kernels_found:
        return MEASURED_KERNELS
    return COPY_AND_GEMM if measured_profile else DATASHEET

