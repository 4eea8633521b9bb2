"""Named configurations of well-known LLaMA-family models, each with the file it was copied from.

The mixture-of-experts presets serve the analytical commands (flops, kvmem, roofline, models) and `run --dry-run`
(its meta model routes round-robin: tracer/model/moe.py). Both count their QK-norm: Qwen3-30B-A3B's per head (D
wide), OLMoE's over each token's whole q and k (H·D, Hkv·D: qk_norm_whole). The Gemma 3 presets are the text models
(Gemma3ForCausalLM's shapes), every twist on."""

from __future__ import annotations

from llmtrace.tracer.core.config import ModelConfig, MoeSpec, RopeScaling
from llmtrace.tracer.core.errors import UnknownPresetError

_LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
_LLAMA32_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)



def _gemma3(name: str, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, ffn: int, window: int,
            max_seq: int, scaling: RopeScaling | None) -> ModelConfig:
    """A Gemma 3 text model: head_dim 256, every sixth layer global (layer_types' full_attention), the windowed
    layers' RoPE base 10,000, the global layers' 1,000,000 (scaled linearly from 4B up), query_pre_attn_scalar 256,
    Q/K-norm, (1 + w) norms before and after attention and FFN, GeGLU, embeddings × √d, tied, no soft-cap."""
    return ModelConfig(name, vocab, dim, layers, heads, kv_heads, ffn, norm_eps=1e-6, rope_theta=1e6,
                       max_seq_len=max_seq, tie_embeddings=True, explicit_head_dim=256, rope_scaling=scaling,
                       sliding_window=window, qk_norm=True, norm_plus_one=True, post_norms=True, geglu=True,
                       embed_scale=True, query_pre_attn_scalar=256.0,
                       full_layers=tuple(range(5, layers, 6)), rope_local_theta=10000.0)


_PRESET_LIST: tuple[ModelConfig, ...] = (
    # LLaMA 1 (Touvron et al. 2023, Table 2; params.json of the original release; HF huggyllama/llama-*/config.json).
    ModelConfig("llama-7b", 32000, 4096, 32, 32, 32, 11008, norm_eps=1e-6, max_seq_len=2048),
    ModelConfig("llama-13b", 32000, 5120, 40, 40, 40, 13824, norm_eps=1e-6, max_seq_len=2048),
    ModelConfig("llama-33b", 32000, 6656, 60, 52, 52, 17920, norm_eps=1e-6, max_seq_len=2048),
    ModelConfig("llama-65b", 32000, 8192, 80, 64, 64, 22016, norm_eps=1e-5, max_seq_len=2048),
    # Llama 2 (meta-llama/Llama-2-*-hf/config.json); 70B uses GQA with 8 KV heads.
    ModelConfig("llama2-7b", 32000, 4096, 32, 32, 32, 11008, norm_eps=1e-5, max_seq_len=4096),
    ModelConfig("llama2-13b", 32000, 5120, 40, 40, 40, 13824, norm_eps=1e-5, max_seq_len=4096),
    ModelConfig("llama2-70b", 32000, 8192, 80, 64, 8, 28672, norm_eps=1e-5, max_seq_len=4096),
    # Llama 3 (meta-llama/Meta-Llama-3-8B/config.json, Meta-Llama-3-70B/config.json).
    ModelConfig("llama3-8b", 128256, 4096, 32, 32, 8, 14336, rope_theta=500000.0, max_seq_len=8192),
    ModelConfig("llama3-70b", 128256, 8192, 80, 64, 8, 28672, rope_theta=500000.0, max_seq_len=8192),
    # Llama 3.1 (meta-llama/Llama-3.1-*/config.json): rope_type llama3, factor 8, 128K context.
    ModelConfig("llama3.1-8b", 128256, 4096, 32, 32, 8, 14336, rope_theta=500000.0, max_seq_len=131072,
                rope_scaling=_LLAMA31_SCALING),
    ModelConfig("llama3.1-70b", 128256, 8192, 80, 64, 8, 28672, rope_theta=500000.0, max_seq_len=131072,
                rope_scaling=_LLAMA31_SCALING),
    ModelConfig("llama3.1-405b", 128256, 16384, 126, 128, 8, 53248, rope_theta=500000.0, max_seq_len=131072,
                rope_scaling=_LLAMA31_SCALING),
    # Llama 3.2 text models (meta-llama/Llama-3.2-1B/config.json, Llama-3.2-3B/config.json): tied embeddings.
    ModelConfig("llama3.2-1b", 128256, 2048, 16, 32, 8, 8192, rope_theta=500000.0, max_seq_len=131072,
                tie_embeddings=True, explicit_head_dim=64, rope_scaling=_LLAMA32_SCALING),
    ModelConfig("llama3.2-3b", 128256, 3072, 28, 24, 8, 8192, rope_theta=500000.0, max_seq_len=131072,
                tie_embeddings=True, explicit_head_dim=128, rope_scaling=_LLAMA32_SCALING),
    # TinyLlama (TinyLlama/TinyLlama-1.1B-Chat-v1.0/config.json).
    ModelConfig("tinyllama-1.1b", 32000, 2048, 22, 32, 4, 5632, norm_eps=1e-5, max_seq_len=2048),
    # Mistral 7B v0.1 (mistralai/Mistral-7B-v0.1/config.json): "sliding_window": 4096.
    ModelConfig("mistral-7b", 32000, 4096, 32, 32, 8, 14336, norm_eps=1e-5, max_seq_len=32768, sliding_window=4096),
    # SmolLM2 (HuggingFaceTB/SmolLM2-*/config.json): LLaMA architecture, GQA, tied embeddings.
    ModelConfig("smollm2-135m", 49152, 576, 30, 9, 3, 1536, norm_eps=1e-5, rope_theta=100000.0, max_seq_len=8192,
                tie_embeddings=True),
    ModelConfig("smollm2-360m", 49152, 960, 32, 15, 5, 2560, norm_eps=1e-5, rope_theta=100000.0, max_seq_len=8192,
                tie_embeddings=True),
    ModelConfig("smollm2-1.7b", 49152, 2048, 24, 32, 32, 8192, norm_eps=1e-5, rope_theta=130000.0, max_seq_len=8192,
                tie_embeddings=True),
    # Qwen3 dense (Qwen/Qwen3-0.6B/config.json, Qwen/Qwen3-8B/config.json): QK-norm, no biases; the 0.6B's heads are
    # 128 wide where dim / heads is 64, and it ties its embeddings.
    ModelConfig("qwen3-0.6b", 151936, 1024, 28, 16, 8, 3072, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960,
                tie_embeddings=True, explicit_head_dim=128, qk_norm=True),
    ModelConfig("qwen3-8b", 151936, 4096, 36, 32, 8, 12288, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960,
                qk_norm=True),
    # Phi-3-mini 4k (microsoft/Phi-3-mini-4k-instruct/config.json): MHA, "sliding_window": 2047; its checkpoint packs
    # Q|K|V and gate|up (split at load: tracer/checkpoint/packed_tensors.py).
    ModelConfig("phi3-mini-4k", 32064, 3072, 32, 32, 32, 8192, norm_eps=1e-5, max_seq_len=4096, sliding_window=2047),
    # Phi-4-mini (microsoft/Phi-4-mini-instruct/config.json): Phi3ForCausalLM with GQA (24 heads over 8), tied
    # embeddings, a 200,064-token vocabulary and partial_rotary_factor 0.75: RoPE turns 96 of each head's 128 values.
    # Its LongRoPE factors (48 short, 48 long past the original 4,096 positions) are left to its config.json: they
    # move no FLOP nor byte; its sliding_window 262,144 is past its 131,072 positions, so no key ever leaves it.
    ModelConfig("phi4-mini", 200064, 3072, 32, 24, 8, 8192, norm_eps=1e-5, max_seq_len=131072, tie_embeddings=True,
                rope_dim=96),
    # Gemma 3 text models: google/gemma-3-1b-pt/config.json (sliding_window 512, 32K context) and the text_config of
    # google/gemma-3-4b-pt/config.json (sliding_window 1024, 128K context, rope_scaling linear x8 on the global
    # layers; its vision tower is not counted: run refuses the folder, the analytical commands cost the text model).
    _gemma3("gemma3-1b", 262144, 1152, 26, 4, 1, 6912, 512, 32768, None),
    _gemma3("gemma3-4b", 262208, 2560, 34, 8, 4, 10240, 1024, 131072,
            RopeScaling(8.0, 131072, kind="linear")),
    # Mixture of experts: every layer's FFN is E SwiGLU experts of ffn_dim, k per token.
    # Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1/config.json): num_local_experts 8, num_experts_per_tok 2, no window.
    ModelConfig("mixtral-8x7b", 32000, 4096, 32, 32, 8, 14336, norm_eps=1e-5, rope_theta=1e6, max_seq_len=32768,
                moe=MoeSpec(8, 2, "renormalised")),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B/config.json): num_experts 128, num_experts_per_tok 8, moe_intermediate_size
    # 768 (its intermediate_size 6144 is for dense layers, of which it has none: mlp_only_layers []), norm_topk_prob;
    # QK-norm as the dense Qwen3 (Qwen3MoeAttention's q_norm, k_norm).
    ModelConfig("qwen3-30b-a3b", 151936, 2048, 48, 32, 4, 768, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960,
                explicit_head_dim=128, qk_norm=True, moe=MoeSpec(128, 8, "renormalised")),
    # Qwen1.5-MoE-A2.7B (Qwen/Qwen1.5-MoE-A2.7B/config.json): num_experts 60, num_experts_per_tok 4,
    # moe_intermediate_size 1408, norm_topk_prob false, and a shared expert of shared_expert_intermediate_size 5632
    # beside them (its output gated by sigmoid(shared_expert_gate)); Q/K/V biases (Qwen2's attention), MHA.
    ModelConfig("qwen1.5-moe-a2.7b", 151936, 2048, 24, 16, 16, 1408, norm_eps=1e-6, rope_theta=1e6, max_seq_len=8192,
                qkv_bias=True, moe=MoeSpec(60, 4, "softmax"), shared_expert_dim=5632),
    # OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924/config.json): num_experts 64, num_experts_per_tok 8, norm_topk_prob false.
    ModelConfig("olmoe-1b-7b", 50304, 2048, 16, 16, 16, 1024, norm_eps=1e-5, max_seq_len=4096,
                qk_norm=True, qk_norm_whole=True, moe=MoeSpec(64, 8, "softmax")),
)

PRESETS: dict[str, ModelConfig] = {cfg.name: cfg for cfg in _PRESET_LIST}


def get_preset(name: str) -> ModelConfig:
    """The preset called `name` (case-insensitive), or an error that suggests the nearest names."""
    key = name.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    import difflib  # only for a miss: the analytical commands must start in a blink

    near = difflib.get_close_matches(key, PRESETS, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(near)}?" if near else "run `llmtrace models` to list them"
    raise UnknownPresetError(f"unknown model {name!r}: not a preset nor an existing path; {hint}")
