"""The checks of `--batch` and `--batch-sweep` that need no model, without torch: `run` refuses a bad list of batch
sizes or a batch that cannot combine with its other options before torch is imported."""

from __future__ import annotations

from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.trace.records import RunSettings

MAX_BATCH = 4096


def parse_batches(text: str, option: str = "--batch-sweep") -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8); a one-line BadArgumentError for anything else."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or not all(parts):
        raise BadArgumentError(f"{option} takes batch sizes separated by commas, e.g. 1,2,4,8; got {text!r}")
    try:
        batches = tuple(int(part) for part in parts)
    except ValueError:
        raise BadArgumentError(f"{option} takes whole numbers separated by commas, e.g. 1,2,4,8; got {text!r}") \
            from None
    if min(batches) < 1 or max(batches) > MAX_BATCH or list(batches) != sorted(set(batches)):
        raise BadArgumentError(f"{option} takes increasing batch sizes from 1 to {MAX_BATCH}, e.g. 1,2,4,8; "
                               f"got {text!r}")
    return batches


def check_batch_settings(settings: RunSettings) -> None:
    """What --batch cannot be combined with, and a prompt list that does not match N (BadArgumentError)."""
    n = settings.batch
    if n < 1:
        raise BadArgumentError(f"--batch must be at least 1, got {n}")
    if len(settings.batch_prompts) != n:
        raise BadArgumentError(f"--batch {n} needs {n} prompts, got {len(settings.batch_prompts)}")
    for flag, on in (("--dry-run", settings.dry_run), ("--no-kv-cache", settings.no_kv_cache),
                     ("--lens", settings.lens), ("--attention", settings.attention)):
        if on:
            raise BadArgumentError(f"--batch does not combine with {flag} (it follows one sequence); drop one of them")
