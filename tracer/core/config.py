"""Model configuration: one frozen dataclass, built from a preset, an HF config.json, or a GGUF header.

Pure Python (no torch), so the analytical commands stay instant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from llmtrace.tracer.core.errors import ConfigError, UnsupportedModelError
from llmtrace.tracer.core.refusals import gguf_refusal, hf_refusal, refusal_line


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3.1-style frequency-dependent RoPE scaling ("rope_type": "llama3"), or with `kind` "linear" every
    frequency divided by `factor` (Gemma 3's global layers; the other fields then unused)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int
    kind: str = "llama3"  # "llama3" or "linear"


# How a router turns its E logits into the k weights it mixes (the FLOPs differ, the experts chosen do not):
# softmax over all E then the top k renormalised to sum 1 (Mixtral, whose top-k-then-softmax is the same;
# Qwen3-MoE with norm_topk_prob), or softmax over all E with the top k kept as they are (OLMoE).
ROUTER_NORMS = ("renormalised", "softmax")


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A mixture-of-experts FFN in every layer: E experts, each a SwiGLU of the config's ffn_dim, and a router
    (a d x E linear) that sends each token to k of them and sums their outputs weighted."""

    n_experts: int  # E
    experts_per_token: int  # k
    router_norm: str  # one of ROUTER_NORMS

    def check(self, name: str) -> None:
        for field_name in ("n_experts", "experts_per_token"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= _MAX_EXPERTS:
                raise ConfigError(f"config {name!r}: {field_name} must be an integer from 1 to {_MAX_EXPERTS:,}, "
                                  f"got {value!r}")
        if self.experts_per_token > self.n_experts:
            raise ConfigError(f"config {name!r}: {self.experts_per_token} experts per token of only "
                              f"{self.n_experts}; k cannot exceed E")
        if self.router_norm not in ROUTER_NORMS:
            raise ConfigError(f"config {name!r}: router_norm must be one of {', '.join(ROUTER_NORMS)}, got "
                              f"{self.router_norm!r}")


def first_attended_position(end: int, new: int, window: int | None) -> int:
    """The oldest position any of `new` queries (at positions end-new .. end-1) attends: 0 under full causal
    attention; with a sliding window W, the first query's oldest key, end - new - W + 1 (transformers' mask keeps
    key k for query q when q - W < k <= q). Attention reads the keys from here to end - 1, nothing older."""
    return 0 if window is None else max(0, end - new - window + 1)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything about a LLaMA-family model's shape that FLOPs, bytes and the model code need."""

    name: str
    vocab_size: int
    dim: int  # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int  # SwiGLU intermediate size
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    explicit_head_dim: int | None = None  # set where the model gives one (dim != n_heads * head_dim is allowed)
    rope_scaling: RopeScaling | None = None
    source: str = "preset"  # where this config came from, for display
    # Sliding-window attention (Mistral 7B v0.1: 4096): a query at position p sees keys p-W+1..p only, and the
    # cache needs to hold only the last W positions. None: full causal attention.
    sliding_window: int | None = None
    qkv_bias: bool = False  # Q, K and V projections add a bias (HF attention_bias; Qwen2)
    wo_bias: bool = False  # the attention output projection adds a bias (HF attention_bias)
    mlp_bias: bool = False  # the FFN's gate, up and down projections add biases (HF mlp_bias)
    # RMSNorm on each query and key head (weights of size head_dim) after the projections, before RoPE (Qwen3)
    qk_norm: bool = False
    # with qk_norm: one RMSNorm over the whole q and k projections (weights H·D and Hkv·D wide) instead of each head
    # (OLMoE's q_norm and k_norm)
    qk_norm_whole: bool = False
    # A mixture of experts in place of the dense FFN (ffn_dim is then each expert's): Mixtral's HF and GGUF files and
    # the presets; the stage modules run it (tracer/model/moe.py; a dry run routes round-robin).
    moe: MoeSpec | None = None
    # Gemma 3's twists (HF Gemma3ForCausalLM, GGUF gemma3), each its own flag so the contract can switch its stage:
    norm_plus_one: bool = False  # every RMSNorm multiplies by (1 + w) in fp32, cast after (the checkpoint holds w)
    post_norms: bool = False  # an RMSNorm on the attention's and on the FFN's output, before each residual add
    geglu: bool = False  # the FFN gates with gelu (tanh approximation) in place of silu
    embed_scale: bool = False  # the embedding rows times sqrt(dim), in the model's dtype
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its -1/2 power (None: head_dim's)
    # With a sliding window: the layers that attend to every position (Gemma 3: every sixth); the others are windowed.
    # Empty: the window (if any) holds on every layer.
    full_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # the windowed layers' RoPE base (unscaled), where it is not rope_theta
    final_softcap: float | None = None  # logits = c·tanh(logits / c) after the LM head

    def __post_init__(self) -> None:
        for field_name, limit in _INT_LIMITS.items():
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config {self.name!r}: {field_name} must be a positive integer, got {value!r}")
            if value > limit:
                raise ConfigError(f"config {self.name!r}: {field_name} is {value:,}, beyond any real model "
                                  f"(at most {limit:,}); the file is corrupt")
        if self.explicit_head_dim is not None and (
                not isinstance(self.explicit_head_dim, int) or isinstance(self.explicit_head_dim, bool)
                or not 0 < self.explicit_head_dim <= _INT_LIMITS["dim"]):
            raise ConfigError(f"config {self.name!r}: head_dim must be a positive integer, got "
                              f"{self.explicit_head_dim!r}")
        for field_name in ("norm_eps", "rope_theta"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ConfigError(f"config {self.name!r}: {field_name} must be a finite number > 0, got {value!r} "
                                  f"({_WHY_POSITIVE[field_name]})")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"config {self.name!r}: tie_embeddings must be true or false, got "
                              f"{self.tie_embeddings!r}")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.name, self.rope_scaling)
        if self.moe is not None:
            self.moe.check(self.name)
        if self.qk_norm_whole and not self.qk_norm:
            raise ConfigError(f"config {self.name!r}: qk_norm_whole says how QK-norm normalises; set qk_norm too")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"config {self.name!r}: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
            raise ConfigError(f"config {self.name!r}: sliding_window must be a positive integer or null, got {window!r}")
        if self.explicit_head_dim is None and self.dim % self.n_heads:
            raise ConfigError(
                f"config {self.name!r}: dim ({self.dim}) is not divisible by n_heads ({self.n_heads}); give head_dim"
            )
        if any(not isinstance(i, int) or not 0 <= i < self.n_layers for i in self.full_layers):
            raise ConfigError(f"config {self.name!r}: full_layers must list layers from 0 to {self.n_layers - 1}, got "
                              f"{self.full_layers!r}")
        if self.full_layers and window is None:
            raise ConfigError(f"config {self.name!r}: full_layers says which layers are not windowed; set "
                              "sliding_window too")
        for field_name in ("query_pre_attn_scalar", "rope_local_theta", "final_softcap"):
            value = getattr(self, field_name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ConfigError(f"config {self.name!r}: {field_name} must be a finite number > 0 or null, got "
                                  f"{value!r}")
        if self.head_dim % 2:  # LLaMA and Qwen2 alike: every head is rotated whole
            raise ConfigError(f"config {self.name!r}: head_dim is {self.head_dim}, odd; RoPE turns a head's values in "
                              "pairs, so it must be even (the file is corrupt or not a LLaMA-family model)")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim if self.explicit_head_dim is not None else self.dim // self.n_heads

    @property
    def n_rep(self) -> int:
        """How many query heads share one KV head (1 = MHA, n_heads = MQA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def cached_positions(self, context: int) -> int:
        """Positions a KV cache must hold for a context of `context` tokens: all of them, or the window's (on a
        windowed layer: `layer_window`)."""
        return context if self.sliding_window is None else min(context, self.sliding_window)

    def cached_layer_positions(self, context: int) -> int:
        """Positions the caches of all layers together hold for a context of `context` tokens: n_layers ×
        cached_positions, or where windowed and global layers interleave (Gemma 3) the windowed layers' window each
        and the global layers' whole context each."""
        full = len(self.full_layers) if self.sliding_window is not None else 0
        return (self.n_layers - full) * self.cached_positions(context) + full * context

    def layer_window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends through: the config's, unless the layer is one of full_layers."""
        return None if layer in self.full_layers else self.sliding_window

    @property
    def windowed_layers(self) -> int:
        """How many layers attend through the sliding window (all or none, but for Gemma 3's interleaving)."""
        return 0 if self.sliding_window is None else self.n_layers - len(self.full_layers)

    @property
    def mixed_windows(self) -> bool:
        """Some layers windowed, some not (Gemma 3): costs, caches and RoPE tables then differ by layer."""
        return 0 < self.windowed_layers < self.n_layers

    @property
    def attention_scale(self) -> float:
        """What the scores QKᵀ are multiplied by: 1/sqrt(head_dim), or query_pre_attn_scalar^-1/2 (Gemma)."""
        scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return scalar**-0.5

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(RoPE base, scaling) of layer `layer`: a windowed layer's own base, unscaled, where the config has one."""
        if self.rope_local_theta is not None and self.layer_window(layer) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    def with_name(self, name: str, source: str | None = None) -> "ModelConfig":
        return replace(self, name=name, source=source if source is not None else self.source)

    # ---- readers ------------------------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, data: Mapping[str, Any], name: str = "hf", source: str = "config.json") -> "ModelConfig":
        """Build from the dict of an HF `config.json` (LlamaForCausalLM / MistralForCausalLM and kin)."""
        archs = data.get("architectures") or []
        model_type = data.get("model_type", "")
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ConfigError(f"{source}: 'architectures' must be a list of names, got {_short(archs)}")
        if not isinstance(model_type, str):
            raise ConfigError(f"{source}: 'model_type' must be a name, got {_short(model_type)}")
        refused = hf_refusal(archs, model_type)
        if refused is not None:
            raise UnsupportedModelError(refusal_line(source, *refused))
        supported_types = {"llama", "mistral", "mixtral", "olmoe", "qwen2", "qwen3", "qwen3_moe", "phi3",
                           "gemma3_text", ""}
        if model_type not in supported_types or any(a not in _HF_ARCHITECTURES for a in archs):
            what = ", ".join(archs) or model_type
            raise UnsupportedModelError(
                f"{source}: architecture {what!r} is not LLaMA-family; llmtrace supports "
                f"{', '.join(sorted(_HF_ARCHITECTURES))}"
            )

        def need(key: str) -> Any:
            if key not in data:
                raise ConfigError(f"{source}: missing field {key!r}; is this a LLaMA config.json?")
            return data[key]

        def whole(key: str, value: Any) -> int:
            return whole_number(value, source, key)

        def real(key: str, value: Any) -> float:
            return real_number(value, source, key)

        n_heads = whole("num_attention_heads", need("num_attention_heads"))
        head_dim = data.get("head_dim")
        attention_bias = bool(data.get("attention_bias", False))  # LlamaAttention: on q, k, v and o alike
        qwen2 = model_type == "qwen2" or "Qwen2ForCausalLM" in archs  # Qwen2Attention: a bias on q, k, v, none on o
        # Qwen3Attention (Qwen3-MoE's too): q_norm, k_norm per head
        qwen3 = model_type in ("qwen3", "qwen3_moe") or bool({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"} & set(archs))
        qwen3_moe = model_type == "qwen3_moe" or "Qwen3MoeForCausalLM" in archs
        olmoe = model_type == "olmoe" or "OlmoeForCausalLM" in archs  # OlmoeAttention: q_norm, k_norm over q and k
        if model_type == "phi3" or "Phi3ForCausalLM" in archs:
            _check_phi3(data, source)
        gemma3 = model_type == "gemma3_text" or "Gemma3ForCausalLM" in archs
        rope_theta = data.get("rope_theta", _dict_or_empty(data.get("rope_parameters")).get("rope_theta", 10000.0))
        tie = data.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ConfigError(f"{source}: 'tie_word_embeddings' must be true or false, got {tie!r}; fix the file")
        fields = dict(
            name=name,
            vocab_size=whole("vocab_size", need("vocab_size")),
            dim=whole("hidden_size", need("hidden_size")),
            n_layers=whole("num_hidden_layers", need("num_hidden_layers")),
            n_heads=n_heads,
            n_kv_heads=whole("num_key_value_heads", data.get("num_key_value_heads") or n_heads),
            # Qwen3-MoE: each expert's width (its intermediate_size is for dense layers, which _moe_from_hf refuses)
            ffn_dim=(whole("moe_intermediate_size", need("moe_intermediate_size")) if qwen3_moe else
                     whole("intermediate_size", need("intermediate_size"))),
            norm_eps=real("rms_norm_eps", data.get("rms_norm_eps", 1e-6)),
            rope_theta=real("rope_theta", rope_theta),
            max_seq_len=whole("max_position_embeddings", data.get("max_position_embeddings", 2048)),
            tie_embeddings=tie,
            explicit_head_dim=whole("head_dim", head_dim) if head_dim is not None else None,
            # Gemma 3's scaling is its global layers' (_gemma3_from_hf)
            rope_scaling=None if gemma3 else _rope_scaling_from_hf(data.get("rope_scaling")
                                                                   or data.get("rope_parameters"), source),
            source=source,
            sliding_window=_sliding_window_from_hf(data, model_type, archs, source),
            qkv_bias=attention_bias or qwen2,
            wo_bias=attention_bias and not qwen2,
            mlp_bias=bool(data.get("mlp_bias", False)) and not qwen2,
            qk_norm=qwen3 or olmoe,
            qk_norm_whole=olmoe,
            moe=_moe_from_hf(data, model_type, archs, source),
        )
        if gemma3:
            fields.update(_gemma3_from_hf(data, whole("num_hidden_layers", need("num_hidden_layers")), source))
        return cls(**fields)

    @classmethod
    def from_hf_json(cls, path: str | Path) -> "ModelConfig":
        """Read an HF `config.json`, given the file or the model folder that holds it."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.exists():
            raise ConfigError(f"{file}: no such file; pass a model folder with a config.json, or a preset name")
        from llmtrace.tracer.core.json_input import parse_json

        if not file.is_file():
            raise ConfigError(f"{file}: not a regular file (a FIFO, device or folder); pass a config.json file")
        try:
            raw = file.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{file}: cannot read ({exc.strerror or exc}); check the file") from exc
        data = parse_json(raw, str(file), ConfigError, "check the file")
        if not isinstance(data, dict):
            raise ConfigError(f"{file}: expected a JSON object at the top level")
        name = file.parent.name if file.name == "config.json" else file.stem
        return cls.from_hf_dict(data, name=name, source=str(file))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], name: str, source: str) -> "ModelConfig":
        """Build from GGUF key/value metadata (`llama.*` or `qwen2.*` keys), as read by
        `llmtrace.tracer.checkpoint.gguf_header`."""
        arch = meta.get("general.architecture")
        refused = gguf_refusal(arch) if isinstance(arch, str) else None
        if refused is not None:
            raise UnsupportedModelError(refusal_line(source, f"GGUF architecture {arch!r}", refused))
        if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:  # a hostile file's array is no key
            raise UnsupportedModelError(
                f"{source}: GGUF architecture {arch!r} is not supported; llmtrace reads {', '.join(GGUF_ARCHITECTURES)}"
            )

        def key(name: str) -> str:
            return f"{arch}.{name}"


        if key("rope.scaling.attn_factor") in meta:  # llama.cpp writes it, with rope_factors_*, for LongRoPE
            raise UnsupportedModelError(f"{source}: LongRoPE ({key('rope.scaling.attn_factor')}, rope_factors_long and "
                                        "_short) is not modelled; llmtrace reads files without rope scaling (Phi-3's "
                                        "4k models)")

        def need(name: str) -> Any:
            full = key(name)
            if full not in meta:
                raise ConfigError(f"{source}: GGUF metadata lacks {full!r}; the file is incomplete or not a LLaMA model")
            return meta[full]

        def whole(key: str, value: Any) -> int:
            return whole_number(value, source, key)

        def real(key: str, value: Any) -> float:
            return real_number(value, source, key)

        n_heads = whole(key("attention.head_count"), need("attention.head_count"))
        if n_heads <= 0:
            raise ConfigError(f"{source}: 'llama.attention.head_count' is {n_heads}; it must be at least 1, the file "
                              "is corrupt")
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab_size = meta.get(key("vocab_size"))
        vocab = (whole(key("vocab_size"), vocab_size) if vocab_size else
                 len(tokens) if isinstance(tokens, (list, tuple)) or hasattr(tokens, "count") else 0)
        if vocab <= 0:
            raise ConfigError(f"{source}: GGUF metadata gives no vocabulary size")
        listed = len(tokens) if isinstance(tokens, (list, tuple)) or hasattr(tokens, "count") else None
        if listed is not None and listed < vocab:  # an id past the list has no text: decoding it would fail mid-run
            raise ConfigError(f"{source}: the GGUF's token list (tokenizer.ggml.tokens) has {listed:,} entries but its "
                              f"vocabulary is {vocab:,} ({key('vocab_size')}); the file is corrupt")
        key_length = meta.get(key("attention.key_length"))
        dim = whole(key("embedding_length"), need("embedding_length"))
        head_dim = whole(key("attention.key_length"), key_length) if key_length else None
        rope_dims = meta.get(key("rope.dimension_count"))
        if isinstance(rope_dims, int) and rope_dims != (head_dim or dim // n_heads):
            raise UnsupportedModelError(f"{source}: RoPE on {rope_dims} of each head's {head_dim or dim // n_heads} "
                                        f"values ({key('rope.dimension_count')}) is not modelled; llmtrace rotates "
                                        "whole heads")
        scaling = None
        if arch == "gemma3" and meta.get(key("rope.scaling.type")) == "linear":  # its global layers' (4B and up)
            scaling = RopeScaling(real(key("rope.scaling.factor"), meta.get(key("rope.scaling.factor"), 1.0)), 1.0,
                                  4.0, whole(key("context_length"), meta.get(key("context_length"), 131_072)),
                                  kind="linear")
        elif meta.get(key("rope.scaling.type")) == "llama3" or key("rope.scaling.low_freq_factor") in meta:
            scaling = RopeScaling(
                factor=real(key("rope.scaling.factor"), meta.get(key("rope.scaling.factor"), 8.0)),
                low_freq_factor=real(key("rope.scaling.low_freq_factor"),
                                     meta.get(key("rope.scaling.low_freq_factor"), 1.0)),
                high_freq_factor=real(key("rope.scaling.high_freq_factor"),
                                      meta.get(key("rope.scaling.high_freq_factor"), 4.0)),
                original_max_position=whole(key("rope.scaling.original_context_length"),
                                            meta.get(key("rope.scaling.original_context_length"), 8192)),
            )
        fields = dict(
            name=name,
            vocab_size=vocab,
            dim=dim,
            n_layers=whole(key("block_count"), need("block_count")),
            n_heads=n_heads,
            n_kv_heads=whole(key("attention.head_count_kv"), meta.get(key("attention.head_count_kv"), n_heads)),
            # a mixture of experts' expert width where the file gives it apart (qwen3moe; a Mixtral 'llama' file's
            # feed_forward_length is its experts')
            ffn_dim=(whole(key("expert_feed_forward_length"), meta[key("expert_feed_forward_length")])
                     if meta.get(key("expert_feed_forward_length")) else
                     whole(key("feed_forward_length"), need("feed_forward_length"))),
            norm_eps=real(key("attention.layer_norm_rms_epsilon"),
                          meta.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),
            rope_theta=real(key("rope.freq_base"), meta.get(key("rope.freq_base"), 10000.0)),
            max_seq_len=whole(key("context_length"), meta.get(key("context_length"), 2048)),
            # Filled in by the caller from the tensor list (no output.weight means tied); default from metadata.
            tie_embeddings=bool(meta.get("_llmtrace.tied", False)),
            explicit_head_dim=head_dim if head_dim is not None and head_dim != dim // n_heads else None,
            rope_scaling=scaling,
            source=source,
            sliding_window=_sliding_window_from_gguf(meta.get(key("attention.sliding_window")), source),
            # No metadata key says so: the caller reads them from the tensor list (contract.gguf_tensor_flags).
            qkv_bias=bool(meta.get("_llmtrace.qkv_bias", False)),
            wo_bias=bool(meta.get("_llmtrace.wo_bias", False)),
            mlp_bias=bool(meta.get("_llmtrace.mlp_bias", False)),
            # its layers must then hold attn_q_norm and attn_k_norm (a missing one is named)
            qk_norm=arch in ("qwen3", "qwen3moe", "olmoe"),
            qk_norm_whole=arch == "olmoe",  # llama.cpp's OLMoE: attn_q_norm H·D wide, attn_k_norm Hkv·D
            moe=_moe_from_gguf(meta, arch, source),
        )
        if arch == "gemma3":
            fields.update(_gemma3_from_gguf(meta, fields, source))
        return cls(**fields)


# Upper bounds far past any released model (Llama 3.1 405B: dim 16,384, 126 layers, 128 heads, FFN 53,248,
# vocabulary 128,256; the longest contexts are ~10M): a value beyond them is a corrupt file, and refusing it here
# keeps torch from being asked for a tensor of 2^60 elements.
_INT_LIMITS = {"vocab_size": 2**31 - 1, "dim": 2**20, "n_layers": 2**14, "n_heads": 2**14, "n_kv_heads": 2**14,
               "ffn_dim": 2**24, "max_seq_len": 2**30}
_MAX_EXPERTS = 2**16  # DeepSeek-V3 has 256 routed experts a layer
_WHY_POSITIVE = {"norm_eps": "RMSNorm divides by sqrt(mean(x²) + eps)",
                 "rope_theta": "RoPE's base; 0 gives NaN angles and NaN logits"}


def whole_number(value: Any, source: str, key: str) -> int:
    """`value` as an int when it is one (or a float with no fraction, as some writers store sizes); else the
    one-line ConfigError naming the file and the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"{source}: {key!r} must be a whole number, got {_short(value)}; the file is malformed")
    return int(value)


def real_number(value: Any, source: str, key: str) -> float:
    """`value` as a finite float; else the one-line ConfigError naming the file and the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{source}: {key!r} must be a finite number, got {_short(value)}; the file is malformed")
    return float(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _dict_or_empty(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _check_rope_scaling(name: str, scaling: RopeScaling) -> None:
    if scaling.kind not in ("llama3", "linear"):
        raise ConfigError(f"config {name!r}: rope scaling kind must be 'llama3' or 'linear', got {scaling.kind!r}")
    for field_name in ("factor", "low_freq_factor", "high_freq_factor"):
        value = getattr(scaling, field_name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"config {name!r}: rope scaling {field_name} must be a finite number > 0, got {value!r}")
    if scaling.low_freq_factor >= scaling.high_freq_factor:
        raise ConfigError(f"config {name!r}: rope scaling low_freq_factor ({scaling.low_freq_factor}) must be below "
                          f"high_freq_factor ({scaling.high_freq_factor})")
    if not isinstance(scaling.original_max_position, int) or isinstance(scaling.original_max_position, bool) or \
            not 0 < scaling.original_max_position <= _INT_LIMITS["max_seq_len"]:
        raise ConfigError(f"config {name!r}: rope scaling original_max_position must be a positive integer, got "
                          f"{scaling.original_max_position!r}")


# The architectures llmtrace reads, with what each brings beyond plain LLaMA: the one registry the readers check and
# README's table of what loads is generated from (benchmarks/readme_facts.py). GGUF architectures' metadata keys
# differ only in the prefix; qwen2 files keep their Q/K rows in HF's order.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LLaMA, Mistral and other LLaMA-shaped files; Mixtral's experts with `llama.expert_count`",
    "qwen2": "Qwen2: biases on Q, K and V",
    "phi3": "Phi-3: `attn_qkv` and a gate-and-up `ffn_up` split at load; no LongRoPE",
    "qwen3": "Qwen3 dense: RMSNorm on each Q and K head before RoPE",
    "qwen3moe": "Qwen3-MoE: Qwen3's attention, a mixture of experts in every layer",
    "olmoe": "OLMoE: RMSNorm over the whole Q and K projections, a mixture of experts in every layer",
    "gemma3": "Gemma 3 text: norms stored as 1 + w; every sixth layer global, the others windowed",
}
HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "Llama 3.1 rope scaling; `attention_bias`, `mlp_bias`",
    "MistralForCausalLM": "sliding window honoured",
    "MixtralForCausalLM": "mixture of experts: E SwiGLU experts a layer, k per token, weights renormalised",
    "Qwen2ForCausalLM": "biases on Q, K and V; a sliding window on every layer or none",
    "Phi3ForCausalLM": "`qkv_proj` and `gate_up_proj` split at load; its sliding window; no LongRoPE (128k models)",
    "Qwen3ForCausalLM": "RMSNorm on each Q and K head before RoPE; a sliding window on every layer or none",
    "Qwen3MoeForCausalLM": "Qwen3's attention; mixture of experts in every layer, weights renormalised with "
                           "`norm_topk_prob`",
    "OlmoeForCausalLM": "RMSNorm over the whole Q and K projections; mixture of experts in every layer",
    "Gemma3ForCausalLM": "text only: (1 + w) RMSNorm, norms after attention and FFN, GeGLU, embeddings × √d, "
                         "Q/K-norm, windowed and global layers with their own RoPE bases",
}
_HF_ARCHITECTURES = frozenset(HF_ARCHITECTURES)
# MistralConfig's default when config.json has no sliding_window key (transformers' configuration_mistral.py).
_MISTRAL_DEFAULT_WINDOW = 4096


def _moe_from_hf(data: Mapping[str, Any], model_type: str, archs: list[str], source: str) -> MoeSpec | None:
    """Mixtral's experts (num_local_experts, num_experts_per_tok; its router renormalises the k weights),
    Qwen3-MoE's and OLMoE's (num_experts, or num_local_experts as transformers 5 writes Qwen3-MoE's; renormalised
    with norm_topk_prob, else the softmax's own: OLMoE's default), else None (a dense FFN)."""
    mixtral = model_type == "mixtral" or "MixtralForCausalLM" in archs
    qwen3_moe = model_type == "qwen3_moe" or "Qwen3MoeForCausalLM" in archs
    olmoe = model_type == "olmoe" or "OlmoeForCausalLM" in archs
    if not (mixtral or qwen3_moe or olmoe):
        return None
    if olmoe and data.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"{source}: clip_qkv (q, k and v clamped) is not modelled; llmtrace runs OLMoE "
                                    "without it")
    experts_key = "num_experts" if not mixtral and "num_experts" in data else "num_local_experts"
    counts = []
    for key in (experts_key, "num_experts_per_tok"):
        if key not in data:
            raise ConfigError(f"{source}: missing field {key!r}; a mixture of experts' config.json names its experts")
        counts.append(whole_number(data[key], source, key))
    if mixtral:
        return MoeSpec(counts[0], counts[1], "renormalised")
    if data.get("mlp_only_layers") or data.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedModelError(f"{source}: dense FFN layers among the experts' (mlp_only_layers, "
                                    "decoder_sparse_step) are not modelled; llmtrace runs experts in every layer")
    return MoeSpec(counts[0], counts[1], "renormalised" if data.get("norm_topk_prob", False) else "softmax")


def _sliding_window_from_hf(data: Mapping[str, Any], model_type: str, archs: list[str], source: str) -> int | None:
    """The window transformers applies: Mistral's sliding_window (4096 when absent, null for none); LLaMA has none
    (LlamaForCausalLM ignores the key)."""
    if model_type == "mistral" or "MistralForCausalLM" in archs:
        window = data.get("sliding_window", _MISTRAL_DEFAULT_WINDOW)
    elif model_type == "phi3" or "Phi3ForCausalLM" in archs:  # Phi3Config: none unless given (mini-4k: 2047)
        window = data.get("sliding_window")
    elif model_type == "mixtral" or "MixtralForCausalLM" in archs:
        window = data.get("sliding_window")  # MixtralConfig's default is none
    elif model_type in ("qwen2", "qwen3", "qwen3_moe") or {"Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                                           "Qwen3MoeForCausalLM"} & set(archs):
        # windowed only with use_sliding_window
        if not data.get("use_sliding_window", False) or data.get("sliding_window") is None:
            return None
        window = data["sliding_window"]
        first_windowed = data.get("max_window_layers", 28)
        if isinstance(first_windowed, int) and first_windowed >= data.get("num_hidden_layers", 0):
            return None  # every layer is below max_window_layers: full attention throughout
        if first_windowed != 0:
            raise UnsupportedModelError(
                f"{source}: sliding window on layers {first_windowed} and up only (use_sliding_window with "
                "max_window_layers) is not modelled; llmtrace windows all layers or none"
            )
    else:
        return None
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ConfigError(f"{source}: sliding_window must be a positive integer or null, got {window!r}")
    return window


# Gemma3TextConfig's defaults, for a config.json that leaves a field out (transformers' configuration_gemma3.py)
_GEMMA3_DEFAULTS = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window": 4096,
                    "sliding_window_pattern": 6, "query_pre_attn_scalar": 256}


def _gemma3_from_hf(data: Mapping[str, Any], n_layers: int, source: str) -> dict[str, Any]:
    """Gemma 3's fields from its config.json (model_type gemma3_text), as transformers reads them: every twist on,
    the windowed layers from `layer_types` (or every `sliding_window_pattern`-th layer global), the global layers'
    RoPE base and scaling and the windowed layers' base from `rope_parameters` (transformers 5) or `rope_theta`,
    `rope_scaling` and `rope_local_base_freq` (the hub's files). What llmtrace does not model is refused in one line."""
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if data.get(key):
            raise UnsupportedModelError(f"{source}: {key} {_short(data[key])} is not modelled; llmtrace runs Gemma 3 "
                                        "causal, its scores not soft-capped")
    act = data.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"{source}: hidden_activation {_short(act)} is not modelled; llmtrace's Gemma 3 "
                                    "FFN is gelu (tanh approximation)-gated")
    layer_types = data.get("layer_types")
    if layer_types is None:
        pattern = whole_number(data.get("sliding_window_pattern", _GEMMA3_DEFAULTS["sliding_window_pattern"]),
                               source, "sliding_window_pattern")
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != n_layers or not set(layer_types) <= {
            "sliding_attention", "full_attention"}:
        raise ConfigError(f"{source}: 'layer_types' must list 'sliding_attention' or 'full_attention' for each of the "
                          f"{n_layers} layers, got {_short(layer_types)}")
    window = data.get("sliding_window", _GEMMA3_DEFAULTS["sliding_window"])
    if window is not None:
        window = whole_number(window, source, "sliding_window")
    full = tuple(i for i, kind in enumerate(layer_types) if kind == "full_attention")
    if window is None or len(full) == n_layers:
        window, full = None, ()
    params = _dict_or_empty(data.get("rope_parameters"))
    global_params = _dict_or_empty(params.get("full_attention")) or _dict_or_empty(data.get("rope_scaling"))
    local_params = _dict_or_empty(params.get("sliding_attention"))
    theta = global_params.get("rope_theta", data.get("rope_theta", _GEMMA3_DEFAULTS["rope_theta"]))
    local = local_params.get("rope_theta", data.get("rope_local_base_freq", _GEMMA3_DEFAULTS["rope_local_base_freq"]))
    if local_params.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"{source}: RoPE scaling on the windowed layers is not modelled")
    scaling = None
    kind = global_params.get("rope_type") or global_params.get("type")
    if kind == "linear":
        scaling = RopeScaling(real_number(global_params.get("factor"), source, "rope_scaling.factor"), 1.0, 4.0,
                              whole_number(data.get("max_position_embeddings", 131_072), source,
                                           "max_position_embeddings"), kind="linear")
    elif kind not in (None, "default"):
        raise UnsupportedModelError(f"{source}: rope scaling type {kind!r} is not supported on Gemma 3's global "
                                    "layers; llmtrace handles 'linear'")
    softcap = data.get("final_logit_softcapping")
    return dict(norm_plus_one=True, post_norms=True, geglu=True, embed_scale=True, qk_norm=True,
                qkv_bias=bool(data.get("attention_bias", False)), wo_bias=bool(data.get("attention_bias", False)),
                query_pre_attn_scalar=real_number(data.get("query_pre_attn_scalar",
                                                           _GEMMA3_DEFAULTS["query_pre_attn_scalar"]),
                                                  source, "query_pre_attn_scalar"),
                sliding_window=window, full_layers=full,
                rope_theta=real_number(theta, source, "rope_theta"), rope_scaling=scaling,
                rope_local_theta=real_number(local, source, "rope_local_base_freq") if window is not None else None,
                final_softcap=None if softcap is None else real_number(softcap, source, "final_logit_softcapping"),
                tie_embeddings=data.get("tie_word_embeddings", True) is not False)


def _gemma3_from_gguf(meta: Mapping[str, Any], fields: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A 'gemma3' GGUF's fields, as llama.cpp reads the file (llama-model.cpp, LLM_ARCH_GEMMA3): every sixth layer
    global (its swa pattern; `gemma3.attention.sliding_window_pattern` where a file gives one), the windowed layers'
    RoPE base 10,000 (`gemma3.rope.freq_base_swa` where given), scores scaled by 1/sqrt(head_dim), or for the
    27B (62 layers) by 1/sqrt(dim / heads), as llama.cpp does (the file has no query_pre_attn_scalar), and
    `gemma3.final_logit_softcapping` where given. The norms' 1 + w the loader turns back into w
    (tracer/load/gguf_loader.py)."""
    n_layers, window = fields["n_layers"], fields["sliding_window"]
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    pattern = whole_number(pattern, source, "gemma3.attention.sliding_window_pattern")
    full = tuple(i for i in range(n_layers) if (i + 1) % pattern == 0) if window is not None else ()
    if window is not None and len(full) == n_layers:
        window, full = None, ()
    head_dim = fields["explicit_head_dim"] or fields["dim"] // fields["n_heads"]
    scalar = fields["dim"] // fields["n_heads"] if n_layers == 62 else head_dim
    softcap = meta.get("gemma3.final_logit_softcapping")
    local = meta.get("gemma3.rope.freq_base_swa", 10_000.0)
    return dict(norm_plus_one=True, post_norms=True, geglu=True, embed_scale=True, qk_norm=True,
                query_pre_attn_scalar=float(scalar), sliding_window=window, full_layers=full,
                rope_local_theta=real_number(local, source, "gemma3.rope.freq_base_swa") if window else None,
                final_softcap=None if softcap is None else real_number(softcap, source,
                                                                       "gemma3.final_logit_softcapping"))


def _check_phi3(data: Mapping[str, Any], source: str) -> None:
    """Phi-3 is LLaMA's layer once its packed Q|K|V and gate|up are split (tracer/checkpoint/packed_tensors.py), when
    it rotates whole heads with SiLU gating; Phi-4-mini's partial rotary (0.75 of each head) is not modelled."""
    rotary = data.get("partial_rotary_factor", _dict_or_empty(data.get("rope_parameters")).get(
        "partial_rotary_factor", 1.0))
    if rotary != 1.0:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor {_short(rotary)} (RoPE on part of each head) "
                                    "is not modelled; llmtrace rotates whole heads")
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {_short(act)} is not modelled; llmtrace's FFN is SiLU-gated")


def _moe_from_gguf(meta: Mapping[str, Any], arch: str, source: str) -> MoeSpec | None:
    """A Mixtral-style file's experts (arch 'llama' with `llama.expert_count` and `llama.expert_used_count`), a
    'qwen3moe' or an 'olmoe' file's: its layers then hold ffn_gate_inp and the 3-D ffn_*_exps. llama.cpp renormalises
    the k weights of 'llama' and 'qwen3moe', not OLMoE's (its norm_w), unless the file says
    (`<arch>.expert_weights_norm`). None without experts. Another architecture's experts are refused in one line."""
    count = meta.get(f"{arch}.expert_count")
    if not count:
        if arch in ("qwen3moe", "olmoe"):
            raise ConfigError(f"{source}: a '{arch}' GGUF without {arch}.expert_count; the file is incomplete")
        return None
    if arch not in ("llama", "qwen3moe", "olmoe"):
        raise UnsupportedModelError(f"{source}: a '{arch}' mixture of experts is not read; llmtrace reads Mixtral-style "
                                    "'llama', 'qwen3moe' and 'olmoe' GGUFs with experts")
    used = meta.get(f"{arch}.expert_used_count")
    if used is None:
        raise ConfigError(f"{source}: GGUF metadata has {arch}.expert_count but no {arch}.expert_used_count; the "
                          "file is incomplete")
    renormalised = meta.get(f"{arch}.expert_weights_norm", arch != "olmoe")
    return MoeSpec(whole_number(count, source, f"{arch}.expert_count"),
                   whole_number(used, source, f"{arch}.expert_used_count"),
                   "renormalised" if renormalised is True else "softmax")


def _sliding_window_from_gguf(window: Any, source: str) -> int | None:
    """`llama.attention.sliding_window` where the file has it (llama.cpp writes it for windowed models)."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ConfigError(f"{source}: GGUF attention.sliding_window must be a positive integer, got {window!r}")
    return window


def _rope_scaling_from_hf(raw: Any, source: str) -> RopeScaling | None:
    if not raw or not isinstance(raw, dict):
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise UnsupportedModelError(f"{source}: rope scaling type {kind!r} is not supported; llmtrace handles 'llama3'")
    try:
        return RopeScaling(
            factor=real_number(raw["factor"], source, "rope_scaling.factor"),
            low_freq_factor=real_number(raw["low_freq_factor"], source, "rope_scaling.low_freq_factor"),
            high_freq_factor=real_number(raw["high_freq_factor"], source, "rope_scaling.high_freq_factor"),
            original_max_position=whole_number(raw["original_max_position_embeddings"], source,
                                               "rope_scaling.original_max_position_embeddings"),
        )
    except KeyError as exc:
        raise ConfigError(f"{source}: rope_scaling lacks field {exc.args[0]!r}") from exc
