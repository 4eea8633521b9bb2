"""The records of a batched run (`llmtrace run --batch N`): one per sequence, and how the batch was formed.

The steps of a batched run are ordinary StepRecords with `batch` and `rows` (tracer/trace/records.py), and its stage
records have shapes [N, ...]; these records hold what belongs to each sequence over the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrace.tracer.trace.records import TokenizationRecord

# How prompts of different lengths share one prefill, and what a decode step does with a finished sequence.
PADDING = "left"  # left padding, per-row positions counted from each row's first real token, pad keys masked
FINISHED_ROWS = "compact"  # a finished sequence leaves the batch: its KV row is dropped, later steps run without it


@dataclass(frozen=True, slots=True)
class SequenceRecord:
    """One sequence of a batched run, from its prompt to its last token."""

    index: int  # 0 = the first prompt
    tokenization: TokenizationRecord
    pad: int  # left pads before its prompt in the batched prefill (the longest prompt has none)
    seed: int | None  # its sampler's seed (the run's seed + index); None under greedy
    generated_ids: tuple[int, ...]
    generated_text: str
    stop_reason: str  # eos, max_new_tokens, context_full, or interrupted
    last_step: int  # the step that gave its last token (0 = the prefill)
    kv_live_bytes: int  # K and V of its own positions at its end, all layers (pads not counted)


@dataclass(frozen=True, slots=True)
class BatchRun:
    """A batched run: its sequences and how the batch was run."""

    sequences: tuple[SequenceRecord, ...]
    padding: str  # PADDING
    finished_rows: str  # FINISHED_ROWS
    kv_bytes_per_position: int  # K and V of one position of one sequence, all layers
    kv_pad_bytes: int  # K and V the prefill wrote for pads (all rows, all layers): held, never read

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.generated_ids) for s in self.sequences)

    @property
    def prompt_tokens(self) -> int:
        """Real prompt tokens of all sequences (pads not counted)."""
        return sum(len(s.tokenization.ids) for s in self.sequences)
