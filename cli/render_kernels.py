"""The run's kernels in one short line (what multiplied each matrix type, its numerics, where the choice came from),
and the details `--detail kernels` adds: the rule's line, type by type, and tune's figures.

The choice is the engine's (tracer/hardware/kernel_choice.py's KernelChoice, saved in the trace); this only words it.
"""

from __future__ import annotations

from llmtrace.cli import formatting as fmt
from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, get_dtype
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.hardware.kernel_choice import DEFAULT, DENSE, STORED, TUNED, KernelChoice
from llmtrace.tracer.hardware.kernel_defaults import EXACT, SHORT_NUMERICS

WIDTH = 80  # the line fits an 80-column terminal


def dtype_name(torch_name: str) -> str:
    """A trace's torch dtype name ("float16") as the kernel choice names it ("fp16"); other names unchanged."""
    try:
        return get_dtype(torch_name, COMPUTE_DTYPES).name
    except BadArgumentError:
        return torch_name


def numerics_word(choice: KernelChoice) -> str:
    """The run's numerics in a word or two: "exact", "int8 act. + exact"."""
    kinds = list(dict.fromkeys(b.numerics for b in choice.by_type)) or [choice.numerics]
    return " + ".join(SHORT_NUMERICS.get(k, k) for k in kinds)


def kernel_line(choice: KernelChoice | None, dtype: str) -> str:
    """One line of at most WIDTH columns: "kernels Q4_1 i8dot (int8 act.), Q8_0 native (exact) · default,
    AVX-512 VNNI"; "" when no choice was recorded (an older trace)."""
    if choice is None:
        return ""
    source = {DEFAULT: ", ".join(filter(None, ("default", choice.instruction_set))),
              TUNED: f"tuned in {fmt.duration_s(choice.measured_seconds)}",
              "measured": "measured (an older llmtrace)"}.get(choice.source, choice.rule)
    if choice.weights == STORED and not choice.by_type:  # an older trace: the kernels it named, no numerics
        what = choice.picked
    elif choice.weights == DENSE or not choice.by_type:
        what = f"{dtype} dense, {choice.decode_kernel}" + (f" ({numerics_word(choice)})" if choice.numerics else "")
    else:
        what = ", ".join(f"{b.type} {b.kernel} ({SHORT_NUMERICS.get(b.numerics, b.numerics)})"
                         for b in choice.by_type)
    line = f"kernels {what} · {source}"
    if len(line) > WIDTH and choice.weights == STORED:
        line = f"kernels {choice.picked} ({numerics_word(choice)}) · {source}"
    return line if len(line) <= WIDTH else line[:WIDTH - 1] + "…"


def numerics_note(choice: KernelChoice | None) -> str:
    """For views that teach (lens, attention, the sampling lesson): "numerics: exact" or "numerics: int8
    activations (llama.cpp-style) on Q4_1; exact on Q8_0 (--weights native: exact)"."""
    if choice is None or not choice.numerics:
        return ""
    if choice.numerics == EXACT:
        return "numerics: exact (the file's values, fp32 products)"
    return f"numerics: {choice.numerics} (--weights native: exact)"


def detail_lines(choice: KernelChoice | None) -> list[str]:
    """`--detail kernels`: why, each matrix type's kernel and numerics, and tune's figures when it measured."""
    if choice is None:
        return []
    lines = [f"kernels: {choice.rule}", f"compute dtype {choice.dtype}; numerics: {choice.numerics}"]
    lines += [f"  {b.type:<6} {b.kernel:<9} {b.numerics}" for b in choice.by_type]
    if choice.candidates:
        lines.append("tuned (decode step · 128-token prefill products):")
        for c in choice.candidates:
            probe = f", probe error {c.product_error:.1e}" if c.product_error is not None else ""
            mark = f" refused: {c.unsafe_reason}" if not c.safe else probe
            lines.append(f"  {c.name} {fmt.duration_s(c.decode_s)} · {fmt.duration_s(c.prefill_s)}{mark}")
    return lines
