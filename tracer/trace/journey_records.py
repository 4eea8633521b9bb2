"""Records of the journey's extra views: what the model's logits look like at several temperatures (the sampling
lesson), what each layer would predict (the logit lens), where each head looks (attention), and what the run would
have cost without a KV cache.

All are instrumentation: they are worked out apart from the traced stages, so they add nothing to the stages'
FLOPs, bytes or time (tracer/trace/records.py). Frozen dataclasses of plain values, as every trace record is, so
`dataclasses.asdict()` is their JSON form (documented in tracer/trace/trace_schema.json).
"""

from __future__ import annotations

from dataclasses import dataclass

# Where the sampling lesson's filter values came from: the run's own --top-k/--top-p/--min-p, or, when the run set
# none of them, the common values the lesson illustrates with (LESSON_TOP_K, LESSON_TOP_P, LESSON_MIN_P).
FILTERS_FROM_RUN = "run"
FILTERS_ILLUSTRATIVE = "illustrative"
LESSON_TOP_K = 50
LESSON_TOP_P = 0.9
LESSON_MIN_P = 0.05


@dataclass(frozen=True, slots=True)
class LessonToken:
    """One of the most likely tokens the lesson follows across temperatures."""

    token_id: int
    piece: str
    logit: float  # after the repetition penalty (the raw logit when it is off): what the temperature divides


@dataclass(frozen=True, slots=True)
class LessonColumn:
    """The lesson's tokens at one temperature, and what the filters keep there."""

    temperature: float
    probabilities: tuple[float, ...]  # softmax(logits / T) of each lesson token, in the tokens' order
    final_probabilities: tuple[float, ...]  # after top-k, top-p and min-p, renormalised (0 = filtered out)
    entropy_bits: float  # of softmax(logits / T) over the whole vocabulary
    n_after_top_k: int  # tokens left after each filter, cumulative, as the sampler applies them
    n_after_top_p: int
    n_after_min_p: int


@dataclass(frozen=True, slots=True)
class SamplingLesson:
    """The same logits (those of `step`) at several temperatures, side by side (the seed article's table)."""

    step: int  # 0: the prefill's logits, which chose the first generated token
    vocab_size: int
    top_k: int  # the filters applied at every temperature (0, 1.0, 0.0 = off)
    top_p: float
    min_p: float
    filters_from: str  # FILTERS_FROM_RUN or FILTERS_ILLUSTRATIVE
    tokens: tuple[LessonToken, ...]  # the most likely tokens, highest logit first
    columns: tuple[LessonColumn, ...]  # one per temperature, in the order asked
