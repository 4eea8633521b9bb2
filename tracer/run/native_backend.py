"""The native backend running ahead: several decode steps of one sequence in one call of the C step, each next token
the run's sampler's choice, called from C with the step's logits, stamped when traced.

The model only holds the weights and the caches: which tokens follow, and what is recorded of them, is asked here
and composed by the generation loop (tracer/run/generate.py) with the sampler (tracer/run/sampling.py) and the
tracer (tracer/trace/hooks.py). `select` (tracer/run/select.py) decides when a run takes this backend.
"""

from __future__ import annotations

from typing import Any

from llmtrace.tracer.model.native_step import AheadRun, Chooser


class NativeBackend:
    """The C decode step of `model` (a Transformer whose cache is set up), built per run."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def ahead(self, token: int, steps: int, stop_token: int | None, choose: Chooser,
              stamps: bool = False) -> AheadRun | None:
        """Up to `steps` decode steps from `token` at the model's `pos`, in one call (FusedPlan.native_ahead: each
        step's next token is `choose(logits)`'s answer, the run's sampler called from C with that step's logits; it
        stops after the step that chose `stop_token`, or after one whose `choose` raised: AheadRun.failure), with
        each step's stage readings when `stamps`. None when the native step cannot take them (the caller then runs a
        step at a time): the packed path not usable, a padded or batched cache, or too few positions left for
        `steps`."""
        model = self.model
        plan = model._fused_plan
        start = model.pos
        if plan is None or not plan.caches or any(model.pads) or not plan.tree_unchanged() \
                or start + steps > plan.max_seq or (start and plan.cache_dicts[0]["batch"] != 1) or not model.fusable():
            return None
        try:
            run = plan.native_ahead(token, start, steps, stop_token, choose, stamps, model.use_native_step)
        except BaseException:
            model.rewind(start)  # as a step at a time: no layer left ahead of the others
            raise
        if run is not None:
            model.advance(start + len(run.tokens))
        return run
