"""How the run's kernels (compute dtype, stored or dense weights) were chosen, in a line or two: the run view's
header and the summary print these.

The choice and its timings are the engine's (tracer/hardware/kernel_choice.py's KernelChoice, saved in the trace);
this only words them.
"""

from __future__ import annotations

from llmtrace.cli import formatting as fmt
from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, get_dtype
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.hardware.kernel_choice import STORED, CandidateTiming, KernelChoice


def dtype_name(torch_name: str) -> str:
    """A trace's torch dtype name ("float16") as the kernel choice names it ("fp16"); other names unchanged."""
    try:
        return get_dtype(torch_name, COMPUTE_DTYPES).name
    except BadArgumentError:
        return torch_name


def choice_line(choice: KernelChoice | None, dtype: str) -> str:
    """One line: what ran (`dtype`, the run's compute dtype, and the candidate) and why: auto's measured pick and
    its rule, or the options that overrode it and what auto would take."""
    if choice is None:
        return f"dtype {dtype}: as asked (no measurement of this machine for this model saved)"
    picked = choice.timing(choice.picked)
    auto_form = _form(picked) if picked is not None else f"{choice.picked} {choice.weights}"
    if choice.overridden_by:
        ran = choice.running
        what = f"ran {_form(ran, dtype)}" if ran is not None else f"dtype {dtype}"
        verdict = ("auto takes the same" if ran is not None and ran.name == choice.picked
                   else f"auto would take {auto_form}")
        return f"kernels: {choice.overridden_by} (overrides auto): {what}; {verdict}{_busy(choice)}: {choice.rule}"
    how = "saved measurement" if choice.from_store else (
        f"measured in {fmt.duration_s(choice.measured_seconds)}" if choice.candidates else "not measured")
    return f"kernels: auto, {how}{_busy(choice)}: {auto_form}, {choice.rule}"


def _busy(choice: KernelChoice) -> str:
    """" while others took 48% of the CPUs (provisional: next run re-measures)" for a choice measured on a busy
    machine (tracer/hardware/machine_load.py), "" otherwise."""
    if not choice.provisional:
        return ""
    share = f"{choice.others_cpu:.0%}" if choice.others_cpu is not None else "much"
    then = "next run re-measures" if not choice.from_store else "`run --remeasure` replaces it"
    return f" while others took {share} of the CPUs (provisional: {then})"


def alternatives_line(choice: KernelChoice | None) -> str:
    """The measured candidates, fastest acceptable first: a decode step (whole native C steps for a candidate that
    runs as one, else its products: kernel_choice's rule, step 3) and 128-token prefill products, refused ones
    marked (with the probed error where a probe judged them); "" when nothing was measured."""
    if choice is None or not choice.candidates:
        return ""
    parts = []
    for c in choice.candidates:
        kernel = "" if c.weights == STORED else f" {c.decode_kernel}"
        probe = f", probe error {c.product_error:.1e}" if c.product_error is not None else ""
        mark = f" (refused{probe})" if not c.safe else (f" (probe error {c.product_error:.1e})" if probe else "")
        parts.append(f"{c.name}{kernel} {fmt.duration_s(c.decode_s)} · {fmt.duration_s(c.prefill_s)}{mark}")
    return "measured (decode step · 128-token prefill products): " + ", ".join(parts)


def _form(c: CandidateTiming, dtype: str | None = None) -> str:
    """"int4pack (stored, fp32 activations)", "fp16 dense (mv)"."""
    if c.weights == STORED:
        return f"{c.name} (stored, {dtype or c.dtype} activations)"
    return f"{dtype or c.dtype} dense ({c.decode_kernel})"
