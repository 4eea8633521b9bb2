"""Measure a loaded model's decode ceilings on this machine (llmtrace.tracer.hardware.decode_ceilings): the model's
own weight products at each batch's shapes, and the rest of its decode step, counted and timed.

At each batch B:
- Products: one pass of the step's products in the step's order, every layer's Q|K|V, O, gate|up and down, then
  the LM head, each called as the fused path calls it (its `product`: torch.mv for one row, F.linear for more, a
  stored matrix's own kernel through PackedWeight.__call__) on a (B, K) input; the pass streams every weight from
  memory as a real step does (timing one matrix again and again would read it from the caches). Each call is timed;
  the median pass by total (of `repeats` timed passes after one warm-up) gives each product's time, its per-layer
  calls averaged: a typical step's products, as the sweep compares typical (median) steps.
- The rest: the same model's decode steps with each weight product replaced by a stand-in that reads the weight's
  bytes (so the caches are as cold as a product leaves them: small operations right after a weight-streaming
  product run several times slower than hot) and returns an uninitialised tensor of the output's shape; the
  stand-ins' time is taken out. What is left is every other operation of the step at its real shapes: norms, RoPE,
  the KV-cache write, attention, activations, residual adds, the embedding lookup and all views. One step runs
  under a dispatch counter (the stand-ins' own operations not counted); `steps` more are timed, median.
The products' outputs are values no one reads and the stubbed steps' tokens are garbage: only times are kept.
Where the model's one-token steps run as the native decode step (tracer/model/native_step.py: batch 1, every
product a native-kernel matrix) the products run inside one C call, where no stand-in can replace them: the rest
is then the real steps' median minus the products' pass (each product called alone, as above), at least 0, and
its operations those the real step dispatches.
"""

from __future__ import annotations

import statistics
import time
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.hardware.decode_ceilings import (
    STORED,
    BatchCeilings,
    DecodeCeilings,
    ProductTime,
    dense_key,
    shapes_key,
)
from llmtrace.tracer.hardware.dtype_policy import dtype_of
from llmtrace.tracer.hardware.product_shapes import product_shapes
from llmtrace.tracer.hardware.product_timing import machine_key
from llmtrace.tracer.model.weight_formats import DENSE, PackedWeight
from llmtrace.tracer.run.backends import build_backend, matvec_of
from llmtrace.tracer.run.select import Request, select
from llmtrace.tracer.trace.hooks import device_synchronizer
from llmtrace.tracer.trace.records import PACKED

Progress = Callable[[str], None]
# Each per-layer product of the packed path and the PackedLayer attributes holding its weight and bias.
LAYER_PRODUCTS = {"attention.wqkv": ("wqkv", "bqkv"), "attention.wo": ("wo", "bo"),
                  "feed_forward.w13": ("w13", "b13"), "feed_forward.w2": ("w2", "b2")}


class _OpCounter(TorchDispatchMode):
    """Counts every aten operation dispatched while active (and not paused)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = False  # inside a product's stand-in: its operations are not the step's

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        if not self.paused:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _backend(model: Any, batch: int, positions: int, matvec: str) -> Any:
    """The packed (or native) backend of `batch` sequences of up to `positions` tokens, its cache set up."""
    model.setup_cache(batch, positions)
    selection = select(model, Request(batch=batch, matvec=matvec))
    if selection.route.prefill != PACKED:
        raise BadArgumentError("the decode ceilings are measured on the fused path; something watches the model's "
                               "modules (a hook), so it runs stage by stage")
    return build_backend(model, selection)


def weights_of(plan: Any) -> tuple[str, str]:
    """(weights key, formats label) of the plan's products: "stored" when any is held as the GGUF stores it."""
    labels, stored = [], False
    matrices = [getattr(layer, attr) for layer in plan.layers for attr, _ in LAYER_PRODUCTS.values()]
    for weight in matrices + [plan.output]:
        if isinstance(weight, PackedWeight):
            labels.append(weight.format.label)
            stored = stored or weight.format.kernel != DENSE
        else:
            labels.append(dtype_of(weight.dtype).name)
    formats = "+".join(sorted(set(labels)))
    return (STORED if stored else dense_key(dtype_of(plan.dtype).name)), formats


def _time_products(plan: Any, config: Any, batch: int, repeats: int, sync: Callable[[], None] | None,
                   ) -> tuple[ProductTime, ...]:
    shapes = {s.role: s for s in product_shapes(config)}
    device, dtype = plan.final_norm.weight.device, plan.dtype
    generator = torch.Generator().manual_seed(0)
    calls: list[tuple[str, Any, Any]] = []
    for layer in plan.layers:
        for role, (weight, bias) in LAYER_PRODUCTS.items():
            calls.append((role, getattr(layer, weight), getattr(layer, bias)))
    head_role = next(s.role for s in shapes.values() if not s.per_layer)
    calls.append((head_role, plan.output, plan.output_bias))
    inputs = {}
    for role, shape in shapes.items():
        x = torch.empty(batch, shape.cols).uniform_(-1, 1, generator=generator).to(device, dtype)
        inputs[role] = x[0] if batch == 1 else x  # one row runs as a vector, as the fused path does
    passes: list[dict[str, float]] = []
    with torch.no_grad():
        for round_ in range(repeats + 1):  # round 0 warms up (kernel set-up, first touch of outputs)
            spent: dict[str, float] = {role: 0.0 for role in shapes}
            for role, weight, bias in calls:
                if sync is not None:
                    sync()
                start = time.perf_counter()
                plan.product(inputs[role], weight, bias)
                if sync is not None:
                    sync()
                spent[role] += time.perf_counter() - start
            if round_:
                passes.append(spent)
    passes.sort(key=lambda spent: sum(spent.values()))
    typical = passes[(len(passes) - 1) // 2]  # the median pass: a typical step's products, as the sweep's median step
    n_layers = len(plan.layers)
    return tuple(ProductTime(role=s.role, rows=s.rows, cols=s.cols, per_layer=s.per_layer,
                             seconds=typical[s.role] / (n_layers if s.per_layer else 1)) for s in shapes.values())


def _streamed(weight: Any) -> list[torch.Tensor]:
    """The tensors a product by `weight` reads: the dense matrix, or a stored matrix's kernel layout (the int4
    kernel's repacked codes and scales, made on its first product) or else its codes, scales and zeros."""
    if not isinstance(weight, PackedWeight):
        return [weight]
    prepared = weight._prepared  # noqa: SLF001 - what the int4 kernel reads, once made
    return list(prepared) if prepared is not None else list(weight.tensors.values())


def _stubbed_steps(model: Any, backend: Any, ids: Sequence[int], batch: int, steps: int,
                   sync: Callable[[], None] | None) -> tuple[int, float, int]:
    """(operations of one decode step besides its products, median seconds of `steps` such steps, median context).

    Each product is replaced by a stand-in that reads its weight's bytes (a sum over them: the caches end up as
    cold as after the product) and returns an uninitialised output of its shape; the stand-ins' own time is taken
    out of each step and their operations out of the count, so what remains is the other operations' time with
    the caches in the state a real step leaves them in."""
    inside = 0.0

    def stand_in(x: torch.Tensor, weight: Any, bias: Any = None) -> torch.Tensor:
        nonlocal inside
        counter.paused = True
        if sync is not None:
            sync()
        start = time.perf_counter()
        for tensor in _streamed(weight):
            tensor.sum()
        out = x.new_empty(x.shape[:-1] + (weight.shape[0],))  # (..., out), values never read for what they are
        if sync is not None:
            sync()
        inside += time.perf_counter() - start
        counter.paused = False
        return out

    counter = _OpCounter()
    plan = backend.plan
    plan_product = plan.product
    tokens = torch.tensor([list(ids)] * batch, dtype=torch.long, device=plan.final_norm.weight.device)  # (B, P)
    times, contexts = [], []
    with torch.no_grad():
        logits = backend.prefill(tokens)  # (B, V): real products, so the cache holds what a decode step reads
        try:
            plan.product = stand_in  # every layer's PackedStep takes the plan's product
            next_ids = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            with counter:
                logits = backend.decode(next_ids)
            ops = counter.count
            for _ in range(steps):
                next_ids = logits.argmax(dim=-1, keepdim=True).clamp_(0, plan.embedding.shape[0] - 1)
                inside = 0.0
                if sync is not None:
                    sync()
                start = time.perf_counter()
                logits = backend.decode(next_ids)
                if sync is not None:
                    sync()
                times.append(time.perf_counter() - start - inside)
                contexts.append(int(model.pos))
        finally:
            plan.product = plan_product
    return ops, statistics.median(times), round(statistics.median(contexts))


def _pass_seconds(products: tuple[ProductTime, ...], plan: Any) -> float:
    """One step's products: each per-layer product once per layer, the LM head once."""
    return sum(p.seconds * (len(plan.layers) if p.per_layer else 1) for p in products)


def _native_steps(model: Any, backend: Any, ids: Sequence[int], steps: int, products: float) -> tuple[int, float, int]:
    """`_stubbed_steps` for a model whose one-token steps run as the native decode step (one sequence, CPU): the
    real steps timed, the products' pass (`products` seconds) taken out, at least 0."""
    counter = _OpCounter()
    tokens = torch.tensor([list(ids)], dtype=torch.long)  # (1, P)
    times, contexts = [], []
    with torch.no_grad():
        logits = backend.prefill(tokens)
        with counter:
            logits = backend.decode(logits.argmax(dim=-1, keepdim=True))
        for _ in range(steps):
            next_ids = logits.argmax(dim=-1, keepdim=True)  # (1, 1)
            start = time.perf_counter()
            logits = backend.decode(next_ids)
            times.append(time.perf_counter() - start)
            contexts.append(int(model.pos))
    return counter.count, max(0.0, statistics.median(times) - products), round(statistics.median(contexts))


def measure_decode_ceilings(loaded: Any, ids: Sequence[int], batches: Sequence[int], memory_bandwidth: float,
                            steps: int = 6, repeats: int = 5, progress: Progress | None = None) -> DecodeCeilings:
    """The decode ceilings of `loaded`'s model at each of `batches` (see the module docstring); `ids` is the prompt
    each sequence of the stubbed steps starts from, `memory_bandwidth` (bytes/s, the machine's copy figure) what
    attention/KV bytes of other contexts are charged at."""
    if steps < 1 or repeats < 1:
        raise BadArgumentError(f"measuring decode ceilings needs at least 1 step and 1 repeat, got {steps}, {repeats}")
    model, config = loaded.model, loaded.config
    sync = device_synchronizer(model.norm.weight.device)
    entries = []
    try:
        for batch in batches:
            if progress is not None:
                progress(f"kernels at batch {batch}")
            backend = _backend(model, batch, len(ids) + steps + 2, matvec_of(getattr(loaded, "kernels", None)))
            plan = backend.plan
            products = _time_products(plan, config, batch, repeats, sync)
            if batch == 1 and not plan.native_off_reason():
                ops, other, context = _native_steps(model, backend, ids, steps, _pass_seconds(products, plan))
            else:
                ops, other, context = _stubbed_steps(model, backend, ids, batch, steps, sync)
            entries.append(BatchCeilings(batch=batch, products=products, ops=ops, other_seconds=other,
                                         context=context))
        weights, formats = weights_of(plan)
    finally:
        model.reset_cache()
    device = str(model.norm.weight.device)
    return DecodeCeilings(
        machine=machine_key(device), device_name=machine_key(device).split("|")[1], shapes=shapes_key(config),
        weights=weights, formats=formats, compute_dtype=dtype_of(model.norm.weight.dtype).name,
        n_layers=config.n_layers, memory_bandwidth=memory_bandwidth,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), batches=tuple(entries),
    )
