"""The generation loop: tokenize -> prefill -> sample -> decode_one -> sample ... until EOS or the token limit.

`Generation.events()` yields one event per stage of the journey, so a caller can show each as it happens:
`Tokenized`, `PrefillDone` (with the prefill's stage records), one `TokenStep` per decode step, and `Finished`
with the whole Trace. Ctrl-C (KeyboardInterrupt) inside the loop ends it cleanly: `Finished` still comes, with
`stop_reason == "interrupted"` and every step completed so far. A caller interrupted outside the loop can ask
`Generation.trace()` for the partial trace; `close()` removes the hooks.

The tracer's hooks exist only while `events()` runs (tracer/trace/hooks.py); `settings.trace = False` runs without
hooks and still times each step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Iterator, Protocol

import numpy as np
import torch

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.model.native_step import AheadRun
from llmtrace.tracer.model.rope import rope_inv_freq
from llmtrace.tracer.run.backends import Backend, ModulesBackend, build_backend
from llmtrace.tracer.run.detokenize import TextStream
from llmtrace.tracer.run.no_cache import NoCacheProgress, replay_without_cache
from llmtrace.tracer.run.prompt_ids import prompt_ids
from llmtrace.tracer.run.run_backend import RunBackend
from llmtrace.tracer.run.run_records import RunRecords
from llmtrace.tracer.run.sampling import NonFiniteLogitsError
from llmtrace.tracer.run.select import Selection, select
from llmtrace.tracer.run.token_pieces import TokenPieces
from llmtrace.tracer.trace.hooks import Tracer, device_synchronizer
from llmtrace.tracer.trace.journey_records import AttentionStep, LensStep, NoCacheStep, SamplingLesson
from llmtrace.tracer.trace.observe import Observer
from llmtrace.tracer.trace.routing import RoutingStep
from llmtrace.tracer.trace.records import (
    DECODE,
    PREFILL,
    NATIVE,
    RopeRecord,
    Route,
    RunSettings,
    StagedDecode,
    StageRecord,
    StepRecord,
    TokenizationRecord,
)
from llmtrace.tracer.trace.run_trace import (
    STOP_CONTEXT_FULL,
    STOP_DRY_RUN,
    STOP_EOS,
    STOP_INTERRUPTED,
    STOP_MAX_NEW_TOKENS,
    Trace,
    new_token_limit,
)



def check_prompt_fits(config: ModelConfig, prompt_len: int) -> None:
    """BadArgumentError when a prompt of `prompt_len` tokens leaves no position to generate into."""
    if prompt_len >= config.max_seq_len:
        raise BadArgumentError(f"the prompt is {prompt_len} tokens but {config.name} holds {config.max_seq_len} "
                               "positions; shorten the prompt")

class LoadedModelLike(Protocol):
    """What the loop needs of llmtrace.tracer.load.loader.LoadedModel."""

    config: ModelConfig
    model: Any  # llmtrace.tracer.model.transformer.Transformer
    tokenizer: Any  # llmtrace.tracer.checkpoint.tokenizer.Tokenizer, or None for a dry run
    source: str
    load_seconds: float
    weight_format: str


# ---- events ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tokenized:
    record: TokenizationRecord | None  # None in a dry run without a tokenizer
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class PrefillDone:
    step: StepRecord
    stages: tuple[StageRecord, ...]  # empty with tracing off
    rope: RopeRecord
    limit: int  # the most tokens this run will generate
    lesson: SamplingLesson | None = None  # the first token's logits at several temperatures (settings.temperatures)
    lens: LensStep | None = None  # --lens: what each layer would predict for the first token
    attention: AttentionStep | None = None  # --attention: where the first token's position looks


@dataclass(frozen=True, slots=True)
class TokenStep:
    step: StepRecord
    generated: int  # tokens generated so far, this one included
    limit: int  # the most this run will generate


@dataclass(frozen=True, slots=True)
class Finished:
    trace: Trace


Event = Tokenized | PrefillDone | TokenStep | NoCacheProgress | Finished


# ---- the loop -------------------------------------------------------------------------------------------------


class Generation(RunBackend, RunRecords):
    """One traced generation of `settings.prompt` on `loaded`; iterate `events()` once."""

    def __init__(self, loaded: LoadedModelLike, settings: RunSettings, sampler: Any = None,
                 run_ahead: bool = True, backend: str | None = None) -> None:
        """`run_ahead=False`: every decode step its own call, as the steps that cannot run ahead
        (`select`'s route says why); for comparisons, the records are the same. `backend` ("native", "packed",
        "modules"): the fastest backend no faster than it (Request.backend), for comparisons."""
        if settings.max_new_tokens < 1:
            raise BadArgumentError(f"--max-new-tokens must be at least 1, got {settings.max_new_tokens}")
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.dry_run = settings.dry_run
        self.sampler = sampler if sampler is not None or self.dry_run else make_sampler(settings)
        self.settings = _with_seed_used(settings, self.sampler)
        self.origin_ns = time.perf_counter_ns()
        param = self.model.norm.weight  # dense, in the compute dtype (stored matrices are meta placeholders)
        self.device = param.device
        self._on_cpu = self.device.type == "cpu"  # read once: a torch.device's attribute costs ~10 us after a step
        self.dtype = param.dtype
        self._sync = device_synchronizer(self.device)
        # the run's tracer follows its backend: made once `select` has chosen it (`_new_tracer`)
        self._tracer = Tracer(self.model, self.origin_ns, enabled=False)
        self._tokenization: TokenizationRecord | None = None
        self._rope: RopeRecord | None = None
        self._generated: list[int] = []
        self._stream: TextStream | None = None  # made on the first generated token (dry runs have no tokenizer)
        self._pieces = TokenPieces(self.tokenizer)  # display pieces and candidate records
        self._piece = self._pieces.piece  # a token's display piece, looked up once a run
        self._decode_ids: np.ndarray | None = None  # a decode step's input id on the CPU (_token_tensor) ...
        self._decode_tensor: torch.Tensor | None = None  # ... and the (1, 1) tensor over it
        self._kv_allocated: int | None = None  # the cache's allocated bytes, read once it is set up
        self._steps: list[StepRecord] = []
        self._lesson: SamplingLesson | None = None
        self._no_cache_steps: list[NoCacheStep] = []  # --no-kv-cache: the replay's steps so far
        # --lens / --attention: forward hooks that copy the predicted position's rows (tracer/trace/observe.py)
        observe = (settings.lens or settings.attention) and not settings.dry_run
        self._observer = Observer(self.model, lens=settings.lens, attention=settings.attention) if observe else None
        self._lens: list[LensStep] = []
        self._attention: list[AttentionStep] = []
        self._routing: list[RoutingStep] = []  # a mixture of experts: each step's choices (tracer/trace/routing.py)
        self._stop_reason = STOP_INTERRUPTED
        self._events: Iterator[Event] | None = None
        self._staged_decode: StagedDecode | None = None  # --staged: how its one-token steps ran (_staged_path)
        self._run_ahead = run_ahead
        self._asked_backend = backend
        self._run_ahead_calls: list[int] = []  # the decode steps recorded of each C call, when they ran ahead
        self._selection = Selection(None)  # the backend of the run's steps (`select`, once the observers are on)
        self._untraced: Backend = ModulesBackend(self.model)  # built from the selection (warm-up, replay) ...
        self._backend: Backend = self._untraced  # ... and the same traced by the run's tracer: the steps run on it

    def events(self) -> Iterator[Event]:
        if self._events is not None:
            raise RuntimeError("Generation.events() can be iterated only once")
        self._events = self._run()
        return self._events

    def run(self) -> Trace:
        """Generate to the end without looking at the events; the Trace."""
        for event in self.events():
            if isinstance(event, Finished):
                return event.trace
        return self.trace()

    def close(self) -> None:
        """Stop the loop (if suspended) and remove the hooks."""
        if self._events is not None:
            self._events.close()  # type: ignore[attr-defined]
        self._tracer.remove()
        if self._observer is not None:
            self._observer.remove()

    def _run(self) -> Iterator[Event]:
        """The loop of a run, one sequence or a batch (BatchGeneration: its own prompt, cache, warm-up and steps):
        the prompt, the cache, the warm-up, then the steps on the backend `select` chose, traced."""
        # Tokenization and context checks come first: a bad prompt fails before any hook is attached.
        prompt, limit = yield from self._prompt()
        try:
            self._set_up_cache(prompt, limit)
            if self._observer is not None:
                self._observer.attach()  # before the backend is chosen: the path the run takes is the observed one
            self._selection = select(self.model, self._request())
            self._untraced = build_backend(self.model, self._selection)
            self._staged_decode = staged_record(self.settings, self._selection.route)
            if self.settings.warmup and not self.dry_run:
                self._warm_up(prompt)
                if self._observer is not None:
                    self._observer.take()  # the warm-up's rows are not a step's
            rope = self._rope = _rope_record(self.config, self._prompt_length(prompt), limit)
            self._tracer = self._new_tracer()
            with self._tracer:
                self._backend = self._untraced.traced(self._tracer)
                yield from self._steps_of(prompt, rope, limit)
        except KeyboardInterrupt:
            self._stop_reason = STOP_INTERRUPTED
        else:
            if self.settings.no_kv_cache and not self.dry_run and self._steps:
                try:
                    yield from self._replay_without_cache(prompt)
                except KeyboardInterrupt:
                    pass  # the generation itself finished; the replay keeps the steps it completed
        finally:
            if self._observer is not None:
                self._observer.remove()
        yield Finished(self.trace())

    # ---- the parts a batch does its own way (BatchGeneration) ------------------------------------------------

    def _prompt(self) -> Iterator[Event]:
        """The prompt's ids (the Tokenized event first) and the most tokens the run may generate."""
        ids = self._tokenize()
        limit = self._new_token_limit(len(ids))
        yield Tokenized(self._tokenization, len(ids))
        return ids, limit

    def _steps_of(self, ids: list[int], rope: RopeRecord, limit: int) -> Iterator[Event]:
        return self._dry_run(ids, rope, limit) if self.dry_run else self._generate(ids, rope, limit)

    def _replay_without_cache(self, ids: list[int]) -> Iterator[NoCacheProgress]:
        """The generated tokens again without a KV cache (tracer/run/no_cache.py), traced the same way."""
        tracer = self._new_tracer()
        try:
            yield from replay_without_cache(self.model, self._untraced, self.config, self._dtypes(), ids, self._steps,
                                            self._tracer.records(), make_sampler(self.settings), tracer, self._sync,
                                            self._no_cache_steps)
        finally:
            tracer.remove()

    def _generate(self, ids: list[int], rope: RopeRecord, limit: int) -> Iterator[Event]:
        eos = getattr(self.tokenizer, "eos_id", None)
        token = yield from self._prefill(ids, rope, limit)
        ahead = FIRST_RUN_AHEAD if self._selection.ahead else 0  # 0: a step a call (the route's ahead_reason)
        while token != eos and len(self._generated) < limit:
            ran = self._decode_ahead(token, min(ahead, limit - len(self._generated)), eos) if ahead else None
            if ran is None:
                ahead = 0  # what said no (no native step, a hook) stays for the run: a step a call from here on
                step = self._step(DECODE, len(self._steps), [token])
                token = step.token_id
                yield TokenStep(step, len(self._generated), limit)
                continue
            run, results = ran
            self._run_ahead_calls.append(0)
            for step in self._run_records(run, results):
                self._run_ahead_calls[-1] += 1  # the steps recorded (Ctrl-C may come between two records)
                token = step.token_id
                yield TokenStep(step, len(self._generated), limit)
            if isinstance(run.failure, NonFiniteLogitsError):
                raise self._not_finite(DECODE, len(self._steps))
            if run.failure is not None:
                raise run.failure
            ahead = _steps_ahead(run)
        if token == eos:
            self._stop_reason = STOP_EOS
        elif limit < self.settings.max_new_tokens:
            self._stop_reason = STOP_CONTEXT_FULL
        else:
            self._stop_reason = STOP_MAX_NEW_TOKENS

    def _prefill(self, ids: list[int], rope: RopeRecord, limit: int) -> Iterator[Event]:
        step = self._step(PREFILL, 0, ids)
        yield PrefillDone(step, self._tracer.records(), rope, limit, self._lesson,
                          self._lens[0] if self._lens else None, self._attention[0] if self._attention else None)
        return step.token_id

    def _dry_run(self, ids: list[int], rope: RopeRecord, limit: int) -> Iterator[Event]:
        """Meta device: one prefill and one decode step for shapes and FLOPs; no sampling, times meaningless."""
        prefill = self._step(PREFILL, 0, ids)
        yield PrefillDone(prefill, self._tracer.records(), rope, limit)
        decode = self._step(DECODE, 1, [0])
        yield TokenStep(decode, 1, 1)
        self._stop_reason = STOP_DRY_RUN

    def _tokenize(self, prompt: str | None = None) -> list[int]:
        """The ids of `prompt` (default: the run's), recorded as this run's TokenizationRecord."""
        prompt = self.settings.prompt if prompt is None else prompt
        ids, record = prompt_ids(self.tokenizer, self.config, self.settings, prompt, self.origin_ns,
                                 self._new_token_limit)
        if record is not None:
            self._tokenization = record
        return ids

    def _new_token_limit(self, prompt_len: int) -> int:
        check_prompt_fits(self.config, prompt_len)
        return new_token_limit(self.settings.max_new_tokens, self.config.max_seq_len, prompt_len)

    def _new_text(self, token_id: int) -> str:
        """The text this token adds; held back while a multi-byte character is incomplete."""
        if self._stream is None:
            self._stream = TextStream(self.tokenizer, getattr(self.tokenizer, "eos_id", None))
        return self._stream.add(token_id)


FIRST_RUN_AHEAD = 1  # the first C call: one step, whose time sets how many the next calls run (RUN_AHEAD_NS)
RUN_AHEAD_NS = 50_000_000  # a C call's steps: the longest a live view waits for its next tokens, or Ctrl-C for effect
MOST_RUN_AHEAD = 64  # past a few tens of steps a call, the Python between calls is already under 1% of the time


def _steps_ahead(run: AheadRun) -> int:
    """How many steps the next C call may run: as many as took about RUN_AHEAD_NS in the last one."""
    if not run.clock:
        return FIRST_RUN_AHEAD
    per_step = max((run.clock[-1][2] - run.clock[0][0]) // len(run.clock), 1)
    return max(1, min(MOST_RUN_AHEAD, RUN_AHEAD_NS // per_step))


def generate(loaded: LoadedModelLike, settings: RunSettings) -> Trace:
    """Run a whole generation and return its Trace (no live events)."""
    generation = Generation(loaded, settings)
    try:
        return generation.run()
    finally:
        generation.close()


# ---- helpers --------------------------------------------------------------------------------------------------


def sampling_params(settings: RunSettings) -> Any:
    """The run's SamplingParams, checked (BadArgumentError): callers check them before loading a model."""
    from llmtrace.tracer.run.sampling import SamplingParams

    return SamplingParams(
        temperature=settings.temperature, top_k=settings.top_k or 0,
        top_p=1.0 if settings.top_p is None else settings.top_p, min_p=settings.min_p or 0.0,
        repetition_penalty=settings.repetition_penalty, seed=settings.seed,
    )


def make_sampler(settings: RunSettings) -> Any:
    from llmtrace.tracer.run.sampling import Sampler

    return Sampler(sampling_params(settings))


def _with_seed_used(settings: RunSettings, sampler: Any) -> RunSettings:
    """Record the seed a sampling run drew when none was given, so `--seed <it>` replays the run."""
    drawn = getattr(sampler, "seed", None)
    if settings.seed is not None or settings.temperature == 0 or drawn is None:
        return settings  # greedy needs no seed: it is deterministic
    return replace(settings, seed=int(drawn), seed_drawn=True)


def staged_record(settings: RunSettings, route: Route) -> StagedDecode | None:
    """--staged: whether its one-token steps ran as the native step's stages apart, timed in C, or through the stage
    modules, and why (the route's reason the native backend was not taken)."""
    if not settings.staged:
        return None
    return StagedDecode(next((r.reason for r in route.not_taken if r.backend == NATIVE), ""))


def _rope_record(config: ModelConfig, prompt_len: int, limit: int) -> RopeRecord:
    """The prefill's RoPE, at the frequencies of the run's tables (LongRoPE's factors are chosen by their length, the
    cache's: prompt and new tokens)."""
    inv_freq = rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling, prompt_len + limit)
    scaling = config.rope_scaling
    return RopeRecord(
        theta=config.rope_theta, head_dim=config.head_dim,
        scaling=None if scaling is None else f"{scaling.kind} x{scaling.factor:g}",
        inv_freq_first=float(inv_freq[0]), inv_freq_last=float(inv_freq[-1]),
        positions=tuple(range(prompt_len)),
    )
