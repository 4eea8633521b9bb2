"""The GGUF loader: block decoders, the Q/K un-permutation, names, and whole tiny models written the way llama.cpp
writes them, checked against the same weights loaded from an HF folder and against the `gguf` package's decoders."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import pytest
import sentencepiece as spm
import torch
from tiny_gguf import llama_cpp_name, llama_cpp_permute, sentencepiece_vocab, write_tiny_gguf

from llmtrace.tracer.checkpoint.bundled import bundled_model_path
from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
from llmtrace.tracer.checkpoint.gguf_tokenizer import _pre_tokenizer
from llmtrace.tracer.checkpoint.resolve import config_from_gguf_header
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import gguf_to_ours as meta_name
from llmtrace.tracer.load.gguf_dequant import dequantize
from llmtrace.tracer.load.gguf_loader import load_gguf_weights, unpermute_rope_rows
from llmtrace.tracer.load.hf_loader import load_hf_state_dict
from llmtrace.tracer.load.loader import load_model

Q = gguf.GGMLQuantizationType
PROMPTS = ["今天天气真", "Hello world 😀!", "def add(a, b):\n    return a + b", "   three leading spaces",
           "The capital of France is", "The sky is blue."]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test converts afresh into its own cache folder (never the user's ~/.cache)."""
    monkeypatch.setenv("LLMTRACE_CACHE_DIR", str(tmp_path / "cache"))


def _fp16_bytes(value: float) -> list[int]:
    return list(np.array([value], dtype="<f2").view(np.uint8))


# ---- block decoders --------------------------------------------------------------------------------------------


def test_q4_1_block_by_hand() -> None:
    """block_q4_1 = fp16 d, fp16 m, 16 bytes; byte j holds element j (low nibble) and j + 16 (high); x = d*q + m."""
    quants = [(j & 0xF) | ((15 - j) << 4) for j in range(16)]
    block = np.array(_fp16_bytes(0.5) + _fp16_bytes(-1.0) + quants, dtype=np.uint8)
    expected = [0.5 * j - 1.0 for j in range(16)] + [0.5 * (15 - j) - 1.0 for j in range(16)]
    assert dequantize(block, 3, 32).tolist() == expected


def test_q4_0_and_q8_0_blocks_by_hand() -> None:
    q4 = np.array(_fp16_bytes(2.0) + [0x80 | 0x0F] + [0x88] * 15, dtype=np.uint8)  # q: 15, 8, ... ; hi: 8, 8, ...
    assert dequantize(q4, 2, 32).tolist() == [2.0 * (15 - 8)] + [0.0] * 15 + [0.0] * 16
    q8_values = list(range(-16, 16))
    q8 = np.array(_fp16_bytes(0.25) + [v & 0xFF for v in q8_values], dtype=np.uint8)
    assert dequantize(q8, 8, 32).tolist() == [0.25 * v for v in q8_values]


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_decoders_match_gguf_package_bit_for_bit(qtype: Q) -> None:
    values = np.random.default_rng(int(qtype)).standard_normal((8, 128)).astype(np.float32)
    raw = values if qtype == Q.F32 else gguf.quants.quantize(values, qtype)
    raw_bytes = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    reference = gguf.quants.dequantize(raw, qtype).reshape(-1)
    ours = dequantize(raw_bytes, int(qtype), 128)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, reference.astype(np.float32))


def test_decoders_match_gguf_package_on_the_bundled_file() -> None:
    path = bundled_model_path()
    header = read_gguf_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    wanted = {"token_embd.weight": "Q8_0", "blk.0.ffn_down.weight": "Q4_1", "blk.29.attn_q.weight": "Q4_1",
              "output_norm.weight": "F32"}
    for info in header.tensors:
        if info.name in wanted:
            assert info.type_name == wanted.pop(info.name)
            start = header.data_offset + info.offset
            raw = data[start:start + info.n_bytes]
            reference = gguf.quants.dequantize(raw, Q(info.ggml_type)).reshape(-1)
            np.testing.assert_array_equal(dequantize(raw, info.ggml_type, info.shape[0]), reference)
    assert not wanted


# ---- names and row order ---------------------------------------------------------------------------------------


def test_llama_cpp_names_map_to_meta_names() -> None:
    assert meta_name("token_embd.weight") == "tok_embeddings.weight"
    assert meta_name("output_norm.weight") == "norm.weight"
    assert meta_name("output.weight") == "output.weight"
    assert meta_name("blk.7.attn_q.weight") == "layers.7.attention.wq.weight"
    assert meta_name("blk.7.attn_output.weight") == "layers.7.attention.wo.weight"
    assert meta_name("blk.12.ffn_gate.weight") == "layers.12.feed_forward.w1.weight"
    assert meta_name("blk.12.ffn_up.weight") == "layers.12.feed_forward.w3.weight"
    assert meta_name("blk.12.ffn_down.weight") == "layers.12.feed_forward.w2.weight"
    assert meta_name("blk.0.attn_norm.weight") == "layers.0.attention_norm.weight"
    assert meta_name("blk.0.ffn_norm.weight") == "layers.0.ffn_norm.weight"
    assert meta_name("blk.0.attn_qkv.weight") is None  # fused QKV belongs to other architectures
    assert meta_name("rope_freqs.weight") is None


@pytest.mark.parametrize(("n_heads", "n_kv_heads", "head_dim"), [(4, 4, 8), (9, 3, 64), (8, 2, 16)])
def test_unpermute_inverts_llama_cpp_permute(n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    rng = np.random.default_rng(0)
    wq = rng.standard_normal((n_heads * head_dim, 24)).astype(np.float32)
    wk = rng.standard_normal((n_kv_heads * head_dim, 24)).astype(np.float32)
    permuted_q = llama_cpp_permute(wq, n_heads, n_heads)
    permuted_k = llama_cpp_permute(wk, n_heads, n_kv_heads)
    assert not np.array_equal(permuted_q, wq)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted_q, n_heads), wq)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted_k, n_kv_heads), wk)


def test_unpermute_row_order_by_hand() -> None:
    """One head of D = 4: llama.cpp stores rows (0, 2, 1, 3) of HF's (x0, x1 | x2, x3) halves as pairs."""
    hf_rows = np.arange(4, dtype=np.float32).reshape(4, 1)
    gguf_rows = np.array([[0.0], [2.0], [1.0], [3.0]], dtype=np.float32)
    np.testing.assert_array_equal(llama_cpp_permute(hf_rows, 1, 1), gguf_rows)
    np.testing.assert_array_equal(unpermute_rope_rows(gguf_rows, 1), hf_rows)


# ---- whole tiny models -----------------------------------------------------------------------------------------

TINY_VARIANTS = {
    "gguf-gqa": {},  # 4 heads over 2 KV heads, untied
    "gguf-tied": {"tie": True, "n_kv_heads": 4},
    "gguf-headdim": {"head_dim": 32, "n_kv_heads": 1},  # q_dim 128 != dim 64
}


@pytest.fixture(scope="module")
def tiny_gguf_pair(make_tiny_llama: Callable[..., Path], sp_model_bytes: bytes,
                   tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    """variant -> (HF folder, the same weights as an F32 GGUF written llama.cpp's way)."""
    made: dict[str, tuple[Path, Path]] = {}

    def make(variant: str) -> tuple[Path, Path]:
        if variant not in made:
            folder = make_tiny_llama(variant, seed=3, **TINY_VARIANTS[variant])
            config = ModelConfig.from_hf_json(folder)
            state = load_hf_state_dict(folder, config)
            path = tmp_path_factory.mktemp(variant) / "tiny.gguf"
            write_tiny_gguf(path, config, state, sentencepiece_vocab(sp_model_bytes))
            made[variant] = (folder, path)
        return made[variant]

    return make


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_tiny_gguf_logits_equal_the_hf_folder(variant: str, tiny_gguf_pair: Callable[[str], tuple[Path, Path]]) -> None:
    """Same fp32 weights, once through safetensors and once through GGUF's names and permuted Q/K rows."""
    folder, path = tiny_gguf_pair(variant)
    from_folder = load_model(str(folder), use_cache=False)
    from_gguf = load_model(str(path), use_cache=False)
    assert from_gguf.config.tie_embeddings == from_folder.config.tie_embeddings
    assert from_gguf.config.head_dim == from_folder.config.head_dim
    assert from_gguf.weight_format == "GGUF F32 -> fp32"
    tokens = torch.tensor([from_folder.tokenizer.encode("The capital of France is a city")])
    with torch.no_grad():
        expected = from_folder.model(tokens)
        got = from_gguf.model(tokens)
    assert (got - expected).abs().max().item() < 1e-5
    if from_gguf.config.tie_embeddings:
        assert from_gguf.model.output.weight is from_gguf.model.tok_embeddings.weight


def test_tiny_gguf_sentencepiece_tokenizer_matches_sentencepiece(
    tiny_gguf_pair: Callable[[str], tuple[Path, Path]], sp_model_bytes: bytes
) -> None:
    """The tokenizer rebuilt from a 'llama' GGUF vocabulary encodes as the original tokenizer.model does."""
    _, path = tiny_gguf_pair("gguf-gqa")
    tokenizer = load_model(str(path), dry_run=True).tokenizer
    reference = spm.SentencePieceProcessor(model_proto=sp_model_bytes)
    assert tokenizer.bos_id == reference.bos_id() == 1 and tokenizer.eos_id == reference.eos_id() == 2
    assert tokenizer.add_bos
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_bos=False)
        assert ids == reference.encode(prompt), prompt
        assert tokenizer.decode(ids) == prompt
        assert tokenizer.encode(prompt)[0] == 1


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_1, Q.Q5_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_quantized_tiny_gguf_equals_gguf_package_dequantization(
    qtype: Q, make_tiny_llama: Callable[..., Path], sp_model_bytes: bytes, tmp_path: Path
) -> None:
    """Every tensor equals gguf.GGUFReader + gguf.quants.dequantize of the file, with Q/K rows un-permuted."""
    folder = make_tiny_llama("gguf-gqa", seed=3, **TINY_VARIANTS["gguf-gqa"])
    config = ModelConfig.from_hf_json(folder)
    source = load_hf_state_dict(folder, config)
    path = write_tiny_gguf(tmp_path / "q.gguf", config, source, sentencepiece_vocab(sp_model_bytes), matrix_type=qtype)
    header = read_gguf_header(path)
    weights = load_gguf_weights(header, config_from_gguf_header(header))
    assert weights.quantization == qtype.name
    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    for ours, tensor in weights.state_dict.items():
        info = by_name[llama_cpp_name(ours)]
        reference = gguf.quants.dequantize(info.data, info.tensor_type).reshape(tensor.shape)
        if ours.endswith("attention.wq.weight"):
            reference = unpermute_rope_rows(reference, config.n_heads)
        elif ours.endswith("attention.wk.weight"):
            reference = unpermute_rope_rows(reference, config.n_kv_heads)
        np.testing.assert_array_equal(tensor.numpy(), reference, err_msg=ours)
        # and close to the original weights: quantization error only (Q4: 15 levels across each block's range)
        tolerance = {Q.Q8_0: 0.01, Q.Q5_0: 0.06, Q.Q5_1: 0.04, Q.Q4_0: 0.12, Q.Q4_1: 0.08, Q.F16: 1e-3,
                     Q.BF16: 4e-3}[qtype]
        assert (tensor - source[ours]).abs().max().item() < tolerance, ours


# ---- byte-level BPE pre-tokenization ---------------------------------------------------------------------------


def _pieces(pre: str | None, text: str) -> list[str]:
    return [piece for piece, _ in _pre_tokenizer(pre, "test").pre_tokenize_str(text)]


def test_pre_tokenizer_rules_by_hand() -> None:
    """llama.cpp's regexes applied by hand to 'abc 12345': smollm splits every digit; llama-bpe takes 3 at a time."""
    assert _pieces("smollm", "abc 12345") == ["abc", "Ġ", "1", "2", "3", "4", "5"]
    assert _pieces("llama-bpe", "abc 12345") == ["abc", "Ġ", "123", "45"]
    assert _pieces("gpt-2", "abc 12345") == ["abc", "Ġ12345"]
    assert _pieces(None, "it's") == ["it", "'s"]
