"""Which way to run a model's products on this machine: the rule that turns measured timings into a choice.

`--dtype auto` is decided here from measurements (tracer/hardware/product_timing.py times the model's own products at
the model's own shapes), not from CPU flags: on one AVX-512-BF16 CPU fp16 matrix-vector products streamed at ~50 GB/s
and bf16 ones at ~17 GB/s, on an AMX CPU bf16 won, on an AVX2 one bf16 is several times slower than fp32. Which is
fastest is a property of the machine.

The rule, in order:
1. Candidates. Each dense compute dtype (fp32, fp16, bf16: every matrix converted to it, activations in it) and,
   where the weights have a stored-precision kernel, the stored format itself (the weights read as stored).
2. Numerical safety: a candidate never holds a matrix with fewer significand bits than the checkpoint gives it
   (`precise_enough`): a float matrix keeps at least its own bits (fp16 -> bf16 loses 3, so never; bf16 -> fp16
   is exact in fp16's range); a block-quantized matrix (GGUF Q4_1, Q8_0...) needs its code bits + 3 guard bits, so
   rounding its dequantized values adds at most 1/8 of a quantization step (half a step is the error the format
   already has): Q4 and Q5 fit bf16's 8 bits, Q6_K and Q8_0 need fp16's 11. 1-D tensors (norms, biases) follow the
   compute dtype, as in every framework; the fused path normalises in fp32 anyway. fp16 has a second condition,
   range, checked on the loaded model (tracer/load/kernel_pick.py): no weight beyond fp16's largest value and the
   residual stream of a probe forward below FP16_ACTIVATION_LIMIT, else the next candidate is taken.
   The stored format itself is always safe for its weights (it reads them as stored).
3. Speed: each candidate's cost is the time of a reference generation, a REFERENCE_PROMPT-token prefill plus
   REFERENCE_DECODE decode steps, from its measured product times (decode: matrix-vector, the faster of torch.mv and
   mm; prefill: matrix-matrix). The fastest safe candidate wins, except that a checkpoint stored in fp16 or bf16
   keeps its own dtype unless another safe one is MARGIN faster ("measurably": beyond a quick measurement's noise).
   A checkpoint without stored weights (random init) has every candidate safe.

Pure Python (no torch): the timings come in as records, so the rule is tested with injected timings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

# The reference generation a candidate's cost is the time of: a typical prompt's prefill and as many decode steps.
REFERENCE_PROMPT = 128
REFERENCE_DECODE = 128
MARGIN = 1.10  # another dtype must be 10% faster to replace a checkpoint's own fp16 or bf16
FP16_ACTIVATION_LIMIT = 4096.0  # 65504 / 16: room for prompts that push the residual stream further than the probe

DENSE = "dense"  # every matrix converted to the compute dtype
STORED = "stored"  # the matrices read at their stored precision (GGUF blocks through their kernels)

# Significand bits (the implicit bit included) of the dtypes the products compute in.
COMPUTE_BITS = {"fp32": 24, "fp16": 11, "bf16": 8}
# Significand bits a float-stored matrix has.
FLOAT_STORED_BITS = {"F64": 53, "F32": 24, "fp32": 24, "F16": 11, "fp16": 11, "BF16": 8, "bf16": 8}
# Code bits of block-quantized formats (ggml type names); the block scales are fp16 in all of them.
QUANT_BITS = {
    "Q8_0": 8, "Q8_1": 8, "Q8_K": 8, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4,
    "IQ4_NL": 4, "IQ4_XS": 4, "MXFP4": 4, "NVFP4": 4, "Q3_K": 3, "IQ3_XXS": 3, "IQ3_S": 3, "Q2_K": 2, "IQ2_XXS": 2,
    "IQ2_XS": 2, "IQ2_S": 2, "TQ1_0": 2, "TQ2_0": 2, "IQ1_S": 1, "IQ1_M": 1, "Q1_0": 1,
}
GUARD_BITS = 3  # rounding a dequantized value adds at most 2^-3 of a quantization step


def required_bits(stored: str) -> int:
    """Significand bits a compute dtype needs to hold a matrix stored as `stored` (a ggml type name or a dtype)
    without losing what the checkpoint has (see the module docstring)."""
    if stored in FLOAT_STORED_BITS:
        return FLOAT_STORED_BITS[stored]
    if stored in QUANT_BITS:
        return QUANT_BITS[stored] + GUARD_BITS
    return COMPUTE_BITS["fp32"]  # an unknown format: only fp32 is known to be enough


def precise_enough(dtype: str, stored_formats: Iterable[str]) -> tuple[bool, str]:
    """Whether dense `dtype` holds every matrix format in `stored_formats` (see the module docstring), and if not,
    which one it cannot hold."""
    bits = COMPUTE_BITS[dtype]
    for stored in sorted(set(stored_formats)):
        need = required_bits(stored)
        if bits < need:
            return False, f"{stored} matrices need {need} significand bits, {dtype} has {bits}"
    return True, ""


@dataclass(frozen=True, slots=True)
class CandidateTiming:
    """One measured way to run the model's products."""

    name: str  # "fp16", or "stored+bf16" (the stored formats' kernels with bf16 activations)
    dtype: str  # the compute (activation) dtype: fp32, fp16, bf16
    weights: str  # DENSE or STORED
    decode_kernel: str  # "mv" or "mm" for dense; the stored formats' kernel otherwise
    decode_s: float  # the products of one decode step: every layer and the LM head, best of the timed runs
    prefill_s: float  # the products of a REFERENCE_PROMPT-token prefill (the LM head on the last position only)
    weight_bytes: int  # bytes a decode step's products read in this form
    safe: bool = True
    unsafe_reason: str = ""

    @property
    def reference_s(self) -> float:
        """The reference generation's product time: what candidates are ranked by."""
        return self.prefill_s + REFERENCE_DECODE * self.decode_s

    @property
    def decode_tokens_per_s(self) -> float:
        return 1.0 / self.decode_s if self.decode_s > 0 else float("inf")


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """What `--dtype auto` (and `--weights`, once stored formats exist) resolved to, and why."""

    picked: str  # a candidate name
    dtype: str  # its compute dtype
    weights: str  # DENSE or STORED
    decode_kernel: str
    rule: str  # one line: why this one
    candidates: tuple[CandidateTiming, ...]  # every candidate measured, fastest first (unsafe ones included)
    measured_seconds: float  # how long the measurement took (0 when read back)
    from_store: bool = False  # read back from the saved choices for this machine and model shape
    overridden_by: str = ""  # "--dtype fp32" when the user chose; then `picked` is what auto would have taken
    stored_dtype: str | None = None  # the checkpoint's own compute dtype (select's argument)

    def timing(self, name: str) -> CandidateTiming | None:
        return next((c for c in self.candidates if c.name == name), None)


def select(candidates: Iterable[CandidateTiming], stored_dtype: str | None = None,
           measured_seconds: float = 0.0) -> KernelChoice:
    """The choice among measured `candidates` by the rule of the module docstring. `stored_dtype`: the compute
    dtype the checkpoint is stored in (fp16/bf16/fp32 HF weights), None for quantized or random weights."""
    ranked = tuple(sorted(candidates, key=lambda c: (not c.safe, c.reference_s, c.name)))
    safe = [c for c in ranked if c.safe]
    if not safe:
        raise ValueError("no numerically safe candidate was measured")  # the caller always offers fp32 dense
    fastest = safe[0]
    own = next((c for c in safe if c.weights == DENSE and c.dtype == stored_dtype), None)
    if own is not None and stored_dtype in ("fp16", "bf16") and own is not fastest:
        if fastest.reference_s * MARGIN > own.reference_s:
            gain = own.reference_s / fastest.reference_s
            return _choice(own, ranked, measured_seconds,
                           f"the checkpoint's own {stored_dtype}: {fastest.name} is only {gain:.2f}x faster "
                           f"(needs {MARGIN:.2f}x)", stored_dtype)
    if len(safe) == 1:
        rule = f"the only numerically safe candidate ({_unsafe_summary(ranked)})"
    else:
        runner_up = safe[1]
        rule = (f"fastest of {len(safe)} safe candidates ({runner_up.reference_s / fastest.reference_s:.2f}x "
                f"ahead of {runner_up.name})")
        unsafe = [c for c in ranked if not c.safe]
        if unsafe:
            rule += f"; not safe: {_unsafe_summary(ranked)}"
    return _choice(fastest, ranked, measured_seconds, rule, stored_dtype)


def without(choice: KernelChoice, name: str, reason: str) -> KernelChoice:
    """`choice` re-decided with candidate `name` marked unsafe for `reason` (an fp16 range check that failed)."""
    marked = [replace(c, safe=False, unsafe_reason=reason) if c.name == name else c for c in choice.candidates]
    again = select(marked, choice.stored_dtype, choice.measured_seconds)
    return replace(again, from_store=choice.from_store)


def unmeasured(dtype: str, rule: str, stored_dtype: str | None = None) -> KernelChoice:
    """A choice with nothing to measure (one safe candidate, or a device without timings): dense `dtype`."""
    return KernelChoice(picked=dtype, dtype=dtype, weights=DENSE, decode_kernel="mv", rule=rule, candidates=(),
                        measured_seconds=0.0, stored_dtype=stored_dtype)


def _choice(picked: CandidateTiming, ranked: tuple[CandidateTiming, ...], seconds: float, rule: str,
            stored_dtype: str | None) -> KernelChoice:
    return KernelChoice(picked=picked.name, dtype=picked.dtype, weights=picked.weights,
                        decode_kernel=picked.decode_kernel, rule=rule, candidates=ranked, measured_seconds=seconds,
                        stored_dtype=stored_dtype)


def _unsafe_summary(ranked: tuple[CandidateTiming, ...]) -> str:
    unsafe = [f"{c.name}: {c.unsafe_reason}" for c in ranked if not c.safe]
    return "; ".join(unsafe) if unsafe else "no other candidate"
