"""A random-weight HF LLaMA folder at LLaMA-2-7B's shapes in bf16 (issue 31, item 2: an HF bf16 7B folder runs
without ever holding an fp32 copy), as benchmarks/scale_models.py writes GGUFs: no weights can be downloaded here.

config.json (LlamaForCausalLM, benchmarks/scale_models.py's llama-7b shape, torch_dtype bfloat16), tokenizer.model
(a SentencePiece BPE model trained on sample_prompts/, tests/tiny_llama.train_sentencepiece, padded with unused
pieces to the embedding's 32,000 rows, as scale_models pads a GGUF's vocabulary: random weights pick any id) and the
weights as safetensors shards of at most `SHARD_BYTES` with model.safetensors.index.json, as HF's own 7B folders
are: 13.5 GB. Each bf16 value is random bits with its exponent drawn from four (magnitudes 2^-8 to 2^-4, random sign
and mantissa: a trained matrix's range), norms 1.0. Written tensor by tensor in 128 MB pieces (no tensor is ever
whole in memory), each shard to NAME.part and renamed, the folder reused when its index exists.

    /work/tools/py -m benchmarks.scale_hf --dir /tmp/scale/llama-7b-hf-bf16
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
SHARD_BYTES = 5 * 10**9
PIECE = 64 << 20  # values a piece


def hf_tensors(shape) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of a LLaMA checkpoint, in HF's order."""
    head_dim = shape.dim // shape.n_heads
    kv = shape.n_kv_heads * head_dim
    out = [("model.embed_tokens.weight", (shape.vocab, shape.dim))]
    for i in range(shape.n_layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (shape.dim, shape.dim)),
                (p + "self_attn.k_proj.weight", (kv, shape.dim)), (p + "self_attn.v_proj.weight", (kv, shape.dim)),
                (p + "self_attn.o_proj.weight", (shape.dim, shape.dim)),
                (p + "mlp.gate_proj.weight", (shape.ffn_dim, shape.dim)),
                (p + "mlp.up_proj.weight", (shape.ffn_dim, shape.dim)),
                (p + "mlp.down_proj.weight", (shape.dim, shape.ffn_dim)),
                (p + "input_layernorm.weight", (shape.dim,)), (p + "post_attention_layernorm.weight", (shape.dim,))]
    out.append(("model.norm.weight", (shape.dim,)))
    if not shape.tied:
        out.append(("lm_head.weight", (shape.vocab, shape.dim)))
    return out


def _bf16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random bf16 values as uint16 bits: random sign and mantissa, exponent 119-122 (|x| in [2^-8, 2^-4))."""
    r = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    return (r & np.uint16(0x807F)) | ((np.uint16(119) + ((r >> np.uint16(7)) & np.uint16(3))) << np.uint16(7))


def _write_shard(path: Path, names: list[tuple[str, tuple[int, ...]]], rng: np.random.Generator) -> None:
    header, at = {}, 0
    for name, dims in names:
        size = 2 * int(np.prod(dims))
        header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [at, at + size]}
        at += size
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        for name, dims in names:
            n = int(np.prod(dims))
            if name.endswith("norm.weight"):
                fh.write(np.full(n, 0x3F80, dtype=np.uint16).tobytes())  # bf16 1.0
                continue
            for start in range(0, n, PIECE):
                fh.write(_bf16_bits(rng, min(PIECE, n - start)).tobytes())
    part.rename(path)


def padded_tokenizer(model: bytes, size: int) -> bytes:
    """A SentencePiece model's bytes with unused pieces appended up to `size` pieces."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    for i in range(len(proto.pieces), size):
        piece = proto.pieces.add()
        piece.piece, piece.score = f"<unused{i}>", -1e9
        piece.type = sentencepiece_model_pb2.ModelProto.SentencePiece.UNUSED
    return proto.SerializeToString()


def ensure(folder: Path, shape_name: str = "llama-7b", seed: int = 0, say=print) -> Path:
    """The folder, written first when its index is absent."""
    from benchmarks.scale_models import SHAPES

    index = folder / "model.safetensors.index.json"
    if index.exists():
        return folder
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from tiny_llama import hf_config_dict, train_sentencepiece

    shape = SHAPES[shape_name]
    folder.mkdir(parents=True, exist_ok=True)
    config = hf_config_dict(shape.vocab, shape.dim, shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.ffn_dim,
                            tie=shape.tied, rope_theta=shape.rope_theta, max_pos=shape.context)
    config["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "tokenizer.model").write_bytes(padded_tokenizer(train_sentencepiece(vocab_size=2000), shape.vocab))
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in hf_tensors(shape):
        nbytes = 2 * int(np.prod(dims))
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        say(f"  writing {folder.name}/{file}: {len(names)} tensors")
        _write_shard(folder / file, names, rng)
        for name, dims in names:
            weight_map[name] = file
            total += 2 * int(np.prod(dims))
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, type=Path, help="the folder to write (reused when complete)")
    parser.add_argument("--shape", default="llama-7b")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    print(ensure(args.dir, args.shape))
