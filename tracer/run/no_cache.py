"""The no-KV-cache counterfactual (`run --no-kv-cache`): after the cached run, its token sequence generated again
without a cache, every step recomputing the whole sequence so far, traced like the cached run.

Step i feeds the prompt and the i tokens generated before it through one cache-free pass (a prefill of P + i
tokens into an emptied cache: the cache holds only that pass's own keys and values, as a cache-free forward's
attention does) and samples from its logits with a Sampler of the run's settings and seed, which must give the
cached run's token (recorded per step: it checks the cached path against the recomputation). Its own Tracer, the
same mechanism as the cached run's, counts the FLOPs, so the two runs are counted the same way; the analytic ratio
beside each step comes from llmtrace.tracer.analytic.no_cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from llmtrace.tracer.analytic import estimate
from llmtrace.tracer.analytic.estimate import Dtypes
from llmtrace.tracer.analytic.no_cache import generation_without_cache, prefill_flops
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.trace.hooks import Tracer
from llmtrace.tracer.trace.journey_records import NoCacheRun, NoCacheStep
from llmtrace.tracer.trace.records import StageRecord, StepRecord

HORIZON_TOKENS = 1000  # the seed article's "about 1000x for 1000 tokens"


@dataclass(frozen=True, slots=True)
class NoCacheProgress:
    """An event: one more step recomputed without the cache."""

    step: NoCacheStep
    done: int
    total: int


def replay_without_cache(model: Any, backend: Any, config: ModelConfig, dtypes: Dtypes, prompt_ids: Sequence[int],
                         cached_steps: Sequence[StepRecord], cached_stages: Sequence[StageRecord], sampler: Any,
                         tracer: Tracer, sync: Callable[[], None] | None,
                         out: list[NoCacheStep]) -> Iterator[NoCacheProgress]:
    """Recompute each of `cached_steps` without a cache, appending one NoCacheStep to `out` per step (so an
    interrupted replay keeps what it finished) and yielding progress, on the run's `backend` (tracer/run/backends.py)
    traced by `tracer`. `model.setup_cache` must have room for the whole sequence; the cache is left empty."""
    ids = list(prompt_ids) + [s.token_id for s in cached_steps]
    cached_flops = _flops_by_step(cached_stages)
    prompt_len = len(prompt_ids)
    seen = 0  # stage records already counted
    with tracer:
        prefill = backend.traced(tracer).prefill
        for i, cached in enumerate(cached_steps):
            positions = prompt_len + i
            tokens = torch.tensor([ids[:positions]], dtype=torch.long, device=model.norm.weight.device)
            model.reset_cache()
            tracer.begin_step(cached.phase, cached.step)
            if sync is not None:
                sync()
            start = time.perf_counter_ns()
            logits = prefill(tokens)  # (1, V): the whole sequence, nothing cached before
            if sync is not None:
                sync()
            forward_ns = time.perf_counter_ns() - start
            tracer.end_step()
            token = int(sampler.sample(logits[0], ids[:positions]).token_id)
            records = tracer.records()
            counted = sum(r.flops for r in records[seen:])
            seen = len(records)
            was = cached_flops.get(cached.step, 0)
            uncached_estimate, cached_estimate = _analytic(config, dtypes, cached.step, positions)
            step = NoCacheStep(
                step=cached.step, positions=positions, forward_ns=forward_ns, cached_forward_ns=cached.forward_ns,
                time_ratio=forward_ns / cached.forward_ns if cached.forward_ns else None,
                flops=counted, cached_flops=was, flops_ratio=counted / was if was and counted else None,
                analytic_flops=uncached_estimate, analytic_cached_flops=cached_estimate,
                analytic_ratio=uncached_estimate / cached_estimate, same_token=token == cached.token_id,
            )
            out.append(step)
            yield NoCacheProgress(step, len(out), len(cached_steps))
    model.reset_cache()


def no_cache_run(steps: Sequence[NoCacheStep], total: int, config: ModelConfig, dtypes: Dtypes,
                 prompt_len: int) -> NoCacheRun:
    """The replay's record: its steps, their sums, and the analytic ratios over them and over a 1000-token horizon."""
    done = tuple(steps)
    uncached = sum(s.analytic_flops for s in done)
    cached = sum(s.analytic_cached_flops for s in done)
    horizon = generation_without_cache(config, prompt_len, HORIZON_TOKENS, dtypes)
    forward_ns, cached_forward_ns = sum(s.forward_ns for s in done), sum(s.cached_forward_ns for s in done)
    flops, cached_flops = sum(s.flops for s in done), sum(s.cached_flops for s in done)
    return NoCacheRun(
        steps=done, complete=len(done) == total,
        forward_ns=forward_ns, cached_forward_ns=cached_forward_ns,
        flops=flops, cached_flops=cached_flops,
        time_ratio=forward_ns / cached_forward_ns if cached_forward_ns else None,
        flops_ratio=flops / cached_flops if flops and cached_flops else None,
        analytic_generation_ratio=uncached / cached if cached else 1.0,
        horizon_tokens=HORIZON_TOKENS, horizon_step_ratio=horizon.last_step_ratio,
        horizon_generation_ratio=horizon.ratio,
    )


def _analytic(config: ModelConfig, dtypes: Dtypes, step: int, positions: int) -> tuple[int, int]:
    """The estimate's FLOPs of step `step` without and with the cache (the prefill, step 0, is the same work)."""
    uncached = prefill_flops(config, positions, dtypes)
    if step == 0:
        return uncached, uncached
    return uncached, estimate.decode_step(config, positions - 1, dtypes).totals.total_flops


def _flops_by_step(stages: Sequence[StageRecord]) -> dict[int, int]:
    out: dict[int, int] = {}
    for s in stages:
        out[s.step] = out.get(s.step, 0) + s.flops
    return out
