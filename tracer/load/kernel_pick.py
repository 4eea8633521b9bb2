"""`--dtype auto` for one model on this machine: read the saved choice, or measure the model's products and save it.

The rule is tracer/hardware/kernel_choice.py's; the timing tracer/hardware/product_timing.py's; the saved choices
tracer/hardware/kernel_store.py's. This module knows the checkpoint (which formats its matrices are stored in, so
which candidates are numerically safe) and the loaded model (fp16's range checks), so it sits in the load layer.

Flow (`pick`): the matrices' stored formats -> the dense candidates that are precise enough for them -> one safe
candidate: taken without measuring; several: the saved choice for this machine and model shape, or a measurement
(seconds, `progress` hears each candidate) that is then saved. A damaged store is one line (`note`) and a fresh
measurement that replaces it; an unwritable one is one line and an unsaved choice. After the model is loaded in
fp16, `fp16_problem` checks its range: no weight overflowed to inf, and a probe forward's residual stream stays
below kernel_choice.FP16_ACTIVATION_LIMIT; the loader otherwise takes the next candidate (`without`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from llmtrace.tracer.checkpoint.resolve import GGUF, HF, ResolvedModel
from llmtrace.tracer.core.errors import HardwareError
from llmtrace.tracer.hardware import kernel_choice as rule
from llmtrace.tracer.hardware import kernel_store
from llmtrace.tracer.hardware.kernel_choice import CandidateTiming, KernelChoice
from llmtrace.tracer.hardware.product_timing import (
    DenseKernel, ProductKernel, machine_key, product_shapes, time_kernels,
)

Progress = Callable[[str], None]
Timer = Callable[..., tuple[tuple[CandidateTiming, ...], float]]  # product_timing.time_kernels' signature
DENSE_DTYPES = ("fp32", "fp16", "bf16")
PROBE_TEXT = "The capital of France is Paris. 1, 2, 3: def main():"  # words, digits, code: a few token kinds


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


def pick(resolved: ResolvedModel, device: torch.device, progress: Progress | None = None,
         extra_kernels: Sequence[ProductKernel] = (), timer: Timer | None = None,
         store_path: Path | None = None) -> PickedKernels:
    """What `--dtype auto` means for `resolved` on `device` (see the module docstring). `extra_kernels`: stored-
    precision candidates (always safe for their weights); `timer`: product_timing.time_kernels, looked up at call
    time (tests inject another)."""
    formats = matrix_formats(resolved)
    own = stored_dtype(formats)
    kernels: list[ProductKernel] = []
    unsafe: list[str] = []
    for dtype in dense_dtypes(device):
        ok, why = rule.precise_enough(dtype, formats)
        if ok:
            kernels.append(DenseKernel(dtype))
        else:
            unsafe.append(f"{dtype}: {why}")
    kernels.extend(extra_kernels)
    if device.type not in ("cpu", "cuda"):
        fallback = own if own is not None else "fp32"
        return PickedKernels(rule.unmeasured(fallback, f"{device.type}: not measured; the checkpoint's own "
                                                       f"{fallback}" if own else f"{device.type}: not measured; fp32",
                                             own))
    if len(kernels) == 1:
        only = kernels[0]
        return PickedKernels(rule.unmeasured(only.dtype, "the only numerically safe dtype (" + "; ".join(unsafe)
                                             + ")", own))
    machine = machine_key(str(device))
    model = kernel_store.model_key(product_shapes(resolved.config), resolved.config.n_layers, formats)
    note = ""
    try:
        saved = kernel_store.load_choice(machine, model, store_path)
    except kernel_store.StoreProblem as exc:
        saved, note = None, f"kernel choices: {exc}; measuring again"
    if saved is not None:
        return PickedKernels(replace(saved, from_store=True), note)
    timings, seconds = (timer or time_kernels)(kernels, resolved.config, str(device), progress=progress)
    choice = rule.select(timings, own, seconds)
    if unsafe:
        choice = replace(choice, rule=f"{choice.rule}; not safe: {'; '.join(unsafe)}")
    try:
        saved_to: str | None = str(kernel_store.save_choice(machine, model, choice, store_path))
    except HardwareError as exc:
        saved_to = None
        note = "; ".join(n for n in (note, f"kernel choice not saved: {exc}") if n)
    return PickedKernels(choice, note, saved_to)


def lookup(resolved: ResolvedModel, device: torch.device, store_path: Path | None = None) -> KernelChoice | None:
    """The saved choice for `resolved` on `device` without measuring (a run whose --dtype overrides auto still
    shows what was measured); None when there is none or the store cannot be read."""
    if device.type not in ("cpu", "cuda"):
        return None
    formats = matrix_formats(resolved)
    model = kernel_store.model_key(product_shapes(resolved.config), resolved.config.n_layers, formats)
    try:
        return kernel_store.load_choice(machine_key(str(device)), model, store_path)
    except kernel_store.StoreProblem:
        return None


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
