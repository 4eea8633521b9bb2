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

Q = gguf.GGMLQuantizationType

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
    "attention.wq.bias": "attn_q.bias",
    "attention.wk.bias": "attn_k.bias",
    "attention.wv.bias": "attn_v.bias",
    "attention.wo.bias": "attn_output.bias",
    "attention.qk_norm.q_weight": "attn_q_norm.weight",  # Qwen3 (llama-arch.cpp LLM_TENSOR_ATTN_Q_NORM)
    "attention.qk_norm.k_weight": "attn_k_norm.weight",
    "feed_forward.router.weight": "ffn_gate_inp.weight",  # a mixture of experts' router (LLM_TENSOR_FFN_GATE_INP)
    # Qwen2-MoE's shared expert (LLM_TENSOR_FFN_*_SHEXP) and its gate (LLM_TENSOR_FFN_GATE_INP_SHEXP, {n_embd})
    "feed_forward.shared_w1.weight": "ffn_gate_shexp.weight",
    "feed_forward.shared_w3.weight": "ffn_up_shexp.weight",
    "feed_forward.shared_w2.weight": "ffn_down_shexp.weight",
    "feed_forward.shared_gate.weight": "ffn_gate_inp_shexp.weight",
    "post_attention_norm.weight": "post_attention_norm.weight",  # Gemma (LLM_TENSOR_ATTN_POST_NORM)
    "post_ffn_norm.weight": "post_ffw_norm.weight",  # Gemma (LLM_TENSOR_FFN_POST_NORM)
}
# A mixture of experts' stacked expert matrices (E, out, in): llama.cpp's 3-D ffn_*_exps tensors
_EXPERTS = {"feed_forward.w1.weight": "ffn_gate_exps.weight", "feed_forward.w3.weight": "ffn_up_exps.weight",
            "feed_forward.w2.weight": "ffn_down_exps.weight"}
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


# Block layouts of ggml-common.h (QK_K = 256, K_SCALE_SIZE = 12), field by field in storage order. "f16" is an fp16
# scale, "e8m0" MXFP4's power-of-two scale, "ue4m3" NVFP4's unsigned fp8 scales; "u8"/"i8"/"u16" are quant bits.
_F16, _U8, _I8, _U16, _E8M0, _UE4M3 = "f16", "u8", "i8", "u16", "e8m0", "ue4m3"
BLOCK_LAYOUTS: dict[gguf.GGMLQuantizationType, tuple[tuple[str, str, int], ...]] = {
    Q.Q4_0: (("d", _F16, 1), ("qs", _U8, 16)),
    Q.Q4_1: (("d", _F16, 1), ("m", _F16, 1), ("qs", _U8, 16)),
    Q.Q5_0: (("d", _F16, 1), ("qh", _U8, 4), ("qs", _U8, 16)),
    Q.Q5_1: (("d", _F16, 1), ("m", _F16, 1), ("qh", _U8, 4), ("qs", _U8, 16)),
    Q.Q8_0: (("d", _F16, 1), ("qs", _I8, 32)),
    Q.Q2_K: (("scales", _U8, 16), ("qs", _U8, 64), ("d", _F16, 1), ("dmin", _F16, 1)),
    Q.Q3_K: (("hmask", _U8, 32), ("qs", _U8, 64), ("scales", _U8, 12), ("d", _F16, 1)),
    Q.Q4_K: (("d", _F16, 1), ("dmin", _F16, 1), ("scales", _U8, 12), ("qs", _U8, 128)),
    Q.Q5_K: (("d", _F16, 1), ("dmin", _F16, 1), ("scales", _U8, 12), ("qh", _U8, 32), ("qs", _U8, 128)),
    Q.Q6_K: (("ql", _U8, 128), ("qh", _U8, 64), ("scales", _I8, 16), ("d", _F16, 1)),
    Q.IQ2_XXS: (("d", _F16, 1), ("qs", _U16, 32)),
    Q.IQ2_XS: (("d", _F16, 1), ("qs", _U16, 32), ("scales", _U8, 8)),
    Q.IQ2_S: (("d", _F16, 1), ("qs", _U8, 64), ("qh", _U8, 8), ("scales", _U8, 8)),
    Q.IQ3_XXS: (("d", _F16, 1), ("qs", _U8, 96)),
    Q.IQ3_S: (("d", _F16, 1), ("qs", _U8, 64), ("qh", _U8, 8), ("signs", _U8, 32), ("scales", _U8, 4)),
    Q.IQ1_S: (("d", _F16, 1), ("qs", _U8, 32), ("qh", _U16, 8)),
    # IQ1_M has no separate scale: its fp16 scale is the top 4 bits of each of the four u16 `scales`.
    Q.IQ1_M: (("qs", _U8, 32), ("qh", _U8, 16), ("scales", _U16, 4)),
    Q.IQ4_NL: (("d", _F16, 1), ("qs", _U8, 16)),
    Q.IQ4_XS: (("d", _F16, 1), ("scales_h", _U16, 1), ("scales_l", _U8, 4), ("qs", _U8, 128)),
    Q.TQ1_0: (("qs", _U8, 48), ("qh", _U8, 4), ("d", _F16, 1)),
    Q.TQ2_0: (("qs", _U8, 64), ("d", _F16, 1)),
    Q.MXFP4: (("e", _E8M0, 1), ("qs", _U8, 16)),
    Q.NVFP4: (("d", _UE4M3, 4), ("qs", _U8, 32)),
}
_NUMPY = {_F16: "<f2", _U8: "u1", _I8: "i1", _U16: "<u2", _E8M0: "u1", _UE4M3: "u1"}


def block_dtype(qtype: gguf.GGMLQuantizationType) -> np.dtype:
    """One block of `qtype` as a numpy structured dtype (packed, little-endian), per ggml-common.h."""
    return np.dtype([(name, _NUMPY[kind], (count,)) for name, kind, count in BLOCK_LAYOUTS[qtype]])


def random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """rows x cols values of `qtype` as raw blocks (uint8, rows x bytes per row): random quant bits, and scales
    small and finite (fp16 in [0.002, 0.02]; power-of-two and fp8 scales of similar size), so every value decodes
    to a finite weight a model can run on."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    blocks = np.frombuffer(rng.integers(0, 256, n_blocks * block_bytes, dtype=np.uint8).tobytes(),
                           dtype=block_dtype(qtype)).copy()
    for name, kind, count in BLOCK_LAYOUTS[qtype]:
        if kind == _F16:
            blocks[name] = rng.uniform(0.002, 0.02, (n_blocks, count)).astype("<f2")
        elif kind == _E8M0:
            blocks[name] = rng.integers(118, 124, (n_blocks, count))  # 2^-9 .. 2^-4
        elif kind == _UE4M3:
            blocks[name] = rng.integers(8, 48, (n_blocks, count))  # exponents 1-5: 2^-6 .. 2^-1, never 0x7F
    if qtype == Q.IQ1_M:
        scale = rng.uniform(0.002, 0.02, n_blocks).astype("<f2").view("<u2")
        low_bits = blocks["scales"] & 0x0FFF
        for i in range(4):  # nibble i of the fp16 scale sits in the top 4 bits of scales[i]
            low_bits[:, i] |= ((scale >> (4 * i)) & 0xF) << 12
        blocks["scales"] = low_bits
    return blocks.view(np.uint8).reshape(rows, cols // block * block_bytes)


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
    raw_blocks: Mapping[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
    extra_metadata: Mapping[str, int | float | str] | None = None,
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write `state_dict` (our names, fp32, HF RoPE layout) as a llama.cpp-style GGUF; `skip` drops llama.cpp names.

    `raw_blocks` maps llama.cpp names to blocks already in the file's layout (Q/K rows as llama.cpp orders them),
    written as they are in place of the state dict's tensor: how the tests store types gguf cannot quantize.
    `extra_tensors` maps llama.cpp names to fp32 tensors written after the state dict's, as its matrices and vectors
    are: how a test stores a converter's packed tensors (Phi-3's attn_qkv) beside `skip`ped members.
    """
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.n_layers)
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.dim)
    writer.add_feed_forward_length(config.ffn_dim)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_rope_dimension_count(config.rotary_dim)  # n_rot: a partial rotary's R (Phi-4-mini)
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
        if "pre" in vocab:
            writer.add_tokenizer_pre(vocab["pre"])
        writer.add_bos_token_id(vocab["bos"])
        writer.add_eos_token_id(vocab["eos"])
        if "unk" in vocab:
            writer.add_unk_token_id(vocab["unk"])
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for key, value in (extra_metadata or {}).items():  # whole numbers as uint32, others as float32 or a string
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    named = [(llama_cpp_name(ours), ours, tensor) for ours, tensor in state_dict.items()]
    named += [(name, name, tensor) for name, tensor in (extra_tensors or {}).items()]
    for name, ours, tensor in named:
        if tensor.dim() == 3:  # one expert matrix per row of the first axis
            name = f"blk.{ours.split('.')[1]}.{_EXPERTS[ours.split('.', 2)[2]]}"
        if name in skip or (ours == "output.weight" and config.tie_embeddings):
            continue
        if raw_blocks and name in raw_blocks:
            blocks, qtype = raw_blocks[name]
            writer.add_tensor(name, blocks, raw_dtype=qtype)
            continue
        array = tensor.detach().to(torch.float32).numpy()
        if arch != "llama":
            pass  # convert_hf_to_gguf permutes Q/K for LlamaModel only; Qwen2Model keeps HF's row order
        elif ours.endswith(("attention.wq.weight", "attention.wq.bias")):  # the converter permutes biases too
            array = llama_cpp_permute(array, config.n_heads, config.n_heads)
        elif ours.endswith(("attention.wk.weight", "attention.wk.bias")):
            array = llama_cpp_permute(array, config.n_heads, config.n_kv_heads)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            array = array.reshape(-1)  # llama.cpp declares it {n_embd}: one F32 vector
        if array.ndim == 1 or matrix_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, matrix_type), raw_dtype=matrix_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
