"""`--dtype auto` and `--weights auto` for one model on this machine: read the saved choice, or measure the model's
products and save it.

The rule is tracer/hardware/kernel_choice.py's; the timing tracer/hardware/product_timing.py's; the saved choices
tracer/hardware/kernel_store.py's; the stored kernels' adapter and the accuracy probe
tracer/load/stored_candidates.py's. This module knows the checkpoint (which formats its matrices are stored in, so
which candidates are acceptable) and the loaded model (fp16's range checks), so it sits in the load layer.

Flow (`pick`): the matrices' stored formats -> the candidates: each dense dtype, and for a GGUF each stored kernel
that runs all its matrices on the device (weight_formats.stored_kernels: on CUDA torch's, int4pack and blocks; the C
library's on the CPU only), timed and probed on the device; a candidate short of the bits a float-stored matrix
needs is refused untimed, one short of a block format's bits is probed -> one candidate and no probe: taken without
measuring; otherwise the saved choice for this machine and model shape, or a measurement (the probes, then whole
decode steps of the candidates that run as the native C step (tracer/load/step_timing.py), then the products, those
candidates' decode products excepted; seconds, `progress` hears each candidate) that is then saved. While it
measures, the machine's load is read (tracer/hardware/machine_load.py): a measurement during which other processes
took more than BUSY_SHARE of the CPUs serves this run and is saved as `provisional`, which the next run measures
again instead of serving (`Reuse`: `--remeasure` measures whatever is saved; tensor-parallel ranks serve even a
provisional choice, the one their launcher just made, rather than all measuring at once on the same cores). A
damaged store is one line (`note`) and a fresh measurement that replaces it; an unwritable one is one line and an
unsaved choice. After the model is loaded in fp16, `fp16_problem` checks its range: no weight overflowed to inf, and
a probe forward's residual stream stays below kernel_choice.FP16_ACTIVATION_LIMIT; the loader otherwise takes the
next candidate (`without`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from llmtrace.tracer.checkpoint.resolve import GGUF, HF, ResolvedModel
from llmtrace.tracer.core.errors import HardwareError
from llmtrace.tracer.hardware import kernel_choice as rule, kernel_store
from llmtrace.tracer.hardware.kernel_choice import CandidateTiming, KernelChoice
from llmtrace.tracer.hardware.machine_load import LoadWatch, Sampler, busy_share, is_busy, read_sample
from llmtrace.tracer.hardware.product_timing import (
    DenseKernel,
    ProductKernel,
    machine_key,
    product_shapes,
    time_kernels,
)
from llmtrace.tracer.load.gguf_loader import matrix_infos
from llmtrace.tracer.load.stored_candidates import StoredKernel, kernels_for, probe_errors
from llmtrace.tracer.load.step_timing import time_native_steps
from llmtrace.tracer.load.stored_weights import plan_spec
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.weight_formats import runs_here, stored_kernels

Progress = Callable[[str], None]
Timer = Callable[..., tuple[tuple[CandidateTiming, ...], float]]  # product_timing.time_kernels' signature
DENSE_DTYPES = ("fp32", "fp16", "bf16")
PROBE_TEXT = "The capital of France is Paris. 1, 2, 3: def main():"  # words, digits, code: a few token kinds


class Reuse(str, Enum):
    """Which saved choice `pick` serves instead of measuring."""

    SETTLED = "settled"  # one measured on a quiet machine; a provisional one is measured again (the default)
    ANY = "any"  # a provisional one too (tensor-parallel ranks: their launcher measured a moment ago)
    NONE = "none"  # none: measure again and replace it (`llmtrace run --remeasure`)

    @classmethod
    def asked(cls, remeasure: bool) -> "Reuse":
        """What `run` asks for: NONE with --remeasure, else SETTLED."""
        return cls.NONE if remeasure else cls.SETTLED


@dataclass(frozen=True, slots=True)
class PickedKernels:
    choice: KernelChoice
    note: str = ""  # one line for the user: a damaged store replaced, a choice that could not be saved
    saved_to: str | None = None  # where a fresh measurement was saved


def matrix_formats(resolved: ResolvedModel) -> tuple[str, ...]:
    """The stored formats of the checkpoint's matrices (2-D tensors: what the products read), as the file names
    them ("Q4_1", "BF16", "F32"); () when there are no stored weights (a preset with random weights)."""
    if resolved.kind == GGUF and resolved.gguf_header is not None:
        return tuple(sorted({t.type_name for t in resolved.gguf_header.tensors if len(t.shape) == 2}))
    if resolved.kind == HF and resolved.path is not None:
        from llmtrace.tracer.checkpoint.safetensors_header import read_safetensors_checkpoint

        try:
            tensors = read_safetensors_checkpoint(Path(resolved.path)).tensors
        except Exception:  # the loader reports a bad checkpoint properly; here it only means "unknown formats"
            return ("unknown",)
        return tuple(sorted({t.dtype for t in tensors if len(t.shape) == 2}))
    return ()


def stored_dtype(formats: Sequence[str]) -> str | None:
    """The compute dtype the checkpoint is stored in when all its matrices share one float format, else None."""
    names = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}
    return names[formats[0]] if len(formats) == 1 and formats[0] in names else None


def dense_dtypes(device: torch.device) -> tuple[str, ...]:
    """The dense candidates `device` can compute in."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return ("fp32", "fp16")
    return DENSE_DTYPES


@dataclass(frozen=True, slots=True)
class _Candidates:
    """The candidates of one model on one device, before any timing."""

    kernels: tuple[ProductKernel, ...]  # those to time: acceptable by their bits, or judged by a probe
    bits: dict[str, int | None]  # {candidate: precision_bits}
    probes: dict[str, tuple[str, ...]]  # {candidate or stored kernel: block formats a probe must judge}
    refused: tuple[str, ...]  # "bf16: F16 matrices need 11 significand bits, bf16 keeps 8": never timed
    # {ggml type name of a matrix: the stored kernels that run it, in weight_formats' order}: for a kernel per type
    type_kernels: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _candidates(resolved: ResolvedModel, device: torch.device, formats: Sequence[str]) -> _Candidates:
    kernels: list[ProductKernel] = []
    bits: dict[str, int | None] = {}
    probes: dict[str, tuple[str, ...]] = {}
    refused: list[str] = []
    offered: list[tuple[ProductKernel, int | None]] = [
        (DenseKernel(dtype), rule.precision_bits(rule.DENSE, dtype)) for dtype in dense_dtypes(device)]
    header = resolved.gguf_header
    if resolved.kind == GGUF and header is not None:  # the stored kernels that run on this device
        offered += [(StoredKernel(header, resolved.config, k),
                     rule.precision_bits(rule.STORED, rule.STORED_ACTIVATIONS, k))
                    for k in _runnable(kernels_for(header, resolved.config, device.type), device)]
    for kernel, kept in offered:
        short = rule.short_of_bits(kept, formats)
        unprobeable = [f for f in short if not rule.probed(f)]
        if unprobeable:  # a float-stored matrix: fewer bits change the checkpoint's values; nothing to time
            ok, why = rule.judge(kernel.name, kept, unprobeable, {})
            refused.append(f"{kernel.name}: {why}")
            continue
        kernels.append(kernel)
        bits[kernel.name] = kept
        if short:
            probes[kernel.name] = short
    type_kernels: dict[str, tuple[str, ...]] = {}
    if resolved.kind == GGUF and header is not None:
        for info in matrix_infos(header, resolved.config).values():
            type_kernels[info.type_name] = _runnable(stored_kernels(info.ggml_type, device.type), device)
        for type_name, names in type_kernels.items():  # kernels that run only some types are probed for a plan
            for k in names:
                kept = rule.precision_bits(rule.STORED, rule.STORED_ACTIVATIONS, k)
                if rule.short_of_bits(kept, [type_name]) and type_name not in probes.get(k, ()):
                    probes[k] = (*probes.get(k, ()), type_name)
                bits.setdefault(k, kept)
    return _Candidates(tuple(kernels), bits, probes, tuple(refused), type_kernels)


def _runnable(kernels: Sequence[str], device: torch.device) -> tuple[str, ...]:
    """`kernels` less any this very device cannot run (int4pack on a GPU older than torch's int4 kernel)."""
    return tuple(k for k in kernels if runs_here(k, device))


def per_type_plans(offered: _Candidates, errors: dict[str, dict[str, float]]) -> dict[str, dict[str, str]]:
    """Kernels per matrix type to time: first the plan of each type's first acceptable stored kernel (weight_formats'
    order: fastest known first; kernel_choice.judge on that type alone), then, one type at a time, that type on its
    runner-up (its next acceptable kernel), because "fastest known" is an order, not a measurement: a Q8_0 head on
    i16dot and on native are both timed before either is taken. {plan_spec: plan}; {} when some type has no
    acceptable kernel; a plan whose one kernel runs every type is left out (that is a uniform candidate already)."""
    acceptable = {}
    for type_name, names in offered.type_kernels.items():
        acceptable[type_name] = [k for k in names
                                 if rule.judge(k, offered.bits.get(k), [type_name], errors.get(k, {}))[0]]
        if not acceptable[type_name]:
            return {}
    first = {t: ok[0] for t, ok in acceptable.items()}
    plans = [first] + [{**first, t: ok[1]} for t, ok in acceptable.items() if len(ok) > 1]
    return {plan_spec(plan): plan for plan in plans if len(set(plan.values())) > 1}


def pick(resolved: ResolvedModel, device: torch.device, progress: Progress | None = None,
         timer: Timer | None = None, store_path: Path | None = None, reuse: Reuse = Reuse.SETTLED,
         sampler: Sampler | None = None) -> PickedKernels:
    """What `--dtype auto` / `--weights auto` mean for `resolved` on `device` (see the module docstring and
    kernel_choice's rule). `timer`: product_timing.time_kernels, looked up at call time (tests inject another);
    `sampler`: the machine-load reading (machine_load.read_sample, looked up at call time; tests inject readings)."""
    formats = matrix_formats(resolved)
    own = stored_dtype(formats)
    if device.type not in ("cpu", "cuda"):
        fallback = own if own is not None else "fp32"
        return PickedKernels(rule.unmeasured(fallback, f"{device.type}: not measured; the checkpoint's own "
                                                       f"{fallback}" if own else f"{device.type}: not measured; fp32",
                                             own))
    offered = _candidates(resolved, device, formats)
    if len(offered.kernels) == 1 and not offered.probes:
        only = offered.kernels[0]
        return PickedKernels(rule.unmeasured(only.dtype, "the only acceptable candidate ("
                                             + "; ".join(offered.refused) + ")", own))
    machine = machine_key(str(device))
    model = _model_key(resolved, formats, offered)
    note = ""
    try:
        saved = None if reuse is Reuse.NONE else kernel_store.load_choice(machine, model, store_path)
    except kernel_store.StoreProblem as exc:
        saved, note = None, f"kernel choices: {exc}; measuring again"
    if saved is not None and (reuse is Reuse.ANY or not saved.provisional):
        return PickedKernels(replace(saved, from_store=True), note)
    limit = busy_share()  # a bad LLMTRACE_BUSY_SHARE fails now, not after seconds of measuring
    with LoadWatch(sampler or read_sample) as load:
        choice = _measure(resolved, device, offered, formats, own, progress, timer)
    choice = replace(choice, others_cpu=load.share, provisional=is_busy(load.share, limit))
    try:
        saved_to: str | None = str(kernel_store.save_choice(machine, model, choice, store_path))
    except HardwareError as exc:
        saved_to = None
        note = "; ".join(n for n in (note, f"kernel choice not saved: {exc}") if n)
    return PickedKernels(choice, note, saved_to)


def _measure(resolved: ResolvedModel, device: torch.device, offered: _Candidates, formats: Sequence[str],
             own: str | None, progress: Progress | None, timer: Timer | None) -> KernelChoice:
    """The probes, the native steps and the products timed, and the rule's choice among them."""
    errors: dict[str, dict[str, float]] = {}
    if offered.probes:
        assert resolved.gguf_header is not None  # only block formats are probed
        if progress:
            progress("accuracy probe of " + ", ".join(offered.probes))
        errors = probe_errors(resolved.gguf_header, resolved.config, offered.probes, str(device))
    kernels = list(offered.kernels)
    # e.g. i8dot for the Q4 matrices, i16dot or an exact kernel for a Q8_0 one
    plans = per_type_plans(offered, errors)
    for spec in plans:
        assert resolved.gguf_header is not None
        kernels.append(StoredKernel(resolved.gguf_header, resolved.config, spec))
    steps: dict[str, float] = {}
    step_seconds = 0.0
    if resolved.gguf_header is not None and device.type == "cpu":  # the native step runs on the CPU
        started = time.perf_counter()
        steps = time_native_steps(resolved.gguf_header, resolved.config,
                                  [k.name for k in kernels if k.weights == rule.STORED], progress)
        step_seconds = time.perf_counter() - started
    timings, seconds = (timer or time_kernels)(kernels, resolved.config, str(device), progress=progress, steps=steps)
    seconds += step_seconds
    judged = []
    for timing in timings:
        if timing.name in plans:  # acceptable type by type, by construction
            ok, why = True, ""
            probed = [errors[k][t] for t, k in plans[timing.name].items() if t in errors.get(k, {})]
            worst = max(probed) if probed else None
        else:
            ok, why = rule.judge(timing.name, offered.bits.get(timing.name), formats, errors.get(timing.name, {}))
            worst = max(errors[timing.name].values(), default=None) if timing.name in errors else None
        worst = worst if worst is not None and math.isfinite(worst) else None  # JSON holds no NaN; `why` says it
        judged.append(replace(timing, safe=ok, unsafe_reason=why, product_error=worst))
    choice = rule.select(judged, own, seconds)
    if offered.refused:
        choice = replace(choice, rule=f"{choice.rule}; refused: {'; '.join(offered.refused)}")
    return choice


def needs_measurement(resolved: ResolvedModel, device: torch.device) -> bool:
    """Whether `pick` would time anything (several candidates, or a probe to make), rather than take the only one."""
    if device.type not in ("cpu", "cuda"):
        return False
    offered = _candidates(resolved, device, matrix_formats(resolved))
    return len(offered.kernels) > 1 or bool(offered.probes)


def lookup(resolved: ResolvedModel, device: torch.device, store_path: Path | None = None) -> KernelChoice | None:
    """The saved choice for `resolved` on `device` without measuring (a run whose --dtype overrides auto still
    shows what was measured); None when there is none or the store cannot be read."""
    if device.type not in ("cpu", "cuda"):
        return None
    formats = matrix_formats(resolved)
    model = _model_key(resolved, formats, _candidates(resolved, device, formats))
    try:
        return kernel_store.load_choice(machine_key(str(device)), model, store_path)
    except kernel_store.StoreProblem:
        return None


def _model_key(resolved: ResolvedModel, formats: Sequence[str], offered: _Candidates) -> str:
    names = [k.name for k in offered.kernels]
    if any(isinstance(k, StoredKernel) for k in offered.kernels):  # llmtrace's C kernels among them (native, i8dot)
        names.append(f"native sources {native_kernel.sources_digest()}")  # their code changed: measure again
    return kernel_store.model_key(product_shapes(resolved.config), resolved.config.n_layers, formats, names)


def fp16_problem(model: Any, tokenizer: Any) -> str:
    """Why an fp16 model is not safe to run, or "": a weight that overflowed fp16 to inf, or a probe forward whose
    residual stream exceeds FP16_ACTIVATION_LIMIT (or is not finite). The probe runs stage by stage with a hook on
    each layer, then leaves the model as it was (cache reset, hooks removed)."""
    for name, tensor in model.named_parameters():
        if tensor.is_meta:
            continue  # a matrix held as the GGUF stores it (a placeholder): its values are the file's blocks
        if not torch.isfinite(tensor).all():
            return f"{name} overflows fp16"
    ids = list(tokenizer.encode(PROBE_TEXT)) if tokenizer is not None else list(range(1, 17))
    ids = [i for i in ids if 0 <= i < model.config.vocab_size][:32] or [1]
    largest = [0.0]

    def watch(module: Any, args: Any, output: Any) -> None:
        largest[0] = max(largest[0], float(output.detach().abs().max()))  # inf and nan compare as largest / False
        if not torch.isfinite(output).all():
            largest[0] = float("inf")

    handles = [layer.register_forward_hook(watch) for layer in model.layers]
    try:
        model.setup_cache(1, len(ids))
        model.prefill(torch.tensor([ids], device=model.norm.weight.device))
    finally:
        for handle in handles:
            handle.remove()
        model.reset_cache()
    if not largest[0] < rule.FP16_ACTIVATION_LIMIT:
        return (f"a probe's residual stream reaches {largest[0]:.4g}, over fp16's safe {rule.FP16_ACTIVATION_LIMIT:g} "
                "(fp16 tops out at 65504)")
    return ""
