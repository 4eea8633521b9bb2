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
plan holds a reference to every tensor whose memory C reads. Gemma 3 runs too: its (1 + w) norms, norms after
attention and FFN, GeGLU, × √d, QK-norm, query_pre_attn_scalar, soft-cap, and windowed and global layers with their
own RoPE tables, in the same C layer loop (native_plan.py says how each is passed).

A mixture of experts (every layer's FFN routed: tracer/model/moe.py's ExpertsPlan, its experts held as the GGUF
stores them) runs its router, its route (softmax, top-k, the family's renormalisation), each chosen expert's gate|up,
silu*up and down over that expert's bytes of the 3-D tensors, and the weighted sum in C too; the step writes its
choice per layer into buffers whose rows become each layer's Route.last, where the trace's routing record reads it.

The token's embedding row is looked up in C too (the table held as stored, its row dequantized exactly as
native_kernel.dequantize does, or dense fp32), so the step is one call from the token id to the logits.

Tracing: with `stamps=True` the C step reads CLOCK_MONOTONIC at its start and after each stage of
contract.fused_stages (the embedding, every layer's stages, the final norm and the LM head; Gemma's among them),
the clock time.perf_counter_ns reads on Linux (`host_clock_matches` checks that; where it does not, a traced run takes the
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
from llmtrace.tracer.model.native_plan import NotEligible, StepDescription, products, structure_sizes
from llmtrace.tracer.model.weight_formats import PackedWeight, runs_blocks

_STATUS = {2: "a position outside the cache", 4: "a build without the AVX2 row kernels", 5: "too little scratch",
           6: "a token id outside the embedding table"}
_NOT_CHOSEN = 7  # llmt_decode_ahead: the chooser answered no token (it raised: run_ahead hands its exception on)
# llmt_decode_ahead's chooser: called with a step's index once its logits are written, it answers the next token
_CHOOSE = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)
Chooser = Callable[[np.ndarray], int]  # the next token from a step's logits (vocab,): the run's sampler


@functools.cache
def host_clock_matches() -> bool:
    """Whether time.perf_counter_ns reads CLOCK_MONOTONIC, the clock the C step stamps with (Linux: yes)."""
    return time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"


def _entry_points() -> tuple[Any, Any, Any, Any] | None:
    """(llmt_decode_step, llmt_step_scratch_floats, llmt_decode_ahead, llmt_step_stamps) of the current library
    (native_kernel.reset() may load another) with their signatures declared, or None when there is no library, its
    step's structures differ from native_plan.py's, or it was built without the AVX2 row kernels."""
    if not native_kernel.available():
        return None
    library = native_kernel.library()
    if library.path not in _DECLARED:
        _DECLARED[library.path] = _declare(library)
    return _DECLARED[library.path]


_DECLARED: dict[Any, tuple[Any, Any, Any, Any] | None] = {}  # by library file: made once per library loaded


def _declare(library: native_kernel.NativeLibrary) -> tuple[Any, Any, Any, Any] | None:
    handle = library.handle  # its entry points declared by native_kernel._SIGNATURES
    if (handle.llmt_step_layer_size(), handle.llmt_step_plan_size()) != structure_sizes() \
            or not handle.llmt_step_supported():
        return None
    # Called holding the GIL (PyDLL functions): the step's threads are as many as the cores torch uses, and a Python
    # thread running meanwhile (a live view's refresh) would take one of them and stall every barrier of the step.
    holding_the_gil = ctypes.PyDLL(str(library.path))
    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    step = holding_the_gil.llmt_decode_step
    step.argtypes = [pointer, int64, int64, pointer, pointer, ctypes.c_int, ctypes.c_int, pointer, pointer]
    step.restype = ctypes.c_int
    ahead = holding_the_gil.llmt_decode_ahead
    ahead.argtypes = [pointer, int64, int64, int64, int64, _CHOOSE, *(pointer,) * 4, ctypes.c_int, pointer, pointer,
                      pointer]
    ahead.restype = int64
    return step, handle.llmt_step_scratch_floats, ahead, handle.llmt_step_stamps


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


class NativeStep:
    """A model's decode step as one C call. Build with `NativeStep.build(plan)`; call with the token's id."""

    def __init__(self, plan: Any) -> None:
        """`plan` is a FusedPlan (its PackedLayers and blocks, output, norm modules, rope tables and KV rows);
        NotEligible if it cannot run."""
        entry = _entry_points()
        if entry is None:
            raise NotEligible("the native library (with its AVX2 row kernels) is not available")
        self._step, self._scratch_floats, self._ahead, stamps_written = entry
        described = self._described = StepDescription(plan)
        self.layers, self.vocab, self.dim, self.head_dim = (described.layers, described.vocab, described.dim,
                                                            described.head_dim)
        self.top_k = described.top_k
        self._routes, self._routed, self._routed_weights = (described.routes, described.routed,
                                                            described.routed_weights)
        self._address = ctypes.addressof(described.plan)
        # the clock readings a traced step writes (its start, then one after each stage), fused and staged, as C
        # counts them: the buffer below is sized by them, C writes without being told its length
        self.stamp_count, self.staged_stamp_count = (int(stamps_written(self._address, staged)) for staged in (0, 1))
        self._stamps = torch.zeros(self.staged_stamp_count, dtype=torch.int64)  # room for either
        # Every address a step passes to C, read once: a tensor's data_ptr() costs ~10 us right after a step has
        # streamed the weights.
        self._routed_address = self._routed.data_ptr() if self._routes else None
        self._routed_weights_address = self._routed_weights.data_ptr() if self._routes else None
        self._stamps_address = self._stamps.data_ptr()
        # the stamps as ctypes sees them (the tensor above owns the memory): a traced step's readings are a slice of
        # this, a list at once, where the tensor's slice and tolist() took ~40 us right after a step
        self._stamp_values = (ctypes.c_int64 * self.staged_stamp_count).from_address(self._stamps_address)
        self._taken = 0  # readings the last traced step left
        self._threads = 0
        self._ensure_scratch(torch.get_num_threads())

    @classmethod
    def build(cls, plan: Any) -> tuple[NativeStep | None, str]:
        """(the step, "") or (None, why not): the fused path then runs its torch ops."""
        if not all(isinstance(w, PackedWeight) and runs_blocks(w.format.kernel) for w in products(plan)):
            return None, "a product of the step is not held for the native library's kernels (native, i8dot, i16dot)"
        try:
            return cls(plan), ""
        except NotEligible as exc:
            return None, str(exc)

    def _ensure_scratch(self, threads: int) -> None:
        if threads <= self._threads:
            return
        floats = self._scratch_floats(self._address, threads)
        scratch = torch.zeros(floats, dtype=torch.float32)
        self._described.plan.scratch, self._described.plan.scratch_floats = scratch.data_ptr(), floats
        self._scratch, self._threads = scratch, threads

    def __call__(self, token: int, position: int, stamps: bool = False, staged: bool = False) -> torch.Tensor:
        """The token (its id) at `position`, each layer attending the keys its window leaves it -> logits (1, V).
        Writes every layer's K and V at `position`. With `stamps`, `readings()` then holds the step's start and the
        clock reading after each stage from the embedding on: contract.fused_stages', or with `staged`
        contract.staged_stages' (Q, K, V and gate, up as products of their own rows, every stage ended by a barrier;
        the same logits and cache, bit for bit)."""
        threads = torch.get_num_threads()
        if threads > self._threads:
            self._ensure_scratch(threads)
        logits = torch.empty(1, self.vocab, dtype=torch.float32)
        # Until this step succeeds there are no readings: the buffer holds the last step's, or part of this one's.
        self._taken = 0
        status = self._step(self._address, token, position, logits.data_ptr(),
                            self._stamps_address if stamps else None, threads, int(staged), self._routed_address,
                            self._routed_weights_address)
        if status:
            raise native_kernel.NativeKernelError(f"the native decode step failed: {_STATUS.get(status, status)}")
        for route, last in self._routes:  # the route stages' last choice, as the stage modules leave it
            route.last = last
        if stamps:
            self._taken = self.staged_stamp_count if staged else self.stamp_count
        return logits

    def run_ahead(self, token: int, position: int, steps: int, stop_token: int | None, choose: Chooser,
                  stamps: bool = False) -> AheadRun:
        """Up to `steps` decode steps in one C call (decode_step.c's llmt_decode_ahead): the first takes `token` at
        `position`, each next one `choose(logits)`'s answer for the step before, called from C as soon as that
        step's logits (vocab,) are written (a view C overwrites at the next step: the caller's sampler reads it and
        keeps nothing of it). The run stops early after the step that chose `stop_token`, or after a step whose
        `choose` raised: `failure` holds the exception, that step is not in the result (its K and V written, not
        counted). Each step attends the keys each layer's window leaves it and writes its K and V. With `stamps`,
        each step's stage readings as `readings()` would have them."""
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
        done = self._ahead(self._address, token, position, steps, -1 if stop_token is None else stop_token,
                           _CHOOSE(chooser), logits.data_ptr(), chosen, clock, readings, threads,
                           ctypes.byref(status), None if routed is None else routed.data_ptr(),
                           None if routed_weights is None else routed_weights.data_ptr())
        if status.value and status.value != _NOT_CHOSEN:
            raise native_kernel.NativeKernelError(f"the native decode step failed: "
                                                  f"{_STATUS.get(status.value, status.value)}")
        if status.value == _NOT_CHOSEN and not raised:
            raise native_kernel.NativeKernelError("the chooser answered a token outside the vocabulary")
        flat_clock, flat_stamps = clock[: 3 * done], readings[: done * per_step] if readings is not None else []
        return AheadRun(
            tokens=tuple(chosen[:done]),
            clock=tuple(tuple(flat_clock[3 * i : 3 * i + 3]) for i in range(done)),
            stamps=tuple(flat_stamps[i * per_step : (i + 1) * per_step] for i in range(done)) if stamps else (),
            failure=raised[0] if raised else None,
            routes=self._last_routes(routed, routed_weights, done),
        )

    def _last_routes(self, routed: torch.Tensor | None, weights: torch.Tensor | None,
                     done: int) -> tuple[tuple[list[list[int]], list[list[float]]], ...]:
        """A run ahead's choice per step (a mixture of experts'; () else), the last step's left in each layer's
        Route.last, as a step at a time leaves it."""
        if routed is None or not done:
            return ()
        self._routed.copy_(routed[done - 1])
        self._routed_weights.copy_(weights[done - 1])
        for route, last in self._routes:
            route.last = last
        return tuple(zip(routed[:done].tolist(), weights[:done].tolist()))

    def readings(self) -> list[int]:
        """The last step's clock readings (ns, CLOCK_MONOTONIC): its start, then one after each stage; none after a
        step that was not traced or failed."""
        return self._stamp_values[: self._taken]

