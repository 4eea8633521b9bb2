"""Roofline: what a model's prefill and decode cost on given hardware, and which ceiling bounds them. Pure Python.

The FLOPs and bytes of every pass come from llmtrace.tracer.analytic.estimate (one cost model for the whole project); this module
only divides them over tensor-parallel devices (llmtrace.tracer.analytic.tensor_parallel) and puts them against the hardware's two
ceilings (Williams, Waterman & Patterson 2009, "Roofline"):

    time(pass) = max(FLOPs / peak FLOP/s, bytes / memory bandwidth) + all-reduce bytes / link bandwidth

A pass whose arithmetic intensity (FLOPs executed per byte moved) is under the ridge point (peak / bandwidth) is
memory-bound. What the kernels execute and move is the kernel model's (llmtrace.tracer.analytic.kernels): `fused`
(FlashAttention, elementwise ops fused: the default for GPU profiles) computes the causal pairs only and keeps the
attention scores on chip; `eager` (llmtrace's own model: the default for `this-machine`) computes every pair and
writes each operation's output to memory. Bytes are weights read once per pass, the KV cache read and written,
and the activations the kernels pass between them.

Each time is the ceiling's: what kernels running at the full peak FLOP/s and the full memory bandwidth would take.
Real kernels reach a share of both (tuned GEMMs ~70-80% of peak, decode GEMVs ~80-90% of bandwidth), so measured
times sit above these, by that share; a time far above them means the kernels are not the ones modelled.

A generation is the prefill (time to first token) plus N - 1 decode steps, each step bounded on its own and summed
exactly (a step's FLOPs and bytes grow linearly with its context, so the sum has a closed form; see
`_decode_sum`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmtrace.tracer.analytic import estimate
from llmtrace.tracer.analytic.kernels import DESCRIPTIONS, Kernels, default_kernels, parse_kernels
from llmtrace.tracer.analytic.kvmem import kv_cache_bytes
from llmtrace.tracer.analytic.moe import MoeSummary
from llmtrace.tracer.analytic.params import count_params, norm_dtype_for, weight_bytes
from llmtrace.tracer.analytic.tensor_parallel import (
    ALLREDUCES_PER_LAYER,
    DeviceCost,
    allreduce_payload_bytes,
    check_tp,
    device_cost,
    tp_sizes,
)
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import BF16, COMPUTE_DTYPES, DTYPES, FP8, FP16, FP32, DType, activation_dtype_for
from llmtrace.tracer.core.errors import BadArgumentError, HardwareError
from llmtrace.tracer.hardware.profiles import HardwareProfile
from llmtrace.tracer.roofline.kernel_decode import KernelDecode, ceilings_label

COMPUTE, MEMORY = "compute", "memory"
ROOFLINE_SCHEMA = "llmtrace.roofline/1"  # `roofline --json` (tracer/roofline/roofline_schema.json)
MAX_TABLE_BATCH = 4096


@dataclass(frozen=True, slots=True)
class Machine:
    """The ceilings this prediction uses: one device of `hardware`, computing in `compute_dtype`."""

    hardware: str
    label: str
    compute_dtype: str
    compute_note: str  # why that dtype's peak applies
    peak_flops: float  # FLOP/s
    memory_bandwidth: float  # bytes/s
    ridge_point: float  # FLOPs per byte
    memory_bytes: int
    interconnect: str
    link_bandwidth_one_way: float  # bytes/s a device sends while it receives as much
    measured: bool


@dataclass(frozen=True, slots=True)
class PassBound:
    """One forward pass on one device: its work, its traffic, and the ceiling that bounds it."""

    name: str  # "prefill", "first decode step", "last decode step"
    batch: int
    new_tokens: int  # T per sequence
    kv_len: int  # S: positions attended after this pass
    flops: int  # per device, as the kernel model executes them
    useful_flops: int  # attention products over the causal pairs only
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    activation_bytes: int
    bytes: int  # weights + KV read + KV written + activations
    arithmetic_intensity: float  # flops / bytes: FLOPs executed per byte the kernels move
    compute_seconds: float  # flops / peak
    memory_seconds: float  # bytes / bandwidth
    comm_bytes: int  # all-reduce bytes this device sends (0 when tp = 1)
    comm_seconds: float
    bound: str  # "compute" | "memory"
    seconds: float  # max(compute, memory) + comm
    attainable_flops_per_s: float  # min(peak, bandwidth * intensity): the roof above this pass
    intensity_vs_ridge: float  # arithmetic_intensity / the ridge point (< 1: memory-bound)
    passes_per_s_at_peak: float  # 1 / compute_seconds: the rate if compute were the only limit


@dataclass(frozen=True, slots=True)
class GenerationBound:
    prompt_len: int
    new_tokens: int
    batch: int
    decode_steps: int  # new_tokens - 1: the prefill yields the first token
    ttft_seconds: float  # the prefill
    decode_seconds: float  # all decode steps, each bounded on its own
    decode_comm_seconds: float  # of which all-reduce time
    memory_bound_decode_steps: int
    time_per_output_token_seconds: float | None  # mean decode step; None without decode steps
    tokens_per_s_per_sequence: float | None  # decode_steps / decode_seconds
    tokens_per_s_total: float | None  # times batch
    total_seconds: float  # ttft + decode


@dataclass(frozen=True, slots=True)
class Crossover:
    """Where decode stops being memory-bound as the batch grows, at one decode step's context."""

    kv_len: int
    per_sequence_flops: int  # FLOPs each sequence adds to the step
    shared_bytes: int  # bytes the step moves whatever the batch (the weights)
    per_sequence_bytes: int  # bytes each sequence adds (its KV cache, its activations)
    per_sequence_intensity: float  # per_sequence_flops / shared_bytes
    ridge_point: float
    crossover_batch_weights_only: float  # ridge / per_sequence_intensity (KV traffic ignored)
    intensity_limit: float  # per_sequence_flops / per_sequence_bytes: the intensity as batch -> infinity
    crossover_batch: int | None  # smallest batch whose step is compute-bound, KV included; None = never


@dataclass(frozen=True, slots=True)
class BatchRow:
    batch: int
    step_seconds: float
    bound: str
    arithmetic_intensity: float
    tokens_per_s_per_sequence: float
    tokens_per_s_total: float
    kv_bytes_per_device: int  # at the table's context
    memory_bytes_per_device: int  # weights + KV
    fits: bool
    attainable_flops_per_s: float  # min(peak, bandwidth * intensity): the roof above this step


@dataclass(frozen=True, slots=True)
class MemoryFit:
    capacity_bytes: int
    batch: int
    positions: int  # per sequence: the generation's final length (prompt + decode steps)
    weight_bytes_per_device: int
    kv_bytes_per_device: int  # at the generation's final length, whole batch
    # The largest working set one kernel needs beside them (its activation inputs + outputs): under eager kernels
    # a long prefill's materialised attention scores, B·H·T·S values read and written by the scaling.
    activation_bytes_per_device: int
    needed_bytes: int
    free_bytes: int  # negative when it does not fit
    fits: bool
    max_batch: int  # sequences of the generation's final length that fit beside the weights (activations included)


@dataclass(frozen=True, slots=True)
class TensorParallel:
    tp: int
    interconnect: str
    link_bandwidth_one_way: float
    link_bandwidth: float  # both directions together, as datasheets print it (0 when tp = 1)
    allreduces_per_layer: int
    prefill_payload_bytes: int  # one all-reduce in the prefill: B*P*d activations
    decode_payload_bytes: int  # one all-reduce in a decode step: B*d
    prefill_comm_bytes: int  # sent per device, whole prefill (ring: 2(N-1)/N of each payload)
    decode_comm_bytes_per_step: int
    prefill_comm_seconds: float
    decode_comm_seconds_per_step: float


@dataclass(frozen=True, slots=True)
class RooflineReport:
    model: str
    kernels: str  # "eager" | "fused": the kernel model every figure below is costed under
    kernels_from: str  # "option" (--kernels) or "default" (fused for a GPU profile, eager for this-machine)
    kernels_description: str
    parameters: int
    active_parameters: int  # those one token's pass uses (a mixture of experts' k of E); `parameters` when dense
    weights_dtype: str
    kv_dtype: str
    activation_dtype: str
    machine: Machine
    tensor_parallel: TensorParallel
    memory: MemoryFit
    prefill: PassBound
    first_decode: PassBound | None
    last_decode: PassBound | None
    generation: GenerationBound
    crossover: Crossover
    table_kv_len: int  # context of the batch table's decode step
    batch_table: tuple[BatchRow, ...]
    # A mixture of experts: the experts the batch table's decode step reads at several batch sizes (whole model, not
    # per device); None for a dense model. Its weights grow with the batch, which `crossover` (from batch 1 and 2)
    # counts as per-sequence bytes.
    moe: MoeSummary | None
    notes: tuple[str, ...]
    # where weights_dtype came from: "option" (--dtype), "checkpoint" (the file's main type, e.g. a GGUF's q4_1)
    # or "default" (fp16)
    weights_dtype_from: str = "option"
    # what the decode figures above stand on: "datasheet peak + bandwidth", "memcpy + square GEMM" (a measured
    # profile's copy bandwidth and GEMM FLOP/s) or "measured kernels at decode shapes" (then `kernel_decode` holds
    # the decode predicted from them: llmtrace.tracer.roofline.measured_decode)
    decode_ceilings: str = ""
    kernel_decode: KernelDecode | None = None
    schema: str = ROOFLINE_SCHEMA  # `--json` writes it first


# ---- ceilings -------------------------------------------------------------------------------------------------


def activations_for(weights: DType, hardware: HardwareProfile) -> DType:
    """The activations' dtype (and the KV cache's by default) of a model with `weights` on `hardware`: the
    weights' own for fp32/bf16/fp16; for a quantized format, fp32 on a measured profile (this machine, where
    llmtrace's own model runs: it multiplies weights held as stored with fp32 activations, as `run` does) and
    fp16 on a datasheet profile (what inference engines keep around block formats)."""
    if weights in COMPUTE_DTYPES:
        return weights
    return FP32 if hardware.measured else activation_dtype_for(weights)


def compute_dtype_for(weights: DType, hardware: HardwareProfile) -> tuple[str, str]:
    """The dtype whose peak bounds the matmuls, and why: the one rule of `roofline` and `run`'s summary.

    fp32/bf16/fp16 weights compute in their own dtype (fp32 without tf32, PyTorch's default). fp8 uses fp8 tensor
    cores where the hardware has them. int8, int4 and a GGUF's block formats are dequantized by the kernel and
    multiplied in the activations' dtype (activations_for: fp16 on a GPU profile, fp32 on this machine). fp16 and
    bf16 stand in for each other (same rate on every profile) when a profile lacks one.
    """
    if weights in COMPUTE_DTYPES:
        wanted, note = weights.name, ""
    elif weights is FP8 and hardware.has_peak(FP8.name):
        wanted, note = FP8.name, ""
    else:
        wanted = activations_for(weights, hardware).name
        note = f"{weights.name} weights are dequantized in the kernel and multiplied in {wanted}"
    if not hardware.has_peak(wanted) and wanted in (FP16.name, BF16.name):
        other = BF16.name if wanted == FP16.name else FP16.name
        if hardware.has_peak(other):
            note = (note + "; " if note else "") + f"{hardware.name} has no {wanted} peak, its {other} peak is used"
            wanted = other
    hardware.peak(wanted)  # one-line HardwareError if there is still none
    return wanted, note


def machine_for(hardware: HardwareProfile, weights: DType) -> Machine:
    dtype, note = compute_dtype_for(weights, hardware)
    peak = hardware.peak(dtype)
    return Machine(
        hardware=hardware.name, label=hardware.label, compute_dtype=dtype, compute_note=note, peak_flops=peak,
        memory_bandwidth=hardware.memory_bandwidth, ridge_point=peak / hardware.memory_bandwidth,
        memory_bytes=hardware.memory_bytes, interconnect=hardware.interconnect,
        link_bandwidth_one_way=hardware.link_bandwidth_one_way, measured=hardware.measured,
    )


def _comm_seconds(comm_bytes: int, machine: Machine) -> float:
    return comm_bytes / machine.link_bandwidth_one_way if comm_bytes else 0.0


def bound_pass(name: str, phase: estimate.PhaseEstimate, cost: DeviceCost, machine: Machine) -> PassBound:
    """Put one pass's per-device cost against the ceilings."""
    compute = cost.flops / machine.peak_flops
    memory = cost.bytes / machine.memory_bandwidth
    comm = _comm_seconds(cost.comm_bytes, machine)
    intensity = cost.flops / cost.bytes
    return PassBound(
        name=name, batch=phase.batch, new_tokens=phase.new_tokens, kv_len=phase.kv_len, flops=cost.flops,
        useful_flops=cost.useful_flops, weight_bytes=cost.weight_bytes, kv_read_bytes=cost.kv_read_bytes,
        kv_write_bytes=cost.kv_write_bytes, activation_bytes=cost.activation_bytes, bytes=cost.bytes,
        arithmetic_intensity=intensity, compute_seconds=compute, memory_seconds=memory, comm_bytes=cost.comm_bytes,
        comm_seconds=comm, bound=COMPUTE if compute >= memory else MEMORY, seconds=max(compute, memory) + comm,
        attainable_flops_per_s=min(machine.peak_flops, machine.memory_bandwidth * intensity),
        intensity_vs_ridge=intensity / machine.ridge_point,
        passes_per_s_at_peak=1 / compute if compute else math.inf,
    )


# ---- decode over a whole generation ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Context:
    config: ModelConfig
    dtypes: estimate.Dtypes
    tp: int
    machine: Machine
    kernels: Kernels

    def decode_cost(self, cached: int, batch: int) -> tuple[estimate.PhaseEstimate, DeviceCost]:
        phase = estimate.decode_step(self.config, cached, self.dtypes, batch, self.kernels)
        return phase, device_cost(self.config, phase, self.dtypes.activations.bytes_per_value, self.tp)


def _affine_sum(x0: float, x1: float, start: int, stop: int) -> float:
    """sum of x0 + x1*k for k in [start, stop)."""
    n = stop - start
    return n * x0 + x1 * (start + stop - 1) * n / 2 if n > 0 else 0.0


def _sum_max_affine(c0: float, c1: float, m0: float, m1: float, steps: int) -> tuple[float, int]:
    """sum over k < steps of max(c0 + c1 k, m0 + m1 k), and how many k have m >= c (memory-bound), exactly."""
    d0, d1 = c0 - m0, c1 - m1  # compute minus memory
    if d1 == 0:
        split = 0 if d0 > 0 else steps  # all compute-bound, or all memory-bound
        memory_first = True
    else:
        crossing = -d0 / d1  # d(k) = 0
        if d1 > 0:  # memory-bound first, compute-bound from the crossing on
            split = min(steps, max(0, math.floor(crossing) + 1))
            memory_first = True
        else:  # compute-bound first
            split = min(steps, max(0, math.floor(crossing) + 1))
            memory_first = False
    if memory_first:
        total = _affine_sum(m0, m1, 0, split) + _affine_sum(c0, c1, split, steps)
        return total, split
    total = _affine_sum(c0, c1, 0, split) + _affine_sum(m0, m1, split, steps)
    return total, steps - split


def _is_affine(a: DeviceCost, mid: DeviceCost, b: DeviceCost, k_mid: int, k_b: int) -> bool:
    """Whether the middle step's figures lie on the line through the first and last (up to ceil rounding)."""
    for fa, fm, fb in zip(_fields(a), _fields(mid), _fields(b)):
        expected = fa + (fb - fa) * k_mid / k_b
        if abs(fm - expected) > 64 + 1e-12 * abs(expected):
            return False
    return True


def _fields(c: DeviceCost) -> tuple[int, int, int]:
    return c.flops, c.bytes, c.comm_bytes


def _decode_sum(ctx: _Context, first_cached: int, steps: int, batch: int) -> tuple[float, float, int]:
    """(seconds, all-reduce seconds, memory-bound steps) of `steps` decode steps from `first_cached` positions.

    Every step's FLOPs and bytes are affine in its context (checked on three steps; if estimate.py ever made them
    otherwise, every step is estimated on its own), so the sum of per-step maxima has a closed form.
    """
    m = ctx.machine
    if steps == 0:
        return 0.0, 0.0, 0
    if steps <= 3:
        costs = [ctx.decode_cost(first_cached + k, batch)[1] for k in range(steps)]
    else:
        a = ctx.decode_cost(first_cached, batch)[1]
        b = ctx.decode_cost(first_cached + steps - 1, batch)[1]
        k_mid = (steps - 1) // 2
        mid = ctx.decode_cost(first_cached + k_mid, batch)[1]
        if _is_affine(a, mid, b, k_mid, steps - 1):
            span = steps - 1
            c0, c1 = a.flops / m.peak_flops, (b.flops - a.flops) / span / m.peak_flops
            m0, m1 = a.bytes / m.memory_bandwidth, (b.bytes - a.bytes) / span / m.memory_bandwidth
            roof, memory_steps = _sum_max_affine(c0, c1, m0, m1, steps)
            comm = _comm_seconds(a.comm_bytes, m) * steps  # B*d per all-reduce: the same every step
            return roof + comm, comm, memory_steps
        costs = [ctx.decode_cost(first_cached + k, batch)[1] for k in range(steps)]
    roof = sum(max(c.flops / m.peak_flops, c.bytes / m.memory_bandwidth) for c in costs)
    comm = sum(_comm_seconds(c.comm_bytes, m) for c in costs)
    memory_steps = sum(1 for c in costs if c.bytes / m.memory_bandwidth > c.flops / m.peak_flops)
    return roof + comm, comm, memory_steps


# ---- memory -----------------------------------------------------------------------------------------------


def weight_bytes_per_device(config: ModelConfig, weights: DType, tp: int,
                            stored: tuple[tuple[str, int, int], ...] = ()) -> int:
    """Matrices split over tp devices; norm vectors replicated on each. `stored` (a GGUF's tensors as stored,
    estimate.Dtypes.stored): the file's bytes instead of `weights`' size."""
    if stored:
        norms = sum(n_bytes for name, n_bytes, _ in stored if "norm" in name)
        return -(-(sum(n_bytes for _, n_bytes, _ in stored) - norms) // tp) + norms
    norms = norm_dtype_for(weights).matrix_bytes(1, config.dim * (2 * config.n_layers + 1))
    return -(-(weight_bytes(config, weights) - norms) // tp) + norms


def kv_bytes_per_device(config: ModelConfig, positions: int, kv: DType, batch: int, tp: int) -> int:
    return -(-kv_cache_bytes(config, positions, kv, batch) // tp)


def _memory_fit(config: ModelConfig, dtypes: estimate.Dtypes, tp: int, positions: int, batch: int,
                capacity: int, activation_peak: int) -> MemoryFit:
    """`activation_peak`: the largest working set of one kernel per device over the generation's passes."""
    w = weight_bytes_per_device(config, dtypes.weights, tp, dtypes.stored)
    kv = kv_bytes_per_device(config, positions, dtypes.kv, batch, tp)
    # Every activation scales with the batch: each sequence brings its share of the peak along with its KV cache.
    per_sequence = kv_bytes_per_device(config, positions, dtypes.kv, 1, tp) + -(-activation_peak // batch)
    needed = w + kv + activation_peak
    return MemoryFit(
        capacity_bytes=capacity, batch=batch, positions=positions, weight_bytes_per_device=w,
        kv_bytes_per_device=kv, activation_bytes_per_device=activation_peak, needed_bytes=needed,
        free_bytes=capacity - needed, fits=needed <= capacity, max_batch=max(0, capacity - w) // per_sequence,
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:,.1f} MiB"


def _check_fits(config: ModelConfig, fit: MemoryFit, hardware: HardwareProfile, dtypes: estimate.Dtypes,
                tp: int, positions: int, batch: int, kernels: Kernels) -> None:
    """A one-line HardwareError saying by how much the model does not fit, and what would make it fit."""
    if fit.fits:
        return
    hints = []
    if fit.weight_bytes_per_device > fit.capacity_bytes:
        if hardware.interconnect_bandwidth > 0:
            enough = [n for n in tp_sizes(config)
                      if n > tp and weight_bytes_per_device(config, dtypes.weights, n, dtypes.stored) < fit.capacity_bytes]
            if enough:
                hints.append(f"--tp {enough[0]}")
        smaller = [d.name for d in DTYPES.values() if d.bits_per_value < dtypes.weights.bits_per_value]
        if smaller:
            hints.append(f"a smaller --dtype ({', '.join(smaller[-2:])})")
        hints.append("hardware with more memory")
    else:
        if kernels is Kernels.EAGER and fit.activation_bytes_per_device > fit.kv_bytes_per_device:
            hints.append("--kernels fused (attention scores never in memory)")
        if fit.max_batch:
            hints.append(f"--batch {fit.max_batch}")
        hints.append("a shorter --prompt-len/--max-new-tokens")
        if dtypes.kv.bits_per_value > 8.5:
            hints.append("--kv-dtype int8")
    per = " per device" if tp > 1 else ""
    raise HardwareError(
        f"{config.name} ({dtypes.weights.name}{f', tp {tp}' if tp > 1 else ''}) does not fit on {hardware.name}: "
        f"needs {_gib(fit.needed_bytes)}{per} (weights {_gib(fit.weight_bytes_per_device)} + KV cache "
        f"{_gib(fit.kv_bytes_per_device)} for {batch} x {positions:,} positions + {kernels.value} kernels' largest "
        f"activations {_gib(fit.activation_bytes_per_device)}), has {_gib(fit.capacity_bytes)}: "
        f"{_gib(-fit.free_bytes)} short; try {' or '.join(hints)}"
    )


# ---- crossover and batch table ------------------------------------------------------------------------------


def _crossover(ctx: _Context, cached: int) -> Crossover:
    phase1, one = ctx.decode_cost(cached, 1)
    _, two = ctx.decode_cost(cached, 2)
    per_seq_flops = two.flops - one.flops
    per_seq_bytes = two.bytes - one.bytes
    shared = one.bytes - per_seq_bytes
    ridge = ctx.machine.ridge_point
    per_seq_intensity = per_seq_flops / shared
    limit = per_seq_flops / per_seq_bytes if per_seq_bytes else math.inf
    # Compute-bound when B * F1 >= ridge * (shared + B * K1), i.e. B >= ridge * shared / (F1 - ridge * K1).
    margin = per_seq_flops - ridge * per_seq_bytes
    exact = math.ceil(ridge * shared / margin) if margin > 0 else None
    return Crossover(
        kv_len=phase1.kv_len, per_sequence_flops=per_seq_flops, shared_bytes=shared,
        per_sequence_bytes=per_seq_bytes, per_sequence_intensity=per_seq_intensity, ridge_point=ridge,
        crossover_batch_weights_only=ridge / per_seq_intensity, intensity_limit=limit, crossover_batch=exact,
    )


def _table_batches(crossover: Crossover, max_batch: int) -> list[int]:
    top = max(8, 2 * max_batch, 2 * (crossover.crossover_batch or 0), 2 * math.ceil(crossover.crossover_batch_weights_only))
    top = min(top, MAX_TABLE_BATCH)
    batches = {1}
    b = 1
    while b < top:
        b *= 2
        batches.add(b)
    for extra in (crossover.crossover_batch, max_batch):
        if extra and extra <= MAX_TABLE_BATCH:
            batches.add(extra)
    return sorted(batches)


def _batch_table(ctx: _Context, cached: int, crossover: Crossover, max_batch: int, capacity: int,
                 activation_peak_per_sequence: int) -> tuple[BatchRow, ...]:
    """A decode step's row for each batch of the table (_table_batches), at `cached` positions."""
    return tuple(_batch_row(ctx, cached, b, capacity, activation_peak_per_sequence)
                 for b in _table_batches(crossover, max_batch))


def _batch_row(ctx: _Context, cached: int, batch: int, capacity: int, activation_peak_per_sequence: int) -> BatchRow:
    phase, cost = ctx.decode_cost(cached, batch)
    p = bound_pass("decode", phase, cost, ctx.machine)
    w = weight_bytes_per_device(ctx.config, ctx.dtypes.weights, ctx.tp, ctx.dtypes.stored)
    kv = kv_bytes_per_device(ctx.config, phase.kv_len, ctx.dtypes.kv, batch, ctx.tp)
    return BatchRow(
        batch=batch, step_seconds=p.seconds, bound=p.bound, arithmetic_intensity=p.arithmetic_intensity,
        tokens_per_s_per_sequence=1 / p.seconds, tokens_per_s_total=batch / p.seconds, kv_bytes_per_device=kv,
        memory_bytes_per_device=w + kv, fits=w + kv + batch * activation_peak_per_sequence <= capacity,
        attainable_flops_per_s=p.attainable_flops_per_s,
    )


# ---- the report ---------------------------------------------------------------------------------------------


def _generation(prefill: PassBound, decode: tuple[float, float, int], prompt_len: int, new_tokens: int,
                batch: int) -> GenerationBound:
    """The whole generation from the prefill's bound and _decode_sum's (seconds, all-reduce seconds, steps bound
    by memory) over the new_tokens - 1 decode steps."""
    decode_s, decode_comm_s, memory_steps = decode
    steps = new_tokens - 1
    return GenerationBound(
        prompt_len=prompt_len, new_tokens=new_tokens, batch=batch, decode_steps=steps,
        ttft_seconds=prefill.seconds, decode_seconds=decode_s, decode_comm_seconds=decode_comm_s,
        memory_bound_decode_steps=memory_steps,
        time_per_output_token_seconds=decode_s / steps if steps else None,
        tokens_per_s_per_sequence=steps / decode_s if steps else None,
        tokens_per_s_total=batch * steps / decode_s if steps else None,
        total_seconds=prefill.seconds + decode_s,
    )


def _tensor_parallel(config: ModelConfig, hardware: HardwareProfile, tp: int, batch: int, prompt_len: int, act: int,
                     prefill: PassBound, first: PassBound | None) -> TensorParallel:
    """The all-reduces' part of the report: all zero for one device."""
    split = tp > 1
    return TensorParallel(
        tp=tp, interconnect=hardware.interconnect if split else "none",
        link_bandwidth_one_way=hardware.link_bandwidth_one_way if split else 0.0,
        link_bandwidth=hardware.interconnect_bandwidth if split else 0.0,
        allreduces_per_layer=ALLREDUCES_PER_LAYER if split else 0,
        prefill_payload_bytes=allreduce_payload_bytes(config, batch, prompt_len, act) if split else 0,
        decode_payload_bytes=allreduce_payload_bytes(config, batch, 1, act) if split else 0,
        prefill_comm_bytes=prefill.comm_bytes, decode_comm_bytes_per_step=first.comm_bytes if first else 0,
        prefill_comm_seconds=prefill.comm_seconds, decode_comm_seconds_per_step=first.comm_seconds if first else 0.0,
    )


def _notes(config: ModelConfig, hardware: HardwareProfile, machine: Machine, final_positions: int,
           tp: int) -> tuple[str, ...]:
    notes = []
    if machine.compute_note:
        notes.append(machine.compute_note + ".")
    if final_positions > config.max_seq_len:
        notes.append(f"{final_positions:,} positions exceed {config.name}'s trained context of {config.max_seq_len:,}.")
    if machine.measured:
        notes.append(f"{hardware.name} ceilings are measured ({hardware.source}).")
    if tp > 1:
        notes.append("All-reduce time assumes no overlap with compute and ignores per-call latency.")
    return tuple(notes)


def roofline(config: ModelConfig, hardware: HardwareProfile, prompt_len: int = 512, new_tokens: int = 128,
             batch: int = 1, dtype: DType = FP16, kv_dtype: DType | None = None, tp: int = 1,
             check_fit: bool = True, kernels: str | Kernels | None = None,
             weights_from: str = "option", stored: tuple[tuple[str, int, int], ...] = ()) -> RooflineReport:
    """The roofline prediction for generating `new_tokens` after a `prompt_len` prompt, `batch` sequences at once.

    kernels: "eager" or "fused" (llmtrace.tracer.analytic.kernels); None = the hardware's default (fused on a GPU
    profile, eager on this-machine).

    Raises BadArgumentError / HardwareError (one line each) for a bad batch, prompt or tp, a dtype the hardware
    has no peak for, and, with check_fit, a model + KV cache that does not fit in the devices' memory.
    """
    estimate.check_count("--batch", batch)
    estimate.check_count("--prompt-len", prompt_len)
    estimate.check_count("--max-new-tokens", new_tokens)
    weights = dtype
    activations = activations_for(weights, hardware)
    # stored: a GGUF's tensors at their own sizes
    dtypes = estimate.Dtypes(weights=weights, kv=kv_dtype or activations, activations=activations, stored=stored)
    check_tp(config, tp, hardware)
    kernels_from = "option" if kernels is not None else "default"
    kernels = parse_kernels(kernels) if kernels is not None else default_kernels(hardware)
    machine = machine_for(hardware, weights)
    ctx = _Context(config, dtypes, tp, machine, kernels)
    act = dtypes.activations.bytes_per_value
    steps = new_tokens - 1
    final_positions = prompt_len + steps

    pre_phase = estimate.prefill(config, prompt_len, dtypes, batch, kernels)
    pre_cost = device_cost(config, pre_phase, act, tp)
    first_cost = last_cost = None
    if steps:
        first_cost = ctx.decode_cost(prompt_len, batch)
        last_cost = ctx.decode_cost(final_positions - 1, batch)
    peak = max(pre_cost.peak_activation_bytes, last_cost[1].peak_activation_bytes if last_cost else 0)
    fit = _memory_fit(config, dtypes, tp, final_positions, batch, hardware.memory_bytes, peak)
    if check_fit:
        _check_fits(config, fit, hardware, dtypes, tp, final_positions, batch, kernels)

    prefill = bound_pass("prefill", pre_phase, pre_cost, machine)
    first = last = None
    if first_cost and last_cost:
        first = bound_pass("first decode step", *first_cost, machine)
        last = bound_pass("last decode step", *last_cost, machine)
    generation = _generation(prefill, _decode_sum(ctx, prompt_len, steps, batch), prompt_len, new_tokens, batch)
    table_cached = max(final_positions - 1, prompt_len)
    crossover = _crossover(ctx, table_cached)
    table = _batch_table(ctx, table_cached, crossover, fit.max_batch, hardware.memory_bytes, -(-peak // batch))
    params = count_params(config)
    return RooflineReport(
        model=config.name, kernels=kernels.value, kernels_from=kernels_from, kernels_description=DESCRIPTIONS[kernels],
        parameters=params.total, active_parameters=params.active, weights_dtype=weights.name,
        kv_dtype=dtypes.kv.name, activation_dtype=dtypes.activations.name, machine=machine,
        tensor_parallel=_tensor_parallel(config, hardware, tp, batch, prompt_len, act, prefill, first), memory=fit,
        prefill=prefill, first_decode=first, last_decode=last,
        generation=generation, crossover=crossover, table_kv_len=table_cached + 1, batch_table=table,
        moe=estimate.moe_reads(config, table_cached, dtypes, batch, kernels),
        notes=_notes(config, hardware, machine, final_positions, tp), weights_dtype_from=weights_from,
        decode_ceilings=ceilings_label(hardware.measured, kernels_found=False),
    )
