"""Random-weight GGUF files at the sizes users run (LLaMA 1B, 7B and 8B shapes), for benchmarks/bench_scale.py.

No weights can be downloaded here, so the files have the real models' shapes and llama.cpp's tensor types per
quantization mix, with random blocks (tests/tiny_gguf.random_blocks: random quant bits, small finite scales): every
byte count, every product's shape and every kernel's path is the real model's; only the text is nonsense.

- llama-1b: Llama 3.2 1B (dim 2048, 16 layers, 32 heads over 8 KV heads, FFN 8192, vocabulary 128,256, tied head);
- llama-7b: Llama 2 7B (dim 4096, 32 layers, 32 heads, FFN 11,008, vocabulary 32,000, untied);
- llama-8b: Llama 3 8B (dim 4096, 32 layers, 32 heads over 8 KV heads (GQA), FFN 14,336, vocabulary 128,256);
- llama-13b: Llama 2 13B (dim 5120, 40 layers, 40 heads, FFN 13,824, vocabulary 32,000, untied; Q4_0 7.4 GB).

Types per mix, as llama.cpp's llama-quant.cpp assigns them: Q4_0 (token embedding Q4_0, output Q6_K), Q8_0 (every
matrix Q8_0) and Q4_K_M (Q4_K, with attn_v and ffn_down Q6_K in the layers `use_more_bits` picks: the first and
last eighth and every third between; output Q6_K). Norms are F32 ones.

The vocabulary is a SentencePiece BPE model trained on sample_prompts/ (tests/tiny_llama.train_sentencepiece),
padded with unused tokens to the model's size, so llmtrace and llama.cpp both tokenize the prompts for real.

Files are written tensor by tensor (gguf's GGUFWriter with add_tensor_info + write_tensor_data: one tensor in
memory at a time) to NAME.part, renamed when complete, and reused when present.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Shape:
    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab: int
    rope_theta: float
    tied: bool
    context: int
    experts: int = 0  # a mixture of experts (Mixtral's 'llama' layout): E experts of FFN ffn_dim each, 0: dense
    experts_per_token: int = 0


SHAPES = {
    "llama-1b": Shape("llama-1b", 2048, 16, 32, 8, 8192, 128256, 500000.0, True, 8192),
    "llama-7b": Shape("llama-7b", 4096, 32, 32, 32, 11008, 32000, 10000.0, False, 4096),
    "llama-8b": Shape("llama-8b", 4096, 32, 32, 8, 14336, 128256, 500000.0, False, 8192),
    "llama-13b": Shape("llama-13b", 5120, 40, 40, 40, 13824, 32000, 10000.0, False, 4096),
    # A small Mixtral: 8 experts of FFN 2816, 2 a token (Mixtral-8x7B's routing at a 4-layer, dim-1024 size):
    # 0.37 B parameters, 0.13 B active; Q4_0 210 MB, its experts 1.2 GB in fp32
    "mixtral-small": Shape("mixtral-small", 1024, 4, 16, 4, 2816, 32000, 1e6, False, 4096, 8, 2),
}
MIXES = ("Q4_0", "Q4_K_M", "Q8_0")


def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(mix: str, name: str, layer: int | None, n_layers: int) -> str:
    """The ggml type llama.cpp gives tensor `name` (llama.cpp's names) under `mix`."""
    if name.endswith(("norm.weight", "ffn_gate_inp.weight")):  # llama.cpp keeps a router F32 in every mix
        return "F32"
    if mix == "Q8_0":
        return "Q8_0"
    if name == "output.weight":
        return "Q6_K"
    if mix == "Q4_0":
        return "Q4_0"
    assert mix == "Q4_K_M", mix
    if layer is not None and name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")) \
            and _use_more_bits(layer, n_layers):
        return "Q6_K"
    return "Q4_K"


def tensors(shape: Shape) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(llama.cpp name, torch shape ((E,) rows, cols) or (n,), layer) in the order llama.cpp's converter writes
    them; a mixture of experts' router (E, dim) and its 3-D ffn_*_exps in place of the dense FFN's matrices."""
    head_dim = shape.dim // shape.n_heads
    kv = shape.n_kv_heads * head_dim
    out: list[tuple[str, tuple[int, ...], int | None]] = [("token_embd.weight", (shape.vocab, shape.dim), None)]
    e, f = shape.experts, shape.ffn_dim
    ffn = [("ffn_gate", (f, shape.dim)), ("ffn_up", (f, shape.dim)), ("ffn_down", (shape.dim, f))]
    for i in range(shape.n_layers):
        out += [(f"blk.{i}.attn_norm.weight", (shape.dim,), i),
                (f"blk.{i}.attn_q.weight", (shape.dim, shape.dim), i),
                (f"blk.{i}.attn_k.weight", (kv, shape.dim), i),
                (f"blk.{i}.attn_v.weight", (kv, shape.dim), i),
                (f"blk.{i}.attn_output.weight", (shape.dim, shape.dim), i),
                (f"blk.{i}.ffn_norm.weight", (shape.dim,), i)]
        if e:
            out.append((f"blk.{i}.ffn_gate_inp.weight", (e, shape.dim), i))
            out += [(f"blk.{i}.{name}_exps.weight", (e, *dims), i) for name, dims in ffn]
        else:
            out += [(f"blk.{i}.{name}.weight", dims, i) for name, dims in ffn]
    out.append(("output_norm.weight", (shape.dim,), None))
    if not shape.tied:
        out.append(("output.weight", (shape.vocab, shape.dim), None))
    return out


def file_name(shape: str, mix: str) -> str:
    return f"{shape}.{mix}.random.gguf"


def _vocabulary(size: int) -> dict:
    """A real SentencePiece vocabulary (trained on sample_prompts/) padded with unused tokens to `size`."""
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    import gguf
    from tiny_gguf import sentencepiece_vocab
    from tiny_llama import train_sentencepiece

    vocab = sentencepiece_vocab(train_sentencepiece(vocab_size=2000))
    pad = size - len(vocab["tokens"])
    vocab["tokens"] += [f"<unused{i}>" for i in range(pad)]
    vocab["scores"] += [-1e9] * pad
    vocab["types"] += [gguf.TokenType.UNUSED] * pad
    return vocab


# random_blocks draws every fp16 scale in [0.002, 0.02]; the K-quants multiply theirs by 6-bit (Q4_K) or int8 (Q6_K)
# sub-scales and Q8_0 by int8 quants, which would make weights of ~1-10. These factors bring every type's largest
# weight to ~0.2-0.4, as trained LLaMA matrices have, so activations stay in fp16's and bf16's range.
_SCALE_FACTOR = {"Q4_0": 1.0, "Q8_0": 0.1, "Q4_K": 0.01, "Q6_K": 0.005}


def _realistic(blocks: np.ndarray, kind: str) -> np.ndarray:
    from tiny_gguf import block_dtype

    import gguf

    factor = _SCALE_FACTOR[kind]
    if factor == 1.0:
        return blocks
    rows = blocks.shape[0]
    structured = blocks.reshape(-1).view(block_dtype(gguf.GGMLQuantizationType[kind]))
    for field in ("d", "dmin"):
        if field in structured.dtype.names:
            structured[field] = (structured[field].astype(np.float32) * factor).astype("<f2")
    return structured.view(np.uint8).reshape(rows, -1)


def ensure(folder: Path, shape_name: str, mix: str, seed: int = 0, say=print) -> Path:
    """The file for (shape, mix) in `folder`, written first when absent."""
    path = folder / file_name(shape_name, mix)
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    return write(path, SHAPES[shape_name], mix, seed, say)


def write(path: Path, shape: Shape, mix: str, seed: int = 0, say=print) -> Path:
    """A random-weight GGUF of `shape` in `mix` at `path` (written to path.part, then renamed)."""
    shape_name = shape.name
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    import gguf
    from tiny_gguf import random_blocks

    vocab = _vocabulary(shape.vocab)
    part = path.with_name(path.name + ".part")
    writer = gguf.GGUFWriter(str(part), "llama")
    writer.add_name(f"{shape_name} random {mix}")
    writer.add_block_count(shape.n_layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.dim)
    writer.add_feed_forward_length(shape.ffn_dim)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(shape.dim // shape.n_heads)
    writer.add_vocab_size(shape.vocab)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_per_token)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_scores(vocab["scores"])
    writer.add_token_types(vocab["types"])
    writer.add_bos_token_id(vocab["bos"])
    writer.add_eos_token_id(vocab["eos"])
    writer.add_unk_token_id(vocab["unk"])
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    plan = [(name, dims, tensor_type(mix, name, layer, shape.n_layers)) for name, dims, layer in tensors(shape)]
    for name, dims, kind in plan:
        if kind == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*dims[:-1], dims[-1] // block * block_bytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    total = sum(4 * int(np.prod(d)) if k == "F32" else 0 for _, d, k in plan)
    for i, (name, dims, kind) in enumerate(plan):
        if kind == "F32" and len(dims) == 1:
            writer.write_tensor_data(np.ones(dims[0], dtype=np.float32))
        elif kind == "F32":  # a router: N(0, 1) logits' worth of spread, so tokens pick different experts
            writer.write_tensor_data((rng.standard_normal(dims) / np.sqrt(dims[1])).astype(np.float32))
        else:
            rows = int(np.prod(dims[:-1]))  # an expert tensor's E matrices, one after another
            blocks = _realistic(random_blocks(gguf.GGMLQuantizationType[kind], rows, dims[-1], rng), kind)
            blocks = blocks.reshape(*dims[:-1], -1)
            total += blocks.nbytes
            writer.write_tensor_data(blocks)
        if i % 40 == 0:
            say(f"  writing {path.name}: tensor {i + 1}/{len(plan)}, {total / 1e9:.2f} GB")
    writer.close()
    part.rename(path)
    return path


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--mix", choices=MIXES, required=True)
    args = parser.parse_args()
    print(ensure(args.dir, args.shape, args.mix))
