"""Whole decode steps of the stored candidates whose one-token step runs as the native C step, for the kernel
choice's decode cost (tracer/hardware/kernel_choice.py, step 3).

Why whole steps: such a candidate's decode runs as ONE C call per token (tracer/model/native_step.py: every layer's
products, norms, RoPE, attention and the LM head, the OpenMP threads woken once, an i8dot or i16dot product's
activations quantized inside the step), while a sum of its products timed one by one from Python (tracer/hardware/
product_timing.py) pays a ctypes call and a thread wake-up per product and quantizes differently. That sum misjudged the
bundled model: 11.9 ms (Q4_1:i8dot,Q8_0:native) against 11.6 ms (native) while whole steps differed by ~15%,
and `--weights auto` took one or the other from run to run.

What is timed (`time_native_steps`):
- each candidate's model as `run` loads it: load_gguf_stored with the candidate's kernel plan (its block matrices
  copied into one huge-page arena, tracer/load/weight_arena.py, the rest dense fp32), its cache set up for
  ROUND_STEPS + 1 positions. A candidate whose model has no native step (Transformer.native_decode_reason: a matrix
  on another kernel, a model shape the step does not take, a library without its AVX2 row kernels) is left out:
  its decode stays the sum of its products;
- ROUNDS rounds with the candidates alternated within each (a slow spell of a shared machine then hits every
  candidate, not the one that happened to be measured during it), when their models fit in memory together (each
  holds a copy of the file's matrices: at most TOGETHER_SHARE of the memory available); else one candidate at a
  time, its rounds back to back. A round: the cache reset, one untimed step (the first after another model's
  steps), then `decode_one` steps at positions 1, 2, ..., each timed alone (perf_counter
  around the call: what `run`'s decode loop calls per token), until the round's share of STEP_BUDGET_SECONDS is
  spent (at least MIN_ROUND_STEPS, at most ROUND_STEPS steps). The steps sit at the first positions of an empty
  cache (attention over at most ROUND_STEPS + 1 keys), so beyond its products a step's work is at its smallest:
  the figure stays comparable with the other candidates' sums of products, which count no attention at all;
- the figure: the STEP_QUANTILE quantile of a candidate's timed steps (the fastest fifth's slowest). Each step
  streams the model's weights from DRAM, so the steps' times have a floor, and a shared machine's neighbours only
  add to it: the median measures the neighbours (as product_timing's best-of says); the single fastest of up to 64
  steps is an extreme that moves with how many steps were taken; a low quantile is neither.
The models are dropped when timing ends: nothing stays resident beside the model `run` then loads.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch

from llmtrace.tracer.checkpoint.gguf_header import GGUFHeader
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, get_dtype
from llmtrace.tracer.hardware.dtype_policy import torch_dtype
from llmtrace.tracer.hardware.kernel_choice import STORED_ACTIVATIONS
from llmtrace.tracer.hardware.memory import available_memory_bytes
from llmtrace.tracer.load.gguf_loader import load_gguf_stored, stored_model
from llmtrace.tracer.load.stored_weights import kernel_plan
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.transformer import Transformer
from llmtrace.tracer.model.weight_formats import runs_blocks

Progress = Callable[[str], None]
ROUNDS = 4
ROUND_STEPS = 16  # at most, per candidate and round
MIN_ROUND_STEPS = 2  # at least, however slow a step
STEP_BUDGET_SECONDS = 0.5  # per candidate, over all its rounds (the untimed steps not counted)
STEP_QUANTILE = 0.2
TOGETHER_SHARE = 0.5  # of MemAvailable: the most the candidates' models may take to be timed alternated
TOKEN = 1  # the token every timed step feeds (any id: a step's time does not depend on it)


def native_library_plan(spec: str) -> bool:
    """Whether every kernel of a candidate's spec ("native", "Q4_1:i8dot,Q8_0:native") is the native library's, so
    its model can run as the native step (building it says for sure: `native_step_models`)."""
    plan = kernel_plan(spec)
    return native_kernel.available() and all(runs_blocks(k) for k in ([plan] if isinstance(plan, str)
                                                                         else plan.values()))


def native_step_models(header: GGUFHeader, config: ModelConfig, names: Sequence[str]) -> dict[str, Transformer]:
    """{candidate: its model, cache set up} for the candidates among `names` (stored kernel specs) whose
    one-token step runs as the native C step; the others are left out."""
    models = {}
    activations = torch_dtype(get_dtype(STORED_ACTIVATIONS, COMPUTE_DTYPES))  # fp32: what the native step takes
    for name in names:
        if not native_library_plan(name):
            continue
        model = stored_model(config, *load_gguf_stored(header, config, activations, kernel_plan(name)))
        model.setup_cache(1, ROUND_STEPS + 1)
        if model.native_decode_reason() == "":
            models[name] = model
    return models


def low_quantile(samples: Sequence[float], q: float = STEP_QUANTILE) -> float:
    """The `q` quantile of `samples` as one of them: the ceil(q*n)-th fastest (the fastest for few samples)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def time_steps(models: dict[str, Transformer], budget: float = STEP_BUDGET_SECONDS) -> dict[str, list[float]]:
    """{candidate: every timed step's seconds}: ROUNDS rounds, the candidates alternated (module docstring)."""
    tokens = torch.tensor([[TOKEN]])  # (1, 1)
    times: dict[str, list[float]] = {name: [] for name in models}
    share = budget / ROUNDS
    for _ in range(ROUNDS):
        for name, model in models.items():
            model.reset_cache()
            model.decode_one(tokens)  # untimed: the first step after another model's
            spent = 0.0
            for step in range(ROUND_STEPS):
                start = time.perf_counter()
                model.decode_one(tokens)
                elapsed = time.perf_counter() - start
                times[name].append(elapsed)
                spent += elapsed
                if step + 1 >= MIN_ROUND_STEPS and spent >= share:
                    break
    return times


def time_native_steps(header: GGUFHeader, config: ModelConfig, names: Sequence[str],
                      progress: Progress | None = None) -> dict[str, float]:
    """{candidate: seconds of one decode step, whole} for the candidates among `names` that run as the native
    step (STEP_QUANTILE of their timed steps); the others are absent (see the module docstring)."""
    wanted = [n for n in names if native_library_plan(n)]
    if not wanted:
        return {}
    if progress:
        progress("native decode steps of " + ", ".join(wanted))
    groups = [wanted] if fit_together(header, len(wanted)) else [[n] for n in wanted]
    times: dict[str, list[float]] = {}
    for group in groups:
        models = native_step_models(header, config, group)
        try:
            with torch.no_grad():
                times.update(time_steps(models))
        finally:
            models.clear()
    return {name: low_quantile(steps) for name, steps in times.items()}


def fit_together(header: GGUFHeader, candidates: int, available: int | None = None) -> bool:
    """Whether `candidates` models of this file, each with its own copy of the file's matrices, take at most
    TOGETHER_SHARE of the memory available (`available`: MemAvailable when not given; unknown: assumed to fit)."""
    available = available_memory_bytes() if available is None else available
    matrices = sum(t.n_bytes for t in header.tensors if len(t.shape) >= 2)
    return available is None or candidates * matrices <= TOGETHER_SHARE * available
