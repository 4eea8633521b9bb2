"""Property-based tests (hypothesis) of the readers of outside data: random bytes, random truncations and random
type swaps give a parsed value or one typed, one-line LlmtraceError, never another exception, a hang or a leftover
file (issue 10). In process and bounded (max_examples, small inputs), so the suite stays fast."""

from __future__ import annotations

import json
import math
import signal
import struct
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
from llmtrace.tracer.checkpoint.safetensors_header import read_safetensors_header
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.errors import LlmtraceError

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


def _only_typed_errors(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except LlmtraceError as exc:
        assert "\n" not in str(exc) and str(exc)


@pytest.fixture(scope="module")
def real_gguf(tmp_path_factory: pytest.TempPathFactory, make_tiny_llama: Callable[..., Path],
              sp_model_bytes: bytes) -> bytes:
    from tiny_gguf import sentencepiece_vocab, write_tiny_gguf

    from llmtrace.tracer.load.hf_loader import load_hf_state_dict

    folder = make_tiny_llama("fuzz-gguf")
    config = ModelConfig.from_hf_json(folder)
    path = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    write_tiny_gguf(path, config, load_hf_state_dict(folder, config), vocab=sentencepiece_vocab(sp_model_bytes))
    return path.read_bytes()


@FUZZ
@given(cut=st.integers(min_value=0), flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)),
                                                    max_size=6), decode=st.booleans())
def test_gguf_header_truncated_or_corrupted(real_gguf: bytes, tmp_path: Path, cut: int,
                                            flips: list[tuple[int, int]], decode: bool) -> None:
    data = bytearray(real_gguf[: cut % (len(real_gguf) + 1)])
    header_end = min(len(data), 40_000)  # the metadata and descriptors live at the start
    for at, value in flips:
        if header_end:
            data[at % header_end] = value
    path = tmp_path / "f.gguf"
    path.write_bytes(bytes(data))
    _only_typed_errors(lambda: read_gguf_header(path, decode_arrays=decode))


@FUZZ
@given(raw=st.binary(max_size=256))
def test_gguf_header_random_bytes(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "r.gguf"
    path.write_bytes(b"GGUF" + raw)
    _only_typed_errors(lambda: read_gguf_header(path, decode_arrays=True))


@FUZZ
@given(header=json_values, tail=st.binary(max_size=64))
def test_safetensors_header_any_json(tmp_path: Path, header: Any, tail: bytes) -> None:
    raw = json.dumps(header).encode()
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + tail)
    _only_typed_errors(lambda: read_safetensors_header(path))


@FUZZ
@given(raw=st.binary(max_size=128))
def test_safetensors_header_random_bytes(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(raw)
    _only_typed_errors(lambda: read_safetensors_header(path))


HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256, "head_dim": 16,
             "tie_word_embeddings": False}


@FUZZ
@given(key=st.sampled_from(sorted(HF_CONFIG)), value=json_values)
def test_config_json_any_value_in_any_field(tmp_path: Path, key: str, value: Any) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**HF_CONFIG, key: value}))

    def read() -> None:
        config = ModelConfig.from_hf_json(path)
        assert config.n_heads > 0 and math.isfinite(config.rope_theta) and config.rope_theta > 0

    _only_typed_errors(read)


@FUZZ
@given(key=st.sampled_from(["llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
                            "llama.attention.head_count", "llama.attention.head_count_kv", "llama.context_length",
                            "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon", "llama.vocab_size",
                            "llama.attention.key_length", "llama.rope.scaling.factor"]),
       value=json_values)
def test_gguf_metadata_any_value_in_any_field(key: str, value: Any) -> None:
    meta = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
            "llama.feed_forward_length": 96, "llama.attention.head_count": 4, "llama.context_length": 256,
            "llama.vocab_size": 100, key: value}
    _only_typed_errors(lambda: ModelConfig.from_gguf_metadata(meta, "m", "m.gguf"))


def test_a_stop_signal_during_the_final_write_waits_for_it() -> None:
    """A second Ctrl-C while the outputs are written: held until the block ends, then raised."""
    import os

    from llmtrace.cli.interrupts import Received, deferred_interrupts

    received = Received()
    finished = False
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts(received):
            os.kill(os.getpid(), signal.SIGTERM)
            finished = True  # reached: the signal did not cut the block
    assert finished and received.exit_code == 128 + signal.SIGTERM
