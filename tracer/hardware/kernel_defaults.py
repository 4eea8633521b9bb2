"""The default kernels: a fixed table per instruction set, so the same command on the same machine runs the same
kernels, gives the same tokens and the same numerics every time, and nothing is measured to decide it.

Each row says, for each GGUF block type, which kernel multiplies it as stored ("dense": dequantized exactly into
fp32), and for a checkpoint stored in floats which dtype the products compute in. The rows come from the figures in
BENCHMARKS.md ("Default kernels", which renders `table_markdown()`; README.md carries the same table, and a test
holds both to this one):
- i8dot (int8 activations per 32 values, as llama.cpp's CPU kernels compute) for the 4-bit types wherever the C
  library has its AVX2 rows: its decode steps ran 1.12x (Zen 3, AVX2), 1.17-1.72x (Zen 4) and ~1.5x (Zen 5) the
  exact kernel's, its prefill 1.38x; the accuracy rule (kernel_choice.py) admits it for 4-bit matrices only;
- i8dot for Q8_0 too where the CPU has AVX-512 VNNI (measured on Zen 4 only): its products are llama.cpp's own
  (q8_0 activations: the same integers and fp16 scales), which it agreed with at 99.80% of 512 teacher-forced
  greedy tokens on a real Q8_0 model (the accuracy rule admits it by that reference: kernel_choice.LLAMA_CPP_MATH),
  and a 7B Q8_0 prefill ran 1.66x / 2.51x llama.cpp's at 128 / 512 tokens against the exact kernel's 0.41x / 0.33x
  (its sixteen-row packed prefill needs VNNI; the AVX2 row has no Q8_0 figures);
- native (exact: the file's values, fp32 products) for Q5_* and Q6_K, and Q8_0 without AVX-512 VNNI: i8dot errs over
  what their bits need, and i16dot, which passes, was no faster in the 2-thread decode step (2.22 vs 2.22 ms; 3.06
  vs 3.14 ms);
- without the library's AVX2 rows (a CPU without AVX2): native everywhere (nothing measured there: exact is the
  reference, so it is the default);
- without a C compiler: torch's int4 kernel (int4pack, bf16 products) for Q4_0/Q4_1/Q4_K, which decoded 3.2x faster
  than dense fp32 on the AVX2 machine (22.6 vs 71.7 ms a step), and dense fp32 for the rest (the torch "blocks"
  kernel was 3x slower than dense fp32 there: 212 vs 71.7 ms);
- on CUDA the same torch choices (not measured in this project: no GPU run has timed them);
- float checkpoints compute in their own dtype (bf16 ran a step in 24.4 ms against fp32's 71.7 on the AVX2 machine;
  no conversion copy), fp16 ones in fp32 when fp16 overflows (the loader's range check); their one-token products
  (functional.MATVEC_KERNELS) through torch.mv (on AVX2: twice mm's speed for bf16, the faster for fp32 in every
  measurement), except bf16 on AVX-512, where torch's mv takes a slower path than mm, the (1, K) @ (K, N) product
  F.linear runs (benchmarks/bench_matvec.py, Zen 4: `MATVEC_AVX512`'s figures).

Pure Python (no torch): the loader passes what it knows of the machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

DENSE = "dense"
# The instruction sets the table has a row for, in the order they are tried.
AVX512_VNNI, AVX2, PORTABLE, NO_COMPILER, CUDA, OTHER = (
    "AVX-512 VNNI", "AVX2", "portable C", "no C compiler", "CUDA", "other device")

# What each kernel's products compute, for the run's header and JSON.
EXACT = "exact"
NUMERICS = {
    "native": EXACT, "blocks": EXACT, DENSE: EXACT,
    "i8dot": "int8 activations (llama.cpp-style)",
    "i16dot": "int16 activations",
    "int4pack": "bf16 products (torch int4)",
}
SHORT_NUMERICS = {EXACT: "exact", "int8 activations (llama.cpp-style)": "int8 act.", "int16 activations": "int16 act.",
                  "bf16 products (torch int4)": "bf16"}
GGUF_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
_Q4 = ("Q4_0", "Q4_1", "Q4_K")
_OTHERS = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


@dataclass(frozen=True, slots=True)
class DefaultRow:
    """One instruction set's defaults."""

    instruction_set: str
    machines: str  # where the figures behind it were taken
    kernels: Mapping[str, str]  # {GGUF type name: kernel or DENSE}
    evidence: str  # one line: the figures (BENCHMARKS.md sections)


def _row(isa: str, machines: str, q4: str, others: str, evidence: str, **cells: str) -> DefaultRow:
    """One row: `q4` for the 4-bit types, `others` for the rest, `cells` ({type: kernel}) where a type differs."""
    return DefaultRow(isa, machines, {**{t: q4 for t in _Q4}, **{t: others for t in _OTHERS}, **cells}, evidence)


TABLE = (
    _row(AVX512_VNNI, "Zen 4, Zen 5", "i8dot", "native",
         "i8dot plan 1.17-1.72x native's step (Zen 4), i16dot head = native head at 2 threads (Zen 5); Q8_0 i8dot: "
         "7B prefill 1.66-2.51x llama.cpp, 99.80% top-1 with it (Zen 4)", Q8_0="i8dot"),
    _row(AVX2, "Zen 3", "i8dot", "native", "i8dot plan: decode 1.12x, prefill 1.38x native's (Zen 3)"),
    _row(PORTABLE, "none measured", "native", "native", "no figures: the exact kernel, the reference"),
    _row(NO_COMPILER, "Zen 3", "int4pack", DENSE, "int4pack 22.6 ms, fp32 71.7, blocks 212 a step (Zen 3)"),
    _row(CUDA, "none measured", "int4pack", DENSE, "not timed on a GPU here: the torch kernels of the row above"),
    _row(OTHER, "none measured", DENSE, DENSE, "torch's dense products only"),
)
DENSE_DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}  # a float checkpoint computes in its own dtype
MATVEC = "mv"
# The dtypes whose one-token products run through mm on an AVX-512 CPU (BENCHMARKS.md "bf16's one-token products"):
# bf16's four products of a 7B layer 31.3 ms through mv, 20.1 through mm (1.55x); fp16 12.2 / 12.3, fp32 37.3 / 37.1
MATVEC_AVX512 = {"bf16": "mm"}


def matvec_for(instruction_set: str, dtype: str) -> str:
    """The one-token product kernel ("mv" or "mm": functional.MATVEC_KERNELS) of dense `dtype` weights."""
    return MATVEC_AVX512.get(dtype, MATVEC) if instruction_set == AVX512_VNNI else MATVEC


def _matvec_cell(instruction_set: str) -> str:
    """The float checkpoints' cell: "own dtype, mv", or the dtypes that take mm."""
    mm = [d for d in ("fp32", "bf16", "fp16") if matvec_for(instruction_set, d) != MATVEC]
    return f"own dtype, {MATVEC}" + (f" ({'/'.join(mm)}: mm)" if mm else "")


def default_phrase(instruction_set: str) -> str:
    """"the default for AVX2", "the default without a C compiler"."""
    return {NO_COMPILER: "the default without a C compiler", OTHER: "the default for this device"}.get(
        instruction_set, f"the default for {instruction_set}")


def row_for(instruction_set: str) -> DefaultRow:
    return next(r for r in TABLE if r.instruction_set == instruction_set)


def instruction_set(device_type: str, library: bool, library_avx2: bool, cpu_flags: Iterable[str]) -> str:
    """The table's row for a device: `library` whether llmtrace's C library is built here, `library_avx2` whether
    it has its AVX2 rows, `cpu_flags` /proc/cpuinfo's flags."""
    if device_type == "cuda":
        return CUDA
    if device_type != "cpu":
        return OTHER
    if not library:
        return NO_COMPILER
    if not library_avx2:
        return PORTABLE
    return AVX512_VNNI if {"avx512f", "avx512bw", "avx512_vnni"} <= set(cpu_flags) else AVX2


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's flags (Linux); empty elsewhere."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def default_plan(instruction_set: str, type_names: Iterable[str]) -> dict[str, str]:
    """{type: kernel} for the file's block types that the row multiplies as stored; the rest (float types, types
    the row has no kernel for) are absent: dequantized."""
    kernels = row_for(instruction_set).kernels
    return {t: kernels[t] for t in sorted(set(type_names)) if kernels.get(t, DENSE) != DENSE}


def numerics_summary(by_type: Mapping[str, str], short: bool = False) -> str:
    """"exact", or "int8 activations (llama.cpp-style) on Q4_1; exact on Q8_0" (short: "int8 act. Q4_1, exact
    Q8_0")."""
    groups: dict[str, list[str]] = {}
    for t in sorted(by_type):
        groups.setdefault(by_type[t], []).append(t)
    if len(groups) <= 1:
        only = next(iter(groups), EXACT)
        return SHORT_NUMERICS.get(only, only) if short else only
    if short:
        return ", ".join(f"{SHORT_NUMERICS.get(n, n)} {'/'.join(ts)}" for n, ts in groups.items())
    return "; ".join(f"{n} on {', '.join(ts)}" for n, ts in groups.items())


def table_markdown() -> str:
    """The table as BENCHMARKS.md and README.md print it (tests hold them to this)."""
    head = "| instruction set (machines measured) | " + " | ".join(GGUF_TYPES) + " | float checkpoints | evidence |"
    lines = [head, "|" + "---|" * (len(GGUF_TYPES) + 3)]
    for row in TABLE:
        cells = [row.kernels[t] for t in GGUF_TYPES]
        lines.append(f"| {row.instruction_set} ({row.machines}) | " + " | ".join(cells)
                     + f" | {_matvec_cell(row.instruction_set)} | {row.evidence} |")
    return "\n".join(lines)
