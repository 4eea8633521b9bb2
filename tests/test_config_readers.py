"""Reading configs and checkpoint headers without weights: safetensors (single and sharded), GGUF, config.json;
and what each says when the file is truncated, malformed or incomplete."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Callable

import pytest

from llmtrace.tracer.analytic.params import count_params
from llmtrace.tracer.checkpoint.bundled import bundled_model_path
from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
from llmtrace.tracer.checkpoint.prompt_tokens import count_prompt_tokens
from llmtrace.tracer.checkpoint.resolve import resolve_model
from llmtrace.tracer.checkpoint.safetensors_header import read_safetensors_checkpoint, read_safetensors_header
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.core.errors import (
    ConfigError,
    FileFormatError,
    LlmtraceError,
    UnknownPresetError,
    UnsupportedModelError,
)

# ---- safetensors -------------------------------------------------------------------------------------------------


def _numel_by_safe_open(files: list[Path]) -> int:
    """The independent count: the safetensors library itself opens each file and reports every tensor's shape."""
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


@pytest.mark.parametrize("shards", [1, 3])
def test_safetensors_param_count_matches_library_and_config(make_tiny_llama: Callable[..., Path], shards: int) -> None:
    folder = make_tiny_llama(f"readers-{shards}", shards=shards)
    ckpt = read_safetensors_checkpoint(folder)
    files = sorted(folder.glob("*.safetensors"))
    assert len(ckpt.files) == len(files) == shards
    assert ckpt.n_params == _numel_by_safe_open(files)
    resolved = resolve_model(str(folder))
    assert resolved.kind == "hf" and resolved.weights is not None
    assert resolved.weights.n_params == ckpt.n_params == count_params(resolved.config).total
    assert resolved.weights.main_dtype == "F32" and resolved.weights.llmtrace_dtype is FP32
    assert resolved.weights.total_bytes == 4 * ckpt.n_params


def test_tied_checkpoint_counts_embedding_once(make_tiny_llama: Callable[..., Path]) -> None:
    folder = make_tiny_llama("readers-tied", tie=True)
    resolved = resolve_model(str(folder))
    assert resolved.config.tie_embeddings
    assert resolved.weights is not None
    assert resolved.weights.n_params == count_params(resolved.config).total == _numel_by_safe_open(
        sorted(folder.glob("*.safetensors")))


def _write_safetensors(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "truncated"),
        (b"\x05\x00\x00", "truncated"),
        (struct.pack("<Q", 10_000) + b"{}", "truncated"),
        (struct.pack("<Q", 2**40), "corrupt"),
        (struct.pack("<Q", 4) + b"{{{{", "not valid JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    ],
)
def test_safetensors_header_broken(tmp_path: Path, content: bytes, message: str) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(content)
    with pytest.raises(FileFormatError, match=message):
        read_safetensors_header(file)


@pytest.mark.parametrize(
    ("entry", "data_len", "message"),
    [
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, 8, "truncated"),
        ({"dtype": "F99", "shape": [4], "data_offsets": [0, 16]}, 16, "unknown dtype"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}, 16, "needs 16"),
        ({"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}, 16, "malformed shape"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}, 16, "malformed data_offsets"),
    ],
)
def test_safetensors_entry_broken(tmp_path: Path, entry: dict, data_len: int, message: str) -> None:
    file = _write_safetensors(tmp_path / "w.safetensors", {"w": entry}, b"\0" * data_len)
    with pytest.raises(FileFormatError, match=message):
        read_safetensors_header(file)


def test_sharded_index_with_missing_shard(make_tiny_llama: Callable[..., Path], tmp_path: Path) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(make_tiny_llama("readers-2", shards=2), folder)
    next(iter(sorted(folder.glob("*.safetensors")))).unlink()
    with pytest.raises(FileFormatError, match="no such file"):
        resolve_model(str(folder))


def test_truncated_shard_in_a_model_folder(make_tiny_llama: Callable[..., Path], tmp_path: Path) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(make_tiny_llama("readers-1", shards=1), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(FileFormatError, match="truncated"):
        resolve_model(str(folder))


# ---- GGUF --------------------------------------------------------------------------------------------------------


def _gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _tiny_gguf_bytes(version: int = 3) -> bytes:
    """One string key and one 32-value F32 tensor, laid out per llama.cpp's gguf.md."""
    head = b"GGUF" + struct.pack("<IQQ", version, 1, 1)
    kv = _gguf_string("general.architecture") + struct.pack("<I", 8) + _gguf_string("llama")
    tensor = _gguf_string("w") + struct.pack("<I", 1) + struct.pack("<Q", 32) + struct.pack("<I", 0) + struct.pack("<Q", 0)
    body = head + kv + tensor
    body += b"\0" * (-len(body) % 32)
    return body + b"\0" * 128


def test_tiny_gguf_reads(tmp_path: Path) -> None:
    file = tmp_path / "ok.gguf"
    file.write_bytes(_tiny_gguf_bytes())
    header = read_gguf_header(file)
    assert header.metadata["general.architecture"] == "llama"
    assert [(t.name, t.shape, t.n_bytes) for t in header.tensors] == [("w", (32,), 128)]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:3], "truncated"),
        (lambda b: b"GGML" + b[4:], "not a GGUF file"),
        (lambda b: b[:4] + struct.pack("<I", 7) + b[8:], "version 7"),
        (lambda b: b[:30], "truncated"),  # cut inside the metadata key
        (lambda b: b[:-64], "past the end of the file"),  # tensor data cut short
        (lambda b: b[:8] + struct.pack("<Q", 10**9) + b[16:], "corrupt"),  # absurd tensor count
        (lambda b: b"", "empty"),
    ],
)
def test_gguf_header_broken(tmp_path: Path, mutate: Callable[[bytes], bytes], message: str) -> None:
    file = tmp_path / "bad.gguf"
    file.write_bytes(mutate(_tiny_gguf_bytes()))
    with pytest.raises(FileFormatError, match=message):
        read_gguf_header(file)


def test_gguf_without_llama_keys_lacks_fields(tmp_path: Path) -> None:
    file = tmp_path / "nofields.gguf"
    file.write_bytes(_tiny_gguf_bytes())
    with pytest.raises(ConfigError, match="llama.attention.head_count"):
        resolve_model(str(file))


def test_bundled_gguf_resolves_with_real_tensor_counts() -> None:
    import gguf  # independent reader (numpy-based), test-only here

    path = bundled_model_path()
    resolved = resolve_model(str(path))
    assert resolved.kind == "gguf" and resolved.weights is not None
    reader = gguf.GGUFReader(str(path))
    assert resolved.weights.n_params == sum(int(t.n_elements) for t in reader.tensors) == 134_515_008
    assert resolved.weights.total_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    shares = {s.dtype: s.tensors for s in resolved.weights.by_dtype}
    assert shares == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert resolved.weights.main_dtype == "Q4_1" and resolved.weights.llmtrace_dtype.name == "q4_1"
    assert resolved.config.tie_embeddings and count_params(resolved.config).total == 134_515_008


def test_prompt_tokens_from_the_gguf_vocabulary() -> None:
    resolved = resolve_model(str(bundled_model_path()))
    # SmolLM2's byte-level BPE: "Hello" and "Ġworld"; it adds no BOS.
    assert count_prompt_tokens(resolved, "Hello world").n_tokens == 2


def test_prompt_tokens_from_a_sentencepiece_folder(tiny_llama_dir: Path) -> None:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tiny_llama_dir / "tokenizer.model"))
    text = "The capital of France is"
    counted = count_prompt_tokens(resolve_model(str(tiny_llama_dir)), text)
    assert counted.n_tokens == 1 + len(sp.encode(text))  # LLaMA's tokenizer adds BOS


def test_prompt_tokens_need_a_tokenizer() -> None:
    with pytest.raises(LlmtraceError, match="--prompt-len"):
        count_prompt_tokens(resolve_model("llama-7b"), "hi")


# ---- config.json -------------------------------------------------------------------------------------------------

_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
}


def test_config_json_reads_llama_7b(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_LLAMA_CONFIG))
    resolved = resolve_model(str(tmp_path))
    assert resolved.weights is None  # a folder with a config and no weights still works
    assert count_params(resolved.config).total == 6_738_415_616
    assert resolved.config.n_kv_heads == 32  # no num_key_value_heads: plain multi-head attention


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"])
def test_config_json_missing_field(tmp_path: Path, field: str) -> None:
    data = {k: v for k, v in _LLAMA_CONFIG.items() if k != field}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=f"missing field '{field}'"):
        resolve_model(str(tmp_path / "config.json"))


def test_config_json_unreadable(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        resolve_model(str(tmp_path))


def test_config_json_not_llama(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**_LLAMA_CONFIG, "architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="not LLaMA-family"):
        resolve_model(str(tmp_path))


def test_missing_paths_and_unknown_presets(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file or folder"):
        resolve_model(str(tmp_path / "nothing" / "config.json"))
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_model(str(tmp_path))  # an empty folder
    with pytest.raises(UnknownPresetError, match="did you mean llama-7b"):
        resolve_model("llama-7c")


def test_head_dim_from_config(tmp_path: Path) -> None:
    cfg = ModelConfig.from_hf_dict({**_LLAMA_CONFIG, "head_dim": 64, "num_key_value_heads": 8})
    assert (cfg.head_dim, cfg.q_dim, cfg.kv_dim) == (64, 2048, 512)
