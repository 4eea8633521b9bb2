"""Which backend runs a run's steps, decided in one place, with the reason each other one was not taken.

Three backends run a step, all with the stage modules' math (tracer/core/contract.py's stages, in its order):
- "native": the C decode step (tracer/model/native_step.py), one token of one sequence a call; several steps a call
  when nothing reads each step (run-ahead: the same backend running more than one step, C calling the run's sampler
  for each next token). Under --staged it runs the stages of contract.staged_stages apart, each timed in C.
- "packed": the packed torch path (tracer/model/fused.py's FusedPlan.step): Q|K|V and gate|up one product each.
- "modules": the stage modules themselves, each a hook point (what --staged, --lens, --attention and
  FlopCounterMode watch).
A prefill runs "packed" or "modules" (the native step takes one token). `select` is asked once the run's observers
and tracer are attached, as the steps will run; the Route it returns is the trace's `route` (tracer/trace/records.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmtrace.tracer.model.native_step import host_clock_matches
from llmtrace.tracer.trace.records import MODULES, NATIVE, PACKED, Route, RouteNotTaken


@dataclass(frozen=True, slots=True)
class Request:
    """What a run asks of the backend: how many sequences, which stages to see, who chooses the next token."""

    batch: int = 1  # sequences stepped together
    staged: bool = False  # --staged: Q, K, V, gate and up apart
    observed: bool = False  # --lens / --attention: forward hooks read the stage modules at every step
    tracer: Any = None  # the run's Tracer (tracer/trace/hooks.py), attached; None when nothing is recorded
    sampler: Any = None  # who chooses the next token (tracer/run/sampling.py's Sampler); None in a dry run
    run_ahead: bool = True  # False: every native call runs one step (comparisons)
    on_cpu: bool = True


@dataclass(frozen=True, slots=True)
class Selection:
    """`select`'s answer: the route (the trace's record) and whether the native backend runs several steps a call."""

    route: Route
    ahead: bool = False


def select(model: Any, request: Request) -> Selection:
    """The backend of the run's decode steps and prefill, and for every backend not taken, why."""
    packed_off = _packed_reason(model, request)
    prefill = MODULES if packed_off else PACKED
    if request.staged:
        native_off = _staged_native_reason(model, request)
        decode = NATIVE if not native_off else MODULES
        modules_off = "the C step runs the stages apart, timed in C" if decode == NATIVE else ""
    else:
        native_off = _native_reason(model, request, packed_off)
        decode = NATIVE if not native_off else PACKED if not packed_off else MODULES
        modules_off = "" if decode == MODULES else "nothing watches them: fewer ops run the same math"
    ahead, ahead_off = _run_ahead(model, request) if decode == NATIVE else (False, "")
    if decode == NATIVE and not packed_off:
        packed_off = "the native step runs a one-token step as one C call"
    reasons = {NATIVE: native_off, PACKED: packed_off, MODULES: modules_off}
    not_taken = tuple(RouteNotTaken(name, why) for name, why in reasons.items() if name != decode and why)
    return Selection(Route(prefill, decode, ahead_off, not_taken), ahead)


def _packed_reason(model: Any, request: Request) -> str:
    """"" when the packed torch path may run the steps, else why the stage modules must."""
    if request.staged:
        return "--staged runs Q, K, V, gate and up apart"
    plan = getattr(model, "_fused_plan", None)
    if plan is None:
        return "this model has no packed path" if not hasattr(model, "fusable") else "the KV cache is not set up"
    if model.fusable():
        return ""
    why = model._watcher(plan)
    return why or "the packed path is switched off (use_fused)"


def _native_reason(model: Any, request: Request, packed_off: str) -> str:
    """"" when an untraced or C-stamped one-token step runs as the native decode step, else why not."""
    why = getattr(model, "native_decode_reason", None)
    if request.batch != 1:
        # a row left alone once the others finished (unpadded) runs as one sequence: on the C step, when there is one
        alone = why is not None and not packed_off and not why()
        return (f"a batch of {request.batch} sequences (the native decode step runs one"
                + ("; it may step a last row left alone)" if alone else ")"))
    if why is None:
        return "this model has no native decode step"
    if packed_off:  # the native step stands in for the packed path: what stops that stops it
        reason = model._fused_plan.native_off_reason(model.use_native_step) if model._fused_plan else ""
        return reason or packed_off
    reason = why()
    if reason:
        return reason
    tracer = request.tracer
    if tracer is not None and tracer.enabled and not (tracer.takes_stamped_steps() and host_clock_matches()):
        return "the tracer's clock is not the host clock the C step stamps with"
    return ""


def _staged_native_reason(model: Any, request: Request) -> str:
    if request.batch != 1:
        return f"a batch of {request.batch} sequences (the native decode step runs one)"
    why = getattr(model, "staged_native_reason", None)
    return why() if why is not None else "this model has no native decode step"


def _run_ahead(model: Any, request: Request) -> tuple[bool, str]:
    """(True, "") when the native backend may run several steps a call, C calling the run's sampler with each step's
    logits for the next token (the tokens and records a step at a time gives); else (False, why each call runs one
    step)."""
    if not request.run_ahead:
        return False, "switched off (run_ahead=False)"
    if request.staged:
        return False, "--staged stamps each step's stages apart"
    if request.observed:
        return False, "--lens or --attention read every step"
    if not request.on_cpu:
        return False, "the native step runs on the CPU"
    if request.sampler is None:
        return False, "a dry run chooses no tokens"
    tracer = request.tracer
    if tracer is not None and not tracer.takes_stamped_steps():
        return False, "the tracer cannot take the steps' C clock readings"
    if not host_clock_matches():
        return False, "the host clock is not CLOCK_MONOTONIC, the one the C step stamps with"
    return True, ""
