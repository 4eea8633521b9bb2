"""ModelConfig's fields from an HF `config.json`, read as transformers reads it for each architecture llmtrace
runs; what llmtrace does not model is refused in one line naming the file and the key.

Pure Python (no torch).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Mapping

from llmtrace.tracer.core.config_values import (MoeSpec, RopeScaling, dict_or_empty, positive_window, real_number,
                                                whole_number)
from llmtrace.tracer.core.errors import ConfigError, UnsupportedModelError, short_repr
from llmtrace.tracer.core.refusals import hf_refusal, refusal_line

# The architectures llmtrace reads, with what each brings beyond plain LLaMA: the one registry the reader checks and
# README's table of what loads is generated from (benchmarks/readme_facts.py).
HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "Llama 3.1 rope scaling; `attention_bias`, `mlp_bias`",
    "MistralForCausalLM": "sliding window honoured",
    "MixtralForCausalLM": "mixture of experts: E SwiGLU experts a layer, k per token, weights renormalised",
    "Qwen2ForCausalLM": "biases on Q, K and V; a sliding window on every layer or none",
    "Phi3ForCausalLM": "`qkv_proj` and `gate_up_proj` split at load; its sliding window; LongRoPE (128k models); "
                       "RoPE on part of each head (Phi-4-mini's `partial_rotary_factor`)",
    "Qwen3ForCausalLM": "RMSNorm on each Q and K head before RoPE; a sliding window on every layer or none",
    "Qwen2MoeForCausalLM": "biases on Q, K and V; mixture of experts in every layer beside one shared expert, its "
                           "output scaled by a sigmoid gate",
    "Qwen3MoeForCausalLM": "Qwen3's attention; mixture of experts in every layer, weights renormalised with "
                           "`norm_topk_prob`",
    "OlmoeForCausalLM": "RMSNorm over the whole Q and K projections; mixture of experts in every layer",
    "Gemma3ForCausalLM": "text only: (1 + w) RMSNorm, norms after attention and FFN, GeGLU, embeddings × √d, "
                         "Q/K-norm, windowed and global layers with their own RoPE bases",
}
# Each architecture's model_type: a config.json names either or both, and the reader treats them alike.
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
                "Qwen2ForCausalLM": "qwen2", "Phi3ForCausalLM": "phi3", "Qwen3ForCausalLM": "qwen3",
                "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe", "Gemma3ForCausalLM": "gemma3_text"}
# MistralConfig's default when config.json has no sliding_window key (transformers' configuration_mistral.py).
_MISTRAL_DEFAULT_WINDOW = 4096
_NEEDED = object()  # a field the file must give
# The plain sizes: (ModelConfig field, config.json key, default or _NEEDED, how the value is read).
_SHAPE: tuple[tuple[str, str, Any, Callable[[Any, str, str], Any]], ...] = (
    ("vocab_size", "vocab_size", _NEEDED, whole_number),
    ("dim", "hidden_size", _NEEDED, whole_number),
    ("n_layers", "num_hidden_layers", _NEEDED, whole_number),
    ("norm_eps", "rms_norm_eps", 1e-6, real_number),
    ("max_seq_len", "max_position_embeddings", 2048, whole_number),
)


def read_config_json(path: str | Path) -> tuple[dict[str, Any], str, str]:
    """An HF `config.json`, given the file or the model folder that holds it: (its dict, the model's name, the
    file's path as errors name it)."""
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
    return data, file.parent.name if file.name == "config.json" else file.stem, str(file)


def hf_fields(data: Mapping[str, Any], name: str, source: str) -> dict[str, Any]:
    """ModelConfig's fields from the dict of an HF `config.json` (LlamaForCausalLM / MistralForCausalLM and kin)."""
    kinds = _model_types(data, source)
    n_heads = whole_number(_need(data, "num_attention_heads", source), source, "num_attention_heads")
    if "phi3" in kinds:
        _check_phi3_act(data, source)
    tie = data.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"{source}: 'tie_word_embeddings' must be true or false, got {tie!r}; fix the file")
    fields: dict[str, Any] = dict(name=name, source=source, tie_embeddings=tie, n_heads=n_heads)
    for field, key, default, read in _SHAPE:
        fields[field] = read(_need(data, key, source) if default is _NEEDED else data.get(key, default), source, key)
    fields["n_kv_heads"] = whole_number(data.get("num_key_value_heads") or n_heads, source, "num_key_value_heads")
    # Qwen2/3-MoE: each expert's width (its intermediate_size is for dense layers, which _moe refuses)
    ffn_key = "moe_intermediate_size" if {"qwen2_moe", "qwen3_moe"} & kinds else "intermediate_size"
    fields["ffn_dim"] = whole_number(_need(data, ffn_key, source), source, ffn_key)
    rope_theta = data.get("rope_theta", dict_or_empty(data.get("rope_parameters")).get("rope_theta", 10000.0))
    fields["rope_theta"] = real_number(rope_theta, source, "rope_theta")
    head_dim = data.get("head_dim")
    fields["explicit_head_dim"] = whole_number(head_dim, source, "head_dim") if head_dim is not None else None
    if "phi3" in kinds:
        fields["rope_dim"] = _phi3_rope_dim(data, fields["explicit_head_dim"] or fields["dim"] // max(n_heads, 1),
                                            source)
    fields.update(_attention_flags(data, kinds))
    # Gemma 3's scaling is its global layers' (_gemma3)
    fields["rope_scaling"] = None if "gemma3_text" in kinds else _rope_scaling(
        data.get("rope_scaling") or data.get("rope_parameters"), data, source)
    fields["sliding_window"] = _sliding_window(data, kinds, source)
    fields["moe"] = _moe(data, kinds, source)
    if "qwen2_moe" in kinds:  # Qwen2MoeSparseMoeBlock's shared_expert, beside the routed ones
        key = "shared_expert_intermediate_size"
        fields["shared_expert_dim"] = whole_number(_need(data, key, source), source, key)
    if "gemma3_text" in kinds:
        fields.update(_gemma3(data, fields["n_layers"], source))
    return fields


def _model_types(data: Mapping[str, Any], source: str) -> frozenset[str]:
    """The model types the file names, directly (`model_type`) or through its architectures; a family llmtrace
    refuses or does not know is refused in one line."""
    archs = data.get("architectures") or []
    model_type = data.get("model_type", "")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"{source}: 'architectures' must be a list of names, got {short_repr(archs)}")
    if not isinstance(model_type, str):
        raise ConfigError(f"{source}: 'model_type' must be a name, got {short_repr(model_type)}")
    refused = hf_refusal(archs, model_type)
    if refused is not None:
        raise UnsupportedModelError(refusal_line(source, *refused))
    if model_type not in {*_MODEL_TYPES.values(), ""} or any(a not in _MODEL_TYPES for a in archs):
        what = ", ".join(archs) or model_type
        raise UnsupportedModelError(
            f"{source}: architecture {what!r} is not LLaMA-family; llmtrace supports "
            f"{', '.join(sorted(HF_ARCHITECTURES))}"
        )
    return frozenset({model_type, *(_MODEL_TYPES[a] for a in archs)})


def _need(data: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in data:
        raise ConfigError(f"{source}: missing field {key!r}; is this a LLaMA config.json?")
    return data[key]


def _attention_flags(data: Mapping[str, Any], kinds: frozenset[str]) -> dict[str, bool]:
    """The projections' biases and the QK-norm, as each family's attention has them."""
    attention_bias = bool(data.get("attention_bias", False))  # LlamaAttention: on q, k, v and o alike
    qwen2 = bool({"qwen2", "qwen2_moe"} & kinds)  # Qwen2Attention: a bias on q, k, v, none on o
    # Qwen2MoeConfig's qkv_bias (transformers 5; true when absent, as the hub's files leave it)
    qwen2_bias = qwen2 and ("qwen2" in kinds or data.get("qkv_bias", True) is not False)
    return dict(qkv_bias=attention_bias or qwen2_bias, wo_bias=attention_bias and not qwen2,
                mlp_bias=bool(data.get("mlp_bias", False)) and not qwen2,
                # Qwen3Attention (Qwen3-MoE's too): q_norm, k_norm per head; OlmoeAttention: over the whole q and k
                qk_norm=bool({"qwen3", "qwen3_moe", "olmoe"} & kinds), qk_norm_whole="olmoe" in kinds)


def _moe(data: Mapping[str, Any], kinds: frozenset[str], source: str) -> MoeSpec | None:
    """Mixtral's experts (num_local_experts, num_experts_per_tok; its router renormalises the k weights),
    Qwen2-MoE's, Qwen3-MoE's and OLMoE's (num_experts, or num_local_experts as transformers 5 writes Qwen3-MoE's; renormalised
    with norm_topk_prob, else the softmax's own: OLMoE's default), else None (a dense FFN)."""
    mixtral = "mixtral" in kinds
    if not {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"} & kinds:
        return None
    if "olmoe" in kinds and data.get("clip_qkv") is not None:
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


def _sliding_window(data: Mapping[str, Any], kinds: frozenset[str], source: str) -> int | None:
    """The window transformers applies: Mistral's sliding_window (4096 when absent, null for none); LLaMA has none
    (LlamaForCausalLM ignores the key)."""
    if "mistral" in kinds:
        window = data.get("sliding_window", _MISTRAL_DEFAULT_WINDOW)
    elif "phi3" in kinds or "mixtral" in kinds:  # Phi3Config: none unless given (mini-4k: 2047); MixtralConfig: none
        window = data.get("sliding_window")
    elif {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"} & kinds:
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
    return positive_window(window, f"{source}: sliding_window must be a positive integer or null")


def _rope_scaling(raw: Any, data: Mapping[str, Any], source: str) -> RopeScaling | None:
    if not raw or not isinstance(raw, dict):
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind in (None, "default"):
        return None
    if kind in ("longrope", "su"):  # "su": Phi-3's first configs' name for it
        return _longrope(raw, data, source)
    if kind != "llama3":
        raise UnsupportedModelError(f"{source}: rope scaling type {short_repr(kind)} is not supported; llmtrace "
                                    "handles 'llama3' and 'longrope'")
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


def _longrope(raw: Mapping[str, Any], data: Mapping[str, Any], source: str) -> RopeScaling:
    """LongRoPE (Phi-3's 128k models) as transformers reads it (_compute_longrope_parameters): the short and long
    factors, the original context (rope_scaling's, or the config's original_max_position_embeddings), the stretch
    `factor` (rope_scaling's, or max_position_embeddings over the original) and the attention factor (rope_scaling's,
    or sqrt(1 + ln factor / ln original) where the context is stretched, 1 where not)."""
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = raw.get(key)
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{source}: LongRoPE's rope_scaling.{key} must be a list of numbers, got "
                              f"{short_repr(values)}")
        factors[key] = tuple(real_number(v, source, f"rope_scaling.{key}") for v in values)
    longest = whole_number(data.get("max_position_embeddings", 4096), source, "max_position_embeddings")
    original = raw.get("original_max_position_embeddings", data.get("original_max_position_embeddings", longest))
    original = whole_number(original, source, "original_max_position_embeddings")
    if original < 2:  # the stretch divides by it, the attention factor by its log
        raise ConfigError(f"{source}: LongRoPE's original_max_position_embeddings must be a whole number above 1, "
                          f"got {original}; the file is malformed")
    factor = real_number(raw.get("factor") or longest / original, source, "rope_scaling.factor")
    attention = raw.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return RopeScaling(factor, original, kind="longrope", attention_factor=real_number(
        attention, source, "rope_scaling.attention_factor"), **factors)


def _check_phi3_act(data: Mapping[str, Any], source: str) -> None:
    """Phi-3 is LLaMA's layer once its packed Q|K|V and gate|up are split (tracer/checkpoint/packed_tensors.py), when
    it gates with SiLU."""
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {short_repr(act)} is not modelled; llmtrace's FFN is "
                                    "SiLU-gated")


def _phi3_rope_dim(data: Mapping[str, Any], head_dim: int, source: str) -> int | None:
    """The values of each head Phi-3's RoPE turns, where partial_rotary_factor (Phi-4-mini's 0.75; top level or in
    rope_parameters) makes it part of the head: int(head_dim * factor), as transformers' Phi3RotaryEmbedding counts
    them; None for the whole head."""
    factor = data.get("partial_rotary_factor", dict_or_empty(data.get("rope_parameters")).get(
        "partial_rotary_factor", 1.0))
    factor = real_number(factor, source, "partial_rotary_factor")
    if not 0 < factor <= 1:
        raise ConfigError(f"{source}: 'partial_rotary_factor' must be above 0 and at most 1, got {factor:g}; the file "
                          "is malformed")
    rotary = int(head_dim * factor)
    if rotary == head_dim:
        return None
    if rotary <= 0 or rotary % 2:
        raise ConfigError(f"{source}: partial_rotary_factor {factor:g} of a head of {head_dim} turns {rotary} "
                          "values; RoPE turns them in pairs, so it must be a positive even number (the file is "
                          "malformed)")
    return rotary


# Gemma3TextConfig's defaults, for a config.json that leaves a field out (transformers' configuration_gemma3.py)
_GEMMA3_DEFAULTS = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window": 4096,
                    "sliding_window_pattern": 6, "query_pre_attn_scalar": 256}


def _gemma3(data: Mapping[str, Any], n_layers: int, source: str) -> dict[str, Any]:
    """Gemma 3's fields from its config.json (model_type gemma3_text), as transformers reads them: every twist on,
    the windowed layers from `layer_types` (or every `sliding_window_pattern`-th layer global), the global layers'
    RoPE base and scaling and the windowed layers' base from `rope_parameters` (transformers 5) or `rope_theta`,
    `rope_scaling` and `rope_local_base_freq` (the hub's files). What llmtrace does not model is refused in one line."""
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if data.get(key):
            raise UnsupportedModelError(f"{source}: {key} {short_repr(data[key])} is not modelled; llmtrace runs "
                                        "Gemma 3 causal, its scores not soft-capped")
    act = data.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"{source}: hidden_activation {short_repr(act)} is not modelled; llmtrace's "
                                    "Gemma 3 FFN is gelu (tanh approximation)-gated")
    window, full = _gemma3_layers(data, n_layers, source)
    softcap = data.get("final_logit_softcapping")
    return dict(norm_plus_one=True, post_norms=True, geglu=True, embed_scale=True, qk_norm=True,
                qkv_bias=bool(data.get("attention_bias", False)), wo_bias=bool(data.get("attention_bias", False)),
                query_pre_attn_scalar=real_number(data.get("query_pre_attn_scalar",
                                                           _GEMMA3_DEFAULTS["query_pre_attn_scalar"]),
                                                  source, "query_pre_attn_scalar"),
                sliding_window=window, full_layers=full,
                **_gemma3_rope(data, window, source),
                final_softcap=None if softcap is None else real_number(softcap, source, "final_logit_softcapping"),
                tie_embeddings=data.get("tie_word_embeddings", True) is not False)


def _gemma3_layers(data: Mapping[str, Any], n_layers: int, source: str) -> tuple[int | None, tuple[int, ...]]:
    """(sliding window, the global layers): from `layer_types`, or every `sliding_window_pattern`-th layer global;
    no window where every layer is global."""
    layer_types = data.get("layer_types")
    if layer_types is None:
        pattern = whole_number(data.get("sliding_window_pattern", _GEMMA3_DEFAULTS["sliding_window_pattern"]),
                               source, "sliding_window_pattern")
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != n_layers or not set(layer_types) <= {
            "sliding_attention", "full_attention"}:
        raise ConfigError(f"{source}: 'layer_types' must list 'sliding_attention' or 'full_attention' for each of the "
                          f"{n_layers} layers, got {short_repr(layer_types)}")
    window = data.get("sliding_window", _GEMMA3_DEFAULTS["sliding_window"])
    if window is not None:
        window = whole_number(window, source, "sliding_window")
    full = tuple(i for i, kind in enumerate(layer_types) if kind == "full_attention")
    if window is None or len(full) == n_layers:
        return None, ()
    return window, full


def _gemma3_rope(data: Mapping[str, Any], window: int | None, source: str) -> dict[str, Any]:
    """The global layers' RoPE base and scaling, and the windowed layers' base (where there are windowed layers)."""
    params = dict_or_empty(data.get("rope_parameters"))
    global_params = dict_or_empty(params.get("full_attention")) or dict_or_empty(data.get("rope_scaling"))
    local_params = dict_or_empty(params.get("sliding_attention"))
    theta = global_params.get("rope_theta", data.get("rope_theta", _GEMMA3_DEFAULTS["rope_theta"]))
    local = local_params.get("rope_theta", data.get("rope_local_base_freq", _GEMMA3_DEFAULTS["rope_local_base_freq"]))
    if local_params.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"{source}: RoPE scaling on the windowed layers is not modelled")
    scaling = None
    kind = global_params.get("rope_type") or global_params.get("type")
    if kind == "linear":
        scaling = RopeScaling(real_number(global_params.get("factor"), source, "rope_scaling.factor"),
                              whole_number(data.get("max_position_embeddings", 131_072), source,
                                           "max_position_embeddings"), kind="linear")
    elif kind not in (None, "default"):
        raise UnsupportedModelError(f"{source}: rope scaling type {kind!r} is not supported on Gemma 3's global "
                                    "layers; llmtrace handles 'linear'")
    return dict(rope_theta=real_number(theta, source, "rope_theta"), rope_scaling=scaling,
                rope_local_theta=real_number(local, source, "rope_local_base_freq") if window is not None else None)
