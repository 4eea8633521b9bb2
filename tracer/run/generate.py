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

import platform
import resource
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator, Protocol

import numpy as np
import torch

from llmtrace.tracer.analytic.estimate import Dtypes
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.errors import BadArgumentError, CheckpointError
from llmtrace.tracer.core.version import llmtrace_version
from llmtrace.tracer.hardware.decode_ceilings import this_cpu_name
from llmtrace.tracer.hardware.dtype_policy import dtype_of
from llmtrace.tracer.model.native_step import AheadRun
from llmtrace.tracer.model.rope import rope_inv_freq
from llmtrace.tracer.run.detokenize import TextStream
from llmtrace.tracer.run.native_backend import NativeBackend
from llmtrace.tracer.run.prompt_ids import prompt_ids
from llmtrace.tracer.run.token_pieces import TokenPieces
from llmtrace.tracer.run.no_cache import NoCacheProgress, no_cache_run, replay_without_cache
from llmtrace.tracer.run.sampling import NonFiniteLogitsError, SampleResult, float32_numpy
from llmtrace.tracer.run.sampling_lesson import sampling_lesson
from llmtrace.tracer.run.select import Request, Selection, select
from llmtrace.tracer.trace.attention_view import attention_step
from llmtrace.tracer.trace.fused_marks import StepDims
from llmtrace.tracer.trace.hooks import Tracer, device_synchronizer
from llmtrace.tracer.trace.journey_records import AttentionStep, LensStep, NoCacheRun, NoCacheStep, SamplingLesson
from llmtrace.tracer.trace.lens import logit_lens
from llmtrace.tracer.trace.observe import Observer
from llmtrace.tracer.trace.records import (
    DECODE,
    PREFILL,
    EnvironmentInfo,
    ModelInfo,
    NATIVE,
    RopeRecord,
    Route,
    RunAhead,
    RunSettings,
    SamplingRecord,
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
from llmtrace.tracer.trace.step_selection import StepSelection, prune_steps



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


class Generation:
    """One traced generation of `settings.prompt` on `loaded`; iterate `events()` once."""

    def __init__(self, loaded: LoadedModelLike, settings: RunSettings, sampler: Any = None,
                 run_ahead: bool = True) -> None:
        """`run_ahead=False`: every decode step its own call, as the steps that cannot run ahead
        (`select`'s route says why); for comparisons, the records are the same."""
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
        # "auto" traces the path the model takes (the fused one, unless something else watches its modules);
        # --staged runs and traces the stage modules (Q, K, V, gate and up as separate products).
        self._tracer = Tracer(self.model, self.origin_ns, enabled=settings.trace,
                              mechanism="wrap" if settings.staged else "auto")
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
        self._stop_reason = STOP_INTERRUPTED
        self._events: Iterator[Event] | None = None
        self._staged_decode: StagedDecode | None = None  # --staged: how its one-token steps ran (_staged_path)
        self._run_ahead = run_ahead
        self._run_ahead_calls: list[int] = []  # the decode steps recorded of each C call, when they ran ahead
        self._selection = Selection(None)  # the backend of the run's steps (`select`, once everything is attached)
        self._native: NativeBackend | None = None  # the native backend running ahead, when the route takes it

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
        fused = getattr(self.model, "use_fused", None)
        staged_native = getattr(self.model, "staged_native", None)
        if self.settings.staged and fused is not None:
            self.model.use_fused = False  # stage by stage, warm-up and all, traced or not
            if staged_native is not None and self.settings.batch == 1:  # one-token steps of one sequence as the
                self.model.staged_native = True  # native step's stages apart, where it can
        try:
            self._set_up_cache(prompt, limit)
            if self._observer is not None:
                self._observer.attach()  # before the warm-up and the tracer: the path they take is the observed one
            if self.settings.warmup and not self.dry_run:
                self._warm_up(prompt)
                if self._observer is not None:
                    self._observer.take()  # the warm-up's rows are not a step's
            rope = self._rope = _rope_record(self.config, self._prompt_length(prompt))
            with self._tracer:
                self._selection = select(self.model, self._request())
                self._native = NativeBackend(self.model)
                self._staged_decode = staged_record(self.settings, self._selection.route)
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
            if fused is not None:
                self.model.use_fused = fused
            if staged_native is not None:
                self.model.staged_native = staged_native
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

    def _set_up_cache(self, ids: list[int], limit: int) -> None:
        self.model.setup_cache(1, len(ids) + limit)
        self._kv_allocated = int(self.model.kv_allocated_bytes)  # fixed until the next setup_cache

    @staticmethod
    def _prompt_length(ids: list[int]) -> int:
        return len(ids)

    def _request(self) -> Request:
        """What the run asks of the backend (tracer/run/select.py), asked with the observers and the tracer attached,
        as the steps will run."""
        return Request(batch=1, staged=self.settings.staged, observed=self._observer is not None,
                       tracer=self._tracer, sampler=self.sampler, run_ahead=self._run_ahead, on_cpu=self._on_cpu)

    def _steps_of(self, ids: list[int], rope: RopeRecord, limit: int) -> Iterator[Event]:
        return self._dry_run(ids, rope, limit) if self.dry_run else self._generate(ids, rope, limit)

    def _replay_without_cache(self, ids: list[int]) -> Iterator[NoCacheProgress]:
        """The generated tokens again without a KV cache (tracer/run/no_cache.py), traced the same way."""
        tracer = Tracer(self.model, self.origin_ns, enabled=self.settings.trace,
                        mechanism="wrap" if self.settings.staged else "auto")
        try:
            yield from replay_without_cache(self.model, self.config, self._dtypes(), ids, self._steps,
                                            self._tracer.records(), make_sampler(self.settings), tracer, self._sync,
                                            self._no_cache_steps)
        finally:
            tracer.remove()

    def _dtypes(self) -> Dtypes:
        return Dtypes.for_weights(dtype_of(self.dtype))

    def _warm_up(self, ids: list[int]) -> None:
        """One untimed prefill of the prompt and one decode step, then an empty cache: the first call of a kernel
        for a shape pays one-off set-up (oneDNN's bf16/AMX kernels took ~40x a layer's time in the first prefill),
        which a profile of steady-state work must not show as layer 0's cost. It takes the path the traced run
        takes: the model's own choice, which the tracer's "auto" mechanism follows."""
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, T)
        try:
            with torch.no_grad():
                self.model.prefill(tokens)
                self.model.decode_one(tokens[:, -1:])  # (1, 1)
        finally:
            self.model.reset_cache()
        if self._sync is not None:
            self._sync()

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

    def _decode_ahead(self, token: int, steps: int, eos: int | None) -> tuple[AheadRun, list[SampleResult]] | None:
        """The native backend's run of up to `steps` steps from `token`, the sampler choosing each next token from
        the step's logits as `_step` has it choose (the prompt and every token so far for its penalty); the run and
        the sampler's results, in order (one more than the run's steps when the sampler raised on the last)."""
        results: list[SampleResult] = []
        previous = self._prompt_ids_and_generated()

        def choose(logits: np.ndarray) -> int:
            result = self.sampler.sample(logits, previous)
            results.append(result)
            previous.append(int(result.token_id))
            return int(result.token_id)

        run = self._native.ahead(token, steps, eos, choose, self.settings.trace)
        return None if run is None else (run, results)

    def _run_records(self, run: AheadRun, results: list[SampleResult]) -> Iterator[StepRecord]:
        """The records of the steps one C call ran (NativeBackend.ahead), in order, each made as it is yielded from
        the sampler's result for that step; its times C's clock readings (the forward, then the sampler called from
        C): the steps ran back to back, so each span ends where the next begins, and the detokenizing done here
        after the call, like the records, is in none."""
        stamped = self.settings.trace
        for i, result in enumerate(results[: len(run.tokens)]):
            start, forward_end, sample_end = run.clock[i]
            index = len(self._steps)
            context_length = int(self.model.pos) - len(run.tokens) + i + 1
            if stamped:
                self._tracer.stamped_step(DECODE, index, run.stamps[i], StepDims(1, 1, context_length))
            yield self._record(DECODE, index, 1, context_length, run.kv_live_bytes[i], result, start, forward_end,
                               sample_end, detokenize_in_step=False)

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

    def _forward(self, phase: str, index: int, tokens: torch.Tensor,
                 pad: list[int] | None = None) -> tuple[torch.Tensor, int, int]:
        """One traced forward of tokens (B, T), prefill or decode_one: the logits (B, V), its start and end."""
        sync = self._sync
        self._tracer.begin_step(phase, index)
        if sync is not None:
            sync()
        start = time.perf_counter_ns()
        logits = self.model.prefill(tokens, pad) if phase == PREFILL else self.model.decode_one(tokens)  # (B, V)
        if sync is not None:
            sync()
        forward_end = time.perf_counter_ns()
        self._tracer.end_step()
        return logits, start, forward_end

    def _step(self, phase: str, index: int, ids: list[int]) -> StepRecord:
        """One forward (prefill or decode_one), the sample from its logits, the text it adds."""
        logits, start, forward_end = self._forward(phase, index, self._token_tensor(ids))  # (1, V)
        result = None
        sample_end = forward_end
        if not self.dry_run:
            previous = self._prompt_ids_and_generated()
            try:  # the sampler's one pass over the logits is the finiteness check (no torch pass of its own)
                result = self.sampler.sample(float32_numpy(logits)[0], previous)  # (V,), a view when it can be
            except NonFiniteLogitsError:
                raise self._not_finite(phase, index) from None
            sample_end = time.perf_counter_ns()
        record = self._record(phase, index, len(ids), int(self.model.pos), int(self.model.kv_live_bytes), result,
                              start, forward_end, sample_end)
        if self._observer is not None:
            self._observe(record)
        if phase == PREFILL and not self.dry_run and self.settings.temperatures:
            # after the step's clocks stopped: the lesson is instrumentation, not part of the run's sampling time
            self._lesson = sampling_lesson(logits[0], previous, self.settings, self._piece)
        return record

    def _record(self, phase: str, index: int, inputs: int, context_length: int, kv_live_bytes: int,
                result: SampleResult | None, start: int, forward_end: int, sample_end: int,
                detokenize_in_step: bool = True) -> StepRecord:
        """The step's record (kept in the run's steps) once its token is chosen (`result`; None in a dry run):
        the text it adds is detokenized here, its time the step's last part, after `sample_end`; not timed when
        `detokenize_in_step` is False (a step run ahead in C, whose successors ran before this: its span ends with
        its choice, and the next step's starts there)."""
        if result is None:
            token_id, probability, greedy, filters, candidates, sampling = -1, 0.0, True, (), (), None
            text_end = sample_end
            piece, text = "", ""
        else:
            token_id = int(result.token_id)
            self._generated.append(token_id)
            detokenize_start = time.perf_counter_ns()
            text = self._new_text(token_id)
            text_end = sample_end + (time.perf_counter_ns() - detokenize_start if detokenize_in_step else 0)
            piece = self._piece(token_id)
            probability = float(result.probability)
            greedy = self.settings.temperature == 0
            filters = _active_filters(result)
            candidates = tuple(map(self._pieces.candidate, result.candidates))
            sampling = _sampling_record(result)
        record = StepRecord(
            phase=phase, step=index, input_tokens=inputs, context_length=context_length,
            token_id=token_id, piece=piece, text=text, probability=probability, greedy=greedy, filters=filters,
            candidates=candidates, sampling=sampling,
            kv_allocated_bytes=(int(self.model.kv_allocated_bytes) if self._kv_allocated is None
                                else self._kv_allocated),
            kv_live_bytes=kv_live_bytes,
            start_ns=start - self.origin_ns, forward_ns=forward_end - start, sample_ns=sample_end - forward_end,
            detokenize_ns=text_end - sample_end, duration_ns=text_end - start,
        )
        self._steps.append(record)
        return record

    @staticmethod
    def _not_finite(phase: str, index: int) -> CheckpointError:
        return CheckpointError(
            f"the model's logits at {phase} step {index} are not finite (NaN, +inf or all -inf); its weights "
            "or config hold invalid values (NaN weights, a zero RoPE base, a negative norm epsilon)")

    def _token_tensor(self, ids: list[int]) -> torch.Tensor:
        """The ids as a (1, T) int64 tensor on the model's device. On the CPU through numpy: torch.tensor() parses a
        nested list and dispatches a copy, tens of microseconds right after a model step has evicted the caches
        (bench_token_overhead). A decode step's one id is written into the run's one (1, 1) tensor, made once: the
        model reads its ids during the step and keeps no reference to them."""
        if not self._on_cpu:
            return torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, T)
        if len(ids) != 1:
            return torch.from_numpy(np.array([ids], dtype=np.int64))  # (1, T); a fresh array: nothing aliases it
        if self._decode_ids is None:
            self._decode_ids = np.zeros((1, 1), dtype=np.int64)
            self._decode_tensor = torch.from_numpy(self._decode_ids)  # (1, 1), sharing the array's memory
        self._decode_ids[0, 0] = ids[0]
        return self._decode_tensor

    def _observe(self, record: StepRecord) -> None:
        """The lens and attention views of the step just taken, from the Observer's rows (after its clocks)."""
        residual, weights = self._observer.take()
        position = record.context_length - 1
        if residual is not None:
            self._lens.append(logit_lens(self.model, residual, record.step, position, record.token_id, self._piece))
        if weights is not None:
            sequence = self._prompt_ids_and_generated()[: position + 1]  # the tokens at positions 0 .. position
            self._attention.append(attention_step(weights, record.step, [self._piece(i) for i in sequence],
                                                  keep_full=record.step in self.settings.attention_steps))

    def _prompt_ids_and_generated(self) -> list[int]:
        prompt = list(self._tokenization.ids) if self._tokenization is not None else []
        return prompt + self._generated

    def _new_text(self, token_id: int) -> str:
        """The text this token adds; held back while a multi-byte character is incomplete."""
        if self._stream is None:
            self._stream = TextStream(self.tokenizer, getattr(self.tokenizer, "eos_id", None))
        return self._stream.add(token_id)

    # ---- the result -----------------------------------------------------------------------------------------

    def trace(self) -> Trace:
        """The trace of everything completed so far (the whole run once `Finished` has been yielded)."""
        # The whole text decoded at once (the streamed pieces join into it); EOS is not shown.
        text = self.tokenizer.decode(self._stream.ids) if self._stream is not None else ""
        completed = {(s.phase, s.step) for s in self._steps}
        trace = Trace(
            settings=self.settings,
            config=self.config,
            environment=environment_info(self.device, self.dtype),
            model=model_info(self.loaded),
            tokenization=self._tokenization,
            rope=self._rope,
            # A step interrupted between its forward and its token has stages but no StepRecord: leave them out.
            stages=tuple(r for r in self._tracer.records() if (r.phase, r.step) in completed),
            steps=tuple(self._steps),
            generated_ids=tuple(self._generated),
            generated_text=text,
            stop_reason=self._stop_reason,
            wall_ns=(self._steps[-1].end_ns if self._steps else 0),
            peak_rss_bytes=peak_rss_bytes(),
            peak_device_bytes=(int(torch.cuda.max_memory_allocated(self.device))
                               if self.device.type == "cuda" else None),
            sampling_lesson=self._lesson,
            no_kv_cache=self._no_cache_record(),
            lens=tuple(self._lens),  # made after each step's record: every one belongs to a completed step
            attention=tuple(self._attention),
            kernels=getattr(self.loaded, "kernels", None),
            staged_decode=self._staged_decode,
            run_ahead=self._run_ahead_record(),
            route=self._selection.route,
        )
        return prune_steps(trace, StepSelection.parse(self.settings.trace_steps))

    def _run_ahead_record(self) -> RunAhead | None:
        calls = [steps for steps in self._run_ahead_calls if steps]  # a call that failed or was cut at its first
        return RunAhead(len(calls), sum(calls), max(calls)) if calls else None

    def _no_cache_record(self) -> NoCacheRun | None:
        if not self._no_cache_steps:
            return None
        prompt_len = len(self._tokenization.ids) if self._tokenization is not None else 0
        return no_cache_run(self._no_cache_steps, len(self._steps), self.config, self._dtypes(), prompt_len)


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


def _sampling_record(result: Any) -> SamplingRecord | None:
    """SampleResult's whole-distribution figures; None from a sampler that does not report them."""
    try:
        return SamplingRecord(
            probability_raw=float(result.probability_raw), rank=int(result.rank), vocab_size=int(result.vocab_size),
            n_after_top_k=int(result.n_after_top_k), n_after_top_p=int(result.n_after_top_p),
            n_after_min_p=int(result.n_after_min_p), n_final=int(result.n_final),
            entropy_raw_bits=float(result.entropy_raw_bits), entropy_final_bits=float(result.entropy_final_bits),
            top_p_mass=float(result.top_p_mass),
        )
    except AttributeError:
        return None


def _active_filters(result: Any) -> tuple[str, ...]:
    """The sampling steps that changed anything, in the order they ran (SampleResult.active_steps)."""
    if type(result) is SampleResult:  # the Sampler's own: a tuple of STEP_ORDER's names already
        return result.active_steps
    return tuple(str(step) for step in getattr(result, "active_steps", ()))


def _rope_record(config: ModelConfig, prompt_len: int) -> RopeRecord:
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    scaling = config.rope_scaling
    return RopeRecord(
        theta=config.rope_theta, head_dim=config.head_dim,
        scaling=None if scaling is None else f"llama3 x{scaling.factor:g}",
        inv_freq_first=float(inv_freq[0]), inv_freq_last=float(inv_freq[-1]),
        positions=tuple(range(prompt_len)),
    )


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def environment_info(device: torch.device, dtype: torch.dtype) -> EnvironmentInfo:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "meta":
        name = "meta (shapes only)"
    else:
        name = this_cpu_name() or platform.processor() or platform.machine()
    return EnvironmentInfo(
        llmtrace_version=llmtrace_version(),
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        platform=platform.platform(),
        device=str(device),
        device_name=name,
        threads=torch.get_num_threads(),
        dtype=str(dtype).removeprefix("torch."),
    )


def model_info(loaded: LoadedModelLike) -> ModelInfo:
    params = list(loaded.model.parameters())  # tied weights listed once
    stored = getattr(loaded.model, "stored_weights", dict)()  # {module: PackedWeight}; the tied head twice
    placeholders = {id(module.weight) for module in map(loaded.model.get_submodule, stored)}
    held = {id(w): w.stored_bytes for w in stored.values()}  # a matrix held as stored: its bytes in the file
    return ModelInfo(
        source=str(loaded.source),
        weight_format=str(loaded.weight_format),
        load_seconds=float(loaded.load_seconds),
        parameters=sum(p.numel() for p in params),
        parameter_bytes=sum(p.numel() * p.element_size() for p in params if id(p) not in placeholders)
        + sum(held.values()),
    )

