"""A run's prompt as token ids, with the record of how they were made (TokenizationRecord)."""

from __future__ import annotations

import time
from typing import Any, Callable

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.errors import BadArgumentError, CheckpointError
from llmtrace.tracer.trace.records import RunSettings, TokenizationRecord


def prompt_ids(tokenizer: Any, config: ModelConfig, settings: RunSettings, prompt: str, origin_ns: int,
               check_length: Callable[[int], object]) -> tuple[list[int], TokenizationRecord | None]:
    """The ids of `prompt` and their record (times from `origin_ns`). Without a tokenizer (a dry run of a preset:
    anything else is refused) `settings.prompt_tokens` zeros, or one per character, and no record; `check_length`
    refuses a length past the context before a list of it is made."""
    if tokenizer is None:
        if not settings.dry_run:
            raise BadArgumentError("this model has no tokenizer; pass a model folder or .gguf with one")
        count = settings.prompt_tokens or max(1, len(prompt))
        check_length(count)
        return [0] * count, None
    start = time.perf_counter_ns()
    text = prompt
    if settings.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise BadArgumentError("this model has no chat template; run without --chat")
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = list(tokenizer.encode(text))
    pieces = tuple(tokenizer.piece(i) for i in ids)
    end = time.perf_counter_ns()
    if not ids:
        raise BadArgumentError("the prompt is empty after tokenization; give some text")
    outside = [i for i in ids if not 0 <= i < config.vocab_size]
    if outside:
        raise CheckpointError(
            f"the tokenizer gave token id {outside[0]}, outside the model's vocabulary of "
            f"{config.vocab_size}; the tokenizer (its bos/eos ids) does not belong to these weights")
    record = TokenizationRecord(
        text=prompt, model_text=text, pieces=pieces, ids=tuple(ids),
        add_bos=bool(ids and ids[0] == getattr(tokenizer, "bos_id", None)),
        start_ns=start - origin_ns, duration_ns=end - start,
    )
    return ids, record
