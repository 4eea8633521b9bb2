"""Count a prompt's tokens with the model's own tokenizer, loading nothing but the tokenizer (no torch, no weights).

The tokenizers are the ones `llmtrace run` uses: llmtrace.tracer.checkpoint.tokenizer.load_tokenizer for an HF folder (tokenizer.json,
else tokenizer.model) and llmtrace.tracer.checkpoint.gguf_tokenizer for the vocabulary in a GGUF header. A preset has no tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrace.tracer.checkpoint.resolve import GGUF, PRESET, ResolvedModel
from llmtrace.tracer.core.errors import BadArgumentError


@dataclass(frozen=True, slots=True)
class PromptTokens:
    n_tokens: int  # with BOS where the model adds one
    tokenizer: str  # the file whose tokenizer counted them


def count_prompt_tokens(model: ResolvedModel, text: str) -> PromptTokens:
    """Tokens of `text` with the model's own tokenizer; resolve the model with vocabulary=True to spare a GGUF a
    second header read."""
    if model.kind == PRESET or model.source.path is None:
        raise BadArgumentError(
            f"model {model.config.name!r} is a preset and has no tokenizer to count --prompt with; "
            "give --prompt-len N instead, or a --model folder or .gguf file"
        )
    path = model.source.path
    if model.kind == GGUF:
        # Imported here: only --prompt needs a tokenizer, and building one costs more than the whole estimate.
        from llmtrace.tracer.checkpoint.gguf_header import ArraySummary, read_gguf_header
        from llmtrace.tracer.checkpoint.gguf_tokenizer import tokenizer_from_gguf

        header = model.gguf_header
        if header is None or any(isinstance(v, ArraySummary) for v in header.metadata.values()):
            header = read_gguf_header(path, decode_arrays=True)  # resolved without its vocabulary
        return PromptTokens(len(tokenizer_from_gguf(header).encode(text)), str(path))
    from llmtrace.tracer.checkpoint.tokenizer import load_tokenizer

    return PromptTokens(len(load_tokenizer(path).encode(text)), str(path))
