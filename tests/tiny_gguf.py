"""Tiny GGUF files for tests, written the way llama.cpp's convert_hf_to_gguf.py writes a LLaMA: llama.cpp tensor
names, Q/K rows permuted for its interleaved RoPE, matrices quantized by the `gguf` package, norms in F32, no
output.weight when the embedding is tied, and the SentencePiece vocabulary as tokens + scores + token types.

The permutation below is copied from llama.cpp's converter (`LlamaModel.permute`), not from tracer/, so the loader's
inverse is checked against an independent statement of the forward transform.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import gguf
import numpy as np
import torch

from llmtrace.tracer.core.config import ModelConfig

# Meta name suffix -> llama.cpp name, per layer (llama.cpp's tensor_mapping.py / llama-arch.cpp).
_LAYER = {
    "attention_norm.weight": "attn_norm.weight",
    "attention.wq.weight": "attn_q.weight",
    "attention.wk.weight": "attn_k.weight",
    "attention.wv.weight": "attn_v.weight",
    "attention.wo.weight": "attn_output.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
}
_TOP = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "output.weight": "output.weight"}


def llama_cpp_name(ours: str) -> str:
    if ours in _TOP:
        return _TOP[ours]
    _, index, rest = ours.split(".", 2)
    return f"blk.{index}.{_LAYER[rest]}"


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF's half-split rows -> llama.cpp's interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def sentencepiece_vocab(model_proto: bytes) -> dict[str, Any]:
    """tokens / scores / token types of a SentencePiece model, as llama.cpp's converter stores them."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        elif sp.is_unused(i):
            types.append(gguf.TokenType.UNUSED)
        else:
            types.append(gguf.TokenType.NORMAL)
    return {"tokens": tokens, "scores": scores, "types": types, "bos": sp.bos_id(), "eos": sp.eos_id(),
            "unk": sp.unk_id()}


def write_tiny_gguf(
    path: Path,
    config: ModelConfig,
    state_dict: Mapping[str, torch.Tensor],
    vocab: Mapping[str, Any] | None,
    matrix_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    arch: str = "llama",
    tokenizer_model: str = "llama",
    skip: tuple[str, ...] = (),
    chat_template: str | None = None,
) -> Path:
    """Write `state_dict` (our names, fp32, HF RoPE layout) as a llama.cpp-style GGUF; `skip` drops llama.cpp names."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.n_layers)
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.dim)
    writer.add_feed_forward_length(config.ffn_dim)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    if config.explicit_head_dim is not None:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if vocab is not None:
        writer.add_tokenizer_model(tokenizer_model)
        writer.add_token_list(vocab["tokens"])
        if "scores" in vocab:
            writer.add_token_scores(vocab["scores"])
        writer.add_token_types(vocab["types"])
        if "merges" in vocab:
            writer.add_token_merges(vocab["merges"])
        writer.add_bos_token_id(vocab["bos"])
        writer.add_eos_token_id(vocab["eos"])
        if "unk" in vocab:
            writer.add_unk_token_id(vocab["unk"])
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for ours, tensor in state_dict.items():
        name = llama_cpp_name(ours)
        if name in skip or (ours == "output.weight" and config.tie_embeddings):
            continue
        array = tensor.detach().to(torch.float32).numpy()
        if ours.endswith("attention.wq.weight"):
            array = llama_cpp_permute(array, config.n_heads, config.n_heads)
        elif ours.endswith("attention.wk.weight"):
            array = llama_cpp_permute(array, config.n_heads, config.n_kv_heads)
        if array.ndim == 1 or matrix_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, matrix_type), raw_dtype=matrix_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
