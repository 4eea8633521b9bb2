"""Time a model's own matrix products on this machine, once per way of running them: `llmtrace tune`
(tracer/load/kernel_pick.py; tracer/hardware/kernel_choice.py's rule decides with the result).

What is timed is what a step of the fused path multiplies, at the model's shapes (contract.fused_stages: Q|K|V and
gate|up packed, the LM head):
- decode: one matrix-vector product per matrix of every layer, then the LM head's; dense candidates are timed
  through torch.mv and through mm (x (1, in) @ Wᵀ), which differ by 2x for some dtypes on some CPUs, and keep the
  faster. A candidate whose decode runs as the native C step (one C call a token) is timed the same way, a call
  per product: that leans against it by a ctypes call and a thread wake-up per product (tune's figures are for
  ranking kernels, not a prediction of `run`'s step);
- prefill: REFERENCE_PROMPT rows through each matrix of one layer (matrix-matrix), times the layer count, and the
  LM head's matrix-vector product (the fused path applies it to the last position only).
Weights are random (timing does not depend on their values) and, for decode, spread over enough layers to stream
STREAM_BYTES per pass: one layer of a small model sits in the CPU's caches, which a real decode step (all layers)
never does. Each figure is the fastest of the timed runs after one warm-up run (as tracer/hardware/measure.py:
on a shared machine the median mostly measures the neighbours); runs stop early once a candidate has used its
share of the time budget, so a first run measures in seconds; a kernel already SLOW_FACTOR times slower than the
fastest so far with one layer in cache is not streamed at all (the exact "blocks" reference kernel: it
dequantizes every matrix per product), and one whose warm-up alone is several budgets long is timed once.

Stored-precision kernels (GGUF blocks, int4 packs) come in through the same `ProductKernel` interface from the
layer that owns them (tracer/load/stored_candidates.py: the model's own blocks, one layer's matrices and the LM
head, copied as the dense candidates' random layers are); this module only knows dense tensors. A kernel with a
`release()` method has it called once its timing is done, so no two candidates' weights are held at once.
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import Any, Callable, Protocol, Sequence

import torch

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, get_dtype
from llmtrace.tracer.hardware.dtype_policy import torch_dtype
from llmtrace.tracer.hardware.kernel_choice import DENSE, REFERENCE_PROMPT, CandidateTiming
from llmtrace.tracer.hardware.product_shapes import ProductShape, product_shapes  # noqa: F401 - re-exported

Progress = Callable[[str], None]
STREAM_BYTES = 128 * 2**20  # decode passes stream at least this much (or the whole model, if smaller)
REPEATS = 3
BUDGET_SECONDS = 0.6  # per candidate and phase, after the warm-up run
SLOW_WARMUP = 4.0  # a warm-up this many budgets long is not repeated
SLOW_FACTOR = 4.0  # a candidate this many times slower than the fastest on a cached layer is not streamed


class ProductKernel(Protocol):
    """One way to run products: how to make a weight of a shape, and how to multiply by it."""

    name: str  # the candidate's name: "fp16", "stored+bf16"
    dtype: str  # activations' dtype name
    weights: str  # kernel_choice.DENSE or STORED
    decode_variants: tuple[str, ...]  # names of the matrix-vector kernels to try ("mv", "mm")

    def prepare(self, shape: ProductShape, generator: torch.Generator, device: str) -> Any: ...
    def nbytes(self, weight: Any) -> int: ...
    def matvec(self, variant: str, weight: Any, x: torch.Tensor) -> torch.Tensor: ...  # (cols,) -> (rows,)
    def matmul(self, weight: Any, x: torch.Tensor) -> torch.Tensor: ...  # (T, cols) -> (T, rows)


class DenseKernel:
    """Every matrix converted to `dtype`; decode through torch.mv or mm."""

    weights = DENSE
    decode_variants = ("mv", "mm")

    def __init__(self, dtype: str) -> None:
        self.dtype = self.name = get_dtype(dtype, COMPUTE_DTYPES).name
        self.values = torch_dtype(get_dtype(dtype, COMPUTE_DTYPES))

    def prepare(self, shape: ProductShape, generator: torch.Generator, device: str) -> torch.Tensor:
        bound = shape.cols**-0.5  # typical weight scale: no fp16 overflow, no denormals
        weight = torch.empty(shape.rows, shape.cols, dtype=self.values)
        return weight.uniform_(-bound, bound, generator=generator).to(device)

    def nbytes(self, weight: torch.Tensor) -> int:
        return weight.numel() * weight.element_size()

    def matvec(self, variant: str, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if variant == "mv":
            return torch.mv(weight, x)
        return torch.mm(x.view(1, -1), weight.t()).view(-1)

    def matmul(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, weight.t())


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _best(run: Callable[[], object], device: str, budget: float) -> float:
    """The fastest of up to REPEATS timed runs after one warm-up; stops once `budget` seconds are spent. After a
    warm-up over SLOW_WARMUP x `budget` only one run is timed: a kernel that slow per pass (the exact "blocks"
    reference kernel) would cost more to time again than the figure could change."""
    _sync(device)
    start = time.perf_counter()
    run()  # warm-up: first-call kernel set-up (oneDNN), first touch of the outputs
    _sync(device)
    warmup = time.perf_counter() - start
    repeats = 1 if warmup > SLOW_WARMUP * budget else REPEATS
    best = math.inf
    spent = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        _sync(device)
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
        if spent >= budget:
            break
    return best


def time_kernel(kernel: ProductKernel, config: ModelConfig, device: str = "cpu", budget: float = BUDGET_SECONDS,
                progress: Progress | None = None, seed: int = 0, beat: float | None = None) -> CandidateTiming:
    """Decode and prefill product times of `kernel` at `config`'s shapes (see the module docstring). `beat`: the
    fastest decode step measured so far; a kernel whose decode products with one layer in cache already take
    SLOW_FACTOR times that is not streamed (its figure is that lower bound: it cannot win)."""
    shapes = product_shapes(config)
    layer_shapes = [s for s in shapes if s.per_layer]
    step_shapes = [s for s in shapes if not s.per_layer]
    generator = torch.Generator().manual_seed(seed)
    act = torch_dtype(get_dtype(kernel.dtype, COMPUTE_DTYPES))

    def vector(cols: int, rows: int = 0) -> torch.Tensor:
        shape = (rows, cols) if rows else (cols,)
        return torch.empty(shape, dtype=torch.float32).uniform_(-1, 1, generator=generator).to(device, act)

    if progress:
        progress(f"{kernel.name} products")
    first = [kernel.prepare(s, generator, device) for s in layer_shapes]
    layer_bytes = sum(kernel.nbytes(w) for w in first)
    copies = max(1, min(config.n_layers, math.ceil(STREAM_BYTES / max(layer_bytes, 1))))
    layers: list[list[Any]] = []  # `copies` layers, made when a decode pass first streams them
    head = [kernel.prepare(s, generator, device) for s in step_shapes]
    vectors = {s.cols: vector(s.cols) for s in shapes}
    rows = {s.cols: vector(s.cols, REFERENCE_PROMPT) for s in layer_shapes}

    def head_pass(variant: str) -> None:
        for shape, weight in zip(step_shapes, head):
            kernel.matvec(variant, weight, vectors[shape.cols])

    decode_times = {}
    for variant in kernel.decode_variants:
        def layers_pass(variant: str = variant, only_first: bool = False) -> None:
            for weights in [first] if only_first else layers:
                for shape, weight in zip(layer_shapes, weights):
                    kernel.matvec(variant, weight, vectors[shape.cols])

        head_s = _best(partial(head_pass, variant), device, budget / 4)
        if beat is not None:  # one layer in cache first: a lower bound of the streamed figure
            cached = _best(lambda: layers_pass(only_first=True), device, budget / 4) * config.n_layers + head_s
            if cached > SLOW_FACTOR * beat:
                decode_times[variant] = (cached, head_s)
                continue
        if not layers:
            layers = [first] + [[kernel.prepare(s, generator, device) for s in layer_shapes]
                                for _ in range(copies - 1)]
        per_layer = _best(layers_pass, device, budget / 2) / copies
        decode_times[variant] = (per_layer * config.n_layers + head_s, head_s)
    variant = min(decode_times, key=lambda v: decode_times[v][0])
    decode_s, head_s = decode_times[variant]

    def prefill_layer() -> None:
        for shape, weight in zip(layer_shapes, first):
            kernel.matmul(weight, rows[shape.cols])

    prefill_s = _best(prefill_layer, device, budget) * config.n_layers + head_s  # the head: the last row only
    weight_bytes = layer_bytes * config.n_layers + sum(kernel.nbytes(w) for w in head)
    return CandidateTiming(name=kernel.name, dtype=kernel.dtype, weights=kernel.weights, decode_kernel=variant,
                           decode_s=decode_s, prefill_s=prefill_s, weight_bytes=weight_bytes)


def time_kernels(kernels: Sequence[ProductKernel], config: ModelConfig, device: str = "cpu",
                 progress: Progress | None = None) -> tuple[tuple[CandidateTiming, ...], float]:
    """Every kernel timed in turn (its weights freed before the next); and the seconds it all took."""
    start = time.perf_counter()
    timings: list[CandidateTiming] = []
    for kernel in kernels:
        beat = min([t.decode_s for t in timings], default=None)
        timings.append(time_kernel(kernel, config, device, progress=progress, beat=beat))
        release = getattr(kernel, "release", None)
        if release is not None:
            release()
    return tuple(timings), time.perf_counter() - start


def machine_key(device: str = "cpu") -> str:
    """What a saved choice is valid for: the device, its model name, torch's version, its CPU kernels (capability)
    and the thread count; any change means measuring again."""
    from llmtrace.tracer.hardware.measure import _device_name

    kind = torch.device(device).type
    if kind == "cuda":
        return f"cuda|{torch.cuda.get_device_name(0)}|torch {torch.__version__}|cuda {torch.version.cuda}"
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        capability = "unknown"
    return f"{kind}|{_device_name('cpu')}|torch {torch.__version__}|{capability}|{torch.get_num_threads()} threads"
