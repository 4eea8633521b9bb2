"""The accuracy rule every way of running a model's products is judged by, and the record of what a run used.

What runs by default is a fixed table per instruction set (tracer/hardware/kernel_defaults.py), never a timing taken
at run time. `llmtrace tune` (tracer/load/kernel_pick.py) times the candidates on this machine at the model's own
shapes and saves its pick, which a run uses only under `--weights tuned`; a saved pick is judged again by the same
rule before it is used.

The rule:
1. Candidates (tune). Each dense compute dtype (fp32, fp16, bf16: every matrix converted to it, activations in it)
   and, for a GGUF, each stored-precision kernel that runs every one of its matrices as stored
   (llmtrace.tracer.model.weight_formats.stored_kernels), with fp32 activations; and, when no one kernel is acceptable
   for every matrix type, a kernel PER TYPE ("Q4_1:i8dot,Q8_0:native": for each type the first acceptable kernel in
   weight_formats' order, and that plan with one type at a time on its next acceptable kernel).
2. Accuracy: one rule for dense and stored candidates. A matrix stored as format F needs `required_bits(F)`
   significand bits: a float matrix its own bits (fp16 -> bf16 loses 3, so never; bf16 -> fp16 is exact in fp16's
   range); a block-quantized one (GGUF Q4_1, Q8_0...) its code bits + GUARD_BITS, so that rounding a dequantized
   value adds at most 1/8 of a quantization step (half a step is the error the format already has): Q4 and Q5 fit
   bf16's 8 bits, Q6_K and Q8_0 need fp16's 11. A candidate carries `precision_bits`: a dense dtype its significand
   bits; a stored kernel the bits its products keep (KERNEL_BITS: "int4pack" rounds the activations, scales and
   zeros to bf16, so 8; "blocks" dequantizes exactly into the activations' dtype, so the activations' bits; a kernel
   not listed has None: it is judged by its probe alone). A candidate is ACCEPTABLE for the model when, for every
   matrix format F of the model,
     precision_bits >= required_bits(F), or
     F is block-quantized and the PROBED product error on the model's own F matrices is at most 2^-required_bits(F):
     err = ||y - y_exact||_2 / ||y_exact||_2 over the outputs of PROBE_ROWS seeded standard-normal activation rows
     multiplied by those matrices (y: the candidate's product; y_exact: the same rows times the file's exactly
     dequantized values, in fp64). 2^-b is the unit roundoff of a b-bit significand.
   A kernel that computes llama.cpp's own products on a format (LLAMA_CPP_MATH: i8dot on Q8_0) is held there to
   llama.cpp's int8 activations' bits instead: its reference is llama.cpp, against which it is verified.
   fp16 has a second condition, range, checked on the loaded model (tracer/load/kernel_pick.py's fp16_problem).
3. Speed (tune): each candidate's cost is the time of a reference generation's products, a REFERENCE_PROMPT-token
   prefill plus REFERENCE_DECODE decode steps (`reference_s`), timed one layer and the LM head at a time
   (tracer/hardware/product_timing.py). The fastest acceptable candidate is tune's pick.

Pure Python (no torch): the timings and probe errors come in as records, so the rule is tested with injected ones.
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

# The reference generation a candidate's cost is the time of: a typical prompt's prefill and as many decode steps.
REFERENCE_PROMPT = 128
REFERENCE_DECODE = 128
FP16_ACTIVATION_LIMIT = 4096.0  # 65504 / 16: room for prompts that push the residual stream further than the probe
PROBE_ROWS = 4  # activation rows a probe multiplies each matrix by

DENSE = "dense"  # every matrix converted to the compute dtype
STORED = "stored"  # the matrices read at their stored precision (GGUF blocks through their kernels)
STORED_ACTIVATIONS = "fp32"  # the activations' dtype of a stored candidate

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
# The significand bits a stored kernel's products keep: "int4pack" (torch's int4 kernel) runs in bf16 (activations,
# scales and zeros rounded to bf16); "blocks" dequantizes exactly into the activations' dtype (EXACT: their bits).
# A kernel not listed is judged by its probe alone (its precision is measured, not declared): "native" (exact, so its
# probe measures fp32 rounding), "i8dot", which rounds the activations to int8 per 32 values (~2^-7.5 relative
# on a product: admitted for Q4 matrices and, by LLAMA_CPP_MATH below, Q8_0 ones; refused for Q5/Q6_K ones on the
# probe's standard-normal rows), and
# "i16dot" (Q8_0, Q6_K), which rounds them to int16 (~2^-15.5 relative: admitted for Q8_0's 11 bits by its probe).
EXACT = "exact"
KERNEL_BITS: dict[str, int | str] = {"int4pack": COMPUTE_BITS["bf16"], "blocks": EXACT}
# Where a kernel computes llama.cpp's own products for a format, the numerics users compare against are llama.cpp's,
# so that is the reference it is verified against (issue 31: greedy top-1 agreement with llama.cpp on the same file,
# teacher-forced over 512 tokens, >= 99%: benchmarks/check_numerics.py), and its probe holds it to the precision
# of llama.cpp's activations, INT8_ACTIVATION_BITS, instead of the format's code bits + GUARD_BITS. i8dot on Q8_0:
# ggml's Q8_0 product rounds the activations to q8_0 blocks (int8 per 32 values, d = max|x| / 127 in fp16) and i8dot
# sums the same integers with the same scales; the rounding of x costs ~2^-7.5 relative on a product whatever the weights' bits, over Q8_0's
# 2^-11, so by the format's bits i8dot would be refused; on a real model stored as Q8_0 (SmolLM2-135M requantized) it
# agreed with llama.cpp at 99.80 % (BENCHMARKS "Issue 31: i8dot for Q8_0", helper H1). Only the pairs verified so:
# Q5_0/Q5_1 (llama.cpp's math too) have not been.
LLAMA_CPP_MATH = {"i8dot": ("Q8_0",)}
INT8_ACTIVATION_BITS = 7  # int8 codes: 7 bits of magnitude (the 4-bit formats' 4 + GUARD_BITS, which i8dot meets)


def required_bits(stored: str, kernel: str = "") -> int:
    """Significand bits a compute dtype needs to hold a matrix stored as `stored` (a ggml type name or a dtype)
    without losing what the checkpoint has (see the module docstring); for a `kernel` computing llama.cpp's own
    products on that format (LLAMA_CPP_MATH), the bits of llama.cpp's int8 activations."""
    if stored in LLAMA_CPP_MATH.get(kernel, ()):
        return INT8_ACTIVATION_BITS
    if stored in FLOAT_STORED_BITS:
        return FLOAT_STORED_BITS[stored]
    if stored in QUANT_BITS:
        return QUANT_BITS[stored] + GUARD_BITS
    return COMPUTE_BITS["fp32"]  # an unknown format: only fp32 is known to be enough


def tolerance(stored: str, kernel: str = "") -> float:
    """The largest probed relative product error acceptable for matrices stored as `stored` (on `kernel`):
    2^-required_bits."""
    return 2.0 ** -required_bits(stored, kernel)


def probed(stored: str) -> bool:
    """Whether a candidate short of bits may still pass on a probe of `stored` matrices: block formats only."""
    return stored in QUANT_BITS


def precision_bits(weights: str, dtype: str, kernel: str = "") -> int | None:
    """The significand bits a candidate's products keep (see the module docstring); None: not declared, so only a
    probe can accept it."""
    if weights == DENSE:
        return COMPUTE_BITS[dtype]
    declared = KERNEL_BITS.get(kernel)
    if declared == EXACT:
        return COMPUTE_BITS[dtype]
    return None if declared is None else min(int(declared), COMPUTE_BITS[dtype])


def short_of_bits(bits: int | None, stored_formats: Iterable[str], kernel: str = "") -> tuple[str, ...]:
    """The formats a candidate (`kernel`) keeping `bits` cannot hold by its bits alone (all of them when bits is
    None)."""
    return tuple(f for f in sorted(set(stored_formats)) if bits is None or bits < required_bits(f, kernel))


def judge(name: str, bits: int | None, stored_formats: Iterable[str], errors: Mapping[str, float]
          ) -> tuple[bool, str]:
    """Whether candidate `name` (keeping `bits`, None = undeclared) is acceptable for a model whose matrices are
    `stored_formats`, given the probed relative product errors `errors` {format: err} (see the module
    docstring); and if not, why, in a phrase naming the format, the bits, and the probe's error and tolerance."""
    for stored in short_of_bits(bits, stored_formats, name):
        need = required_bits(stored, name)
        has = f"{name} keeps {bits}" if bits is not None else f"{name} declares none"
        if not probed(stored):
            return False, f"{stored} matrices need {need} significand bits, {has}"
        err = errors.get(stored)
        if err is None:
            return False, f"{stored} matrices need {need} significand bits, {has}, and no probe was made"
        if not err <= tolerance(stored, name):  # NaN fails
            return False, (f"{stored} matrices need {need} significand bits, {has}; probed product error "
                           f"{err:.2g} > 2^-{need} = {tolerance(stored, name):.2g}")
    return True, ""


@dataclass(frozen=True, slots=True)
class CandidateTiming:
    """One measured way to run the model's products."""

    name: str  # "fp16" (dense), or a stored kernel's name: "int4pack", "blocks"
    dtype: str  # the compute (activation) dtype: fp32, fp16, bf16
    weights: str  # DENSE or STORED
    decode_kernel: str  # "mv" or "mm" for dense; the stored kernel otherwise
    # One decode step (step 3): a whole native C step for a native-step candidate, else its products (every layer
    # and the LM head, best of the timed runs)
    decode_s: float
    prefill_s: float  # the products of a REFERENCE_PROMPT-token prefill (the LM head on the last position only)
    weight_bytes: int  # bytes a decode step's products read in this form (stored bytes for a stored kernel)
    safe: bool = True  # acceptable by the accuracy rule (module docstring, step 2) and fp16's range checks
    unsafe_reason: str = ""
    # The probed relative product error (step 2), worst over the formats probed; None: no probe was needed.
    product_error: float | None = None

    @property
    def reference_s(self) -> float:
        """The reference generation's product time: what candidates are ranked by."""
        return self.prefill_s + REFERENCE_DECODE * self.decode_s


DEFAULT, TUNED, OPTION = "default", "tuned", "option"  # where a run's kernels came from


@dataclass(frozen=True, slots=True)
class TypeKernel:
    """How one stored type's matrices ran: "Q4_1" on "i8dot", "int8 activations (llama.cpp-style)"."""

    type: str  # the file's type name (Q4_1, Q8_0, F32...)
    kernel: str  # a stored kernel, or "dense" (dequantized into the compute dtype)
    numerics: str  # what its products compute (kernel_defaults.NUMERICS)


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """What a run multiplied its matrices with, where that came from, and what its products compute."""

    picked: str  # a dense dtype ("fp32") or a stored kernel spec ("Q4_1:i8dot,Q8_0:native")
    dtype: str  # the compute (activation) dtype
    weights: str  # DENSE or STORED
    decode_kernel: str  # "mv"/"mm" for dense; the stored kernel spec otherwise
    source: str  # DEFAULT (the table), TUNED (`llmtrace tune`'s saved pick), OPTION (--dtype / --weights)
    rule: str  # one line: why these
    numerics: str  # "exact", or per type: "int8 activations (llama.cpp-style) on Q4_1; exact on Q8_0"
    instruction_set: str = ""  # the default table's row (kernel_defaults.py)
    by_type: tuple[TypeKernel, ...] = ()  # the file's matrix types, each's kernel and numerics
    candidates: tuple[CandidateTiming, ...] = ()  # tune's timings, fastest acceptable first (a tuned pick)
    measured_seconds: float = 0.0  # how long tune measured
    others_cpu: float | None = None  # the share of the CPUs other processes took while tune measured

    def timing(self, name: str) -> CandidateTiming | None:
        return next((c for c in self.candidates if c.name == name), None)


def select(candidates: Iterable[CandidateTiming]) -> CandidateTiming:
    """Tune's pick among measured `candidates`: the fastest acceptable one (ties by name)."""
    safe = sorted((c for c in candidates if c.safe), key=lambda c: (c.reference_s, c.name))
    if not safe:
        raise ValueError("no acceptable candidate was measured")  # the caller always offers fp32 dense
    return safe[0]


def ranked(candidates: Iterable[CandidateTiming]) -> tuple[CandidateTiming, ...]:
    """Acceptable ones first, each group fastest first."""
    return tuple(sorted(candidates, key=lambda c: (not c.safe, c.reference_s, c.name)))
