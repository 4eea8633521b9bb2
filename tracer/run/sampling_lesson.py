"""The sampling lesson: one step's logits at several temperatures side by side, with what top-k, top-p and min-p
keep at each (the seed article's "T = 0.1, 1, 2" table, on the run's real logits).

Each column is the run's own Sampler (tracer/run/sampling.py) applied to the same logits at another temperature, so
the counts and renormalised probabilities are exactly what a run at that temperature would draw from; the lesson's
Sampler has its own seed and never touches the run's random sequence. The filters are the run's --top-k/--top-p/
--min-p when it set any, else the common values top-k 50, top-p 0.9, min-p 0.05 (named as illustrative).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import torch

from llmtrace.tracer.run.sampling import Sampler, SamplingParams
from llmtrace.tracer.run.sampling_params import check_temperatures
from llmtrace.tracer.trace.journey_records import (
    FILTERS_FROM_RUN,
    FILTERS_ILLUSTRATIVE,
    LESSON_MIN_P,
    LESSON_TOP_K,
    LESSON_TOP_P,
    LessonColumn,
    LessonToken,
    SamplingLesson,
)
from llmtrace.tracer.trace.records import RunSettings

LESSON_TOKENS = 8


def lesson_filters(settings: RunSettings) -> tuple[int, float, float, str]:
    """(top_k, top_p, min_p, where they came from): the run's filters when it set any, else the illustrative ones."""
    if settings.top_k or (settings.top_p is not None and settings.top_p < 1) or settings.min_p:
        return (settings.top_k or 0, 1.0 if settings.top_p is None else settings.top_p, settings.min_p or 0.0,
                FILTERS_FROM_RUN)
    return LESSON_TOP_K, LESSON_TOP_P, LESSON_MIN_P, FILTERS_ILLUSTRATIVE


def sampling_lesson(logits: torch.Tensor, previous_ids: Sequence[int], settings: RunSettings,
                    piece: Callable[[int], str], step: int = 0, n_tokens: int = LESSON_TOKENS) -> SamplingLesson:
    """The lesson for one logits vector (shape (vocab,)) at each of `settings.temperatures`."""
    temperatures = check_temperatures(settings.temperatures)
    top_k, top_p, min_p, source = lesson_filters(settings)
    columns: list[LessonColumn] = []
    tokens: tuple[LessonToken, ...] = ()
    for temperature in temperatures:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repetition_penalty=settings.repetition_penalty, seed=0)
        result = Sampler(params, n_candidates=n_tokens).sample(logits, previous_ids)
        ranked = [c for c in result.candidates if c.rank <= n_tokens]  # the drawn token is appended when lower
        if not tokens:  # the order is by penalised logit, the same at every temperature
            tokens = tuple(LessonToken(int(c.token_id), piece(int(c.token_id)), float(c.logit_penalized))
                           for c in ranked)
        columns.append(LessonColumn(
            temperature=temperature,
            probabilities=tuple(float(c.prob_tempered) for c in ranked),
            final_probabilities=tuple(float(c.prob_final) for c in ranked),
            # the whole tempered distribution, before any filter: the same Sampler with the filters off
            entropy_bits=float(Sampler(replace(params, top_k=0, top_p=1.0, min_p=0.0), n_candidates=1)
                               .sample(logits, previous_ids).entropy_final_bits),
            n_after_top_k=int(result.n_after_top_k), n_after_top_p=int(result.n_after_top_p),
            n_after_min_p=int(result.n_after_min_p),
        ))
    return SamplingLesson(step=step, vocab_size=int(logits.shape[-1]), top_k=top_k, top_p=top_p, min_p=min_p,
                          filters_from=source, tokens=tokens, columns=tuple(columns))
