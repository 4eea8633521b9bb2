"""A finished run next to the roofline bound of the machine it ran on, or the one-line reason there is none.

`llmtrace run` ends its summary with this: the run's measured prefill and decode (forward passes only) against
llmtrace.tracer.roofline.compare's bound, in the dtype the run computed in. The ceilings come from the saved
'this-machine' profile, the one `llmtrace roofline --hardware this-machine` uses (store.saved_this_machine), with the
same dtype rule (analysis.compute_dtype_for), so both give one verdict. When none is saved yet, a quick measurement
(well under 2 s; llmtrace.tracer.hardware.measure) makes and saves one, as `llmtrace hardware --measure` would, and
the result says so. A measurement taken while other processes kept the machine busy judges nothing: its ceilings are
likely low (a run once reached "129% of the bound" by one); it is not saved and the run has no bound, with a note
saying how to measure (tracer/hardware/machine_load.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable

from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, FP32, TF32, DType, get_dtype
from llmtrace.tracer.core.errors import HardwareError, LlmtraceError
from llmtrace.tracer.hardware.machine_load import Sampler, busy_share, is_busy
from llmtrace.tracer.hardware.profiles import MEASURABLE_DTYPES, HardwareProfile
from llmtrace.tracer.hardware.store import UnusableProfile, save_measured_profile, saved_this_machine
from llmtrace.tracer.roofline.compare import MeasuredVsBound, compare_with_measured
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.summary import RunSummary

if TYPE_CHECKING:  # measure.py imports torch: `llmtrace show` renders a RunRoofline-free summary without it
    from llmtrace.tracer.hardware.measure import QuickMeasurement


@dataclass(frozen=True, slots=True)
class RunRoofline:
    comparison: MeasuredVsBound | None
    note: str  # why there is no comparison; "" when there is one
    measured: "QuickMeasurement | None"  # the first-run measurement made for it, saved as 'this-machine'
    saved_to: str | None  # where that measurement was saved
    not_saved: str = ""  # why that measurement could not be saved (a read-only or full home); it still served


class NoProfileForDevice(HardwareError):
    """'this-machine' cannot judge the run: measured on another device, on a busy machine, or a device nothing
    measures."""


@dataclass(frozen=True, slots=True)
class MachineProfile:
    """This machine's saved profile, or the quick measurement made (and saved, where possible) because none was."""

    profile: HardwareProfile
    measured: "QuickMeasurement | None"  # the first-run measurement made for it, saved as 'this-machine'
    saved_to: str | None
    not_saved: str = ""  # why that measurement could not be saved; it still serves


def this_machine_profile(device: str, dtype: DType, progress: Callable[[str], None] | None = None,
                         sampler: Sampler | None = None) -> MachineProfile:
    """The saved 'this-machine' profile, or one measured now (quickly, fp32 and `dtype` GEMMs and a copy) and saved.
    NoProfileForDevice when there is none to judge by: the saved one was measured on another device or on a busy
    machine, `device` is one nothing measures, or other processes kept the machine busy during the measurement
    made now (tracer/hardware/machine_load.py: it is neither saved nor used, and the next run measures again);
    HardwareError for an unreadable store. `sampler`: the machine-load reading (tests inject one)."""
    try:
        saved = saved_this_machine(device)
    except UnusableProfile as exc:
        raise NoProfileForDevice(str(exc)) from exc
    if saved is not None:
        return MachineProfile(saved, None, None)
    if device not in ("cpu", "cuda"):
        raise NoProfileForDevice(f"no measurement for {device}; compare with "
                                 "`llmtrace roofline --hardware <your machine>`")
    from llmtrace.tracer.hardware.measure import quick_profile  # torch: only when measuring

    limit = busy_share()
    measured = quick_profile((FP32,) if dtype is FP32 else (FP32, dtype), device, progress, sampler)
    others = measured.measurement.others_cpu
    if is_busy(others, limit):  # its ceilings are likely low: a bound that judges a run too fast, so none at all
        assert others is not None
        raise NoProfileForDevice(f"no saved profile, and other processes took {others:.0%} of the CPUs while this "
                                 "run measured the machine, so no bound to judge it by; run `llmtrace hardware "
                                 "--measure` when the machine is quiet")
    try:
        saved_to, not_saved = str(save_measured_profile(measured.profile, asdict(measured.measurement))), ""
    except HardwareError as exc:  # an unwritable config folder: this run still gets its bound
        saved_to, not_saved = None, str(exc)
    return MachineProfile(measured.profile, measured, saved_to, not_saved)


def run_roofline(trace: Trace, summary: RunSummary,
                 progress: Callable[[str], None] | None = None,
                 stored: tuple[tuple[str, int, int], ...] = ()) -> RunRoofline:
    """The comparison for `trace` on this machine (measuring it first if needed; `progress` hears what is being
    measured), or the note saying why there is none. Bad profiles and measurement errors become the note.
    `stored`: the GGUF's tensors as stored when the run read them so (compare_with_measured), so the bound and the
    run count the same bytes."""
    device = trace.environment.device.split(":")[0]
    measured: "QuickMeasurement | None" = None
    saved_to: str | None = None
    not_saved = ""

    def without(note: str) -> RunRoofline:
        return RunRoofline(None, f"roofline: {note}", measured, saved_to, not_saved)

    try:
        dtype = get_dtype(trace.environment.dtype, COMPUTE_DTYPES)  # the record's "bfloat16" -> BF16
        try:
            machine = this_machine_profile(device, dtype, progress)
        except NoProfileForDevice as exc:
            return without(str(exc))
        profile, measured, saved_to, not_saved = machine.profile, machine.measured, machine.saved_to, machine.not_saved
        if not profile.has_peak(dtype.name):
            have = ", ".join(d.name for d in MEASURABLE_DTYPES
                             if d is not TF32 and profile.has_peak(d.name)) or "none"
            return without(f"the saved 'this-machine' profile has no {dtype} peak FLOP/s ({have} only), so no bound "
                           f"for this {dtype} run; add it with `llmtrace hardware --measure --dtypes fp32,{dtype}`")
        pre, dec = summary.prefill, summary.decode
        if not pre.forward_ns:
            return without("no prefill was timed")
        # per sequence: a batched step gives each row one token (finished rows leave, so late steps may hold fewer
        # rows than the bound assumes: the bound is then for the whole batch throughout)
        decode_tps = dec.steps / (dec.forward_ns / 1e9) if dec.steps and dec.forward_ns else None
        batch = trace.prefill_step.batch if trace.prefill_step is not None else 1
        # the prefill yields the first token, so the bound covers the decode steps that actually ran
        comparison = compare_with_measured(trace.config, profile, prompt_len=pre.tokens_in // batch,
                                           new_tokens=dec.steps + 1, measured_ttft_s=pre.forward_ns / 1e9,
                                           measured_decode_tokens_per_s=decode_tps, dtype=dtype, batch=batch,
                                           stored=stored)
        return RunRoofline(comparison, "", measured, saved_to, not_saved)
    except LlmtraceError as exc:  # an unreadable or malformed hardware.json among others: a note, not a lost run
        return without(f"skipped: {exc}")
