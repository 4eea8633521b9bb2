"""The model contract: every stage of a LLaMA-family forward pass and every tensor of its checkpoint, declared once.

Everything that lists stages or tensors derives from the tables below: the stage modules the tracer wraps
(tracer/trace/hooks.py) and the fused path's marks (tracer/trace/fused_marks.py), the analytical estimate's rows
(tracer/analytic/estimate.py) and their tensor-parallel split, parameter counts and weight bytes
(tracer/analytic/params.py), the tensors a checkpoint must hold and their shapes (`expected_shapes`), both loaders'
name maps (HF safetensors, llama.cpp GGUF), the kinds (tracer/core/stage_kinds.py: each kind's shapes and FLOPs,
which the tracer's costs, the packed path's marks and the estimate read) and the labels the CLI prints. Adding a
stage or a tensor here reaches all of them (tests/test_contract.py shows it); the model code (tracer/model/) must
then compute it.

Names are Meta's (llama/model.py), relative to a layer for layer stages ("attention.wq") and absolute at the top
("output"). A tensor's shape is written in dimension symbols (`dims`), so the same declaration gives the numbers,
the estimate's formulas and the checks. A tensor switched by a config flag (`when`, or `unless` for the LM head of
a tied model) is expected exactly when the flag says so. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmtrace.tracer.core.stage_kinds import KINDS, Kind  # noqa: F401 - the contract's kinds, declared there

if TYPE_CHECKING:
    from llmtrace.tracer.core.config import ModelConfig


# ---- kinds: how the cost model and the tracers treat a stage (each kind's shapes and FLOPs: stage_kinds.py) -------

MATMUL_KINDS = frozenset(k.name for k in KINDS.values() if k.matmul)
TUPLE_OUTPUT_KINDS = frozenset(k.name for k in KINDS.values() if k.tuple_output)
INDEX_ARGUMENTS: dict[str, int] = {k.name: k.index_argument for k in KINDS.values() if k.index_argument is not None}


# ---- tensors ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One checkpoint tensor. `name`, `hf` and `gguf` are relative to the layer for layer tensors
    ("layers.{i}.", "model.layers.{i}.", "blk.{i}." in front), absolute at the top."""

    name: str  # ours (Meta's): "attention.wq.weight"
    hf: str  # HF transformers' LlamaForCausalLM / Qwen2ForCausalLM: "self_attn.q_proj.weight"
    gguf: str  # llama.cpp (llama-arch.cpp, LLM_ARCH_LLAMA): "attn_q.weight"
    shape: tuple[str, ...]  # dimension symbols (`dims`), rows first
    group: str  # what a parameter count files it under: embedding, attention, ffn, norm, final_norm, lm_head
    when: str | None = None  # a boolean config field that must be True for the tensor to exist
    unless: str | None = None  # a boolean config field that must be False
    rope_heads: str | None = None  # "H" / "Hkv": llama.cpp interleaves these rows per head for its RoPE
    # The HF name where the layer has norms after attention and FFN too (config.post_norms: Gemma), whose HF names
    # shift: there post_attention_layernorm is the norm after attention, and the FFN's is pre_feedforward_layernorm
    hf_post_norms: str | None = None
    # A mixture of experts' tensor in HF checkpoints, spelled per family (HF_MOE_FAMILIES' order): the router's, and
    # an expert's matrix per expert ("{j}" its index). An expert's matrix is held E times (expected_shapes: (E, ...)
    # stacked); llama.cpp holds all E in one 3-D tensor (`gguf_expert`).
    hf_moe: tuple[str, ...] = ()
    gguf_expert: str | None = None

    def present(self, config: ModelConfig) -> bool:
        if self.when is not None and not getattr(config, self.when):
            return False
        return self.unless is None or not getattr(config, self.unless)


# ---- stages -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StageSpec:
    """One stage of the forward pass: one module of tracer/model/transformer.py (the staged path)."""

    role: str  # module path inside a layer ("attention.wq"), or at the top ("output")
    kind: str  # a key of KINDS
    label: str  # what the estimate's tables call it ("Q projection")
    short: str  # what the run's tables call it ("Q proj")
    in_layer: bool
    block: str | None = None  # "attention" / "FFN": says which one when two stages share a short label
    packed: str | None = None  # the fused-path stage (a PackSpec role) that does this stage's work with others
    replicated: bool = False  # under tensor parallelism every device runs it in full (norms, residual adds)
    tensors: tuple[TensorSpec, ...] = ()
    when: str | None = None  # a config field that must be set (true, a value) for the stage to run (qk_norm: Qwen3)
    unless: str | None = None  # a config field that must not be set (silu(gate)·up: unless geglu)

    def present(self, config: ModelConfig | None) -> bool:
        """Whether the stage runs for `config`; with no config, whether every model runs it (no `when`: LLaMA's)."""
        if config is not None and self.unless is not None and getattr(config, self.unless):
            return False
        return self.when is None or (config is not None and bool(getattr(config, self.when)))


@dataclass(frozen=True, slots=True)
class PackSpec:
    """Stages the fused path (tracer/model/fused.py) runs as one product over their weights packed by rows."""

    role: str
    kind: str
    short: str
    members: tuple[str, ...]  # stage roles, in row order


@dataclass(frozen=True, slots=True)
class FusedStage:
    """One stage the fused path marks: a stage of its own, or a pack of several."""

    role: str
    kind: str
    in_layer: bool
    members: tuple[StageSpec, ...]  # the staged-path stages whose work it does (one unless packed)


def _linear(role: str, label: str, short: str, hf: str, gguf: str, shape: tuple[str, str], group: str,
            packed: str | None = None, rope_heads: str | None = None, bias_when: str | None = None,
            expert: tuple[str, str] | None = None, when: str | None = None) -> StageSpec:
    """A bias-free projection, or one with a bias vector when the config field `bias_when` says so. `expert`: the
    (Mixtral's HF, llama.cpp's) names of its matrix in a mixture of experts, where it is one expert's of E (the
    other HF families keep the dense name under mlp.experts.{j})."""
    hf_moe = () if expert is None else (f"block_sparse_moe.experts.{{j}}.{expert[0]}.weight",
                                        f"mlp.experts.{{j}}.{hf.removeprefix('mlp.')}.weight")
    gguf_expert = None if expert is None else f"{expert[1]}.weight"
    tensors = [TensorSpec(f"{role}.weight", f"{hf}.weight", f"{gguf}.weight", shape, group, rope_heads=rope_heads,
                          hf_moe=hf_moe, gguf_expert=gguf_expert)]
    if bias_when is not None:
        tensors.append(TensorSpec(f"{role}.bias", f"{hf}.bias", f"{gguf}.bias", shape[:1], group, when=bias_when,
                                  rope_heads=rope_heads))
    return StageSpec(role, "linear", label, short, True, packed=packed, tensors=tuple(tensors), when=when)


def _norm(role: str, label: str, block: str, hf: str, gguf: str, when: str | None = None,
          hf_post_norms: str | None = None) -> StageSpec:
    return StageSpec(role, "rmsnorm", label, "RMSNorm", True, block=block, replicated=True, when=when,
                     tensors=(TensorSpec(f"{role}.weight", hf, gguf, ("d",), "norm",  # present with their stage
                                         hf_post_norms=hf_post_norms),))


STAGES: tuple[StageSpec, ...] = (
    StageSpec("tok_embeddings", "embedding", "embedding lookup", "embedding", False,
              tensors=(TensorSpec("tok_embeddings.weight", "model.embed_tokens.weight", "token_embd.weight",
                                  ("V", "d"), "embedding"),)),
    # Gemma: the looked-up rows times sqrt(d), the constant rounded to the model's dtype first (as HF does)
    StageSpec("embed_scale", "scale", "embedding × √d", "× √d", False, when="embed_scale"),
    _norm("attention_norm", "RMSNorm (attention)", "attention", "input_layernorm.weight", "attn_norm.weight"),
    _linear("attention.wq", "Q projection", "Q proj", "self_attn.q_proj", "attn_q", ("H·D", "d"), "attention",
            packed="attention.wqkv", rope_heads="H", bias_when="qkv_bias"),
    _linear("attention.wk", "K projection", "K proj", "self_attn.k_proj", "attn_k", ("Hkv·D", "d"), "attention",
            packed="attention.wqkv", rope_heads="Hkv", bias_when="qkv_bias"),
    _linear("attention.wv", "V projection", "V proj", "self_attn.v_proj", "attn_v", ("Hkv·D", "d"), "attention",
            packed="attention.wqkv", bias_when="qkv_bias"),
    # Qwen3: each q and k head RMS-normalised over its D values (one weight vector for all q heads, one for all k
    # heads), after the projections and before RoPE (HF Qwen3Attention's q_norm, k_norm)
    StageSpec("attention.qk_norm", "qk_norm", "RMSNorm on q, k heads", "QK-norm", True, when="qk_norm",
              tensors=(TensorSpec("attention.qk_norm.q_weight", "self_attn.q_norm.weight", "attn_q_norm.weight",
                                  ("Dq",), "norm"),
                       TensorSpec("attention.qk_norm.k_weight", "self_attn.k_norm.weight", "attn_k_norm.weight",
                                  ("Dk",), "norm"))),  # present with their stage (its `when`)
    StageSpec("attention.rope", "rope", "RoPE on q, k", "RoPE q,k", True),
    StageSpec("attention.kv_cache", "kv_cache", "KV cache write", "KV write", True),
    StageSpec("attention.scores", "attention_scores", "scores QKᵀ", "scores QKᵀ/√D", True),
    StageSpec("attention.softmax", "softmax", "softmax", "softmax", True),
    StageSpec("attention.pv", "attention_values", "probs × V", "probs·V", True),
    _linear("attention.wo", "output projection", "O proj", "self_attn.o_proj", "attn_output", ("d", "H·D"),
            "attention", bias_when="wo_bias"),
    # Gemma's norms after each sub-block, on its output before the residual add ("sandwich" norms)
    _norm("post_attention_norm", "RMSNorm (after attention)", "after attention", "post_attention_layernorm.weight",
          "post_attention_norm.weight", when="post_norms"),
    StageSpec("attn_residual", "residual", "residual add (attention)", "residual +", True, block="attention",
              replicated=True),
    _norm("ffn_norm", "RMSNorm (FFN)", "FFN", "post_attention_layernorm.weight", "ffn_norm.weight",
          hf_post_norms="pre_feedforward_layernorm.weight"),
    # A mixture of experts' shared expert (config.shared_expert_dim: Qwen2-MoE): a SwiGLU of its own width Fs that
    # every token runs, on the FFN norm's output before the router (as HF's Qwen2MoeSparseMoeBlock runs it), and its
    # gate's logit (a d -> 1 linear); `shared_add` below scales its output by sigmoid(logit) and adds it to the
    # routed experts' weighted sum.
    _linear("feed_forward.shared_w1", "shared expert gate (w1)", "shared gate", "mlp.shared_expert.gate_proj",
            "ffn_gate_shexp", ("Fs", "d"), "shared_expert", packed="feed_forward.shared_w13", when="shared_expert_dim"),
    _linear("feed_forward.shared_w3", "shared expert up (w3)", "shared up", "mlp.shared_expert.up_proj",
            "ffn_up_shexp", ("Fs", "d"), "shared_expert", packed="feed_forward.shared_w13", when="shared_expert_dim"),
    StageSpec("feed_forward.shared_act", "swiglu", "shared silu(gate)·up", "shared silu·up", True,
              when="shared_expert_dim"),
    _linear("feed_forward.shared_w2", "shared expert down (w2)", "shared down", "mlp.shared_expert.down_proj",
            "ffn_down_shexp", ("d", "Fs"), "shared_expert", when="shared_expert_dim"),
    # llama.cpp declares ffn_gate_inp_shexp {n_embd}: a file may hold it (d,); the GGUF loader takes it as (1, d)
    _linear("feed_forward.shared_gate", "shared expert gate logit", "shared σ logit", "mlp.shared_expert_gate",
            "ffn_gate_inp_shexp", ("1", "d"), "shared_expert", when="shared_expert_dim"),
    # A mixture of experts (config.moe): the router's logits (a d -> E linear, HF's `gate`), its choice of k experts
    # a token (softmax, top-k, the renormalisation its model does), then the SwiGLU stages below once per chosen
    # expert on the tokens routed to it, with that expert's matrices, and the k outputs' weighted sum.
    StageSpec("feed_forward.router", "linear", "router logits", "router", True, when="moe",
              tensors=(TensorSpec("feed_forward.router.weight", "block_sparse_moe.gate.weight",
                                  "ffn_gate_inp.weight", ("E", "d"), "router",
                                  hf_moe=("block_sparse_moe.gate.weight", "mlp.gate.weight")),)),
    StageSpec("feed_forward.route", "route", "softmax, top-k", "route top-k", True, when="moe"),
    _linear("feed_forward.w1", "SwiGLU gate (w1)", "gate (w1)", "mlp.gate_proj", "ffn_gate", ("F", "d"), "ffn",
            packed="feed_forward.w13", bias_when="mlp_bias",
            expert=("w1", "ffn_gate_exps")),
    _linear("feed_forward.w3", "SwiGLU up (w3)", "up (w3)", "mlp.up_proj", "ffn_up", ("F", "d"), "ffn",
            packed="feed_forward.w13", bias_when="mlp_bias",
            expert=("w3", "ffn_up_exps")),
    StageSpec("feed_forward.act", "swiglu", "silu(gate)·up", "silu(gate)·up", True, unless="geglu"),
    # Gemma: gelu in place of silu, its tanh approximation (HF's gelu_pytorch_tanh)
    StageSpec("feed_forward.gelu", "geglu", "gelu_tanh(gate)·up", "gelu(gate)·up", True, when="geglu"),
    _linear("feed_forward.w2", "SwiGLU down (w2)", "down (w2)", "mlp.down_proj", "ffn_down", ("d", "F"), "ffn",
            bias_when="mlp_bias", expert=("w2", "ffn_down_exps")),
    StageSpec("feed_forward.combine", "expert_combine", "weighted sum of experts", "weighted sum", True, when="moe"),
    # the shared expert's output times sigmoid(its gate's logit), added to the weighted sum (Qwen2-MoE)
    StageSpec("feed_forward.shared_add", "shared_expert_add", "+ σ(logit)·shared expert", "+ shared", True,
              when="shared_expert_dim"),
    _norm("post_ffn_norm", "RMSNorm (after FFN)", "after FFN", "post_feedforward_layernorm.weight",
          "post_ffw_norm.weight", when="post_norms"),
    StageSpec("ffn_residual", "residual", "residual add (FFN)", "residual +", True, block="FFN", replicated=True),
    StageSpec("norm", "rmsnorm", "final RMSNorm (last position)", "final norm", False, replicated=True,
              tensors=(TensorSpec("norm.weight", "model.norm.weight", "output_norm.weight", ("d",), "final_norm"),)),
    StageSpec("output", "lm_head", "LM head (last position)", "LM head", False,
              tensors=(TensorSpec("output.weight", "lm_head.weight", "output.weight", ("V", "d"), "lm_head",
                                  unless="tie_embeddings"),)),
    StageSpec("softcap", "softcap", "logit soft-cap c·tanh(x/c)", "soft-cap", False, when="final_softcap"),
)

PACKS: tuple[PackSpec, ...] = (
    PackSpec("attention.wqkv", "linear", "Q|K|V proj", ("attention.wq", "attention.wk", "attention.wv")),
    PackSpec("feed_forward.shared_w13", "linear", "shared gate|up",
             ("feed_forward.shared_w1", "feed_forward.shared_w3")),
    PackSpec("feed_forward.w13", "linear", "gate|up (w1|w3)", ("feed_forward.w1", "feed_forward.w3")),
)
# A mixture of experts' shared expert's stages (Qwen2-MoE): each runs once a token, not once per chosen expert
SHARED_EXPERT_ROLES = ("feed_forward.shared_w1", "feed_forward.shared_w3", "feed_forward.shared_w13",
                       "feed_forward.shared_act", "feed_forward.shared_w2", "feed_forward.shared_gate",
                       "feed_forward.shared_add")



# ---- derived: stages ----------------------------------------------------------------------------------------------


def stage(role: str) -> StageSpec:
    return _index().by_role[role]


def staged_stages(config: ModelConfig | None = None) -> tuple[StageSpec, ...]:
    """The stages of one forward pass on the staged path, in execution order (layer stages once): those `config`
    runs (a stage switched by a config field only where it is on), or with no config those every model runs."""
    return tuple(s for s in STAGES if s.present(config))


def layer_stages(config: ModelConfig | None = None) -> tuple[StageSpec, ...]:
    return tuple(s for s in staged_stages(config) if s.in_layer)


def fused_stages(config: ModelConfig | None = None, packed: bool = True) -> tuple[FusedStage, ...]:
    """The stages the fused path marks, in order: packed stages replace their members (at the first one).
    `packed=False`: every staged stage its own (Q, K, V, gate and up apart), the stages the native staged step
    marks (tracer/model/native_step.py)."""
    index = _index()
    out: list[FusedStage] = []
    for spec in staged_stages(config):
        if spec.packed is None or not packed:
            out.append(FusedStage(spec.role, spec.kind, spec.in_layer, (spec,)))
        elif spec.role == index.pack_by_role[spec.packed].members[0]:
            pack = index.pack_by_role[spec.packed]
            out.append(FusedStage(pack.role, pack.kind, spec.in_layer, tuple(index.by_role[m] for m in pack.members)))
    return tuple(out)


def short_label(role: str) -> str:
    """The label a run's per-layer table shows for a stage or pack role ("Q proj", "Q|K|V proj", "RMSNorm")."""
    index = _index()
    if role in index.pack_by_role:
        return index.pack_by_role[role].short
    return index.by_role[role].short if role in index.by_role else role


def role_label(role: str) -> str:
    """As `short_label`, with the block named where two roles of a layer share a label ("RMSNorm (FFN)")."""
    index = _index()
    spec = index.by_role.get(role)
    if spec is not None and spec.block is not None and index.short_count[spec.short] > 1:
        return f"{spec.short} ({spec.block})"
    return short_label(role)


# ---- derived: tensors ---------------------------------------------------------------------------------------------


def dims(config: ModelConfig) -> dict[str, int]:
    """The value of each dimension symbol a tensor shape may use."""
    return {"V": config.vocab_size, "d": config.dim, "H·D": config.q_dim, "Hkv·D": config.kv_dim,
            "F": config.ffn_dim, "H": config.n_heads, "Hkv": config.n_kv_heads, "D": config.head_dim,
            "E": config.moe.n_experts if config.moe is not None else 1,
            # QK-norm's weights: a head's D, or the whole projection's (OLMoE: config.qk_norm_whole)
            "Dq": config.q_dim if config.qk_norm_whole else config.head_dim,
            "Dk": config.kv_dim if config.qk_norm_whole else config.head_dim,
            # a mixture of experts' shared expert's width (Qwen2-MoE), and its gate's one output
            "Fs": config.shared_expert_dim or 1, "1": 1}


def shape_of(tensor: TensorSpec, config: ModelConfig) -> tuple[int, ...]:
    values = dims(config)
    return tuple(values[symbol] for symbol in tensor.shape)


def held_shape(tensor: TensorSpec, config: ModelConfig) -> tuple[int, ...]:
    """The tensor's shape as a checkpoint holds it: `shape_of`, with the E experts stacked in front of one expert's
    matrix in a mixture of experts (as llama.cpp's ffn_*_exps and transformers' fused experts hold them)."""
    shape = shape_of(tensor, config)
    return (config.moe.n_experts, *shape) if per_expert(tensor, config) else shape


# The families of HF mixture-of-experts checkpoints, by how they spell the router and experts (TensorSpec.hf_moe):
# Mixtral's block_sparse_moe.{gate, experts.{j}.w1/w2/w3}; Qwen2/3-MoE's and OLMoE's mlp.{gate, experts.{j}.gate_proj,
# up_proj, down_proj}. A folder's family is the one whose router it holds (`hf_moe_family`).
HF_MOE_FAMILIES = ("mixtral", "mlp")


def hf_moe_family(names: set[str] | frozenset[str]) -> str:
    """The family of an HF checkpoint holding tensors `names`: the first whose layer-0 router is among them, else
    Mixtral's (whose names a loader's message then lists as missing)."""
    router = _index().layer_tensors["feed_forward.router.weight"]
    for family, spelling in zip(HF_MOE_FAMILIES, router.hf_moe):
        if f"model.layers.0.{spelling}" in names:
            return family
    return HF_MOE_FAMILIES[0]


def per_expert(tensor: TensorSpec, config: ModelConfig) -> bool:
    """Whether the config holds the tensor once per expert (an expert's matrix in a mixture of experts)."""
    return config.moe is not None and tensor.gguf_expert is not None


def stage_tensors(spec: StageSpec, config: ModelConfig) -> tuple[TensorSpec, ...]:
    """The stage's tensors this config has."""
    return tuple(t for t in spec.tensors if t.present(config))


def bias_of(spec: StageSpec, config: ModelConfig) -> TensorSpec | None:
    """The stage's bias vector when this config has one."""
    return next((t for t in stage_tensors(spec, config) if t.name.endswith(".bias")), None)


def has_bias(role: str, config: ModelConfig) -> bool:
    """Whether the stage `role` (a projection) adds a bias for this config: how the model builds its Linear."""
    return bias_of(stage(role), config) is not None


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for `config` must hold, in our (Meta's) naming, with its shape (`held_shape`: a
    mixture of experts' E experts stacked), in stage order (the embedding, each layer's tensors, the final norm, the
    LM head unless tied)."""
    shapes: dict[str, tuple[int, ...]] = {}
    top = [s for s in staged_stages(config) if not s.in_layer]
    in_layer = layer_stages(config)
    for spec in top[:1]:
        shapes.update((t.name, held_shape(t, config)) for t in stage_tensors(spec, config))
    for i in range(config.n_layers):
        for spec in in_layer:
            shapes.update((f"layers.{i}.{t.name}", held_shape(t, config)) for t in stage_tensors(spec, config))
    for spec in top[1:]:
        shapes.update((t.name, held_shape(t, config)) for t in stage_tensors(spec, config))
    return shapes


def tensor_of(name: str) -> TensorSpec | None:
    """The declaration of one of our tensor names ("layers.3.attention.wq.bias", "norm.weight")."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
        return _index().layer_tensors.get(parts[2])
    return _index().top_tensors.get(name)


def _to_ours(name: str, layer_prefix: str, top_by: dict, layer_by: dict) -> str | None:
    """Our name for a checkpoint's tensor name in one naming scheme (HF's or llama.cpp's), or None."""
    if name in top_by:
        return top_by[name].name
    if name.startswith(layer_prefix):
        layer, _, rest = name[len(layer_prefix):].partition(".")
        if layer.isdigit() and rest in layer_by:
            return f"layers.{layer}.{layer_by[rest].name}"
    return None


def _from_ours(name: str, layer_prefix: str, scheme: str) -> str:
    """The checkpoint name of one of our tensor names in one naming scheme ("hf" or "gguf")."""
    index = _index()
    if name in index.top_tensors:
        return getattr(index.top_tensors[name], scheme)
    _, layer, rest = name.split(".", 2)
    return f"{layer_prefix}{layer}.{getattr(index.layer_tensors[rest], scheme)}"


def hf_to_ours(name: str) -> str | None:
    """Our name for an HF tensor name, or None when it is not a tensor of the contract (a mixture of experts' are
    named by `ours_to_hf_experts`)."""
    return _to_ours(name, "model.layers.", _index().top_by_hf, _index().layer_by_hf)


def ours_to_hf(name: str) -> str:
    """The HF name of one of our tensor names (inverse of `hf_to_ours`)."""
    return _from_ours(name, "model.layers.", "hf")


def ours_to_hf_experts(name: str, config: ModelConfig, family: str = HF_MOE_FAMILIES[0]) -> tuple[str, ...]:
    """The HF names of one of our tensors in a checkpoint of `family` (HF_MOE_FAMILIES): a mixture of experts'
    router, its expert matrices once per expert, expert 0 first (the E matrices stacked into our one), or the one
    HF name of any other tensor."""
    spec = tensor_of(name)
    if spec is not None and spec.hf_post_norms is not None and config.post_norms:
        _, layer, _ = name.split(".", 2)
        return (f"model.layers.{layer}.{spec.hf_post_norms}",)
    if spec is None or not spec.hf_moe or config.moe is None:
        return (ours_to_hf(name),)
    _, layer, _ = name.split(".", 2)
    spelling = spec.hf_moe[HF_MOE_FAMILIES.index(family)]
    if not per_expert(spec, config):
        return (f"model.layers.{layer}.{spelling}",)
    return tuple(f"model.layers.{layer}.{spelling.format(j=j)}" for j in range(config.moe.n_experts))


def gguf_to_ours(name: str) -> str | None:
    """Our name for a llama.cpp tensor name (a mixture of experts' 3-D ffn_*_exps included), or None when it is
    not a tensor of the contract."""
    return _to_ours(name, "blk.", _index().top_by_gguf, _index().layer_by_gguf)


def ours_to_gguf(name: str, config: ModelConfig | None = None) -> str:
    """The llama.cpp name of one of our tensor names (inverse of `gguf_to_ours`): with a mixture of experts'
    `config`, an expert matrix's 3-D ffn_*_exps name."""
    spec = tensor_of(name)
    if config is not None and spec is not None and per_expert(spec, config):
        _, layer, _ = name.split(".", 2)
        return f"blk.{layer}.{spec.gguf_expert}"
    return _from_ours(name, "blk.", "gguf")


def gguf_tensor_flags(tensor_names: set[str] | frozenset[str]) -> dict[str, bool]:
    """The config flags a GGUF file's tensor list sets: a flag is on when layer 0 holds a tensor it switches on."""
    index = _index()
    return {flag: any(f"blk.0.{t.gguf}" in tensor_names for t in index.layer_tensors.values() if t.when == flag)
            for flag in index.flags}


class _Index:
    """Lookups derived from STAGES and PACKS, rebuilt when either is replaced (as tests/test_contract.py does)."""

    def __init__(self, stages: tuple[StageSpec, ...], packs: tuple[PackSpec, ...]) -> None:
        self.key = (stages, packs)
        self.by_role = {s.role: s for s in stages}
        self.pack_by_role = {p.role: p for p in packs}
        self.short_count: dict[str, int] = {}
        for spec in stages:
            if spec.in_layer:
                self.short_count[spec.short] = self.short_count.get(spec.short, 0) + 1
        self.layer_tensors = {t.name: t for s in stages if s.in_layer for t in s.tensors}
        self.top_tensors = {t.name: t for s in stages if not s.in_layer for t in s.tensors}
        # in stage order, so an HF name two tensors share means the later's (post_attention_layernorm: LLaMA's FFN
        # norm; a Gemma checkpoint's names go through ours_to_hf_experts with its config)
        self.layer_by_hf = {t.hf: t for t in self.layer_tensors.values()}
        self.top_by_hf = {t.hf: t for t in self.top_tensors.values()}
        self.layer_by_gguf = {t.gguf: t for t in self.layer_tensors.values()}
        self.layer_by_gguf.update((t.gguf_expert, t) for t in self.layer_tensors.values() if t.gguf_expert)
        self.top_by_gguf = {t.gguf: t for t in self.top_tensors.values()}
        self.flags = tuple(dict.fromkeys(t.when for s in stages for t in s.tensors if t.when))


_cached: list[_Index] = []


def _index() -> _Index:
    if not _cached or _cached[0].key[0] is not STAGES or _cached[0].key[1] is not PACKS:
        _cached[:] = [_Index(STAGES, PACKS)]
    return _cached[0]
