"""Which way to run a model's products on this machine: the rule that turns measured timings into a choice.

`--dtype auto` and `--weights auto` are decided here from measurements (tracer/hardware/product_timing.py times the
model's own products at the model's own shapes), not from CPU flags: on one AVX-512-BF16 CPU fp16 matrix-vector
products streamed at ~50 GB/s and bf16 ones at ~17 GB/s, on an AMX CPU bf16 won, on an AVX2 one bf16 is several
times slower than fp32, and torch's int4 kernel is a bf16 kernel that beats every dense dtype on some shapes and not
on others. Which is fastest is a property of the machine.

The rule, in order:
1. Candidates. Each dense compute dtype (fp32, fp16, bf16: every matrix converted to it, activations in it) and, for
   a GGUF, each stored-precision kernel that runs every one of its matrices as stored
   (llmtrace.tracer.model.weight_formats.stored_kernels: "int4pack", "blocks", and any kernel added there), with fp32
   activations (the rest of the model computes in fp32; the kernel reads the weights as the file stores them);
   and, when no one kernel is acceptable for every matrix type, a kernel PER TYPE ("Q4_1:int4pack,Q8_0:blocks":
   for each type the first kernel in weight_formats' order that is acceptable for that type alone; and that plan with
   one type at a time on its next acceptable kernel, since an order is not a measurement: "Q4_1:i8dot,Q8_0:i16dot"
   and "Q4_1:i8dot,Q8_0:native" are both timed; tracer/load/kernel_pick.py's per_type_plans).
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
     dequantized values, in fp64). 2^-b is the unit roundoff of a b-bit significand, so a candidate passes when its
     products are as close to the exact ones as rounding to the bits the format needs would leave them.
   The probe runs once per machine and model (its error is saved with the timings) and only where the bits do not
   already settle it; a float-stored matrix is never probed (its values are the checkpoint; fewer bits change them).
   So int4pack is acceptable for Q4 models and refused for a Q8_0 matrix unless its probe passes; exact kernels always
   pass; dense bf16 for Q8_0 is probed the same way. fp16 has a second condition, range, checked on the loaded model
   (tracer/load/kernel_pick.py): no weight beyond fp16's largest value and the residual stream of a probe forward
   below FP16_ACTIVATION_LIMIT, else the next candidate is taken.
3. Speed: each candidate's cost is the time of a reference generation, a REFERENCE_PROMPT-token prefill plus
   REFERENCE_DECODE decode steps (`reference_s`). Prefill: its measured matrix-matrix product times. Decode
   (`decode_s`), timed as the candidate's decode step will run:
   - a stored candidate whose one-token step runs as the native C step (every matrix on the native library's kernels:
     "native", "i8dot", "i16dot", a plan of them; tracer/model/native_step.py) is timed as WHOLE steps of its model as
     `run` loads it (tracer/load/step_timing.py: steps at the first positions of an empty cache, the candidates
     alternated in rounds, the 0.2 quantile of up to 64 steps): its products, norms, RoPE, a few keys' attention and the
     embedding row in one C call, as it runs. A sum of its products called one by one from Python is not what that step
     does (a ctypes call and a thread wake-up per product, activations quantized per call): it misranked the two such
     candidates of the bundled model;
   - every other candidate as the sum of its matrix-vector products (tracer/hardware/product_timing.py: the faster
     of torch.mv and mm for a dense dtype, the kernel itself for a stored one; each the best of a few passes): the
     step's other operations are not counted, which leans towards these candidates, never against them.
   The fastest acceptable candidate wins, except that a checkpoint stored in fp16 or bf16 keeps its own dtype unless
   another acceptable one is MARGIN faster ("measurably": beyond a quick measurement's noise). A checkpoint without
   stored weights (random init) has every dense candidate acceptable. Refused candidates are timed too and listed with
   the reason.
4. Overrides: `--dtype X` and `--weights dense|stored|<kernel>` restrict the candidates (`constrained`); the run
   records the option, what auto would have taken, and the candidate that ran.

Pure Python (no torch): the timings and probe errors come in as records, so the rule is tested with injected ones.
"""


from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Mapping

# The reference generation a candidate's cost is the time of: a typical prompt's prefill and as many decode steps.
REFERENCE_PROMPT = 128
REFERENCE_DECODE = 128
MARGIN = 1.10  # another dtype must be 10% faster to replace a checkpoint's own fp16 or bf16
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
# on a product: admitted for Q4 matrices, refused for Q5/Q6_K/Q8_0 ones on the probe's standard-normal rows), and
# "i16dot" (Q8_0, Q6_K), which rounds them to int16 (~2^-15.5 relative: admitted for Q8_0's 11 bits by its probe).
EXACT = "exact"
KERNEL_BITS: dict[str, int | str] = {"int4pack": COMPUTE_BITS["bf16"], "blocks": EXACT}


def required_bits(stored: str) -> int:
    """Significand bits a compute dtype needs to hold a matrix stored as `stored` (a ggml type name or a dtype)
    without losing what the checkpoint has (see the module docstring)."""
    if stored in FLOAT_STORED_BITS:
        return FLOAT_STORED_BITS[stored]
    if stored in QUANT_BITS:
        return QUANT_BITS[stored] + GUARD_BITS
    return COMPUTE_BITS["fp32"]  # an unknown format: only fp32 is known to be enough


def tolerance(stored: str) -> float:
    """The largest probed relative product error acceptable for matrices stored as `stored`: 2^-required_bits."""
    return 2.0 ** -required_bits(stored)


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


def precise_enough(dtype: str, stored_formats: Iterable[str]) -> tuple[bool, str]:
    """Whether dense `dtype` holds every matrix format in `stored_formats` by its bits alone (no probe), and if
    not, which one it cannot hold."""
    short = short_of_bits(COMPUTE_BITS[dtype], stored_formats)
    if short:
        need = required_bits(short[0])
        return False, f"{short[0]} matrices need {need} significand bits, {dtype} has {COMPUTE_BITS[dtype]}"
    return True, ""


def short_of_bits(bits: int | None, stored_formats: Iterable[str]) -> tuple[str, ...]:
    """The formats a candidate keeping `bits` cannot hold by its bits alone (all of them when bits is None)."""
    return tuple(f for f in sorted(set(stored_formats)) if bits is None or bits < required_bits(f))


def judge(name: str, bits: int | None, stored_formats: Iterable[str], errors: Mapping[str, float]
          ) -> tuple[bool, str]:
    """Whether candidate `name` (keeping `bits`, None = undeclared) is acceptable for a model whose matrices are
    `stored_formats`, given the probed relative product errors `errors` {format: err} (see the module
    docstring); and if not, why, in a phrase naming the format, the bits, and the probe's error and tolerance."""
    for stored in short_of_bits(bits, stored_formats):
        need = required_bits(stored)
        has = f"{name} keeps {bits}" if bits is not None else f"{name} declares none"
        if not probed(stored):
            return False, f"{stored} matrices need {need} significand bits, {has}"
        err = errors.get(stored)
        if err is None:
            return False, f"{stored} matrices need {need} significand bits, {has}, and no probe was made"
        if not err <= tolerance(stored):  # NaN fails
            return False, (f"{stored} matrices need {need} significand bits, {has}; probed product error "
                           f"{err:.2g} > 2^-{need} = {tolerance(stored):.2g}")
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

    @property
    def decode_tokens_per_s(self) -> float:
        return 1.0 / self.decode_s if self.decode_s > 0 else float("inf")


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """What `--dtype auto` and `--weights auto` resolved to, and why."""

    picked: str  # a candidate name: what auto takes (with overridden_by: would take)
    dtype: str  # its compute dtype
    weights: str  # DENSE or STORED
    decode_kernel: str  # "mv"/"mm" for dense, the stored kernel for stored
    rule: str  # one line: why this one
    candidates: tuple[CandidateTiming, ...]  # every candidate measured, fastest first (refused ones included)
    measured_seconds: float  # how long the measurement took (0 when read back)
    from_store: bool = False  # read back from the saved choices for this machine and model shape
    overridden_by: str = ""  # "--dtype fp32", "--weights dense" when the user chose; then `picked` is auto's
    stored_dtype: str | None = None  # the checkpoint's own compute dtype (select's argument)
    ran: str = ""  # with overridden_by: the candidate the options left (the one that ran), "" when none matched
    # The share of the CPUs' time other processes took while it was measured (tracer/hardware/machine_load.py);
    # None: not read (no /proc/stat, nothing measured, an older trace)
    others_cpu: float | None = None
    # Measured on a busy machine (others_cpu over machine_load's BUSY_SHARE): saved, but a later run measures again
    # rather than serve it (tracer/load/kernel_pick.py)
    provisional: bool = False

    def timing(self, name: str) -> CandidateTiming | None:
        return next((c for c in self.candidates if c.name == name), None)

    @property
    def running(self) -> CandidateTiming | None:
        """The candidate the run used: `ran` under an override, else `picked` (None when nothing was measured)."""
        return self.timing(self.ran if self.overridden_by else self.picked)


def select(candidates: Iterable[CandidateTiming], stored_dtype: str | None = None,
           measured_seconds: float = 0.0) -> KernelChoice:
    """The choice among measured `candidates` by the rule of the module docstring. `stored_dtype`: the compute
    dtype the checkpoint is stored in (fp16/bf16/fp32 HF weights), None for quantized or random weights."""
    ranked = tuple(sorted(candidates, key=lambda c: (not c.safe, c.reference_s, c.name)))
    safe = [c for c in ranked if c.safe]
    if not safe:
        raise ValueError("no acceptable candidate was measured")  # the caller always offers fp32 dense
    fastest = safe[0]
    own = next((c for c in safe if c.weights == DENSE and c.dtype == stored_dtype), None)
    if own is not None and stored_dtype in ("fp16", "bf16") and own is not fastest:
        if fastest.reference_s * MARGIN > own.reference_s:
            gain = own.reference_s / fastest.reference_s
            return _choice(own, ranked, measured_seconds,
                           f"the checkpoint's own {stored_dtype}: {fastest.name} is only {gain:.2f}x faster "
                           f"(needs {MARGIN:.2f}x)", stored_dtype)
    if len(safe) == 1:
        rule = f"the only acceptable candidate ({_unsafe_summary(ranked)})"
    else:
        runner_up = safe[1]
        rule = (f"fastest of {len(safe)} acceptable candidates ({runner_up.reference_s / fastest.reference_s:.2f}x "
                f"ahead of {runner_up.name})")
        unsafe = [c for c in ranked if not c.safe]
        if unsafe:
            rule += f"; refused: {_unsafe_summary(ranked)}"
    return _choice(fastest, ranked, measured_seconds, rule, stored_dtype)


def constrained(choice: KernelChoice, flags: str, dtype: str | None = None, weights: str | None = None,
                kernel: str | None = None) -> KernelChoice:
    """`choice` under the user's options (`flags`, e.g. "--dtype fp16 --weights stored"): `ran` is the fastest
    measured candidate they allow (acceptable ones first: an option may also force a refused one), "" when none
    does; `picked` stays what auto takes. `dtype` fixes a dense candidate's dtype (a stored candidate then runs its
    activations in it); `weights` DENSE or STORED; `kernel` one stored kernel."""
    def allowed(c: CandidateTiming) -> bool:
        if weights is not None and c.weights != weights:
            return False
        if kernel is not None and (c.weights != STORED or c.decode_kernel != kernel):
            return False
        return dtype is None or c.weights == STORED or c.dtype == dtype

    matching = sorted((c for c in choice.candidates if allowed(c)), key=lambda c: (not c.safe, c.reference_s))
    return replace(choice, overridden_by=flags, ran=matching[0].name if matching else "")


def without(choice: KernelChoice, name: str, reason: str) -> KernelChoice:
    """`choice` re-decided with candidate `name` marked unsafe for `reason` (an fp16 range check that failed)."""
    marked = [replace(c, safe=False, unsafe_reason=reason) if c.name == name else c for c in choice.candidates]
    again = select(marked, choice.stored_dtype, choice.measured_seconds)
    return replace(again, from_store=choice.from_store, others_cpu=choice.others_cpu, provisional=choice.provisional)


def unmeasured(dtype: str, rule: str, stored_dtype: str | None = None) -> KernelChoice:
    """A choice with nothing to measure (one acceptable candidate, or a device without timings): dense `dtype`."""
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
