"""What a generation records: each step's StepRecord (the token, its text, its times, the cache's size), the lens and
attention views of a step, and the whole Trace (tracer/trace/run_trace.py) of what completed; the Generation loop
(tracer/run/generate.py) takes these from RunRecords."""

from __future__ import annotations

import platform
import resource
import sys
import time
from typing import Any, Iterator

import torch

from llmtrace.tracer.analytic.estimate import Dtypes
from llmtrace.tracer.core.errors import CheckpointError
from llmtrace.tracer.core.version import llmtrace_version
from llmtrace.tracer.hardware.decode_ceilings import this_cpu_name
from llmtrace.tracer.hardware.dtype_policy import dtype_of
from llmtrace.tracer.model.native_step import AheadRun
from llmtrace.tracer.run.no_cache import no_cache_run
from llmtrace.tracer.run.sampling import NonFiniteLogitsError, SampleResult, float32_numpy
from llmtrace.tracer.run.sampling_lesson import sampling_lesson
from llmtrace.tracer.trace.attention_view import attention_step
from llmtrace.tracer.trace.fused_marks import StepDims
from llmtrace.tracer.trace.journey_records import NoCacheRun
from llmtrace.tracer.trace.lens import logit_lens
from llmtrace.tracer.trace.records import DECODE, PREFILL, EnvironmentInfo, ModelInfo, RunAhead, SamplingRecord, StepRecord
from llmtrace.tracer.trace.routing import one_row_routing
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.step_selection import StepSelection, prune_steps


class RunRecords:
    """The records half of a Generation (its settings, sampler, tokenizer, tracer, backend and steps so far)."""

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
        record = self._record(phase, index, len(ids), int(self.model.pos), int(self._backend.kv_live_bytes()), result,
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
            routing=tuple(r for r in self._routing if (r.phase, r.step) in completed),
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

    def _dtypes(self) -> Dtypes:
        return Dtypes.for_weights(dtype_of(self.dtype))

    def _run_records(self, run: AheadRun, results: list[SampleResult]) -> Iterator[StepRecord]:
        """The records of the steps one C call ran (PackedBackend.ahead), in order, each made as it is yielded from
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
            if run.routes:  # a mixture of experts' choice in the step
                self._routing.append(one_row_routing(DECODE, index, *run.routes[i]))
            yield self._record(DECODE, index, 1, context_length, run.kv_live_bytes[i], result, start, forward_end,
                               sample_end, detokenize_in_step=False)


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


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: on Linux the kernel's high-water mark of this program's own memory
    (VmHWM), since ru_maxrss survives exec: a process spawned by fork + exec (a `run --tp` rank) would report its
    launcher's size at the fork when that is larger (a pytest process: 565 MB against a rank's own 474 MB); elsewhere
    ru_maxrss (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
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


def model_info(loaded: Any) -> ModelInfo:
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
