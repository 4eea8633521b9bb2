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


@dataclass(frozen=True, slots=True)
class NoCacheStep:
    """One step of the run recomputed without a KV cache (the whole sequence so far), beside the cached step."""

    step: int  # the cached run's step: 0 = the prefill (the same work either way), then 1, 2, ...
    positions: int  # tokens the uncached step runs: the prompt and every token generated before this step
    forward_ns: int  # measured, device synchronised
    cached_forward_ns: int  # the cached run's forward for the same step
    time_ratio: float | None  # forward_ns / cached_forward_ns
    flops: int  # counted by the tracer (0 with --no-trace)
    cached_flops: int
    flops_ratio: float | None  # counted, uncached / cached (None without tracing)
    analytic_flops: int  # the estimate's FLOPs for this step without and with the cache (llmtrace.tracer.analytic)
    analytic_cached_flops: int
    analytic_ratio: float  # analytic_flops / analytic_cached_flops
    same_token: bool  # the uncached logits give the cached run's token (same sampler, same seed)


@dataclass(frozen=True, slots=True)
class NoCacheRun:
    """The no-KV-cache counterfactual: the run's token sequence generated again, recomputing everything each step."""

    steps: tuple[NoCacheStep, ...]
    complete: bool  # False: interrupted, `steps` are those finished
    forward_ns: int  # sums over `steps`
    cached_forward_ns: int
    flops: int
    cached_flops: int
    time_ratio: float | None  # forward_ns / cached_forward_ns
    flops_ratio: float | None  # flops / cached_flops (None without tracing)
    analytic_generation_ratio: float  # the estimate over the same steps: sum uncached / sum cached FLOPs
    horizon_tokens: int  # a longer generation from the same prompt, analytically (the article's 1000 tokens)
    horizon_step_ratio: float  # the estimate's ratio for the last step of that generation
    horizon_generation_ratio: float  # and over the whole of it


@dataclass(frozen=True, slots=True)
class LensToken:
    token_id: int
    piece: str
    probability: float


@dataclass(frozen=True, slots=True)
class LensLayer:
    """What the residual stream after one layer would predict through the final RMSNorm and the LM head."""

    layer: int | None  # None: after the embedding, before any layer; i: after layers.i
    top: tuple[LensToken, ...]  # the most likely tokens, highest first
    chosen_rank: int  # 1-based rank of the token the step finally chose
    chosen_probability: float
    entropy_bits: float


@dataclass(frozen=True, slots=True)
class LensStep:
    """The logit lens at the predicted position of one step (`run --lens`)."""

    step: int
    position: int  # the predicted position: the last one fed
    token_id: int  # the token the step chose, followed through the layers
    piece: str
    first_top_layer: int | None  # the first layer after which the chosen token is the top one (None: never)
    layers: tuple[LensLayer, ...]  # the embedding, then every layer
    instrument_ns: int  # time spent working the lens out, after the step: not in the step's or stages' time


@dataclass(frozen=True, slots=True)
class HeadFocus:
    """Where one head of one layer looks from the predicted position."""

    layer: int
    head: int
    entropy_bits: float  # of its weights over the positions (0: all on one position)
    top_positions: tuple[int, ...]  # its highest weights, highest first
    top_weights: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class AttentionStep:
    """The attention weights of one step's predicted position over every cached position (`run --attention`)."""

    step: int
    position: int  # the query position (the last one fed)
    positions: int  # S: key positions it attends over (0 .. position)
    pieces: tuple[str, ...]  # the token at each key position
    mean_weights: tuple[tuple[float, ...], ...]  # per layer, the heads' mean weight on each position (sums to 1)
    heads: tuple[HeadFocus, ...]  # every layer's every head, layer by layer
    weights: tuple[tuple[tuple[float, ...], ...], ...] | None  # full (layers, H, S) for the steps asked for
    #                                          (settings.attention_steps), each while layers x H x S <= ATTENTION_FULL_LIMIT
    instrument_ns: int  # time spent summarising, after the step: not in the step's or stages' time


ATTENTION_FULL_LIMIT = 65536  # weights kept in full per step asked for (a bounded trace size)
