"""A batched generation (`llmtrace run --batch N`): N sequences through one prefill and one decode step at a time.

Prompts of different lengths are left-padded to the longest and prefilled together: each row's positions count from
its own first token and no real query attends a pad key (Transformer.prefill's `pad`), so each row's logits are those
of its batch-1 run up to the summation order of the batched products. Left padding rather than per-row write offsets
because it keeps one dense (B, T) prefill and one cache write position for every row, as HF generate and vLLM's
padded paths do; the pads cost their share of prefill FLOPs and KV bytes, which the trace shows (they run).

Each sequence has its own sampler (seed = the run's seed + its index) and its own stopping: a sequence that samples
EOS or reaches the token limit is finished, and the step that finished it drops it from the batch
(Transformer.keep_rows, its KV row with it), so later steps run on the rows still going, with shapes [B', ...] in the
trace and FLOPs and bytes for those rows only. The batch ends when every sequence has.

Events are generate.py's: `BatchTokenized` (every prompt's tokens), `PrefillDone`, one `TokenStep` per decode step
(its StepRecord's `rows` hold each sequence's token) and `Finished`.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch

from llmtrace.tracer.core.errors import CheckpointError
from llmtrace.tracer.run.batch_spec import check_batch_settings
from llmtrace.tracer.run.detokenize import TextStream
from llmtrace.tracer.run.generate import (
    Generation,
    LoadedModelLike,
    PrefillDone,
    TokenStep,
    sampling_params,
)
from llmtrace.tracer.run.run_records import _active_filters
from llmtrace.tracer.run.select import Request
from llmtrace.tracer.trace.batch_records import FINISHED_ROWS, PADDING, BatchRun, SequenceRecord
from llmtrace.tracer.trace.records import (
    DECODE,
    PREFILL,
    RopeRecord,
    RowToken,
    RunSettings,
    StepRecord,
    TokenizationRecord,
)
from llmtrace.tracer.trace.run_trace import (
    STOP_CONTEXT_FULL,
    STOP_EOS,
    STOP_INTERRUPTED,
    STOP_MAX_NEW_TOKENS,
    Trace,
)


@dataclass(frozen=True, slots=True)
class BatchTokenized:
    records: tuple[TokenizationRecord, ...]  # one per sequence
    pads: tuple[int, ...]  # left pads of each in the batched prefill


class BatchGeneration(Generation):
    """One traced generation of `settings.batch_prompts` together on `loaded`; iterate `events()` once."""

    def __init__(self, loaded: LoadedModelLike, settings: RunSettings) -> None:
        check_batch_settings(settings)
        # The sampling lesson follows one sequence's first token: a batched run has none.
        super().__init__(loaded, replace(settings, temperatures=()))
        base = self.settings.seed  # as given, or drawn by the first sampler (greedy: None)
        from llmtrace.tracer.run.sampling import Sampler

        self._seeds = [None if base is None else base + i for i in range(settings.batch)]
        self._samplers = [Sampler(replace(sampling_params(self.settings), seed=seed)) for seed in self._seeds]
        self._records: list[TokenizationRecord] = []
        self._pads: tuple[int, ...] = ()
        self._outputs: list[list[int]] = [[] for _ in range(settings.batch)]
        self._streams: list[TextStream | None] = [None] * settings.batch
        self._ends: dict[int, tuple[str, int]] = {}  # sequence -> (stop reason, last step)
        self._active: list[int] = []  # the sequences in the batch, by row
        self._limit = 0
        self._kv_per_position = 0
        self._kv_pad_bytes = 0

    # ---- Generation's loop (`_run`), a batch's way ----------------------------------------------------------

    def _prompt(self) -> Iterator[Any]:
        """Every prompt checked before any hook is attached, left-padded to the longest: the (N, T) tokens and each
        row's pads (None when no row has any), and the most tokens a sequence may generate."""
        ids = []
        for prompt in self.settings.batch_prompts:
            ids.append(self._tokenize(prompt))
            self._records.append(self._tokenization)
        self._tokenization = self._records[0]
        longest = max(len(i) for i in ids)
        self._limit = limit = self._new_token_limit(longest)  # one cache for all rows: the longest bounds it
        self._pads = tuple(longest - len(i) for i in ids)
        pad_id = 0  # never attended, so any id in the vocabulary serves
        tokens = torch.tensor([[pad_id] * p + i for p, i in zip(self._pads, ids)], dtype=torch.long,
                              device=self.device)  # (N, T)
        yield BatchTokenized(tuple(self._records), self._pads)
        return (tokens, list(self._pads) if any(self._pads) else None), limit

    def _set_up_cache(self, prompt: tuple[torch.Tensor, list[int] | None], limit: int) -> None:
        tokens, _ = prompt
        self.model.setup_cache(tokens.shape[0], tokens.shape[1] + limit)
        self._kv_per_position = int(self.model.kv_bytes_per_position)
        self._kv_pad_bytes = sum(self._pads) * self._kv_per_position

    @staticmethod
    def _prompt_length(prompt: tuple[torch.Tensor, list[int] | None]) -> int:
        return prompt[0].shape[1]

    def _warm_up(self, prompt: tuple[torch.Tensor, list[int] | None]) -> None:
        tokens, pad = prompt
        try:
            with torch.no_grad():
                self._untraced.prefill(tokens, pad)
                self._untraced.decode(tokens[:, -1:])  # (N, 1)
        finally:
            self.model.reset_cache()
        if self._sync is not None:
            self._sync()

    def _request(self, batch: int = 1) -> Request:
        return replace(super()._request(len(self._records)), observed=False, sampler=self._samplers[0])

    def _steps_of(self, prompt: tuple[torch.Tensor, list[int] | None], rope: RopeRecord,
                  limit: int) -> Iterator[Any]:
        """The batched prefill, then a step of every active row until the last sequence finishes."""
        tokens, pad = prompt
        self._active = list(range(tokens.shape[0]))
        step = self._batch_step(PREFILL, 0, tokens, pad)
        yield PrefillDone(step, self._tracer.records(), rope, limit)
        index = 1
        while self._active:
            last = torch.tensor([[self._outputs[q][-1]] for q in self._active], dtype=torch.long,
                                device=self.device)  # (B', 1): each row's own last token
            step = self._batch_step(DECODE, index, last, None)
            yield TokenStep(step, sum(len(o) for o in self._outputs), limit * tokens.shape[0])
            index += 1
        self._stop_reason = self._last_reason()

    def _last_reason(self) -> str:
        """The batch ran until its last sequence finished: that one's reason (ties: the most common)."""
        last = max(step for _, step in self._ends.values())
        reasons = Counter(reason for reason, step in self._ends.values() if step == last)
        return reasons.most_common(1)[0][0]

    def _batch_step(self, phase: str, index: int, tokens: torch.Tensor, pad: list[int] | None) -> StepRecord:
        """One forward of every active row, each row's sample and text, then the finished rows leave the batch."""
        rows_in = len(self._active)
        logits, start, forward_end = self._forward(phase, index, tokens, pad)  # (B', V)
        if not bool(torch.isfinite(logits).any(dim=-1).all()) or bool(torch.isnan(logits).any()):
            raise CheckpointError(
                f"the model's logits at {phase} step {index} are not finite (NaN or all -inf); its weights or "
                "config hold invalid values (NaN weights, a zero RoPE base, a negative norm epsilon)")
        results = []
        for row, q in enumerate(self._active):
            previous = list(self._records[q].ids) + self._outputs[q]
            results.append(self._samplers[q].sample(logits[row], previous))
        sample_end = time.perf_counter_ns()
        texts = []
        for q, result in zip(self._active, results):
            token_id = int(result.token_id)
            self._outputs[q].append(token_id)
            texts.append(self._text_of(q, token_id))
        text_end = time.perf_counter_ns()
        eos = getattr(self.tokenizer, "eos_id", None)
        rows, keep = [], []
        for row, (q, result, text) in enumerate(zip(self._active, results, texts)):
            token_id = int(result.token_id)
            finished = ""
            if token_id == eos:
                finished = STOP_EOS
            elif len(self._outputs[q]) >= self._limit:
                finished = STOP_CONTEXT_FULL if self._limit < self.settings.max_new_tokens else STOP_MAX_NEW_TOKENS
            positions = len(self._records[q].ids) + len(self._outputs[q]) - 1  # in the cache after this forward
            held = positions if self.config.sliding_window is None else min(positions, self.config.sliding_window)
            rows.append(RowToken(
                sequence=q, row=row, token_id=token_id, piece=self._piece(token_id), text=text,
                probability=float(result.probability), context_length=positions,
                kv_live_bytes=held * self._kv_per_position, finished=finished))
            if finished:
                self._ends[q] = (finished, index)
            else:
                keep.append(row)
        kv_allocated, kv_live = int(self.model.kv_allocated_bytes), int(self._backend.kv_live_bytes())
        if keep and len(keep) < rows_in:
            self.model.keep_rows(keep)
        self._active = [self._active[row] for row in keep]
        compact_end = time.perf_counter_ns()
        record = StepRecord(
            phase=phase, step=index, input_tokens=int(tokens.numel()), context_length=int(self.model.pos),
            token_id=-1, piece="", text="", probability=0.0, greedy=self.settings.temperature == 0,
            filters=_active_filters(results[0]), candidates=(), sampling=None,
            kv_allocated_bytes=kv_allocated, kv_live_bytes=kv_live,
            start_ns=start - self.origin_ns, forward_ns=forward_end - start, sample_ns=sample_end - forward_end,
            detokenize_ns=text_end - sample_end, duration_ns=compact_end - start,
            batch=rows_in, rows=tuple(rows), compact_ns=compact_end - text_end,
        )
        self._steps.append(record)
        return record

    def _text_of(self, sequence: int, token_id: int) -> str:
        stream = self._streams[sequence]
        if stream is None:
            stream = self._streams[sequence] = TextStream(self.tokenizer, getattr(self.tokenizer, "eos_id", None))
        return stream.add(token_id)

    def trace(self) -> Trace:
        """The trace so far: the first sequence's tokens at the top level (as a batch-1 reader expects) and every
        sequence in `batch`."""
        self._generated = self._outputs[0]
        self._stream = self._streams[0]
        base = super().trace()
        sequences = []
        for q, record in enumerate(self._records):
            stream = self._streams[q]
            reason, last = self._ends.get(q, (STOP_INTERRUPTED, len(self._steps) - 1))
            positions = len(record.ids) + max(len(self._outputs[q]) - 1, 0)
            window = self.config.sliding_window
            sequences.append(SequenceRecord(
                index=q, tokenization=record, pad=self._pads[q] if self._pads else 0, seed=self._seeds[q]
                if self.settings.temperature > 0 else None,
                generated_ids=tuple(self._outputs[q]),
                generated_text=self.tokenizer.decode(stream.ids) if stream is not None else "",
                stop_reason=reason, last_step=last,
                kv_live_bytes=(positions if window is None else min(positions, window)) * self._kv_per_position,
            ))
        return replace(base, batch=BatchRun(
            sequences=tuple(sequences), padding=PADDING, finished_rows=FINISHED_ROWS,
            kv_bytes_per_position=self._kv_per_position, kv_pad_bytes=self._kv_pad_bytes))


def generation_for(loaded: LoadedModelLike, settings: RunSettings) -> Generation:
    """The generation `settings` asks for: batched when it lists batch prompts (--batch), else the one-sequence run."""
    return BatchGeneration(loaded, settings) if settings.batch_prompts else Generation(loaded, settings)
