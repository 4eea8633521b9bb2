"""Which backend runs a run's steps, decided in one place, with the reason each other one was not taken.

Three backends run a step, all with the stage modules' math (tracer/core/contract.py's stages, in its order):
- "native": the C decode step (tracer/model/native_step.py), one token of one sequence a call; several steps a call
  when nothing reads each step (run-ahead: the same backend running more than one step, C calling the run's sampler
  for each next token). Under --staged it runs the stages of contract.staged_stages apart, each timed in C.
- "packed": the packed torch path (tracer/model/fused.py's FusedPlan.step): Q|K|V and gate|up one product each.
- "modules": the stage modules themselves, each a hook point (what --staged, --lens, --attention and
  FlopCounterMode watch).
A prefill runs "packed" or "modules" (the native step takes one token). A mixture of experts runs packed (each
step's choice left on its Route for the trace's routing record), its one-token steps on the native step where its
experts are held as stored (tracer/model/moe.py), several steps a call (each step's choice brought back with it:
AheadRun.routes). A traced one runs the stage modules and stamps their stages apart on the native step (the "wrap"
tracer takes them: StagedNativeBackend): the packed step's marks follow a fixed stage order, and a mixture of experts
runs its expert stages once per expert chosen.

`select` is asked once per run, with the run's observers attached and before its tracer is; it builds the plan the
packed and native backends read from the model as it stands (a weight replaced, a hook added or a `.to()` before the
run is seen by it), and tracer/run/backends.py builds the backend from its answer. The Route is the trace's `route` (tracer/trace/records.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmtrace.tracer.model.fused import FusedPlan, watcher
from llmtrace.tracer.model.native_step import host_clock_matches
from llmtrace.tracer.trace.fused_marks import marks_off_reason
from llmtrace.tracer.trace.records import MODULES, NATIVE, PACKED, Route, RouteNotTaken

BACKENDS = (NATIVE, PACKED, MODULES)


@dataclass(frozen=True, slots=True)
class Request:
    """What a run asks of the backend: how many sequences, which stages to see, who chooses the next token."""

    batch: int = 1  # sequences stepped together
    staged: bool = False  # --staged: Q, K, V, gate and up apart
    observed: bool = False  # --lens / --attention: forward hooks read the stage modules at every step
    traced: bool = False  # a Tracer records the stages (tracer/trace/hooks.py)
    host_clock: bool = True  # the tracer's clock is the host clock, the one the C step stamps with
    sampler: Any = None  # who chooses the next token (tracer/run/sampling.py's Sampler); None in a dry run
    run_ahead: bool = True  # False: every native call runs one step (comparisons)
    on_cpu: bool = True
    backend: str | None = None  # "native", "packed" or "modules": the fastest no faster than it (comparisons, tests)
    matvec: str = "mv"  # the one-token product kernel (functional.MATVEC_KERNELS) this machine's measurement chose


@dataclass(frozen=True, slots=True)
class Selection:
    """`select`'s answer: the route (the trace's record), whether the native backend runs several steps a call, the
    plan the packed and native backends read (None when neither can run), and whether a one-token step of one
    sequence runs as the C step (the native route, or a batch's last row left alone)."""

    route: Route
    ahead: bool = False
    plan: FusedPlan | None = None
    native: bool = False
    staged: bool = False  # --staged (the native step's traced one-token steps stamp the stages apart either way)


def select(model: Any, request: Request) -> Selection:
    """The backend of the run's decode steps and prefill, and for every backend not taken, why."""
    if request.backend not in (None, *BACKENDS):
        raise ValueError(f"backend must be one of {BACKENDS}, got {request.backend!r}")
    plan, plan_off = _plan(model, request)
    packed_off = _packed_reason(model, request, plan_off)
    prefill = MODULES if packed_off else PACKED
    if request.staged:
        native_off = _staged_native_reason(model, request, plan, plan_off)
        decode = NATIVE if not native_off else MODULES
        modules_off = "the C step runs the stages apart, timed in C" if decode == NATIVE else ""
    else:
        native_off = _native_reason(model, request, plan, packed_off)
        decode = NATIVE if not native_off else PACKED if not packed_off else MODULES
        modules_off = "" if decode == MODULES else "nothing watches them: fewer ops run the same math"
    ahead, ahead_off = _run_ahead(model, request) if decode == NATIVE else (False, "")
    if decode == NATIVE and not packed_off:
        packed_off = "the native step runs a one-token step as one C call"
    reasons = {NATIVE: native_off, PACKED: packed_off, MODULES: modules_off}
    not_taken = tuple(RouteNotTaken(name, why) for name, why in reasons.items() if name != decode and why)
    alone = request.batch != 1 and native_off.endswith("left alone)")
    return Selection(Route(prefill, decode, ahead_off, not_taken), ahead,
                     plan if MODULES not in (prefill, decode) or decode == NATIVE else None, decode == NATIVE or alone,
                     request.staged)


def _plan(model: Any, request: Request) -> tuple[FusedPlan | None, str]:
    """The plan the packed and native backends read, built from the model as it stands, or None and why not."""
    if not hasattr(model, "packed_off_reason"):
        return None, "this model has no packed path"
    why = model.packed_off_reason()
    if why:
        return None, why
    if request.backend == MODULES and not request.staged:
        return None, ""
    return FusedPlan(model, request.matvec), ""


def _marks_off(model: Any, request: Request) -> str:
    """Why a traced run's packed step cannot be traced by its marks (a mixture of experts:
    fused_marks.marks_off_reason), where the native step, stamping in C, may still run it; "" otherwise."""
    return marks_off_reason(model) if request.traced else ""


def _packed_reason(model: Any, request: Request, plan_off: str) -> str:
    """"" when the packed torch path may run the steps, else why the stage modules must."""
    if request.staged:
        return "--staged runs Q, K, V, gate and up apart"
    if request.backend == MODULES:
        return "asked for the modules backend (Request.backend)"
    return plan_off or _marks_off(model, request) or watcher(model)  # plan_off holds packed_off_reason()'s answer


def _native_reason(model: Any, request: Request, plan: FusedPlan | None, packed_off: str) -> str:
    """"" when an untraced or C-stamped one-token step runs as the native decode step, else why not."""
    if request.batch != 1:
        # a row left alone once the others finished (unpadded) runs as one sequence: on the C step, when there is one
        alone = plan is not None and not packed_off and plan.native is not None and request.backend != PACKED
        return (f"a batch of {request.batch} sequences (the native decode step runs one"
                + ("; it may step a last row left alone)" if alone else ")"))
    if not hasattr(model, "packed_off_reason"):
        return "this model has no native decode step"
    if packed_off and not (plan is not None and packed_off == _marks_off(model, request)):
        # the native step stands in for the packed path: what stops that stops it, but the marks' refusal (a traced
        # mixture of experts: the C step stamps its stages apart)
        return (plan.native_off_reason() if plan is not None else "") or packed_off
    watched = watcher(model) if packed_off else ""  # (folded into packed_off otherwise)
    if watched:
        return plan.native_off_reason() or watched
    if request.backend == PACKED:
        return "asked for the packed backend (Request.backend)"
    reason = plan.native_off_reason()
    if reason:
        return reason
    if request.traced and not (request.host_clock and host_clock_matches()):
        return "the tracer's clock is not the host clock the C step stamps with"
    return ""


def _staged_native_reason(model: Any, request: Request, plan: FusedPlan | None, plan_off: str) -> str:
    """"" when --staged's one-token steps of one sequence run as the native step's stages apart, timed in C, else
    why the stage modules run them."""
    if request.batch != 1:
        return f"a batch of {request.batch} sequences (the native decode step runs one)"
    if plan is None:
        return plan_off if hasattr(model, "packed_off_reason") else "this model has no native decode step"
    if request.backend == MODULES:
        return "asked for the modules backend (Request.backend)"
    reason = plan.native_off_reason() or watcher(model)
    if reason:
        return reason
    if request.traced and not request.host_clock:
        return "forward wrappers that take no C stamps watch the stage modules"
    if request.traced and not host_clock_matches():
        return "the host clock is not CLOCK_MONOTONIC, the one the C step stamps with"
    return ""


def _run_ahead(model: Any, request: Request) -> tuple[bool, str]:
    """(True, "") when the native backend may run several steps a call, C calling the run's sampler with each step's
    logits for the next token (the tokens and records a step at a time gives); else (False, why each call runs one
    step)."""
    if not request.run_ahead:
        return False, "switched off (run_ahead=False)"
    if request.traced and getattr(getattr(model, "config", None), "moe", None) is not None:
        return False, "a traced mixture of experts' step stamps the stage modules' stages apart"
    if request.staged:
        return False, "--staged stamps each step's stages apart"
    if request.observed:
        return False, "--lens or --attention read every step"
    if not request.on_cpu:
        return False, "the native step runs on the CPU"
    if request.sampler is None:
        return False, "a dry run chooses no tokens"
    if request.traced and not request.host_clock:
        return False, "the tracer cannot take the steps' C clock readings"
    if not host_clock_matches():
        return False, "the host clock is not CLOCK_MONOTONIC, the one the C step stamps with"
    return True, ""
