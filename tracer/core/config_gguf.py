"""ModelConfig's fields from a GGUF header's key/value metadata, read as llama.cpp reads each architecture llmtrace
runs. An architecture's keys differ only in their prefix (`llama.`, `qwen2.`, ...); what llmtrace does not model is
refused in one line naming the file and the key.

Pure Python (no torch).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from llmtrace.tracer.core.config_values import MoeSpec, RopeScaling, positive_window, real_number, whole_number
from llmtrace.tracer.core.errors import ConfigError, UnsupportedModelError
from llmtrace.tracer.core.refusals import gguf_refusal, refusal_line

# The architectures llmtrace reads, with what each brings beyond plain LLaMA: the one registry the reader checks and
# README's table of what loads is generated from (benchmarks/readme_facts.py). qwen2 files keep their Q/K rows in
# HF's order.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LLaMA, Mistral and other LLaMA-shaped files; Mixtral's experts with `llama.expert_count`",
    "qwen2": "Qwen2: biases on Q, K and V",
    "phi3": "Phi-3: `attn_qkv` and a gate-and-up `ffn_up` split at load; LongRoPE from `rope_factors_long`/`_short`; "
            "RoPE on part of each head (Phi-4-mini: `rope.dimension_count` below the head's)",
    "qwen3": "Qwen3 dense: RMSNorm on each Q and K head before RoPE",
    "qwen2moe": "Qwen2-MoE: biases on Q, K and V, a mixture of experts beside a shared expert (`ffn_*_shexp`, "
                "`ffn_gate_inp_shexp`)",
    "qwen3moe": "Qwen3-MoE: Qwen3's attention, a mixture of experts in every layer",
    "olmoe": "OLMoE: RMSNorm over the whole Q and K projections, a mixture of experts in every layer",
    "gemma3": "Gemma 3 text: norms stored as 1 + w; every sixth layer global, the others windowed",
}
_NEEDED = object()  # a key the file must have
# The plain sizes: (ModelConfig field, key after the architecture's prefix, default or _NEEDED, how it is read).
_SHAPE: tuple[tuple[str, str, Any, Callable[[Any, str, str], Any]], ...] = (
    ("n_layers", "block_count", _NEEDED, whole_number),
    ("norm_eps", "attention.layer_norm_rms_epsilon", 1e-5, real_number),
    ("rope_theta", "rope.freq_base", 10000.0, real_number),
    ("max_seq_len", "context_length", 2048, whole_number),
)
# Llama 3.1's scaling as llama.cpp writes it: (RopeScaling field, key after the prefix, llama.cpp's default).
_LLAMA3_SCALING = (("factor", "rope.scaling.factor", 8.0), ("low_freq_factor", "rope.scaling.low_freq_factor", 1.0),
                   ("high_freq_factor", "rope.scaling.high_freq_factor", 4.0),
                   ("original_max_position", "rope.scaling.original_context_length", 8192))


class _Keys:
    """One file's metadata under its architecture's prefix: each value read names the file and the full key."""

    def __init__(self, meta: Mapping[str, Any], arch: str, source: str) -> None:
        self.meta, self.arch, self.source = meta, arch, source

    def full(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def get(self, name: str, default: Any = None) -> Any:
        return self.meta.get(self.full(name), default)

    def need(self, name: str) -> Any:
        if self.full(name) not in self.meta:
            raise ConfigError(f"{self.source}: GGUF metadata lacks {self.full(name)!r}; the file is incomplete or not "
                              "a LLaMA model")
        return self.meta[self.full(name)]

    def whole(self, name: str, value: Any) -> int:
        return whole_number(value, self.source, self.full(name))

    def real(self, name: str, value: Any) -> float:
        return real_number(value, self.source, self.full(name))


def gguf_fields(meta: Mapping[str, Any], name: str, source: str) -> dict[str, Any]:
    """ModelConfig's fields from GGUF key/value metadata (`llama.*`, `qwen2.*`, ... keys), as read by
    `llmtrace.tracer.checkpoint.gguf_header`."""
    keys = _Keys(meta, _architecture(meta, source), source)
    arch = keys.arch
    n_heads = keys.whole("attention.head_count", keys.need("attention.head_count"))
    if n_heads <= 0:
        raise ConfigError(f"{source}: {keys.full('attention.head_count')!r} is {n_heads}; it must be at least 1, "
                          "the file is corrupt")
    vocab = _vocabulary(keys)
    dim = keys.whole("embedding_length", keys.need("embedding_length"))
    key_length = keys.get("attention.key_length")
    head_dim = keys.whole("attention.key_length", key_length) if key_length else None
    fields: dict[str, Any] = dict(name=name, source=source, vocab_size=vocab, dim=dim, n_heads=n_heads,
                                  rope_scaling=_rope_scaling(keys),
                                  rope_dim=_rope_dim(keys, head_dim or dim // n_heads))
    for field, key, default, read in _SHAPE:
        fields[field] = read(keys.need(key) if default is _NEEDED else keys.get(key, default), source, keys.full(key))
    fields["n_kv_heads"] = keys.whole("attention.head_count_kv", keys.get("attention.head_count_kv", n_heads))
    # a mixture of experts' expert width where the file gives it apart (qwen3moe, qwen2moe, whose
    # feed_forward_length is the shared expert's; a Mixtral 'llama' file's feed_forward_length is its experts')
    ffn_key = "expert_feed_forward_length" if keys.get("expert_feed_forward_length") or arch == "qwen2moe" \
        else "feed_forward_length"
    fields["ffn_dim"] = keys.whole(ffn_key, keys.need(ffn_key))
    if arch == "qwen2moe":  # its shared expert's width: llama.cpp's n_ff_shexp, else feed_forward_length
        shared = keys.get("expert_shared_feed_forward_length") or keys.need("feed_forward_length")
        fields["shared_expert_dim"] = keys.whole("expert_shared_feed_forward_length", shared)
    fields["explicit_head_dim"] = head_dim if head_dim is not None and head_dim != dim // n_heads else None
    fields["sliding_window"] = positive_window(keys.get("attention.sliding_window"),
                                               f"{source}: GGUF attention.sliding_window must be a positive integer")
    fields.update(
        # Filled in by the caller from the tensor list (no output.weight means tied); default from metadata.
        tie_embeddings=bool(meta.get("_llmtrace.tied", False)),
        # No metadata key says so: the caller reads them from the tensor list (contract.gguf_tensor_flags).
        qkv_bias=bool(meta.get("_llmtrace.qkv_bias", False)),
        wo_bias=bool(meta.get("_llmtrace.wo_bias", False)),
        mlp_bias=bool(meta.get("_llmtrace.mlp_bias", False)),
        # its layers must then hold attn_q_norm and attn_k_norm (a missing one is named)
        qk_norm=arch in ("qwen3", "qwen3moe", "olmoe"),
        qk_norm_whole=arch == "olmoe",  # llama.cpp's OLMoE: attn_q_norm H·D wide, attn_k_norm Hkv·D
        moe=_moe(keys),
    )
    if arch == "gemma3":
        fields.update(_gemma3(keys, fields))
    return fields


def _rope_dim(keys: _Keys, head_dim: int) -> int | None:
    """`<arch>.rope.dimension_count` below the head's width: Phi-4-mini's partial rotary, which llama.cpp runs as
    NEOX RoPE on the first n_rot values of each head (pairs i and i + n_rot/2, HF's rotate_half over them; a 'phi3'
    file keeps its Q/K rows in HF's order), the rest passed through. None for whole heads. LLaMA's interleaved pairs
    (its Q/K rows permuted by the converter) are read for whole heads only."""
    count = keys.get("rope.dimension_count")
    if count is None:
        return None
    count = keys.whole("rope.dimension_count", count)
    if count == head_dim:
        return None
    if keys.arch != "phi3":
        raise UnsupportedModelError(f"{keys.source}: RoPE on {count} of each head's {head_dim} values "
                                    f"({keys.full('rope.dimension_count')}) is not modelled for '{keys.arch}'; "
                                    "llmtrace turns part of a head in 'phi3' files only (Phi-4-mini)")
    if not 0 < count < head_dim or count % 2:
        raise ConfigError(f"{keys.source}: {keys.full('rope.dimension_count')} is {count}; RoPE turns a positive even "
                          f"number of each head's {head_dim} values, the file is corrupt")
    return count


def _architecture(meta: Mapping[str, Any], source: str) -> str:
    """`general.architecture`, if llmtrace reads it; a family it refuses or does not know is refused in one line."""
    arch = meta.get("general.architecture")
    refused = gguf_refusal(arch) if isinstance(arch, str) else None
    if refused is not None:
        raise UnsupportedModelError(refusal_line(source, f"GGUF architecture {arch!r}", refused))
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:  # a hostile file's array is no key
        raise UnsupportedModelError(
            f"{source}: GGUF architecture {arch!r} is not supported; llmtrace reads {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def _vocabulary(keys: _Keys) -> int:
    """`<arch>.vocab_size`, else the token list's length; a list shorter than the vocabulary is refused (an id past
    it has no text: decoding it would fail mid-run)."""
    tokens = keys.meta.get("tokenizer.ggml.tokens")
    listed = len(tokens) if isinstance(tokens, (list, tuple)) or hasattr(tokens, "count") else None
    vocab_size = keys.get("vocab_size")
    vocab = keys.whole("vocab_size", vocab_size) if vocab_size else listed or 0
    if vocab <= 0:
        raise ConfigError(f"{keys.source}: GGUF metadata gives no vocabulary size")
    if listed is not None and listed < vocab:
        raise ConfigError(f"{keys.source}: the GGUF's token list (tokenizer.ggml.tokens) has {listed:,} entries but "
                          f"its vocabulary is {vocab:,} ({keys.full('vocab_size')}); the file is corrupt")
    return vocab


def _rope_scaling(keys: _Keys) -> RopeScaling | None:
    """Gemma 3's linear scaling of its global layers (4B and up), Llama 3.1's, Phi-3's LongRoPE, or none."""
    if keys.full("rope.scaling.attn_factor") in keys.meta:  # llama.cpp writes it, with rope_factors_*, for LongRoPE
        return _longrope(keys)
    if any(f"_llmtrace.rope_factors_{kind}" in keys.meta for kind in ("short", "long")):  # the loader skips them
        raise ConfigError(f"{keys.source}: rope_factors_short/_long tensors (LongRoPE) without "
                          f"{keys.full('rope.scaling.attn_factor')}; the file is incomplete")
    freqs = keys.meta.get("_llmtrace.rope_freqs")
    if freqs is not None:  # Llama 3.1's scaling as llama.cpp's converter writes it: the divisors, no metadata key
        return RopeScaling(max(freqs), keys.whole("context_length", keys.get("context_length", 131_072)),
                           kind="freqs", freq_factors=tuple(float(f) for f in freqs))
    kind = keys.get("rope.scaling.type")
    if keys.arch == "gemma3" and kind == "linear":
        return RopeScaling(keys.real("rope.scaling.factor", keys.get("rope.scaling.factor", 1.0)),
                           keys.whole("context_length", keys.get("context_length", 131_072)), kind="linear")
    if kind not in (None, "none", "llama3"):  # llama.cpp's 'linear' and 'yarn' scale every frequency or more
        raise UnsupportedModelError(f"{keys.source}: {keys.full('rope.scaling.type')} is {kind!r}; llmtrace reads a "
                                    "GGUF's llama3 (rope_freqs), LongRoPE and Gemma 3's linear scaling")
    if kind != "llama3" and keys.full("rope.scaling.low_freq_factor") not in keys.meta:
        return None
    read = {"original_max_position": keys.whole}
    return RopeScaling(**{field: read.get(field, keys.real)(key, keys.get(key, default))
                          for field, key, default in _LLAMA3_SCALING})


def _longrope(keys: _Keys) -> RopeScaling:
    """LongRoPE as llama.cpp's converter writes it (Phi-3's 128k models): the attention factor and the original
    context in the metadata, the factors as the F32 tensors rope_factors_short and rope_factors_long (read by the
    header's reader into `_llmtrace.rope_factors_*`: checkpoint/resolve.py); the long ones past the original context
    (llama.cpp picks them by the context's size, as `run` does by its cache's)."""
    short, long = (keys.meta.get(f"_llmtrace.rope_factors_{kind}") for kind in ("short", "long"))
    if not short or not long:
        raise ConfigError(f"{keys.source}: LongRoPE ({keys.full('rope.scaling.attn_factor')}) without the F32 "
                          "tensors rope_factors_short.weight and rope_factors_long.weight; the file is incomplete")
    original = keys.whole("rope.scaling.original_context_length", keys.need("rope.scaling.original_context_length"))
    if original < 1:  # the stretch divides by it
        raise ConfigError(f"{keys.source}: {keys.full('rope.scaling.original_context_length')} must be a positive "
                          f"whole number, got {original}; the file is malformed")
    context = keys.whole("context_length", keys.get("context_length", original))
    attention = keys.real("rope.scaling.attn_factor", keys.meta[keys.full("rope.scaling.attn_factor")])
    return RopeScaling(context / original, original, kind="longrope", short_factor=tuple(short),
                       long_factor=tuple(long), attention_factor=attention)


def _moe(keys: _Keys) -> MoeSpec | None:
    """A Mixtral-style file's experts (arch 'llama' with `llama.expert_count` and `llama.expert_used_count`), a
    'qwen2moe', 'qwen3moe' or an 'olmoe' file's: its layers then hold ffn_gate_inp and the 3-D ffn_*_exps. llama.cpp
    renormalises the k weights of 'llama' and 'qwen3moe', not OLMoE's nor Qwen2-MoE's (its norm_w false for both),
    unless the file says (`<arch>.expert_weights_norm`). None without experts. Another architecture's experts are refused in one line."""
    arch, source = keys.arch, keys.source
    count = keys.get("expert_count")
    if not count:
        if arch in ("qwen2moe", "qwen3moe", "olmoe"):
            raise ConfigError(f"{source}: a '{arch}' GGUF without {arch}.expert_count; the file is incomplete")
        return None
    if arch not in ("llama", "qwen2moe", "qwen3moe", "olmoe"):
        raise UnsupportedModelError(f"{source}: a '{arch}' mixture of experts is not read; llmtrace reads Mixtral-style "
                                    "'llama', 'qwen2moe', 'qwen3moe' and 'olmoe' GGUFs with experts")
    used = keys.get("expert_used_count")
    if used is None:
        raise ConfigError(f"{source}: GGUF metadata has {arch}.expert_count but no {arch}.expert_used_count; the "
                          "file is incomplete")
    renormalised = keys.get("expert_weights_norm", arch not in ("olmoe", "qwen2moe"))
    return MoeSpec(keys.whole("expert_count", count), keys.whole("expert_used_count", used),
                   "renormalised" if renormalised is True else "softmax")


def _gemma3(keys: _Keys, fields: Mapping[str, Any]) -> dict[str, Any]:
    """A 'gemma3' GGUF's fields, as llama.cpp reads the file (llama-model.cpp, LLM_ARCH_GEMMA3): every sixth layer
    global (its swa pattern; `gemma3.attention.sliding_window_pattern` where a file gives one), the windowed layers'
    RoPE base 10,000 (`gemma3.rope.freq_base_swa` where given), scores scaled by 1/sqrt(head_dim), or for the
    27B (62 layers) by 1/sqrt(dim / heads), as llama.cpp does (the file has no query_pre_attn_scalar), and
    `gemma3.final_logit_softcapping` where given. The norms' 1 + w the loader turns back into w
    (tracer/load/gguf_loader.py)."""
    n_layers, window = fields["n_layers"], fields["sliding_window"]
    pattern = keys.whole("attention.sliding_window_pattern", keys.get("attention.sliding_window_pattern", 6))
    full = tuple(i for i in range(n_layers) if (i + 1) % pattern == 0) if window is not None else ()
    if window is not None and len(full) == n_layers:
        window, full = None, ()
    head_dim = fields["explicit_head_dim"] or fields["dim"] // fields["n_heads"]
    scalar = fields["dim"] // fields["n_heads"] if n_layers == 62 else head_dim
    softcap = keys.get("final_logit_softcapping")
    return dict(norm_plus_one=True, post_norms=True, geglu=True, embed_scale=True, qk_norm=True,
                query_pre_attn_scalar=float(scalar), sliding_window=window, full_layers=full,
                rope_local_theta=keys.real("rope.freq_base_swa", keys.get("rope.freq_base_swa", 10_000.0))
                if window else None,
                final_softcap=None if softcap is None else keys.real("final_logit_softcapping", softcap))
