"""Streaming detokenization: the text each generated token adds, in time independent of how long the output is."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Decodes a short window of ids per token instead of everything so far (HF's TextStreamer and vLLM do the
    same): the new text is decode(ids[prefix:]) minus decode(ids[prefix:read]), where `read` is where the last
    emitted text ended and `prefix` one emission earlier, so the window always starts with context a tokenizer
    needs (SentencePiece drops the space of a window's first piece in both halves alike). A token that ends inside
    a multi-byte character adds nothing until the character is complete."""

    def __init__(self, tokenizer: Any, skip_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_id = skip_id  # EOS: generated, never shown
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        """The text `token_id` completes ("" while a character is still incomplete, or for the skipped id)."""
        if token_id == self.skip_id:
            return ""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        after = self.tokenizer.decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before):]
