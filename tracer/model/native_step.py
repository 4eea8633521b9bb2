"""The native decode step: one token of one sequence through every layer in one C call (native/decode_step.c).

The fused path's one-token step (tracer/model/fused.py, FusedPlan.step) on weights held as the GGUF stores
them makes ~120 native products and ~1,000 small torch ops per token; on a small model their per-call costs (ctypes,
output allocations, waking the OpenMP threads, torch dispatch) take longer than streaming the weights. This module
builds, once per FusedPlan, the C step's plan: a description of every layer's matrices (the PackedWeights'
BlockMatrix descriptions), norm weights, biases, the KV cache tensor and its strides, the scales, and scratch
buffers allocated once; a step is then one ctypes call, with the threads woken once.

Eligibility (`NativeStep.build` returns None with a reason otherwise, and the torch fused path runs as before): every
product of the step (each layer's packed Q|K|V, wo, gate|up, w2 and the LM head) is a PackedWeight of the native
library's kernels ("native", exact, "i8dot", int8 activations, or "i16dot", int16 ones: each row block's description
says which, so a step runs a per-type plan such as "Q4_1:i8dot,Q8_0:i16dot" as it is); the model computes and caches in
fp32 on the CPU; the library is built with its AVX2 row kernels; every layer has the same shapes and norm epsilon. The
plan holds a reference to every tensor whose memory C reads.

A mixture of experts (every layer's FFN routed: tracer/model/moe.py's ExpertsPlan, its experts held as the GGUF
stores them) runs its router, its route (softmax, top-k, the family's renormalisation), each chosen expert's gate|up,
silu*up and down over that expert's bytes of the 3-D tensors, and the weighted sum in C too; the step writes its
choice per layer into buffers whose rows become each layer's Route.last, where the trace's routing record reads it.

The token's embedding row is looked up in C too (the table held as stored, its row dequantized exactly as
native_kernel.dequantize does, or dense fp32), so the step is one call from the token id to the logits.

Tracing: with `stamps=True` the C step reads CLOCK_MONOTONIC at its start and after each stage of
contract.fused_stages (the embedding, every layer's stages, the final norm and the LM head), the clock
time.perf_counter_ns reads on Linux (`host_clock_matches` checks that; where it does not, a traced run takes the
torch fused path).

Staged (`staged=True`, what `llmtrace run --staged` runs for a one-token step of such a model): the stages of
contract.staged_stages run apart, each its own phase in C (Q, K, V over their row blocks of the packed Q|K|V
matrix, gate and up over theirs of gate|up), and the stamps are taken after each of them; logits and cache are the
fused step's, bit for bit (decode_step.c says why).
"""

from __future__ import annotations

import ctypes
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.functional import rms_norm_floor
from llmtrace.tracer.model.weight_formats import PackedWeight, runs_blocks

STAGES_BEFORE_LAYERS = 1  # the embedding
STAGES_PER_LAYER = 14  # the fused path's layer stages (contract.fused_stages); the C step stamps each
STAGED_STAGES_PER_LAYER = 17  # the staged path's (contract.staged_stages): Q, K, V and gate, up apart
# (each one more with QK-norm, Qwen3's: `stamp_count`)
STAGES_AFTER_LAYERS = 2  # final norm, LM head
_STATUS = {2: "a position outside the cache", 4: "a build without the AVX2 row kernels", 5: "too little scratch",
           6: "a token id outside the embedding table"}
_NOT_CHOSEN = 7  # llmt_decode_ahead: the chooser answered no token (it raised: run_ahead hands its exception on)
# llmt_decode_ahead's chooser: called with a step's index once its logits are written, it answers the next token
_CHOOSE = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)
Chooser = Callable[[np.ndarray], int]  # the next token from a step's logits (vocab,): the run's sampler


class _Layer(ctypes.Structure):
    """decode_step.c's StepLayer."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("wqkv", "wo", "w13", "w2", "attention_norm", "ffn_norm", "bqkv", "bo", "b13", "b2", "q_norm",
                 "k_norm", "router", "router_dense", "expert_w13", "expert_w2")]


class _Plan(ctypes.Structure):
    """decode_step.c's StepPlan."""

    _fields_ = [*((name, ctypes.c_int64) for name in
                  ("layers", "dim", "heads", "kv_heads", "head_dim", "ffn_dim", "vocab", "max_seq")),
                ("norm_floor", ctypes.c_float), ("scale", ctypes.c_float),
                ("layer", ctypes.c_void_p), ("final_norm", ctypes.c_void_p), ("head", ctypes.c_void_p),
                ("head_bias", ctypes.c_void_p), ("kv", ctypes.c_void_p), ("kv_layer", ctypes.c_int64),
                ("kv_head", ctypes.c_int64), ("scratch", ctypes.c_void_p), ("scratch_floats", ctypes.c_int64),
                ("embedding", ctypes.c_void_p), ("embedding_dense", ctypes.c_void_p),
                ("embedding_rows", ctypes.c_int64), ("qk_norm_floor", ctypes.c_float),
                *((name, ctypes.c_int64) for name in ("n_experts", "top_k", "renormalise", "qk_norm_whole")),
                ("qk_norm_floor_k", ctypes.c_float)]


@functools.cache
def host_clock_matches() -> bool:
    """Whether time.perf_counter_ns reads CLOCK_MONOTONIC, the clock the C step stamps with (Linux: yes)."""
    return time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"


def _entry_points() -> tuple[Any, Any, Any] | None:
    """(llmt_decode_step, llmt_step_scratch_floats, llmt_decode_ahead) of the current library
    (native_kernel.reset() may load another) with their signatures declared, or None when there is no library, its
    step's structures differ from this module's, or it was built without the AVX2 row kernels."""
    if not native_kernel.available():
        return None
    library = native_kernel.library()
    if library.path not in _DECLARED:
        _DECLARED[library.path] = _declare(library)
    return _DECLARED[library.path]


_DECLARED: dict[Any, tuple[Any, Any, Any] | None] = {}  # by library file: made once per library loaded


def _declare(library: native_kernel.NativeLibrary) -> tuple[Any, Any, Any] | None:
    handle = library.handle
    handle.llmt_step_layer_size.restype = handle.llmt_step_plan_size.restype = ctypes.c_int64
    if (handle.llmt_step_layer_size() != ctypes.sizeof(_Layer) or handle.llmt_step_plan_size() != ctypes.sizeof(_Plan)
            or not handle.llmt_step_supported()):
        return None
    # Called holding the GIL (PyDLL functions): the step's threads are as many as the cores torch uses, and a Python
    # thread running meanwhile (a live view's refresh) would take one of them and stall every barrier of the step.
    holding_the_gil = ctypes.PyDLL(str(library.path))
    step = holding_the_gil.llmt_decode_step
    step.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                     ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                     ctypes.c_void_p]
    step.restype = ctypes.c_int
    scratch = handle.llmt_step_scratch_floats
    scratch.argtypes = [ctypes.c_void_p, ctypes.c_int]
    scratch.restype = ctypes.c_int64
    ahead = holding_the_gil.llmt_decode_ahead
    ahead.argtypes = [ctypes.c_void_p, ctypes.c_int64, *(ctypes.c_void_p,) * 2, *(ctypes.c_int64,) * 4, _CHOOSE,
                      *(ctypes.c_void_p,) * 4, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    ahead.restype = ctypes.c_int64
    return step, scratch, ahead


@dataclass(frozen=True, slots=True)
class AheadRun:
    """What the steps of one `NativeStep.run_ahead` call chose, and when (CLOCK_MONOTONIC ns); per step, in order."""

    tokens: tuple[int, ...]  # its choice
    clock: tuple[tuple[int, int, int], ...]  # its start, its logits' end, its choice's end
    stamps: tuple[list[int], ...]  # its stage readings (NativeStep.readings' layout) when stamped, else empty
    failure: BaseException | None = None  # what the chooser raised on the logits of the step after the last one here
    kv_live_bytes: tuple[int, ...] = ()  # its live KV bytes after it (FusedPlan.native_ahead fills them in)
    # a mixture of experts' choice in it: (per layer its k experts, per layer their weights); () for a dense model
    routes: tuple[tuple[list[list[int]], list[list[float]]], ...] = ()


class NotEligible(Exception):
    """Why a model's step cannot run natively (one line)."""


class NativeStep:
    """A model's decode step as one C call. Build with `NativeStep.build(plan)`; call with the token's embedding."""

    def __init__(self, plan: Any) -> None:
        """`plan` is a FusedPlan (its PackedLayers, output, norm modules, rope tables and KV rows); NotEligible if it
        cannot run."""
        entry = _entry_points()
        if entry is None:
            raise NotEligible("the native library (with its AVX2 row kernels) is not available")
        self._step, self._scratch_floats, self._ahead = entry
        layers = plan.layers
        if not layers or plan.kv_rows is None:
            raise NotEligible("no layers, or the layers' KV caches are not one tensor")
        first = layers[0]
        heads, kv_heads, head_dim, ffn = first.heads, first.kv_heads, first.head_dim, first.ffn_dim
        dim = first.attention_norm.weight.shape[0]
        vocab = plan.output.shape[0] if isinstance(plan.output, PackedWeight) else 0
        if plan.dtype != torch.float32:
            raise NotEligible(f"the model computes in {plan.dtype}, the native step in fp32")
        if head_dim % 2:
            raise NotEligible("odd head dimension")
        whole = first.qk_whole is not None  # OLMoE's: over each token's whole q and whole k
        qk_norm = first.qk_weight is not None or whole  # Qwen3: every layer or none (one model's layers)
        if any((layer.qk_weight is not None or layer.qk_whole is not None) != qk_norm
               or (layer.qk_whole is not None) != whole for layer in layers):
            raise NotEligible("QK-norm in some layers only")
        self._keep: list[Any] = []  # every tensor and description whose memory C reads
        floor = _floor(first.attention_norm)
        described = []
        moe = first.experts
        self._routes: list[tuple[Any, tuple[torch.Tensor, torch.Tensor]]] = []  # (Route, its rows of the choice)
        self.top_k = moe.top_k if moe is not None else 0
        # a mixture of experts' choice in every layer, written by each step (llmt_decode_step's routed buffers)
        self._routed = torch.zeros(len(layers), max(self.top_k, 1), dtype=torch.int64)  # (L, k)
        self._routed_weights = torch.zeros(len(layers), max(self.top_k, 1), dtype=torch.float32)  # (L, k)
        for index, layer in enumerate(layers):
            if (layer.heads, layer.kv_heads, layer.head_dim, layer.ffn_dim) != (heads, kv_heads, head_dim, ffn) \
                    or layer.scale != first.scale:
                raise NotEligible("layers of different shapes")
            if (layer.experts is None) != (moe is None) or (moe is not None and (
                    len(layer.experts.down), layer.experts.top_k, layer.experts.renormalise) !=
                    (len(moe.down), moe.top_k, moe.renormalise)):
                raise NotEligible("layers with different experts")
            described.append(self._describe(layer, dim, qk_norm, whole))
            if any(_floor(n) != floor for n in (layer.attention_norm, layer.ffn_norm)):
                raise NotEligible("norms of different epsilons")
            if moe is not None:
                self._routes.append((layer.experts.route, (self._routed_weights[index:index + 1],
                                                           self._routed[index:index + 1])))
        if _floor(plan.final_norm) != floor:
            raise NotEligible("norms of different epsilons")
        head = self._matrix(plan.output, (vocab, dim), "LM head")
        kv = plan.kv_rows  # (L, 2*Hkv, S_max, D)
        if kv.dtype != torch.float32 or kv.device.type != "cpu" or kv.shape[:2] != (len(layers), 2 * kv_heads) \
                or kv.shape[3] != head_dim or kv.stride(3) != 1 or kv.stride(2) != head_dim:
            raise NotEligible("the KV cache is not fp32 rows of D values on the CPU")
        self.cos, self.sin = plan.cos, plan.sin  # (S_max, 1, D) each: the step reads the position's row
        for table in (self.cos, self.sin):
            if table is None or table.dtype != torch.float32 or not table.is_contiguous() \
                    or table.shape[-1] != head_dim:
                raise NotEligible("rope tables not contiguous fp32")
        self._layers = (_Layer * len(layers))(*described)
        self._plan = _Plan(len(layers), dim, heads, kv_heads, head_dim, ffn, vocab, kv.shape[2], floor, first.scale,
                           ctypes.addressof(self._layers), self._vector(plan.final_norm.weight, dim, "norm"), head,
                           self._vector(plan.output_bias, vocab, "bias"), kv.data_ptr(), kv.stride(0), kv.stride(1),
                           None, 0)
        self._keep.append(kv)
        self._embed(plan.embedding, dim)
        self._plan.qk_norm_floor = float(first.qk_floor) if qk_norm else 0.0
        if whole:  # the keys' own floor, sqrt(Hkv*D * eps), as QKNorm takes it
            self._plan.qk_norm_whole = 1
            self._plan.qk_norm_floor_k = float(rms_norm_floor(kv_heads * head_dim, first.qk_whole.eps, "cpu"))
        if moe is not None:
            self._plan.n_experts, self._plan.top_k = len(moe.down), moe.top_k
            self._plan.renormalise = int(moe.renormalise)
        self.layers, self.vocab, self.dim, self.head_dim = len(layers), vocab, dim, head_dim
        self._addresses(moe is not None, len(layers), qk_norm)
        self._taken = 0  # readings the last traced step left
        self._threads = 0
        self._ensure_scratch(torch.get_num_threads())

    @classmethod
    def build(cls, plan: Any) -> tuple[NativeStep | None, str]:
        """(the step, "") or (None, why not): the fused path then runs its torch ops."""
        if not all(isinstance(w, PackedWeight) and runs_blocks(w.format.kernel) for w in _products(plan)):
            return None, "a product of the step is not held for the native library's kernels (native, i8dot, i16dot)"
        try:
            return cls(plan), ""
        except NotEligible as exc:
            return None, str(exc)

    def _describe(self, layer: Any, dim: int, qk_norm: bool, whole: bool) -> _Layer:
        """One PackedLayer as decode_step.c reads it: its matrices, norms, biases, QK-norm weights and experts."""
        heads, kv_heads, head_dim, ffn = layer.heads, layer.kv_heads, layer.head_dim, layer.ffn_dim
        moe = layer.experts
        mats = [self._matrix(layer.wqkv, ((heads + 2 * kv_heads) * head_dim, dim), "Q|K|V"),
                self._matrix(layer.wo, (dim, heads * head_dim), "wo"),
                *((None, None) if moe is not None else (self._matrix(layer.w13, (2 * ffn, dim), "gate|up"),
                                                        self._matrix(layer.w2, (dim, ffn), "w2")))]
        norms = [self._vector(n.weight, dim, "norm") for n in (layer.attention_norm, layer.ffn_norm)]
        biases = [self._vector(b, rows, "bias") for b, rows in
                  ((layer.bqkv, (heads + 2 * kv_heads) * head_dim), (layer.bo, dim), (layer.b13, 2 * ffn),
                   (layer.b2, dim))]
        # QK-norm's q and k weights (D,): the first H and the last Hkv rows of the packed path's (H+Hkv, D)
        qk = [None, None] if not qk_norm else [
            self._vector(layer.qk_whole.q_weight.detach(), heads * head_dim, "QK-norm weight"),
            self._vector(layer.qk_whole.k_weight.detach(), kv_heads * head_dim, "QK-norm weight")] if whole else [
            self._vector(layer.qk_weight[row].contiguous(), head_dim, "QK-norm weight")
            for row in (0, heads)]
        return _Layer(*mats, *norms, *biases, *qk, *(self._experts(moe, dim, ffn) if moe is not None else ()))

    def _embed(self, table: Any, dim: int) -> None:
        """The embedding table (V, dim) into the plan: held as stored (the native kernel's rows) or dense fp32."""
        if isinstance(table, PackedWeight) and runs_blocks(table.format.kernel) and table.shape[1] == dim:
            self._plan.embedding = self._keep_matrix(table)
        elif isinstance(table, torch.Tensor) and table.dim() == 2 and table.shape[1] == dim:
            self._plan.embedding_dense = self._vector(table.reshape(-1), table.numel(), "embedding table")
        else:
            raise NotEligible("the embedding table is neither native blocks nor dense fp32")
        self._plan.embedding_rows = table.shape[0]

    def _addresses(self, routed: bool, n_layers: int, qk_norm: bool) -> None:
        """The stamps' buffer and every address a step passes to C, read once."""
        self._routed_address = self._routed.data_ptr() if routed else None
        self._routed_weights_address = self._routed_weights.data_ptr() if routed else None
        self._address = ctypes.addressof(self._plan)
        self.stamp_count = stamp_count(n_layers, staged=False, qk_norm=qk_norm, experts=self.top_k)
        self.staged_stamp_count = stamp_count(n_layers, staged=True, qk_norm=qk_norm, experts=self.top_k)
        self._stamps = torch.zeros(self.staged_stamp_count, dtype=torch.int64)  # room for either
        # Where the rope tables and the stamps live, read once like every other address the plan holds: a tensor's
        # data_ptr() costs ~10 us right after a step has streamed the weights (FusedPlan.native_off_reason checks
        # that the plan's tables are still these tensors before every step).
        self._cos_address, self._sin_address = self.cos.data_ptr(), self.sin.data_ptr()
        self._stamps_address = self._stamps.data_ptr()
        # the stamps as ctypes sees them (the tensor above owns the memory): a traced step's readings are a slice of
        # this, a list at once, where the tensor's slice and tolist() took ~40 us right after a step
        self._stamp_values = (ctypes.c_int64 * self.staged_stamp_count).from_address(self._stamps_address)

    def _matrix(self, weight: Any, shape: tuple[int, int], name: str) -> int:
        if not isinstance(weight, PackedWeight) or not runs_blocks(weight.format.kernel):
            raise NotEligible(f"{name} is not held for the native library's kernels (native, i8dot, i16dot)")
        if weight.shape != shape:
            raise NotEligible(f"{name} is {weight.shape}, the step expects {shape}")
        return self._keep_matrix(weight)

    def _experts(self, experts: Any, dim: int, ffn: int) -> tuple[int | None, int | None, int, int]:
        """A mixture of experts' _Layer fields: (router described, router dense (E, dim) fp32, the E gate|up
        descriptions' addresses, the E down ones'), each expert's pointing at its rows of the file's blocks."""
        count = len(experts.down)
        if isinstance(experts.router, PackedWeight):
            router, dense = self._matrix(experts.router, (count, dim), "the router"), None
        else:
            router, dense = None, self._vector(experts.router.reshape(-1), count * dim, "router")
        tables = []
        for name, weights, shape in (("an expert's gate|up", experts.gate_up, (2 * ffn, dim)),
                                     ("an expert's down", experts.down, (dim, ffn))):
            table = (ctypes.c_void_p * count)(*(self._matrix(w, shape, name) for w in weights))
            self._keep.append(table)
            tables.append(ctypes.addressof(table))
        return router, dense, tables[0], tables[1]

    def _keep_matrix(self, weight: PackedWeight) -> int:
        described = weight.native_matrix()
        self._keep.append(described)  # holds the row blocks' tensors and the C description
        return described.address

    def _vector(self, tensor: torch.Tensor | None, size: int, name: str) -> int | None:
        if tensor is None:
            return None
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous() \
                or tensor.shape != (size,):
            raise NotEligible(f"a {name} is not a contiguous fp32 ({size},) vector on the CPU")
        self._keep.append(tensor)
        return tensor.data_ptr()

    def _ensure_scratch(self, threads: int) -> None:
        if threads <= self._threads:
            return
        floats = self._scratch_floats(self._address, threads)
        scratch = torch.zeros(floats, dtype=torch.float32)
        self._plan.scratch, self._plan.scratch_floats = scratch.data_ptr(), floats
        self._scratch, self._threads = scratch, threads

    def __call__(self, token: int, position: int, first: int, stamps: bool = False,
                 staged: bool = False) -> torch.Tensor:
        """The token (its id) at `position`, attending keys first..position -> logits (1, V). Writes every layer's K
        and V at `position`. With `stamps`, `readings()` then holds the step's start and the clock reading after
        each stage from the embedding on: contract.fused_stages', or with `staged` contract.staged_stages' (Q, K, V
        and gate, up as products of their own rows, every stage ended by a barrier; the same logits and cache, bit
        for bit)."""
        threads = torch.get_num_threads()
        if threads > self._threads:
            self._ensure_scratch(threads)
        logits = torch.empty(1, self.vocab, dtype=torch.float32)
        row = position * self.head_dim * 4  # bytes into the (S_max, 1, D) tables
        # Until this step succeeds there are no readings: the buffer holds the last step's, or part of this one's.
        self._taken = 0
        status = self._step(self._address, token, self._cos_address + row, self._sin_address + row,
                            position, first, logits.data_ptr(), self._stamps_address if stamps else None, threads,
                            int(staged), self._routed_address, self._routed_weights_address)
        if status:
            raise native_kernel.NativeKernelError(f"the native decode step failed: {_STATUS.get(status, status)}")
        for route, last in self._routes:  # the route stages' last choice, as the stage modules leave it
            route.last = last
        if stamps:
            self._taken = self.staged_stamp_count if staged else self.stamp_count
        return logits

    def run_ahead(self, token: int, position: int, window: int | None, steps: int, stop_token: int | None,
                  choose: Chooser, stamps: bool = False) -> AheadRun:
        """Up to `steps` decode steps in one C call (decode_step.c's llmt_decode_ahead): the first takes `token` at
        `position`, each next one `choose(logits)`'s answer for the step before, called from C as soon as that
        step's logits (vocab,) are written (a view C overwrites at the next step: the caller's sampler reads it and
        keeps nothing of it). The run stops early after the step that chose `stop_token`, or after a step whose
        `choose` raised: `failure` holds the exception, that step is not in the result (its K and V written, not
        counted). Each step attends the keys a window of `window` positions (None: all) leaves it and writes its K
        and V. With `stamps`, each step's stage readings as `readings()` would have them."""
        threads = torch.get_num_threads()
        if threads > self._threads:
            self._ensure_scratch(threads)
        chosen, clock = (ctypes.c_int64 * steps)(), (ctypes.c_int64 * (3 * steps))()
        per_step = self.stamp_count
        readings = (ctypes.c_int64 * (steps * per_step))() if stamps else None
        status = ctypes.c_int(0)
        logits = torch.empty(self.vocab, dtype=torch.float32)
        view, raised = logits.numpy(), []

        def chooser(_step: int) -> int:
            try:
                return int(choose(view))
            except BaseException as exc:  # Ctrl-C too: C stops, and the steps done are still the caller's
                raised.append(exc)
                return -1

        self._taken = 0  # the single-step buffer no longer holds the last step's readings
        routed = torch.zeros(steps, *self._routed.shape, dtype=torch.int64) if self._routes else None  # (n, L, k)
        routed_weights = torch.zeros(steps, *self._routed.shape, dtype=torch.float32) if self._routes else None
        done = self._ahead(self._address, token, self._cos_address, self._sin_address, position, window or 0, steps,
                           -1 if stop_token is None else stop_token, _CHOOSE(chooser), logits.data_ptr(), chosen,
                           clock, readings, threads, ctypes.byref(status),
                           None if routed is None else routed.data_ptr(),
                           None if routed_weights is None else routed_weights.data_ptr())
        if status.value and status.value != _NOT_CHOSEN:
            raise native_kernel.NativeKernelError(f"the native decode step failed: "
                                                  f"{_STATUS.get(status.value, status.value)}")
        if status.value == _NOT_CHOSEN and not raised:
            raise native_kernel.NativeKernelError("the chooser answered a token outside the vocabulary")
        flat_clock, flat_stamps = clock[: 3 * done], readings[: done * per_step] if readings is not None else []
        routes = () if routed is None else tuple(zip(routed[:done].tolist(), routed_weights[:done].tolist()))
        if routes:  # each layer's Route.last: the last step's choice, as a step at a time leaves it
            self._routed.copy_(routed[done - 1])
            self._routed_weights.copy_(routed_weights[done - 1])
            for route, last in self._routes:
                route.last = last
        return AheadRun(
            tokens=tuple(chosen[:done]),
            clock=tuple(tuple(flat_clock[3 * i : 3 * i + 3]) for i in range(done)),
            stamps=tuple(flat_stamps[i * per_step : (i + 1) * per_step] for i in range(done)) if stamps else (),
            failure=raised[0] if raised else None,
            routes=routes,
        )

    def readings(self) -> list[int]:
        """The last step's clock readings (ns, CLOCK_MONOTONIC): its start, then one after each stage; none after a
        step that was not traced or failed."""
        return self._stamp_values[: self._taken]


def stamp_count(layers: int, staged: bool, qk_norm: bool = False, experts: int = 0) -> int:
    """Clock readings of a traced step of `layers` layers: its start, then one after each stage (QK-norm's, one a
    layer, where the model has it; a mixture of `experts` chosen experts a token: router, route, each expert's
    gate|up (gate, up when staged), silu*up and down, and the weighted sum in place of gate|up, silu*up, down)."""
    per_layer = (STAGED_STAGES_PER_LAYER if staged else STAGES_PER_LAYER) + int(qk_norm)
    if experts:  # router, route and the weighted sum stand for the dense FFN's gate|up, silu*up, down (staged: gate,
        per_layer += 4 * experts - 1 if staged else 3 * experts  # up, silu*up, down), then each expert's own

    return 1 + STAGES_BEFORE_LAYERS + per_layer * layers + STAGES_AFTER_LAYERS


def _floor(norm: Any) -> float:
    """An RMSNorm module's sqrt(dim * eps), as its forward takes it."""
    return float(norm.floor(norm.weight.device))


def _products(plan: Any) -> list[Any]:
    """Every matrix the step multiplies by: each layer's packed Q|K|V, wo, gate|up, w2 (a mixture of experts': every
    expert's gate|up and down; its router may be dense fp32), then the LM head."""
    return [w for layer in plan.layers for w in (layer.wqkv, layer.wo, *(
        (layer.w13, layer.w2) if layer.experts is None else (*layer.experts.gate_up, *layer.experts.down)))
            ] + [plan.output]
