"""Measure this machine's two roofline ceilings with torch: GEMM FLOP/s per dtype and copy bandwidth.

The only torch-importing part of the roofline: `llmtrace hardware --measure` calls `measure_machine`, turns the
result into a HardwareProfile (`profile_from_measurement`) and saves it as `this-machine`.

- GEMM: C = A @ B with square n x n matrices, 2*n^3 FLOPs each. n is calibrated per dtype (doubled from 128 until
  one product takes `target_seconds` or n reaches `max_n`), because speeds differ by 100x across dtypes and
  machines (bf16 on an AVX2-only CPU is hundreds of times slower than fp32; with AMX it is faster).
- Bandwidth: dst.copy_(src) on a buffer far larger than the caches, counting bytes read + written (2 x size, as
  STREAM's copy does; a CPU's write-allocate read is not counted, so this is the bandwidth a streaming kernel sees).
- A ceiling is what the machine can do, so each figure comes from the fastest of `repeats` timed runs after one
  warm-up run (on a shared machine the median mostly measures the neighbours); the median and every timing are
  kept in the record, with the share of the CPUs other processes took meanwhile (`others_cpu`,
  tracer/hardware/machine_load.py): a best-of filters short spells of the neighbours, not a build that runs
  throughout, so `run` does not save a quick measurement taken on a busy machine and `--measure` warns.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from llmtrace.tracer.core.dtypes import BF16, FP32, TF32, DType, get_dtype
from llmtrace.tracer.core.errors import BadArgumentError, HardwareError
from llmtrace.tracer.hardware.decode_ceilings import this_cpu_name
from llmtrace.tracer.hardware.dtype_policy import torch_dtype
from llmtrace.tracer.hardware.listing import ProfileRow
from llmtrace.tracer.hardware.machine_load import LoadWatch, Sampler, is_busy
from llmtrace.tracer.hardware.profiles import MEASURABLE_DTYPES, THIS_MACHINE, HardwareProfile

Progress = Callable[[str], None]
MAX_REPEATS = 1000
MEASURE_SCHEMA = "llmtrace.hardware-measure/1"  # `hardware --measure --json` (hardware_measure_schema.json)


@dataclass(frozen=True, slots=True)
class GemmMeasurement:
    dtype: str  # a MEASURABLE_DTYPES name
    n: int  # square matrix size
    flops_per_run: int  # 2 * n^3
    seconds: tuple[float, ...]  # every timed run
    median_seconds: float
    best_seconds: float  # the fastest run
    flops_per_s: float  # flops_per_run / best_seconds


@dataclass(frozen=True, slots=True)
class CopyMeasurement:
    buffer_bytes: int  # size of src (and of dst)
    bytes_per_run: int  # read + written = 2 * buffer_bytes
    seconds: tuple[float, ...]
    median_seconds: float
    best_seconds: float  # the fastest run
    bytes_per_s: float  # bytes_per_run / best_seconds


@dataclass(frozen=True, slots=True)
class MachineMeasurement:
    device: str  # "cpu" or "cuda"
    device_name: str
    threads: int  # torch intra-op threads (CPU)
    torch_version: str
    memory_bytes: int
    gemms: tuple[GemmMeasurement, ...]
    copy: CopyMeasurement
    # The share of the CPUs' time other processes took meanwhile (tracer/hardware/machine_load.py): over its
    # BUSY_SHARE the ceilings are likely low. None: not read (no /proc/stat)
    others_cpu: float | None = None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _memory_bytes(device: str) -> int:
    if device == "cuda":
        return int(torch.cuda.get_device_properties(0).total_memory)
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    # A container's cgroup limit, where there is one, is what this process can really use.
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file, encoding="ascii") as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return int(total)


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return this_cpu_name() or platform.processor() or platform.machine()


def measure_gemm(dtype: DType, device: str = "cpu", repeats: int = 5, target_seconds: float = 0.05,
                 max_n: int = 4096, min_n: int = 128) -> GemmMeasurement:
    """Best FLOP/s of an n x n @ n x n matmul in `dtype`, n calibrated so one run takes about target_seconds."""
    dtype = get_dtype(dtype, MEASURABLE_DTYPES, refusal="cannot measure")
    if dtype is TF32 and device != "cuda":
        raise BadArgumentError("tf32 is a CUDA tensor-core mode; measure it with --device cuda")
    values = torch_dtype(dtype)
    generator = torch.Generator(device="cpu").manual_seed(0)
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype is TF32
    try:
        n = min_n
        while True:
            a = torch.randn(n, n, generator=generator).to(device=device, dtype=values)
            b = torch.randn(n, n, generator=generator).to(device=device, dtype=values)
            one = _timed(lambda: a @ b, device)  # also the warm-up run for this size
            if one >= target_seconds or n * 2 > max_n:
                break
            n *= 2
        seconds = tuple(_timed(lambda: a @ b, device) for _ in range(repeats))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32
    flops = 2 * n**3
    best = min(seconds)
    return GemmMeasurement(dtype.name, n, flops, seconds, statistics.median(seconds), best, flops / best)


def measure_copy(device: str = "cpu", buffer_bytes: int = 256 * 2**20, repeats: int = 5) -> CopyMeasurement:
    """Best bandwidth of dst.copy_(src) over `repeats` runs, counting bytes read + written."""
    if buffer_bytes < 2**20:
        raise BadArgumentError(f"copy buffer of {buffer_bytes} bytes is too small to measure memory; use >= 1 MiB")
    numel = buffer_bytes // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch of dst's pages costs page faults, not bandwidth
    seconds = tuple(_timed(lambda: dst.copy_(src), device) for _ in range(repeats))
    moved = 2 * numel * 4
    best = min(seconds)
    return CopyMeasurement(numel * 4, moved, seconds, statistics.median(seconds), best, moved / best)


def measure_machine(dtypes: tuple[DType, ...] = (FP32, BF16), device: str = "cpu", repeats: int = 5,
                    gemm_target_seconds: float = 0.05, gemm_max_n: int | None = None,
                    copy_bytes: int | None = None, progress: Progress | None = None,
                    sampler: Sampler | None = None) -> MachineMeasurement:
    """Measure GEMM FLOP/s for each of `dtypes` and copy bandwidth on `device` ("cpu" or "cuda"), and how busy
    other processes kept the CPUs meanwhile (`sampler`: machine_load.read_sample; tests inject readings)."""
    if device not in ("cpu", "cuda"):
        raise BadArgumentError(f"unknown device {device!r}; use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise HardwareError("--device cuda: torch sees no CUDA device here; measure with --device cpu")
    if repeats < 1:
        raise BadArgumentError(f"--repeats must be at least 1, got {repeats}")
    if not dtypes:
        raise BadArgumentError("--dtypes is empty; give at least one dtype to measure, e.g. fp32,bf16")
    if repeats > MAX_REPEATS:
        raise BadArgumentError(f"--repeats must be at most {MAX_REPEATS} (the fastest of a few runs sets a ceiling), "
                               f"got {repeats}")
    max_n = gemm_max_n or (16384 if device == "cuda" else 4096)
    buffer = copy_bytes or (2 * 2**30 if device == "cuda" else 256 * 2**20)
    memory = _memory_bytes(device)
    if 2 * buffer > memory // 2:  # source and destination, with room left for everything else
        raise BadArgumentError(f"a copy buffer of {buffer / 2**20:,.0f} MiB needs twice that, more than half of the "
                               f"{memory / 2**30:,.1f} GiB {device} memory here; give a smaller --copy-mib")
    gemms = []
    with LoadWatch(sampler) as load:
        for dtype in dtypes:
            if progress:
                progress(f"GEMM {dtype}")
            gemms.append(measure_gemm(dtype, device, repeats, gemm_target_seconds, max_n))
        if progress:
            progress("copy bandwidth")
        copy = measure_copy(device, buffer, repeats)
    return MachineMeasurement(
        device=device,
        device_name=_device_name(device),
        threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        memory_bytes=memory,
        gemms=tuple(gemms),
        copy=copy,
        others_cpu=load.share,
    )


# `llmtrace run`'s first-use measurement: small enough to finish in well under 2 s on a 2-core CPU (GEMMs up to
# 512 x 512 on the CPU, a 128 MiB copy: past the caches of most CPUs), so a run can show its roofline out of the box.
# `llmtrace hardware --measure` (GEMMs up to 4096, 256 MiB) gives steadier figures.
QUICK = {"cpu": dict(repeats=5, gemm_target_seconds=0.01, gemm_max_n=512, copy_bytes=128 * 2**20),
         "cuda": dict(repeats=3, gemm_target_seconds=0.005, gemm_max_n=4096, copy_bytes=512 * 2**20)}


def quick_measure_machine(dtypes: tuple[DType, ...], device: str = "cpu", progress: Progress | None = None,
                          sampler: Sampler | None = None) -> MachineMeasurement:
    """measure_machine with QUICK's sizes for `device` ("cpu" or "cuda")."""
    if device not in QUICK:
        raise BadArgumentError(f"no quick measurement for device {device!r}; use cpu or cuda")
    return measure_machine(dtypes=dtypes, device=device, progress=progress, sampler=sampler,
                           **QUICK[device])  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class QuickMeasurement:
    """A first-use measurement (`quick_profile`): the profile it gives, the raw record, how long it took."""

    profile: HardwareProfile
    measurement: MachineMeasurement
    dtypes: tuple[str, ...]  # the GEMM dtypes measured, by name
    seconds: float


def quick_profile(dtypes: tuple[DType, ...], device: str = "cpu", progress: Progress | None = None,
                  sampler: Sampler | None = None) -> QuickMeasurement:
    """quick_measure_machine, as a 'this-machine' profile whose source says how it was measured. Like every
    measurement here, each ceiling is the fastest of the timed runs (see the module docstring)."""
    start = time.perf_counter()
    result = quick_measure_machine(dtypes, device, progress, sampler)
    seconds = time.perf_counter() - start
    sizes = QUICK[device]
    profile = replace(
        profile_from_measurement(result, THIS_MACHINE),
        source=f"quick measurement by llmtrace run (torch {result.torch_version}, GEMMs up to "
               f"{sizes['gemm_max_n']}, {sizes['copy_bytes'] // 2**20} MiB copy, best of {sizes['repeats']} runs)",
    )
    return QuickMeasurement(profile=profile, measurement=result, dtypes=tuple(d.name for d in dtypes),
                            seconds=seconds)


def profile_from_measurement(m: MachineMeasurement, name: str = THIS_MACHINE) -> HardwareProfile:
    """The measured ceilings as a profile; dtypes not measured have no peak (None)."""
    peaks = {g.dtype: g.flops_per_s for g in m.gemms}
    where = f"{m.threads} threads" if m.device == "cpu" else "cuda:0"
    return HardwareProfile(
        name=name,
        label=f"{m.device_name} ({where}, measured)",
        memory_bandwidth=m.copy.bytes_per_s,
        memory_bytes=m.memory_bytes,
        fp32=peaks.get("fp32"),
        tf32=peaks.get("tf32"),
        bf16=peaks.get("bf16"),
        fp16=peaks.get("fp16"),
        fp8=None,
        int8=None,
        interconnect="none",
        interconnect_bandwidth=0.0,
        source=f"llmtrace hardware --measure (torch {m.torch_version}, best of {len(m.copy.seconds)} runs)",
        measured=True,
    )


@dataclass(frozen=True, slots=True)
class MeasureReport:
    """`llmtrace hardware --measure`: the profile the measurement gives, the measurement, and where it was saved."""

    schema: str  # MEASURE_SCHEMA
    profile: ProfileRow
    measurement: MachineMeasurement
    saved_to: str | None  # None: not saved (not_saved says why)
    not_saved: str  # "" when saved


def busy_note(m: MachineMeasurement) -> str:
    """Why a measurement is not kept as this machine's ceilings ("" when it is): others kept the CPUs busy
    meanwhile (tracer/hardware/machine_load.py), so its ceilings would judge every later run too low."""
    if not is_busy(m.others_cpu):
        return ""
    return (f"other processes took {m.others_cpu:.0%} of the CPUs meanwhile, so these ceilings are likely low; "
            "measure again when the machine is quiet (LLMTRACE_BUSY_SHARE=1 keeps a measurement whatever the load)")
