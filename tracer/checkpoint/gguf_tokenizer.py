"""The tokenizer a GGUF file describes, rebuilt from its metadata (a GGUF carries no tokenizer.json).

`tokenizer.ggml.model` says which kind:
- "gpt2": byte-level BPE. The vocabulary is already spelled in GPT-2's byte alphabet ("Ġthe"), the merges are
  listed in rank order, and `tokenizer.ggml.pre` names the pre-tokenization regexes the merges were learned with
  (llama.cpp's llama-vocab.cpp). Built as a `tokenizers.Tokenizer` in memory.
- "llama": SentencePiece. The file keeps every piece with its score and type (normal, unknown, control,
  user-defined, unused, byte) -- exactly the fields of SentencePiece's ModelProto. We write that proto (a few
  protobuf fields, encoded by hand below) and let the sentencepiece library itself encode: the reference
  implementation, not an imitation of it. Model type BPE, which is the algorithm llama.cpp runs for this vocab
  (highest-scoring merge first).
Control tokens (type 3) are matched whole in the text as special tokens, user-defined ones (type 4) as plain
added tokens, as llama.cpp does.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Mapping, Sequence

from tokenizers import AddedToken, Regex, Tokenizer as RawTokenizer, decoders, models, pre_tokenizers

from llmtrace.tracer.checkpoint.gguf_header import GGUFHeader
from llmtrace.tracer.checkpoint.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer
from llmtrace.tracer.core.errors import FileFormatError, UnsupportedModelError

# llama.cpp token types (llama.h enum llama_token_type), the same numbers as SentencePiece's Piece.Type.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Llama 3's split regex (its tokenizer.json; llama.cpp LLAMA_VOCAB_PRE_TYPE_LLAMA3).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizers that split every digit on its own, then apply GPT-2's regex: llama.cpp groups these pre types
# under one regex list ("\p{N}", then GPT-2's); SmolLM2's own tokenizer.json has Digits(individual) + ByteLevel.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GPT2 = ("gpt-2", "gpt2")
_LLAMA3 = ("llama-bpe", "llama3", "llama-v3")
# Qwen2's split regex (its tokenizer.json; llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2): Llama 3's with single digits.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = ("qwen2",)
SUPPORTED_PRE = _GPT2 + _DIGITS_THEN_GPT2 + _LLAMA3 + _QWEN2


def _pre_tokenizer(pre: str | None, source: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenization a `tokenizer.ggml.pre` value names; files without the key get GPT-2's regex."""
    if pre is None or pre in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _LLAMA3 + _QWEN2:
        split = _LLAMA3_SPLIT if pre in _LLAMA3 else _QWEN2_SPLIT
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise UnsupportedModelError(
        f"{source}: tokenizer pre-tokenization {pre!r} is not supported; llmtrace knows {', '.join(SUPPORTED_PRE)}"
    )


def _need(meta: Mapping[str, Any], key: str, source: str) -> Any:
    value = meta.get(key)
    if value is None:
        raise FileFormatError(f"{source}: GGUF metadata lacks {key!r}; the file has no usable tokenizer")
    if not isinstance(value, (list, str)):
        raise FileFormatError(f"{source}: GGUF metadata {key!r} was not decoded; read the header with decode_arrays=True")
    if isinstance(value, list) and not all(isinstance(item, str) for item in value):
        raise FileFormatError(f"{source}: GGUF metadata {key!r} must be a list of strings; the file is corrupt")
    return value


def _token_types(meta: Mapping[str, Any], n_tokens: int, source: str) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return [NORMAL] * n_tokens
    if not isinstance(types, list) or len(types) != n_tokens:
        raise FileFormatError(f"{source}: tokenizer.ggml.token_type does not have one entry per token; file is corrupt")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in types):
        raise FileFormatError(f"{source}: tokenizer.ggml.token_type must hold integers; the file is corrupt")
    return types


def build_byte_level_bpe(meta: Mapping[str, Any], source: str) -> RawTokenizer:
    """A `tokenizers.Tokenizer` for a "gpt2" GGUF vocabulary: BPE from vocab + merges, ByteLevel pre-tokenizer/decoder."""
    tokens: Sequence[str] = _need(meta, "tokenizer.ggml.tokens", source)
    merges_raw: Sequence[str] = _need(meta, "tokenizer.ggml.merges", source)
    merges = []
    for merge in merges_raw:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise FileFormatError(f"{source}: tokenizer merge {merge!r} is not two tokens separated by a space")
        merges.append((left, right))
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise FileFormatError(f"{source}: tokenizer vocabulary has duplicate tokens; file is corrupt")
    try:
        raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    except Exception as exc:  # tokenizers raises a bare Exception for merges naming unknown tokens
        raise FileFormatError(f"{source}: tokenizer merges do not match the vocabulary ({exc})") from exc
    raw.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), source)
    raw.decoder = decoders.ByteLevel()
    types = _token_types(meta, len(tokens), source)
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL])
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    return raw


# ---- SentencePiece ModelProto, written by hand (sentencepiece_model.proto; protobuf wire format) ---------------


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # negative int32s are written as 10-byte two's complement, as protobuf does
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field_varint(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def sentencepiece_model_proto(meta: Mapping[str, Any], source: str) -> bytes:
    """Serialized ModelProto for a "llama" GGUF vocabulary: pieces with scores and types, BPE, identity normalizer."""
    tokens: Sequence[str] = _need(meta, "tokenizer.ggml.tokens", source)
    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise FileFormatError(f"{source}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in scores):
        raise FileFormatError(f"{source}: tokenizer.ggml.scores must hold finite numbers; the file is corrupt")
    types = _token_types(meta, len(tokens), source)
    if UNKNOWN not in types:
        raise FileFormatError(f"{source}: SentencePiece vocabulary has no unknown token (token_type 2); file is corrupt")
    pieces = bytearray()
    kinds = (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE)
    type_field = {kind: b"" if kind == NORMAL else _field_varint(3, kind) for kind in kinds}
    score_tag, piece_tag = _varint(2 << 3 | 5), _varint(1 << 3 | 2)
    pack_float = struct.Struct("<f").pack
    for token, score, kind in zip(tokens, scores, types):
        if kind not in type_field:
            raise FileFormatError(f"{source}: token {token!r} has unknown token type {kind}; file is corrupt")
        # Piece: piece = 1, score = 2, type = 3 (NORMAL is the default and left out, as sentencepiece writes it).
        # The _field_* helpers written out (the tags made once): a 128k vocabulary took ~0.5 s of a first run.
        raw = token.encode("utf-8")
        body = b"".join((piece_tag, _varint(len(raw)), raw, score_tag, pack_float(float(score)), type_field[kind]))
        pieces += piece_tag + _varint(len(body)) + body  # ModelProto.pieces = 1
    unk = types.index(UNKNOWN)
    trainer = (
        _field_varint(3, 2)  # model_type = BPE
        + _field_varint(4, len(tokens))  # vocab_size
        + _field_varint(35, int(BYTE in types))  # byte_fallback
        + _field_varint(40, unk)  # unk_id
        + _field_varint(41, _special_id(meta, "bos", -1, source))  # bos_id (-1: none)
        + _field_varint(42, _special_id(meta, "eos", -1, source))  # eos_id
        + _field_varint(43, _special_id(meta, "padding", -1, source))  # pad_id
    )
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    normalizer = (
        _field_bytes(1, b"identity")  # name: no Unicode normalization (LLaMA's tokenizer.model uses identity)
        + _field_varint(3, int(add_space_prefix))  # add_dummy_prefix
        + _field_varint(4, 0)  # remove_extra_whitespaces: llama.cpp keeps runs of spaces
        + _field_varint(5, 1)  # escape_whitespaces: " " -> "▁"
    )
    return bytes(pieces) + _field_bytes(2, trainer) + _field_bytes(3, normalizer)


def _special_id(meta: Mapping[str, Any], which: str, default: int | None, source: str) -> int | None:
    """tokenizer.ggml.<which>_token_id, checked to name a token of the vocabulary (a bos id past it would index
    past the embedding table once the run has begun)."""
    key = f"tokenizer.ggml.{which}_token_id"
    value = meta.get(key)
    if value is None:
        return default
    tokens = meta.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (
            n_tokens is not None and value >= n_tokens):
        where = f" of {n_tokens} tokens" if n_tokens is not None else ""
        raise FileFormatError(f"{source}: {key} is {value!r}, outside the vocabulary"
                              f"{where}; the file is corrupt")
    return value


def tokenizer_from_gguf(header: GGUFHeader) -> Tokenizer:
    """The tokenizer of a GGUF file (header read with decode_arrays=True), with bos/eos ids and chat template."""
    meta, source = header.metadata, header.path
    kind = meta.get("tokenizer.ggml.model")
    bos, eos = _special_id(meta, "bos", None, source), _special_id(meta, "eos", None, source)
    template = meta.get("tokenizer.chat_template")
    template = template if isinstance(template, str) else None
    if kind == "gpt2":
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        return HFTokenizer(build_byte_level_bpe(meta, source), bos_id=bos, eos_id=eos, chat_template=template,
                           add_bos=add_bos)
    if kind == "llama":
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))  # llama.cpp's default for SentencePiece
        return SentencePieceTokenizer.from_model_proto(sentencepiece_model_proto(meta, source), bos_id=bos,
                                                       eos_id=eos, chat_template=template, add_bos=add_bos)
    if kind is None:
        raise FileFormatError(f"{source}: GGUF metadata has no tokenizer (tokenizer.ggml.model); pass an HF model folder")
    raise UnsupportedModelError(
        f"{source}: tokenizer type {kind!r} is not supported; llmtrace reads 'gpt2' (byte-level BPE) and 'llama' "
        "(SentencePiece)"
    )
