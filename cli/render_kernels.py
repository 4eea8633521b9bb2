"""How the run's compute dtype was chosen, in a line or two: the run view's header and the summary print these.

The choice and its timings are the engine's (tracer/hardware/kernel_choice.py's KernelChoice, saved in the trace);
this only words them.
"""

from __future__ import annotations

from llmtrace.cli import formatting as fmt
from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, get_dtype
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.hardware.kernel_choice import KernelChoice


def dtype_name(torch_name: str) -> str:
    """A trace's torch dtype name ("float16") as the kernel choice names it ("fp16"); other names unchanged."""
    try:
        return get_dtype(torch_name, COMPUTE_DTYPES).name
    except BadArgumentError:
        return torch_name


def choice_line(choice: KernelChoice | None, dtype: str) -> str:
    """One line: what ran (`dtype`, the run's) and why: auto's measured pick, or the --dtype that overrode it."""
    if choice is None:
        return f"dtype {dtype}: as asked (no measurement of this machine for this model saved)"
    if choice.overridden_by:
        verdict = f"auto would take {choice.picked}" if choice.picked != dtype else "auto takes the same"
        return f"dtype {dtype}: {choice.overridden_by} (overrides auto; {verdict}: {choice.rule})"
    how = "saved measurement" if choice.from_store else (
        f"measured in {fmt.duration_s(choice.measured_seconds)}" if choice.candidates else "not measured")
    return f"dtype {dtype}: auto, {how}: {choice.rule}"


def alternatives_line(choice: KernelChoice | None) -> str:
    """The measured candidates, fastest first: decode products per token and 128-token prefill products; "" when
    nothing was measured."""
    if choice is None or not choice.candidates:
        return ""
    parts = []
    for c in choice.candidates:
        mark = "" if c.safe else " (not safe)"
        parts.append(f"{c.name} {c.decode_kernel} {fmt.duration_s(c.decode_s)} · {fmt.duration_s(c.prefill_s)}{mark}")
    return "measured products (decode step · 128-token prefill): " + ", ".join(parts)
