"""The backends that run a run's steps, built once per run from `select`'s answer (tracer/run/select.py).

Each runs the stage modules' math and fills the model's caches; the model holds only the weights, the rope tables
and the caches, and runs a cached step through whichever backend passes itself as the step's `path`
(Transformer._cached_step):
- ModulesBackend: the stage modules (the reference; each stage a hook point).
- PackedBackend: the packed torch path (FusedPlan.step); with `native`, a one-token step of one sequence is the C
  decode step (FusedPlan.native_decode), and `ahead` runs several steps in one call.
- StagedNativeBackend (--staged): a one-token step of one sequence as the C step with the stages of
  contract.staged_stages apart, each timed in C (FusedPlan.staged_step); every other step through the modules.
`traced(tracer)` is the same backend reporting its stages to the run's attached Tracer (its marks, or the C readings).
"""

from __future__ import annotations

from typing import Any

import torch

from llmtrace.tracer.hardware.kernel_choice import DENSE
from llmtrace.tracer.model.fused import FusedPlan, Mark, no_mark
from llmtrace.tracer.model.native_step import AheadRun, Chooser
from llmtrace.tracer.run.select import Request, Selection, select
from llmtrace.tracer.trace.records import MODULES, NATIVE, PACKED


class ModulesBackend:
    """The stage modules, each a hook point: Transformer.prefill/decode_one with no path."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def traced(self, tracer: Any) -> ModulesBackend:
        return self  # the tracer wraps or hooks the modules themselves

    def prefill(self, tokens: torch.Tensor, pad: list[int] | None = None) -> torch.Tensor:
        return self.model.prefill(tokens, pad)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.decode_one(tokens)

    def kv_live_bytes(self) -> int:
        return self.model.kv_live_bytes

    def ahead(self, *args: Any) -> AheadRun | None:
        return None


class PackedBackend:
    """The packed path (tracer/model/fused.py) over `plan`, the C decode step for a one-token step of one sequence
    when `native`; `mark` the tracer's (FusedMarks), called after each stage or handed C's readings."""

    def __init__(self, model: Any, plan: FusedPlan, native: bool, mark: Mark = no_mark) -> None:
        self.model, self.plan, self.native, self.mark = model, plan, native, mark
        self.max_seq = plan.max_seq  # the caches' size, a plain value (Transformer._cached_step's check)

    def traced(self, tracer: Any) -> PackedBackend:
        return PackedBackend(self.model, self.plan, self.native, tracer.mark)

    def prefill(self, tokens: torch.Tensor, pad: list[int] | None = None) -> torch.Tensor:
        return self.model.prefill(tokens, pad, self)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.decode_one(tokens, self)

    def one(self, tokens: torch.Tensor, start: int) -> torch.Tensor | None:
        """A one-token step of one sequence as one C call, or None: the torch ops run it (`many`)."""
        return self.plan.native_decode(tokens, start, self.mark) if self.native else None

    def many(self, tokens: torch.Tensor, start: int, input_pos: torch.Tensor,
             pad_mask: torch.Tensor | None) -> torch.Tensor:
        return self.plan.step(tokens, start, input_pos, self.mark, pad_mask)

    def kv_live_bytes(self) -> int:
        return self.plan.kv_live_bytes()

    def ahead(self, token: int, steps: int, stop_token: int | None, choose: Chooser,
              stamps: bool = False) -> AheadRun | None:
        """Up to `steps` decode steps from `token` at the model's `pos`, in one call (FusedPlan.native_ahead: each
        step's next token is `choose(logits)`'s answer, the run's sampler called from C with that step's logits; it
        stops after the step that chose `stop_token`, or after one whose `choose` raised: AheadRun.failure), with
        each step's stage readings when `stamps`. None when the native step cannot take them (the caller then runs a
        step at a time): no native step, a padded or batched cache, or too few positions left for `steps`."""
        model, plan = self.model, self.plan
        start = model.pos
        if not self.native or model.pads != (0,) or start + steps > plan.max_seq:
            return None
        return plan.native_ahead(token, start, steps, stop_token, choose, stamps)


class StagedNativeBackend(PackedBackend):
    """--staged: a one-token step of one sequence as the C step with the stage modules' stages apart, each timed in
    C, its readings handed to `take` (the tracer's staged marks) when traced; every other step through the modules
    (which the tracer wraps). A traced mixture of experts' run without --staged (`staged` False) takes it too (the
    packed step's marks cannot count its expert stages)."""

    def __init__(self, model: Any, plan: FusedPlan, take: Any = None, staged: bool = True) -> None:
        super().__init__(model, plan, native=True)
        self.take, self.staged = take, staged
        self.many = model.modules_step

    def traced(self, tracer: Any) -> StagedNativeBackend:
        return StagedNativeBackend(self.model, self.plan, tracer.staged_take, self.staged)

    def prefill(self, tokens: torch.Tensor, pad: list[int] | None = None) -> torch.Tensor:
        return self.model.prefill(tokens, pad)

    def one(self, tokens: torch.Tensor, start: int) -> torch.Tensor | None:
        if self.take is None and not self.staged:
            return self.plan.native_decode(tokens, start)
        return self.plan.staged_step(tokens, start, self.take)

    def ahead(self, token: int, steps: int, stop_token: int | None, choose: Chooser,
              stamps: bool = False) -> AheadRun | None:
        """An untraced mixture of experts' steps, run ahead as PackedBackend's (their choices come back with them:
        AheadRun.routes); None under --staged or when traced (each step stamps its stages apart)."""
        if self.staged or self.take is not None or stamps:
            return None
        return super().ahead(token, steps, stop_token, choose, stamps)


Backend = ModulesBackend | PackedBackend


def build_backend(model: Any, selection: Selection) -> Backend:
    """The backend `selection` chose for `model`, untraced (`traced(tracer)` gives the traced one)."""
    route = selection.route
    if route.decode == NATIVE and route.prefill == MODULES:
        return StagedNativeBackend(model, selection.plan, staged=selection.staged)
    if route.prefill == PACKED:
        return PackedBackend(model, selection.plan, native=selection.native)
    return ModulesBackend(model)


def matvec_of(kernels: Any) -> str:
    """The one-token product kernel ("mv" or "mm") a loaded model's kernel choice measured for its dense weights;
    "mv" otherwise (stored weights run their own kernels)."""
    from llmtrace.tracer.model.functional import MATVEC_KERNELS

    kernel = getattr(kernels, "decode_kernel", None)
    return kernel if getattr(kernels, "weights", None) == DENSE and kernel in MATVEC_KERNELS else "mv"


def backend_for(model: Any, request: Request = Request()) -> Backend:
    """The untraced backend a run asking `request` of `model` takes (its cache set up): tests and benchmarks pick
    one this way, `Request(backend="modules")` or `"packed"` forcing a slower one."""
    return build_backend(model, select(model, request))
