"""Streaming detokenization: the pieces the stream emits join into the full decode, whatever the tokenizer, and
each step decodes a short window however long the output grows."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtrace.tracer.checkpoint.bundled import bundled_model_path
from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
from llmtrace.tracer.checkpoint.gguf_tokenizer import tokenizer_from_gguf
from llmtrace.tracer.checkpoint.tokenizer import load_tokenizer
from llmtrace.tracer.run.detokenize import TextStream

TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower.",
    "今天天气真好，我们去公园散步吧。",
    "emoji 🙂👍 and accents: café, naïve, Zürich",
    "def add(a, b):\n    return a + b  # two spaces, a tab\tand a newline\n",
]


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids: list[int]) -> str:
        self.sizes.append(len(ids))
        return self.inner.decode(ids)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def bundled_tokenizer() -> object:
    return tokenizer_from_gguf(read_gguf_header(bundled_model_path(), decode_arrays=True))


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tiny_llama_dir: Path) -> object:
    return load_tokenizer(tiny_llama_dir)


@pytest.mark.parametrize("which", ["bundled_tokenizer", "sentencepiece_tokenizer"])
@pytest.mark.parametrize("text", TEXTS)
def test_the_pieces_join_into_the_full_decode(which: str, text: str, request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue(which)
    ids = list(tokenizer.encode(text))
    ids = ids[1:] if ids and ids[0] == getattr(tokenizer, "bos_id", None) else ids
    counting = CountingTokenizer(tokenizer)
    stream = TextStream(counting, skip_id=getattr(tokenizer, "eos_id", None))
    pieces = [stream.add(i) for i in ids]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # a character split over tokens comes out whole
    assert max(counting.sizes) <= 8  # a window, never the whole output


def test_the_end_of_sequence_id_adds_nothing(bundled_tokenizer: object) -> None:
    eos = bundled_tokenizer.eos_id  # type: ignore[attr-defined]
    stream = TextStream(bundled_tokenizer, skip_id=eos)
    ids = list(bundled_tokenizer.encode("Paris"))  # type: ignore[attr-defined]
    assert "".join(stream.add(i) for i in [*ids, eos]) == "Paris"
    assert stream.ids == ids
