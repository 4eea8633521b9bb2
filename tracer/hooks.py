"""Instrumentation of the model's stage modules: when each stage ran, on what shapes, and what that cost.

The hot path does as little as possible: one clock read before and one after the stage, then the shapes of the
tensors in and out (torch.Size objects, no copies). FLOPs and bytes are worked out from those shapes later
(`Tracer.records()`, after the run), by the same functions in tracer/flop_formulas.py that the analytical
estimate uses.

The instrumentation exists only inside `with Tracer(model) as tracer:` and is removed in `finally`, also after an
exception. On cuda/mps the device is synchronised before each clock read, so a stage's time is its kernels' time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tracer import flop_formulas as ff
from tracer.trace_records import StageRecord

# Stage modules: dotted-name suffix inside a layer -> stage kind (TEAM.md's model contract).
LAYER_STAGES: dict[str, str] = {
    "attention_norm": "rmsnorm",
    "attention.wq": "linear",
    "attention.wk": "linear",
    "attention.wv": "linear",
    "attention.rope": "rope",
    "attention.kv_cache": "kv_cache",
    "attention.scores": "attention_scores",
    "attention.softmax": "softmax",
    "attention.pv": "attention_values",
    "attention.wo": "linear",
    "attn_residual": "residual",
    "ffn_norm": "rmsnorm",
    "feed_forward.w1": "linear",
    "feed_forward.w3": "linear",
    "feed_forward.act": "swiglu",
    "feed_forward.w2": "linear",
    "ffn_residual": "residual",
}
TOP_STAGES: dict[str, str] = {"tok_embeddings": "embedding", "norm": "rmsnorm", "output": "lm_head"}

MECHANISMS = ("wrap", "hooks")
_NO_INSTANCE_FORWARD = object()  # marks a module whose forward came from its class (the usual case)

# Stages whose forward returns a tuple of tensors (rope: q, k; kv_cache: k_all, v_all); the others return one.
TUPLE_OUTPUT_KINDS = frozenset({"rope", "kv_cache"})

# Integer index tensors among a stage's arguments (argument position by kind): token ids and positions, int64.
# Every other tensor a stage takes or returns is an activation in the model's dtype (the model casts back after
# its fp32 norm and softmax), so the hooks keep shapes only and the dtypes come from here.
INDEX_ARGUMENTS: dict[str, int] = {"embedding": 0, "kv_cache": 0, "rope": 2}

# A raw event, kept by the post-hook: (stage index, start ns, end ns, input shapes, output shapes).
RawEvent = tuple[int, int, int, list[torch.Size], list[torch.Size]]


@dataclass(frozen=True, slots=True)
class StageModule:
    """One hooked module: its stable name, layer, kind and the parameter sizes the byte counts need."""

    name: str
    layer: int | None
    kind: str
    weight_numel: int  # elements of its weight (0 for parameter-free stages)
    weight_itemsize: int


def stage_modules(model: nn.Module) -> list[tuple[StageModule, nn.Module]]:
    """The model's stage modules, in `named_modules()` order, each with its kind."""
    found: list[tuple[StageModule, nn.Module]] = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) >= 3 and parts[0] == "layers" and parts[1].isdigit():
            kind = LAYER_STAGES.get(".".join(parts[2:]))
            layer: int | None = int(parts[1])
        else:
            kind = TOP_STAGES.get(name)
            layer = None
        if kind is None:
            continue
        weight = getattr(module, "weight", None)
        numel = weight.numel() if isinstance(weight, torch.Tensor) else 0
        itemsize = weight.element_size() if isinstance(weight, torch.Tensor) else 0
        found.append((StageModule(name, layer, kind, numel, itemsize), module))
    return found


def device_synchronizer(device: torch.device) -> Any:
    """A no-argument function that waits for the device's queued work, or None on cpu/meta."""
    if device.type == "cuda":
        return torch.cuda.synchronize
    if device.type == "mps":
        return torch.mps.synchronize
    return None


class Tracer:
    """Instruments the stage modules of `model` while inside `with`; collects one StageRecord per stage call.

    Use: `with Tracer(model, origin_ns) as t: t.begin_step("prefill", 0); model.prefill(ids); t.end_step()`.
    `enabled=False` attaches nothing (the run is timed per step only).

    Two mechanisms, same records:
    - "wrap" (default): each stage module gets an instance-level `forward` that reads the clock around the
      original one. nn.Module.__call__ keeps its fast path, so a decode step costs almost nothing extra.
    - "hooks": nn.Module forward pre/post hooks (`register_forward_pre_hook` / `register_forward_hook`). Any
      hook sends every call through nn.Module's slow path; on the default model that machinery alone, with
      no-op hooks, costs about 10% of a decode step (BENCHMARKS.md, "Tracing overhead").
    Both rely on the model calling its submodules through `__call__`, and both are undone in `finally`.
    """

    def __init__(self, model: nn.Module, origin_ns: int | None = None, enabled: bool = True,
                 mechanism: str = "wrap") -> None:
        if mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}")
        self.mechanism = mechanism
        self.model = model
        self.origin_ns = time.perf_counter_ns() if origin_ns is None else origin_ns
        self.enabled = enabled
        found = stage_modules(model) if enabled else []
        self.stages: list[StageModule] = [s for s, _ in found]
        self._modules: list[nn.Module] = [m for _, m in found]
        self._handles: list[Any] = []  # hook handles, or (module, previous instance forward) for "wrap"
        self._cost_cache: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self._starts: list[int] = [0] * len(self.stages)
        self._events: list[RawEvent] = []
        self._steps: list[tuple[str, int, list[RawEvent]]] = []  # finished steps, records not yet built
        self._built: list[StageRecord] = []
        self._phase = ""
        self._step = -1
        param = next(model.parameters(), None)
        self.sync = device_synchronizer(param.device) if param is not None else None
        dtype = param.dtype if param is not None else torch.float32
        self.activation_dtype = str(dtype).removeprefix("torch.")
        self.activation_itemsize = dtype.itemsize

    # ---- context manager -------------------------------------------------------------------------------

    def __enter__(self) -> "Tracer":
        try:
            if self.enabled and hasattr(self.model, "use_fused"):
                # A model with a fused fast path uses it only when nothing watches its stage modules; wrappers are
                # invisible to that check, so say it outright: what is traced must be what runs.
                self._handles.append((self.model, "use_fused", self.model.use_fused))
                self.model.use_fused = False
            for index, module in enumerate(self._modules):
                if self.mechanism == "hooks":
                    pre, post = self._make_hooks(index)
                    self._handles.append(module.register_forward_pre_hook(pre))
                    self._handles.append(module.register_forward_hook(post))
                else:
                    previous = module.__dict__.get("forward", _NO_INSTANCE_FORWARD)
                    self._handles.append((module, previous))
                    module.forward = self._make_wrapper(index, module.forward)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Undo every hook and wrapper (idempotent)."""
        handles, self._handles = self._handles, []
        for handle in reversed(handles):
            if isinstance(handle, tuple) and len(handle) == 3:
                setattr(handle[0], handle[1], handle[2])
            elif isinstance(handle, tuple):
                module, previous = handle
                if previous is _NO_INSTANCE_FORWARD:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = previous
            else:
                handle.remove()

    @property
    def attached(self) -> int:
        """Hooks (two per stage) or wrappers (one per stage) in place."""
        return sum(1 for h in self._handles if not (isinstance(h, tuple) and len(h) == 3))

    def _make_wrapper(self, index: int, forward: Any) -> Any:
        """An instance-level forward for one stage: clock, original forward, clock, shapes (torch.Size, no copies)."""
        events = self._events
        clock = time.perf_counter_ns
        sync = self.sync
        tuple_output = self.stages[index].kind in TUPLE_OUTPUT_KINDS

        def traced_forward(*args: Any) -> Any:
            if sync is not None:
                sync()
            start = clock()
            output = forward(*args)
            if sync is not None:
                sync()
            end = clock()
            try:
                inputs = [a.shape for a in args]
            except AttributeError:  # a non-tensor argument: keep the tensors only
                inputs = [a.shape for a in args if isinstance(a, torch.Tensor)]
            events.append((index, start, end, inputs, [o.shape for o in output] if tuple_output else [output.shape]))
            return output

        return traced_forward

    def _make_hooks(self, index: int) -> tuple[Any, Any]:
        """The two hooks of one stage. Hot path: one clock read each, then the shapes (torch.Size, no copies)."""
        starts = self._starts
        events = self._events
        clock = time.perf_counter_ns
        sync = self.sync
        tuple_output = self.stages[index].kind in TUPLE_OUTPUT_KINDS

        def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
            if sync is not None:
                sync()
            starts[index] = clock()

        def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if sync is not None:
                sync()
            end = clock()
            try:
                inputs = [a.shape for a in args]
            except AttributeError:  # a non-tensor argument: keep the tensors only
                inputs = [a.shape for a in args if isinstance(a, torch.Tensor)]
            outputs = [o.shape for o in output] if tuple_output else [output.shape]
            events.append((index, starts[index], end, inputs, outputs))

        return pre, post

    # ---- steps -----------------------------------------------------------------------------------------

    def begin_step(self, phase: str, step: int) -> None:
        self._phase, self._step = phase, step
        self._events.clear()

    def end_step(self) -> None:
        """Close the step; its records are built when `records()` is next called (off the hot path)."""
        if self.enabled:
            self._steps.append((self._phase, self._step, list(self._events)))
        self._events.clear()

    def records(self) -> tuple[StageRecord, ...]:
        """Every stage record so far, in call order."""
        for phase, step, events in self._steps:
            self._built.extend(self._record(phase, step, e) for e in events)
        self._steps.clear()
        return tuple(self._built)

    def _record(self, phase: str, step: int, event: RawEvent) -> StageRecord:
        index, start, end, input_shapes, output_shapes = event
        stage = self.stages[index]
        key = (index, *input_shapes, None, *output_shapes)  # torch.Size is a tuple: hashable
        cached = self._cost_cache.get(key)
        if cached is None:
            act = self.activation_itemsize
            index_arg = INDEX_ARGUMENTS.get(stage.kind)
            inputs = [(tuple(s), INDEX_ITEMSIZE if i == index_arg else act) for i, s in enumerate(input_shapes)]
            outputs = [(tuple(s), act) for s in output_shapes]
            cached = (tuple(s for s, _ in inputs), tuple(s for s, _ in outputs), stage_cost(stage, inputs, outputs))
            self._cost_cache[key] = cached
        in_shapes, out_shapes, cost = cached
        return StageRecord(
            phase=phase,
            step=step,
            layer=stage.layer,
            stage=stage.name,
            kind=stage.kind,
            input_shapes=in_shapes,
            output_shapes=out_shapes,
            dtype=self.activation_dtype,
            matmul_flops=cost[0],
            elementwise_flops=cost[1],
            weight_bytes_read=cost[2],
            activation_bytes_read=cost[3],
            activation_bytes_written=cost[4],
            kv_bytes_read=cost[5],
            kv_bytes_written=cost[6],
            start_ns=start - self.origin_ns,
            duration_ns=end - start,
        )


INDEX_ITEMSIZE = 8  # int64 token ids and positions

# A tensor as the cost model sees it: (shape, bytes per element).
Entry = tuple[tuple[int, ...], int]


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _nbytes(entry: Entry) -> int:
    return _numel(entry[0]) * entry[1]


def _rows(shape: tuple[int, ...]) -> int:
    """Token rows of an activation (..., dim): every dimension but the last."""
    return _numel(shape[:-1])


def stage_cost(stage: StageModule, inputs: list[Entry], outputs: list[Entry]) -> tuple[int, int, int, int, int, int, int]:
    """(matmul FLOPs, elementwise FLOPs, weight bytes read, activation bytes read, activation bytes written,
    KV bytes read, KV bytes written) of one stage call, from the shapes it saw.

    Bytes are what the stage must move at least: every input read once, every output written once, each weight
    read once (an embedding reads only the rows it looks up); cached K/V read by the attention products count as KV
    reads, the new K/V copied into the cache as KV writes.
    """
    kind = stage.kind
    weight_bytes = stage.weight_numel * stage.weight_itemsize
    read = sum(_nbytes(e) for e in inputs)
    written = sum(_nbytes(e) for e in outputs)
    out_shape = outputs[0][0]
    if kind in ("linear", "lm_head"):
        x = inputs[0][0]
        return ff.linear_flops(_rows(x), x[-1], out_shape[-1]), 0, weight_bytes, read, written, 0, 0
    if kind == "rmsnorm":
        x = inputs[0][0]
        return 0, ff.rmsnorm_flops(_rows(x), x[-1]), weight_bytes, read, written, 0, 0
    if kind == "embedding":
        ids = inputs[0][0]
        rows_read = _numel(ids) * out_shape[-1] * stage.weight_itemsize
        return 0, ff.embedding_flops(_numel(ids), out_shape[-1]), rows_read, read, written, 0, 0
    if kind == "rope":
        (q, item), (k, _) = inputs[0], inputs[1]  # (B, T, H, D), (B, T, Hkv, D)
        flops = ff.rope_flops(_numel(q[:-2]), q[-2], k[-2], q[-1])
        tables = 2 * q[-3] * q[-1] * item  # the cos and sin rows (T, D) of these positions
        return 0, flops, 0, read + tables, written, 0, 0
    if kind == "kv_cache":
        # forward(input_pos, k, v): the new keys and values are read and copied into the cache buffers;
        # the outputs are views of the live slice (no bytes move).
        new_kv = _nbytes(inputs[1]) + _nbytes(inputs[2])
        return 0, 0, 0, read, 0, 0, new_kv
    if kind == "attention_scores":
        q, k_all = inputs[0], inputs[1]  # q (B, H, T, D), k_all (B, Hkv, S, D)
        b, h, t, s = out_shape
        matmul = ff.attention_scores_flops(b, h, t, s, q[0][-1])
        return matmul, ff.score_scale_flops(b, h, t, s), 0, _nbytes(q), written, _nbytes(k_all), 0
    if kind == "attention_values":
        probs, v_all = inputs[0], inputs[1]  # probs (B, H, T, S), v_all (B, Hkv, S, D)
        b, h, t, s = probs[0]
        matmul = ff.attention_values_flops(b, h, t, s, out_shape[-1])
        return matmul, 0, 0, _nbytes(probs), written, _nbytes(v_all), 0
    if kind == "softmax":
        b, h, t, s = out_shape
        return 0, ff.softmax_flops(b, h, t, s), 0, read, written, 0, 0
    if kind == "residual":
        return 0, ff.residual_flops(_rows(out_shape), out_shape[-1]), 0, read, written, 0, 0
    if kind == "swiglu":
        return 0, ff.swiglu_activation_flops(_rows(out_shape), out_shape[-1]), 0, read, written, 0, 0
    raise ValueError(f"no cost model for stage kind {kind!r}")
