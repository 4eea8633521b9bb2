"""Which kernels a run uses: the default table's, a `--weights` option's, or `llmtrace tune`'s saved pick.

- `default_choice`: the fixed table per instruction set (tracer/hardware/kernel_defaults.py) for this checkpoint on
  this device: nothing is measured, so the same command on the same machine runs the same kernels every time.
- `tune`: the opt-in measurement (`llmtrace tune`, `run --tune`): the candidates (each dense dtype, each stored kernel
  that runs all the file's matrices, per-type plans) judged by kernel_choice's accuracy rule (a probe where the bits
  do not settle it) and timed at the model's own shapes, one layer's products and the LM head's
  (tracer/hardware/product_timing.py; never a whole model per candidate), the fastest acceptable one saved
  (tracer/hardware/kernel_store.py). Bounded: a candidate whose one layer and head would take more than
  TUNE_BYTES is not timed (said in the result).
- `saved_choice`: tune's pick for `--weights tuned`, judged again by the same rule as a fresh one (kernels this
  llmtrace runs on this device, a compute dtype it has, the accuracy rule with a fresh probe): anything wrong is one
  note and the default table serves instead.
- `fp16_problem`: the range check of an fp16 model (a weight beyond fp16, a residual stream over
  kernel_choice.FP16_ACTIVATION_LIMIT); the loader then computes in fp32.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from llmtrace.tracer.checkpoint.resolve import GGUF, HF, ResolvedModel
from llmtrace.tracer.core.errors import BadArgumentError, HardwareError
from llmtrace.tracer.hardware import kernel_choice as rule, kernel_defaults as table, kernel_store
from llmtrace.tracer.hardware.kernel_choice import CandidateTiming, KernelChoice, TypeKernel
from llmtrace.tracer.hardware.machine_load import LoadWatch, Sampler, is_busy, read_sample
from llmtrace.tracer.hardware.product_timing import (
    DenseKernel,
    ProductKernel,
    machine_key,
    product_shapes,
    time_kernels,
)
from llmtrace.tracer.load.gguf_loader import matrix_infos
from llmtrace.tracer.load.stored_candidates import StoredKernel, kernels_for, probe_errors
from llmtrace.tracer.load.stored_weights import kernel_plan, plan_spec
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.weight_formats import device_refusal, runs_here, stored_kernels

Progress = Callable[[int, int, str], None]  # (done, total, what is being measured)
Timer = Callable[..., tuple[tuple[CandidateTiming, ...], float]]  # product_timing.time_kernels' signature
DENSE_DTYPES = ("fp32", "fp16", "bf16")
MOE_NOT_TUNED = ("`llmtrace tune` does not measure a mixture of experts' kernels; leave --weights out (the default "
                 "table's kernels) or name one (--weights stored, native, i8dot)")
PROBE_TEXT = "The capital of France is Paris. 1, 2, 3: def main():"  # words, digits, code: a few token kinds
TUNE_BYTES = 2**30  # the most one candidate's timed layer and LM head may take (tune's memory beyond the model)


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
    return table.DENSE_DTYPES.get(formats[0]) if len(formats) == 1 else None


# ---- the default table ------------------------------------------------------------------------------------------


def instruction_set(device: torch.device, build: bool = True) -> str:
    """The default table's row for `device`. `build`: whether the C library may be built to find out (a dry run
    does not: it assumes it builds, with its AVX2 rows where the CPU has AVX2)."""
    flags = table.cpu_flags()
    if device.type != "cpu" or not build:
        return table.instruction_set(device.type, True, "avx2" in flags, flags)
    lib = native_kernel.available()
    return table.instruction_set("cpu", lib, lib and native_kernel.library().avx2, flags)


def default_choice(resolved: ResolvedModel, device: torch.device, build: bool = True) -> KernelChoice:
    """The table's kernels for `resolved` on `device` (see the module docstring)."""
    isa = instruction_set(device, build)
    formats = matrix_formats(resolved)
    row = f"{table.default_phrase(isa)} (BENCHMARKS.md \"Default kernels\")"
    if resolved.kind != GGUF or resolved.gguf_header is None:
        dtype = stored_dtype(formats) or "fp32"
        why = f"the checkpoint's own {dtype}" if stored_dtype(formats) else "fp32"
        return _dense_choice(dtype, table.matvec_for(isa, dtype), rule.DEFAULT, f"{row}: {why}", isa, formats)
    plan = table.default_plan(isa, matrix_infos_types(resolved))
    plan = {t: k for t, k in plan.items() if runs_here(k, device)}  # int4pack on a GPU older than its kernel
    if not plan:
        return _dense_choice("fp32", table.matvec_for(isa, "fp32"), rule.DEFAULT, f"{row}: dequantized", isa,
                             formats)
    return stored_choice(plan_spec(plan), "fp32", rule.DEFAULT, row, isa, formats)


def matrix_infos_types(resolved: ResolvedModel) -> tuple[str, ...]:
    """The type names of the matrices the model multiplies (as the loader maps them)."""
    assert resolved.gguf_header is not None
    return tuple(sorted({i.type_name for i in matrix_infos(resolved.gguf_header, resolved.config).values()}))


def stored_choice(spec: str, dtype: str, source: str, rule_line: str, isa: str, formats: Sequence[str]
                  ) -> KernelChoice:
    """A stored choice's record: `spec` one kernel or a kernel per type; the types it leaves dequantized too."""
    plan = kernel_plan(spec)
    each = {t: plan for t in formats} if isinstance(plan, str) else plan
    dense = table.EXACT if dtype == "fp32" else f"{dtype} products"  # a type no kernel of the spec runs
    by_type = []
    for t in sorted(formats):
        kernel = each.get(t)
        if kernel is None or kernel not in _kernels_of(t):
            by_type.append(TypeKernel(t, table.DENSE, dense))
        else:
            by_type.append(TypeKernel(t, kernel, table.NUMERICS.get(kernel, kernel)))
    numerics = table.numerics_summary({b.type: b.numerics for b in by_type})
    return KernelChoice(picked=spec, dtype=dtype, weights=rule.STORED, decode_kernel=spec, source=source,
                        rule=rule_line, numerics=numerics, instruction_set=isa, by_type=tuple(by_type))


def _kernels_of(type_name: str) -> set[str]:
    """Every kernel that runs `type_name` on some device (the numerics of a type a kernel does not run are the
    dense path's)."""
    from llmtrace.tracer.core.ggml_types import GGML_TYPES

    code = next((c for c, (name, _, _) in GGML_TYPES.items() if name == type_name), None)
    if code is None:
        return set()
    return set(stored_kernels(code, "cpu")) | set(stored_kernels(code, "cuda"))


def _dense_choice(dtype: str, decode: str, source: str, rule_line: str, isa: str, formats: Sequence[str]
                  ) -> KernelChoice:
    numerics = table.EXACT if dtype == "fp32" else f"{dtype} products"
    by_type = tuple(TypeKernel(t, table.DENSE, numerics) for t in sorted(formats))
    return KernelChoice(picked=dtype, dtype=dtype, weights=rule.DENSE, decode_kernel=decode, source=source,
                        rule=rule_line, numerics=numerics, instruction_set=isa, by_type=by_type)


def option_choice(resolved: ResolvedModel, dtype: str, spec: str | None, flags: str, isa: str) -> KernelChoice:
    """The record of what options chose: `spec` a stored kernel spec, or None for dense `dtype`."""
    formats = matrix_formats(resolved)
    if spec is None:
        return _dense_choice(dtype, table.matvec_for(isa, dtype), rule.OPTION, flags, isa, formats)
    return stored_choice(spec, dtype, rule.OPTION, flags, isa, formats)


# ---- tune: the opt-in measurement --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Candidates:
    """The candidates of one model on one device, before any timing."""

    kernels: tuple[ProductKernel, ...]  # those to time: acceptable by their bits, or judged by a probe
    bits: dict[str, int | None]  # {candidate: precision_bits}
    probes: dict[str, tuple[str, ...]]  # {candidate or stored kernel: block formats a probe must judge}
    refused: tuple[str, ...]  # "bf16: F16 matrices need 11 significand bits, bf16 keeps 8": never timed
    # {ggml type name of a matrix: the stored kernels that run it, in weight_formats' order}: for a kernel per type
    type_kernels: dict[str, tuple[str, ...]] = field(default_factory=dict)


def dense_dtypes(device: torch.device) -> tuple[str, ...]:
    """The dense candidates `device` can compute in."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return ("fp32", "fp16")
    return DENSE_DTYPES


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
        too_big = _tune_bytes(kernel, resolved)
        if too_big:
            refused.append(f"{kernel.name}: {too_big}")
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


def _tune_bytes(kernel: ProductKernel, resolved: ResolvedModel) -> str:
    """Why a dense candidate's one layer and LM head (what tune holds of it at once) are over TUNE_BYTES, or ""."""
    if not isinstance(kernel, DenseKernel):
        return ""  # a stored candidate holds the file's bytes of one layer and the head: less than dense fp16's
    values = sum(s.rows * s.cols for s in product_shapes(resolved.config))
    need = values * kernel.values.itemsize
    if need <= TUNE_BYTES:
        return ""
    return f"not timed: one layer and the LM head take {need / 1e9:.1f} GB, over tune's {TUNE_BYTES / 1e9:.1f} GB"


def _runnable(kernels: Sequence[str], device: torch.device) -> tuple[str, ...]:
    """`kernels` less any this very device cannot run (int4pack on a GPU older than torch's int4 kernel)."""
    return tuple(k for k in kernels if runs_here(k, device))


def per_type_plans(offered: _Candidates, errors: dict[str, dict[str, float]]) -> dict[str, dict[str, str]]:
    """Kernels per matrix type to time: first the plan of each type's first acceptable stored kernel (weight_formats'
    order; kernel_choice.judge on that type alone), then, one type at a time, that type on its runner-up (its next
    acceptable kernel), since an order is not a measurement. {plan_spec: plan}; {} when some type has no acceptable
    kernel; a plan whose one kernel runs every type is left out (that is a uniform candidate already)."""
    acceptable = {}
    for type_name, names in offered.type_kernels.items():
        acceptable[type_name] = [k for k in names
                                 if rule.judge(k, offered.bits.get(k), [type_name], errors.get(k, {}))[0]]
        if not acceptable[type_name]:
            return {}
    first = {t: ok[0] for t, ok in acceptable.items()}
    plans = [first] + [{**first, t: ok[1]} for t, ok in acceptable.items() if len(ok) > 1]
    return {plan_spec(plan): plan for plan in plans if len(set(plan.values())) > 1}


@dataclass(frozen=True, slots=True)
class Tuned:
    choice: KernelChoice
    saved_to: str | None  # where it was saved (None: it could not be)
    note: str = ""  # one line: a busy machine, a store that could not be written


def tune(resolved: ResolvedModel, device: torch.device, progress: Progress | None = None,
         timer: Timer | None = None, store_path: Path | None = None, sampler: Sampler | None = None) -> Tuned:
    """Measure the candidates for `resolved` on `device` (see the module docstring) and save the pick for
    `--weights tuned`. `timer`: product_timing.time_kernels, looked up at call time (tests inject another);
    `sampler`: the machine-load reading (tests inject readings)."""
    if device.type not in ("cpu", "cuda"):
        raise HardwareError(f"tune times products on cpu and cuda; {device.type} runs the default table")
    if resolved.config.moe is not None:  # its samples are one layer's 2-D matrices; the experts are 3-D stacks
        raise BadArgumentError(MOE_NOT_TUNED)
    formats = matrix_formats(resolved)
    offered = _candidates(resolved, device, formats)
    with LoadWatch(sampler or read_sample) as load:
        started = time.perf_counter()
        choice = _measure(resolved, device, offered, formats, progress, timer)
        choice = replace(choice, measured_seconds=time.perf_counter() - started)
    choice = replace(choice, others_cpu=load.share)
    note = ""
    if is_busy(load.share):
        note = (f"other processes took {load.share:.0%} of the CPUs while tune measured: the figures may be off; "
                "tune again on a quieter machine")
    try:
        saved_to: str | None = str(kernel_store.save_choice(machine_key(str(device)), _model_key(resolved, formats),
                                                            choice, store_path))
    except HardwareError as exc:
        saved_to = None
        note = "; ".join(n for n in (note, f"tuned choice not saved: {exc}") if n)
    return Tuned(choice, saved_to, note)


def _measure(resolved: ResolvedModel, device: torch.device, offered: _Candidates, formats: Sequence[str],
             progress: Progress | None, timer: Timer | None) -> KernelChoice:
    """The probes and the products timed, and the rule's pick among them."""
    kernels = list(offered.kernels)
    errors: dict[str, dict[str, float]] = {}
    plans_guess = 2 if offered.type_kernels else 0
    total = (1 if offered.probes else 0) + len(kernels) + plans_guess
    done = [0]

    def step(what: str) -> None:
        if progress:
            progress(done[0], max(total, done[0] + 1), what)
        done[0] += 1

    if offered.probes:
        assert resolved.gguf_header is not None  # only block formats are probed
        step("accuracy probe of " + ", ".join(offered.probes))
        errors = probe_errors(resolved.gguf_header, resolved.config, offered.probes, str(device))
    plans = per_type_plans(offered, errors)
    for spec in plans:
        assert resolved.gguf_header is not None
        kernels.append(StoredKernel(resolved.gguf_header, resolved.config, spec))
    total = (1 if offered.probes else 0) + len(kernels)

    def timed(what: str) -> None:
        if what.endswith(" products"):
            step(what)

    timings, _ = (timer or time_kernels)(kernels, resolved.config, str(device), progress=timed)
    if progress:
        progress(total, total, "done")
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
    best = rule.select(judged)
    order = rule.ranked(judged)
    runner = next((c for c in order if c.safe and c is not best), None)
    line = "fastest acceptable of the timed candidates" + (
        f" ({runner.reference_s / best.reference_s:.2f}x ahead of {runner.name})" if runner else "")
    if offered.refused:
        line += f"; not timed: {'; '.join(offered.refused)}"
    isa = instruction_set(device)
    if best.weights == rule.STORED:
        choice = stored_choice(best.name, best.dtype, rule.TUNED, line, isa, formats)
    else:
        choice = _dense_choice(best.dtype, best.decode_kernel, rule.TUNED, line, isa, formats)
    return replace(choice, candidates=order)


def _model_key(resolved: ResolvedModel, formats: Sequence[str]) -> str:
    """The saved pick's key: the model's product shapes, layers and formats, and the C kernels' sources (their code
    changed: tune again)."""
    names = [f"native sources {native_kernel.sources_digest()}"] if resolved.kind == GGUF else []
    return kernel_store.model_key(product_shapes(resolved.config), resolved.config.n_layers, formats, names)


# ---- --weights tuned: the saved pick, judged again ---------------------------------------------------------------


def saved_choice(resolved: ResolvedModel, device: torch.device, store_path: Path | None = None
                 ) -> tuple[KernelChoice | None, str, bool]:
    """(tune's saved pick for `resolved` on `device`, judged again; a note; whether one was saved at all). A pick
    that fails the rule is (None, one line saying why, True): the caller runs the default table."""
    if device.type not in ("cpu", "cuda"):
        return None, "", False
    formats = matrix_formats(resolved)
    try:
        saved = kernel_store.load_choice(machine_key(str(device)), _model_key(resolved, formats), store_path)
    except kernel_store.StoreProblem as exc:
        return None, f"tuned kernels: {exc}; ignored, running the defaults", True
    if saved is None:
        return None, "", False
    problem = _rejudged(resolved, device, saved, formats)
    if problem:
        return None, f"tuned kernels ({saved.picked}): {problem}; ignored, running the defaults", True
    return saved, "", True


def _rejudged(resolved: ResolvedModel, device: torch.device, saved: KernelChoice, formats: Sequence[str]) -> str:
    """Why a saved pick cannot run as it is, by the rule a fresh one meets; "" when it can."""
    if saved.dtype not in rule.COMPUTE_BITS:
        return f"unknown compute dtype {saved.dtype!r}"
    if saved.weights == rule.DENSE:
        if saved.picked != saved.dtype or saved.decode_kernel not in ("mv", "mm"):
            return f"a dense pick must name its dtype and mv or mm, not {saved.picked!r} / {saved.decode_kernel!r}"
        bits, kernels = rule.precision_bits(rule.DENSE, saved.dtype), {saved.dtype: formats}
    elif saved.weights == rule.STORED:
        if resolved.kind != GGUF or resolved.gguf_header is None:
            return "stored kernels for a checkpoint that is not a GGUF"
        try:
            plan = kernel_plan(saved.picked)
        except ValueError as exc:
            return f"{exc} in this llmtrace"
        each = {t: k for t, k in ({t: plan for t in formats} if isinstance(plan, str) else plan).items()
                if k in _kernels_of(t)}  # the types it leaves dequantized are the dense path's
        refusal = device_refusal(set(each.values()), device.type)
        if refusal or not all(runs_here(k, device) for k in each.values()):
            return refusal or f"a kernel of it does not run on this {device.type}"
        kernels = {}
        for t, k in each.items():
            kernels.setdefault(k, []).append(t)
        bits = None
    else:
        return f"unknown weights form {saved.weights!r}"
    for name, types in kernels.items():
        kept = bits if saved.weights == rule.DENSE else rule.precision_bits(rule.STORED, rule.STORED_ACTIVATIONS,
                                                                              name)
        short = rule.short_of_bits(kept, types)
        errors = {}
        if short and all(rule.probed(f) for f in short) and resolved.gguf_header is not None:
            errors = probe_errors(resolved.gguf_header, resolved.config, {name: short}, str(device))[name]
        ok, why = rule.judge(name, kept, types, errors)
        if not ok:
            return why
    return ""


# ---- fp16's range ------------------------------------------------------------------------------------------------


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
