"""Model configuration: one frozen dataclass, built from a preset, an HF config.json (read by config_hf.py) or a
GGUF header (config_gguf.py); its parts (RoPE scaling, experts) and the readers' number checks are config_values.py's.

Pure Python (no torch), so the analytical commands stay instant.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from llmtrace.tracer.core.config_gguf import gguf_fields
from llmtrace.tracer.core.config_hf import hf_fields, read_config_json
# RopeScaling and MoeSpec are a config's parts: their users import them from here with ModelConfig
from llmtrace.tracer.core.config_values import INT_LIMITS, MoeSpec, RopeScaling, positive_real
from llmtrace.tracer.core.errors import ConfigError
from llmtrace.tracer.core.json_input import is_int


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
    # With moe: a shared expert beside the routed ones (Qwen2-MoE): one more SwiGLU of this width that every token
    # runs, its output scaled by sigmoid(x·g) (a d -> 1 gate) and added to the routed experts' weighted sum. None: none.
    shared_expert_dim: int | None = None
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
    # Partial rotary (Phi-4-mini: 96 of 128): RoPE turns the first rope_dim values of each q and k head (pairs i and
    # i + rope_dim/2, its frequencies θ^(-2i/rope_dim)) and passes the rest through. None: the whole head.
    rope_dim: int | None = None

    def __post_init__(self) -> None:
        _check_sizes(self)
        _check_numbers(self)
        _check_layout(self)

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim if self.explicit_head_dim is not None else self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """The values of each head RoPE turns: rope_dim where partial, else the whole head."""
        return self.head_dim if self.rope_dim is None else self.rope_dim

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

    # ---- readers: each source's fields, read by its own module ------------------------------------------------

    @classmethod
    def from_hf_dict(cls, data: Mapping[str, Any], name: str = "hf", source: str = "config.json") -> "ModelConfig":
        """Build from the dict of an HF `config.json` (LlamaForCausalLM / MistralForCausalLM and kin)."""
        return cls(**hf_fields(data, name, source))

    @classmethod
    def from_hf_json(cls, path: str | Path) -> "ModelConfig":
        """Read an HF `config.json`, given the file or the model folder that holds it."""
        return cls.from_hf_dict(*read_config_json(path))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], name: str, source: str) -> "ModelConfig":
        """Build from GGUF key/value metadata (`llama.*` or `qwen2.*` keys), as read by
        `llmtrace.tracer.checkpoint.gguf_header`."""
        return cls(**gguf_fields(meta, name, source))


# ---- a config's checks: each field's type and range, then how the fields fit together -----------------------------

def _check_sizes(config: ModelConfig) -> None:
    """Every size a positive integer below any real model's bound (a larger one is a corrupt file)."""
    for field_name, limit in INT_LIMITS.items():
        value = getattr(config, field_name)
        if not is_int(value) or value <= 0:
            raise ConfigError(f"config {config.name!r}: {field_name} must be a positive integer, got {value!r}")
        if value > limit:
            raise ConfigError(f"config {config.name!r}: {field_name} is {value:,}, beyond any real model "
                              f"(at most {limit:,}); the file is corrupt")
    head_dim = config.explicit_head_dim
    if head_dim is not None and (not is_int(head_dim) or not 0 < head_dim <= INT_LIMITS["dim"]):
        raise ConfigError(f"config {config.name!r}: head_dim must be a positive integer, got {head_dim!r}")


_WHY_POSITIVE = {"norm_eps": "RMSNorm divides by sqrt(mean(x²) + eps)",
                 "rope_theta": "RoPE's base; 0 gives NaN angles and NaN logits"}


def _check_numbers(config: ModelConfig) -> None:
    """The real-valued fields finite and positive, the flags booleans, the parts each by its own check."""
    for field_name in ("norm_eps", "rope_theta"):
        value = getattr(config, field_name)
        if not positive_real(value):
            raise ConfigError(f"config {config.name!r}: {field_name} must be a finite number > 0, got {value!r} "
                              f"({_WHY_POSITIVE[field_name]})")
    if not isinstance(config.tie_embeddings, bool):
        raise ConfigError(f"config {config.name!r}: tie_embeddings must be true or false, got "
                          f"{config.tie_embeddings!r}")
    if config.rope_scaling is not None:
        config.rope_scaling.check(config.name)
    if config.moe is not None:
        config.moe.check(config.name)
    shared = config.shared_expert_dim
    if shared is not None:
        if config.moe is None:
            raise ConfigError(f"config {config.name!r}: shared_expert_dim is a mixture of experts' shared expert; "
                              "set moe too")
        if not is_int(shared) or not 0 < shared <= INT_LIMITS["ffn_dim"]:
            raise ConfigError(f"config {config.name!r}: shared_expert_dim must be an integer from 1 to "
                              f"{INT_LIMITS['ffn_dim']:,}, got {shared!r}")


def _check_layout(config: ModelConfig) -> None:
    """The fields that must agree with each other: heads and KV heads, the window and the global layers, the head
    width RoPE turns in pairs."""
    name = config.name
    if config.qk_norm_whole and not config.qk_norm:
        raise ConfigError(f"config {name!r}: qk_norm_whole says how QK-norm normalises; set qk_norm too")
    if config.n_heads % config.n_kv_heads:
        raise ConfigError(
            f"config {name!r}: n_heads ({config.n_heads}) must be a multiple of n_kv_heads ({config.n_kv_heads})"
        )
    window = config.sliding_window
    if window is not None and (not is_int(window) or window <= 0):
        raise ConfigError(f"config {name!r}: sliding_window must be a positive integer or null, got {window!r}")
    if config.explicit_head_dim is None and config.dim % config.n_heads:
        raise ConfigError(
            f"config {name!r}: dim ({config.dim}) is not divisible by n_heads ({config.n_heads}); give head_dim"
        )
    if any(not isinstance(i, int) or not 0 <= i < config.n_layers for i in config.full_layers):
        raise ConfigError(f"config {name!r}: full_layers must list layers from 0 to {config.n_layers - 1}, got "
                          f"{config.full_layers!r}")
    if config.full_layers and window is None:
        raise ConfigError(f"config {name!r}: full_layers says which layers are not windowed; set sliding_window too")
    for field_name in ("query_pre_attn_scalar", "rope_local_theta", "final_softcap"):
        value = getattr(config, field_name)
        if value is not None and not positive_real(value):
            raise ConfigError(f"config {name!r}: {field_name} must be a finite number > 0 or null, got {value!r}")
    if config.head_dim % 2:  # every family turns a head in pairs (a partial rotary: its first rope_dim, below)
        raise ConfigError(f"config {name!r}: head_dim is {config.head_dim}, odd; RoPE turns a head's values in "
                          "pairs, so it must be even (the file is corrupt or not a LLaMA-family model)")
    rope_dim = config.rope_dim
    if rope_dim is not None and (not is_int(rope_dim) or rope_dim <= 0 or rope_dim % 2
                                 or rope_dim >= config.head_dim):
        raise ConfigError(f"config {name!r}: rope_dim must be an even number of values below head_dim "
                          f"({config.head_dim}), or null for whole heads, got {rope_dim!r}")
    scaling, rotary = config.rope_scaling, config.rotary_dim
    if scaling is not None and scaling.kind == "longrope" and len(scaling.short_factor) != rotary // 2:
        raise ConfigError(f"config {name!r}: LongRoPE has {len(scaling.short_factor)} factors, one per frequency "
                          f"of the {rotary} values RoPE turns in a head ({rotary // 2}) needed")
    if scaling is not None and scaling.kind == "freqs" and len(scaling.freq_factors) != rotary // 2:
        raise ConfigError(f"config {name!r}: rope_freqs has {len(scaling.freq_factors)} factors, one per frequency "
                          f"of the {rotary} values RoPE turns in a head ({rotary // 2}) needed")
