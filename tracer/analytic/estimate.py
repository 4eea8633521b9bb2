"""Analytical FLOPs and bytes of a LLaMA forward pass, per component, per layer and in total. Pure Python.

Phases:
- prefill of P prompt tokens into an empty cache (T = P queries over S = P keys);
- one decode step with L positions already cached (T = 1 query over S = L + 1 keys, its own included);
- a whole generation of N new tokens: the prefill (which yields token 1) plus N - 1 decode steps at
  L = P, P+1, ..., P+N-2, summed exactly step by step (the last new token is never fed back).
The final norm and the LM head run on the last position of each sequence only (B rows), in prefill and decode.

Every pass is costed under a kernel model (llmtrace.tracer.analytic.kernels): `eager` runs each operation as its
own kernel, attention scores materialised and every (query, key) pair computed; `fused` runs attention as
FlashAttention does (scores on chip, masked tiles skipped) with the elementwise operations fused into the matmuls.

Bytes are the traffic the kernels need at least: weights read once per forward pass (the embedding reads only the
gathered rows), the KV cache read once per KV head (K in QKᵀ, V in PV) and written for the new positions, and
activations read and written between kernels in the activation dtype (eager: once per operation; fused: once per
matmul and attention kernel). `min_bytes` (weights + KV) is what a pass must move whatever the kernels.

Where windowed and global layers interleave (Gemma 3: config.full_layers) the attention core is costed twice: its
components as the windowed layers run them (instances: the windowed layers) and, named with GLOBAL_SUFFIX, as the
global layers run them over every position (instances: the global layers); "one layer" is a windowed one.

A mixture of experts (config.moe: E experts, k per token) adds the router (logits d -> E, then softmax, top-k and
the renormalisation its model does) and the weighted sum of the k expert outputs; each expert product runs on the
k·B·T token rows routed to it (FLOPs and activations k times a dense FFN of the same F), and reads the experts the
pass's B·T tokens touch, E·(1 - (1 - k/E)^(B·T)) of them expected under uniform routing (tracer/analytic/moe.py).

Arithmetic intensity, one meaning across llmtrace (`flops`, `roofline`, `run`): FLOPs executed / bytes moved by the
kernels executing them (`total_bytes`, activations included), the x axis of the roofline. `weights_kv_intensity`
(FLOPs / min_bytes) is the highest intensity any kernel fusion could reach for the pass.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

from llmtrace.tracer.core import flop_formulas as ff
from llmtrace.tracer.analytic.kernels import Kernels
from llmtrace.tracer.analytic.moe import MoeSummary, batches_shown, expected_distinct_experts, moe_summary
from llmtrace.tracer.analytic.params import norm_dtype_for
from llmtrace.tracer.core import contract
from llmtrace.tracer.core.config import ModelConfig, first_attended_position
from llmtrace.tracer.core.dtypes import DType, activation_dtype_for
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.core.stage_kinds import KINDS, CallDims, step_flops

MATMUL, ELEMENTWISE, MEMORY = "matmul", "elementwise", "memory"

# flop_formulas' constants as the formulas' text shows them (the figures beside them are the kinds' own)
_NE, _NR = ff.RMSNORM_FLOPS_PER_ELEMENT, ff.RMSNORM_FLOPS_PER_ROW
_SM, _RO, _SC = ff.SOFTMAX_FLOPS_PER_ELEMENT, ff.ROPE_FLOPS_PER_ELEMENT, ff.SOFTCAP_FLOPS_PER_ELEMENT


@dataclass(frozen=True, slots=True)
class Dtypes:
    weights: DType
    kv: DType
    activations: DType
    # Tensors whose bytes the file gives (a GGUF's, each as its own type): (contract tensor name, bytes, values)
    # over all layers. Their traffic is those bytes, in proportion to the values read; every other tensor is sized
    # by `weights` (matrices) or its vector dtype (norms, biases).
    stored: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def for_weights(cls, weights: DType, kv: DType | None = None,
                    stored: tuple[tuple[str, int, int], ...] = ()) -> "Dtypes":
        act = activation_dtype_for(weights)
        return cls(weights=weights, kv=kv or act, activations=act, stored=stored)

    def tensor_bytes(self, tensor: str, values: int, default: int) -> int:
        """Bytes of `values` values of `tensor` as the file stores it, else `default`."""
        for name, n_bytes, n_values in self.stored:
            if name == tensor:
                return round(values * n_bytes / n_values)
        return default


# Output records, read field by field and through asdict(): eq=False and repr=False spare compiling __eq__,
# __hash__ and __repr__ for each at import, which the analytical commands (answering in a blink) feel.
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ComponentCost:
    """One stage of the forward pass. Per-instance figures; `instances` is n_layers inside a layer, else 1."""

    name: str  # stable id, the model's module path inside a layer ("attention.wq") or at the top ("output")
    label: str
    kind: str  # "matmul" | "elementwise" | "memory"
    per_layer: bool
    instances: int
    formula: str  # symbolic = numbers substituted, per instance
    flops: int  # per instance, as the kernel model executes it (eager: every pair; fused: causal pairs only)
    useful_flops: int  # per instance; less than flops only for eager attention products under a causal mask
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    act_read_bytes: int
    act_write_bytes: int
    total_flops: int  # flops * instances
    total_useful_flops: int


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class Totals:
    """Sums over components (all instances)."""

    matmul_flops: int
    elementwise_flops: int
    total_flops: int  # as the kernel model executes them (eager: masked pairs included)
    useful_flops: int  # with the attention products counted over causal pairs only
    attention_dense_flops: int  # QKᵀ + PV as executed
    attention_useful_flops: int  # QKᵀ + PV over the pairs the causal mask keeps
    per_layer_flops: int  # one layer, dense
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    activation_bytes: int  # read + written between kernels
    min_bytes: int  # weights + KV read + KV written
    total_bytes: int  # min_bytes + activations: what the kernels move
    arithmetic_intensity: float  # total_flops / total_bytes
    weights_kv_intensity: float  # total_flops / min_bytes: the most any kernel fusion could reach
    peak_activation_bytes: int  # largest one kernel's activation inputs + outputs (eager prefill: the scores)

    @property
    def attention_masked_flops(self) -> int:
        """QKᵀ + PV FLOPs spent on the pairs a causal mask discards (executed densely, useless)."""
        return self.attention_dense_flops - self.attention_useful_flops


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class PhaseEstimate:
    phase: str  # "prefill" | "decode"
    kernels: str  # "eager" | "fused"
    batch: int
    new_tokens: int  # T, per sequence
    cached_before: int  # positions in the cache before this pass (0 for a prefill, L for a decode step)
    kv_len: int  # S, positions attended after this pass
    components: tuple[ComponentCost, ...]
    totals: Totals

    def per_layer_flops_of(self, kind: str) -> int:
        """FLOPs of one layer's components of `kind` (MATMUL or ELEMENTWISE): a windowed layer's where global layers
        interleave (their attention core's rows, GLOBAL_SUFFIX, left out)."""
        return sum(c.flops for c in self.components if c.per_layer and c.kind == kind and not is_global(c.name))


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ComponentSum:
    """One component over a whole generation: its prefill figure plus the sum over all decode steps."""

    name: str
    label: str
    kind: str
    prefill_flops: int  # all instances
    decode_flops: int  # all instances, all decode steps
    total_flops: int
    total_useful_flops: int


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class GenerationEstimate:
    prompt_len: int
    new_tokens: int
    batch: int
    kernels: str  # "eager" | "fused"
    decode_steps: int  # new_tokens - 1
    final_kv_len: int  # positions in the cache after the last decode step
    exceeds_max_seq_len: bool
    components: tuple[ComponentSum, ...]
    prefill_totals: Totals
    decode_totals: Totals  # sum over the decode steps only (per_layer_flops is 0: steps differ)
    totals: Totals  # prefill + decode steps (per_layer_flops is 0)


# ---- one pass ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Cost:
    """What one instance of a component costs in one pass: FLOPs (all, and those the causal mask keeps) and the bytes
    it must move. Also a sum of such figures over instances or steps."""

    flops: int = 0
    useful_flops: int = 0
    weight_bytes: int = 0
    kv_read_bytes: int = 0
    kv_write_bytes: int = 0
    act_read_bytes: int = 0
    act_write_bytes: int = 0

    def times(self, n: int) -> Cost:
        return Cost(*(getattr(self, f) * n for f in _COST_FIELDS))

    def plus(self, other: Cost) -> Cost:
        return Cost(*(getattr(self, f) + getattr(other, f) for f in _COST_FIELDS))

    @property
    def activation_bytes(self) -> int:
        return self.act_read_bytes + self.act_write_bytes


_COST_FIELDS = tuple(f.name for f in fields(Cost))


@dataclass(frozen=True, slots=True)
class _Row:
    """One component of one pass before it becomes a ComponentCost: the formula is a thunk, formatted only for
    the pass that is shown."""

    name: str
    label: str
    kind: str
    per_layer: bool
    formula: Callable[[], str]
    cost: Cost
    instances: int | None = None  # how many layers run it, where not all (interleaved windows); None: all, or 1

    def with_cost(self, cost: Cost) -> _Row:
        return _Row(self.name, self.label, self.kind, self.per_layer, self.formula, cost, self.instances)

    def count(self, cfg: ModelConfig) -> int:
        """Instances of the row in one pass: its layers, every layer, or 1 at the top."""
        return self.instances if self.instances is not None else cfg.n_layers if self.per_layer else 1


# The attention core's components on the global layers of a model whose windowed and global layers interleave.
GLOBAL_SUFFIX = ".global"


def is_global(name: str) -> bool:
    return name.endswith(GLOBAL_SUFFIX)


def _full_attention(cfg: ModelConfig) -> ModelConfig:
    """The config as its global layers attend: no window."""
    return replace(cfg, sliding_window=None, full_layers=())


def attended_keys(cfg: ModelConfig, t: int, s: int) -> int:
    """Keys the attention of T new queries over S positions reads and multiplies, as the model runs it: S, or
    under a sliding window W only those from the first query's oldest visible key (at most T + W - 1)."""
    return s - first_attended_position(s, t, cfg.sliding_window)


def _dims(cfg: ModelConfig, batch: int, t: int, s: int, per_layer: bool = True,
          widths: tuple[int, int] = (0, 0)) -> CallDims:
    """A step's call dimensions as the stage kinds take them (stage_kinds.CallDims): T new tokens of B sequences,
    S keys attended; rows (B, T) in a layer, (B,) after it (the last position only)."""
    return CallDims(batch, t, s, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim,
                    (batch, t) if per_layer else (batch,), qk_norm_whole=cfg.qk_norm_whole, widths=widths,
                    vocab=cfg.vocab_size, rotary=cfg.rotary_dim)


def _attention_core_numbers(cfg: ModelConfig, batch: int, t: int, s: int, dt: Dtypes,
                            kernels: Kernels) -> list[Cost]:
    """The Costs of QKᵀ, scaling, softmax, PV.
    Under a sliding window they grow with the keys attended (attended_keys), which stop growing at the window."""
    h, hd = cfg.n_heads, cfg.head_dim
    a = dt.activations.bytes_per_value
    q_bytes = int(batch * t * cfg.q_dim * a)
    s = attended_keys(cfg, t, s)
    useful = ff.causal_attention_product_flops(batch, h, t, s, hd, cfg.sliding_window)
    bhts_bytes = int(batch * h * t * s * a)
    kv_read = batch * s * cfg.n_kv_heads * dt.kv.row_bytes(hd)  # K (or V) of every cached position, once per KV head
    if kernels is Kernels.FUSED:
        # FlashAttention: Q, K, V read once, O written once, scores on chip; masked tiles skipped, so the products,
        # the scaling and the softmax run over the causal pairs only.
        pairs = batch * h * ff.causal_useful_pairs(t, s, cfg.sliding_window)
        scale = ff.SCORE_SCALE_FLOPS_PER_ELEMENT * pairs
        softmax = ff.SOFTMAX_FLOPS_PER_ELEMENT * pairs
        return [
            Cost(flops=useful, useful_flops=useful, kv_read_bytes=kv_read, act_read_bytes=q_bytes),
            Cost(flops=scale, useful_flops=scale),
            Cost(flops=softmax, useful_flops=softmax),
            Cost(flops=useful, useful_flops=useful, kv_read_bytes=kv_read, act_write_bytes=q_bytes),
        ]
    dims = _dims(cfg, batch, t, s)  # the stage kinds' FLOPs: every (query, key) pair, as eager kernels run them
    (product, scale), (_, softmax), (values, _) = (step_flops(kind, dims) for kind in _CORE_KINDS)
    return [
        Cost(flops=product, useful_flops=useful, kv_read_bytes=kv_read, act_read_bytes=q_bytes,
             act_write_bytes=bhts_bytes),
        Cost(flops=scale, useful_flops=scale, act_read_bytes=bhts_bytes, act_write_bytes=bhts_bytes),
        Cost(flops=softmax, useful_flops=softmax, act_read_bytes=bhts_bytes, act_write_bytes=bhts_bytes),
        Cost(flops=values, useful_flops=useful, kv_read_bytes=kv_read, act_read_bytes=bhts_bytes,
             act_write_bytes=q_bytes),
    ]


def _attention_core_sums(cfg: ModelConfig, batch: int, prompt_len: int, steps: int, dt: Dtypes,
                         kernels: Kernels) -> list[Cost]:
    """The attention core's Costs summed over `steps` decode steps, at KV lengths P+1 .. P+steps (per layer).

    With one new token per step every figure is affine in the KV length s (the products, the scaling and the
    softmax grow with the s pairs, the KV bytes with s rows, the scores with B·H·s values of whole bytes), so the
    sum is n·f(s₀) + (f(s₀+1) − f(s₀))·n(n−1)/2, exact in integers and instant for any n (a loop over steps never
    finished for --new-tokens 10**30). Activations of a fractional byte width (no CLI dtype has them) floor
    B·H·s·a, so those are summed step by step.
    """
    if steps == 0:
        return [Cost()] * 4
    first = _attention_core_numbers(cfg, batch, 1, prompt_len + 1, dt, kernels)
    if steps == 1:
        return first
    if not float(dt.activations.bytes_per_value).is_integer():
        totals = [Cost()] * len(first)
        for s in range(prompt_len + 1, prompt_len + steps + 1):
            totals = [acc.plus(c) for acc, c in zip(totals, _attention_core_numbers(cfg, batch, 1, s, dt, kernels))]
        return totals
    second = _attention_core_numbers(cfg, batch, 1, prompt_len + 2, dt, kernels)
    pairs = steps * (steps - 1) // 2
    return [Cost(*(steps * getattr(a, f) + (getattr(b, f) - getattr(a, f)) * pairs for f in _COST_FIELDS))
            for a, b in zip(first, second)]


def _attention_core(cfg: ModelConfig, batch: int, t: int, s: int, dt: Dtypes, kernels: Kernels) -> list[_Row]:
    """The components that grow with the context S: QKᵀ, scaling, softmax, PV (per layer)."""
    h, hd = cfg.n_heads, cfg.head_dim
    context, s = s, attended_keys(cfg, t, s)
    pairs = ff.causal_useful_pairs(t, s, cfg.sliding_window)
    windowed = f", window {cfg.sliding_window}: S = {s} of {context}" if s != context else ""
    if kernels is Kernels.FUSED and pairs != t * s:  # masked tiles skipped: the causal pairs P only
        # P: the (query, key) pairs the causal mask keeps, T·(S-T) + T·(T+1)/2
        meta = [
            ("attention.scores", "scores QKᵀ", MATMUL, lambda: f"2·B·H·P·D = 2·{batch}·{h}·{pairs:,}·{hd}"),
            ("attention.scale", "scale 1/√D (+mask)", ELEMENTWISE, lambda: f"B·H·P = {batch}·{h}·{pairs:,}"),
            ("attention.softmax", "softmax", ELEMENTWISE, lambda: f"{_SM}·B·H·P = {_SM}·{batch}·{h}·{pairs:,}"),
            ("attention.pv", "probs × V", MATMUL, lambda: f"2·B·H·P·D = 2·{batch}·{h}·{pairs:,}·{hd}"),
        ]
    else:
        causal = f" (causal pairs {pairs:,} of {t * s:,})" if pairs != t * s else ""
        causal += windowed
        meta = [
            ("attention.scores", "scores QKᵀ", MATMUL, lambda: f"2·B·H·T·S·D = 2·{batch}·{h}·{t}·{s}·{hd}{causal}"),
            ("attention.scale", "scale 1/√D (+mask)", ELEMENTWISE, lambda: f"B·H·T·S = {batch}·{h}·{t}·{s}"),
            ("attention.softmax", "softmax", ELEMENTWISE, lambda: f"{_SM}·B·H·T·S = {_SM}·{batch}·{h}·{t}·{s}"),
            ("attention.pv", "probs × V", MATMUL, lambda: f"2·B·H·T·S·D = 2·{batch}·{h}·{t}·{s}·{hd}{causal}"),
        ]
    numbers = _attention_core_numbers(cfg, batch, t, context, dt, kernels)
    return [_Row(name, label, kind, True, formula, cost) for (name, label, kind, formula), cost in zip(meta, numbers)]


# The stage kinds whose cost grows with the context (the attention core, with the score scaling after QKᵀ).
_CORE_KINDS = ("attention_scores", "softmax", "attention_values")
SCALE = "attention.scale"  # the estimate's name for the score scaling, counted by the tracer inside the scores stage


def _core_at(cfg: ModelConfig) -> int:
    """Where the attention core sits among the context-free rows: after every row of the stages before it."""
    at = 0
    for spec in contract.staged_stages(cfg):
        if spec.kind in _CORE_KINDS:
            return at
        at += 2 if contract.bias_of(spec, cfg) is not None else 1
    return at


def _rows(cfg: ModelConfig, batch: int, t: int, s: int, dt: Dtypes, kernels: Kernels) -> list[_Row]:
    """Every component of one forward pass of T new tokens over S positions, per instance, in execution order;
    interleaved windows: the windowed layers' attention core, then the global layers' (GLOBAL_SUFFIX)."""
    rows = _context_free_rows(cfg, batch, t, dt, kernels)
    at = _core_at(cfg)
    core = _attention_core(cfg, batch, t, s, dt, kernels)
    if cfg.mixed_windows:
        windowed = [replace(row, instances=cfg.windowed_layers) for row in core]
        full = [replace(row, name=row.name + GLOBAL_SUFFIX, label=f"{row.label} (global layers)",
                        instances=len(cfg.full_layers))
                for row in _attention_core(_full_attention(cfg), batch, t, s, dt, kernels)]
        core = windowed + full
    return rows[:at] + core + rows[at:]


def stage_components(role: str, cfg: ModelConfig, layer: int | None = None) -> tuple[str, ...]:
    """The components whose figures a traced stage carries together: its own, its bias add, and for the scores
    the scaling; a packed stage of the fused path ("attention.wqkv") those of each of its members. On a global
    `layer` among windowed ones (Gemma 3), the attention core's global rows."""
    if layer is not None and cfg.mixed_windows and cfg.layer_window(layer) is None:
        spec = next((s for s in contract.staged_stages(cfg) if s.role == role), None)
        if spec is not None and spec.kind in _CORE_KINDS:
            return tuple(name + GLOBAL_SUFFIX for name in stage_components(role, cfg))
    pack = next((p for p in contract.PACKS if p.role == role), None)
    names: list[str] = []
    for member in pack.members if pack is not None else (role,):
        names.append(member)
        spec = next((s for s in contract.staged_stages(cfg) if s.role == member), None)
        if spec is not None and contract.bias_of(spec, cfg) is not None:
            names.append(f"{member}.bias")
        if spec is not None and spec.kind == "attention_scores":
            names.append(SCALE)
    return tuple(names)


# Fused kernels (llmtrace.tracer.analytic.kernels): the activation bytes (read, written) of each component whose
# traffic changes, in units of one row of width d, q (= H·D) or F per token. The norms, RoPE and silu·up live in a
# matmul's prologue or epilogue; wk, wv and w3 share the packed matmul of wq and w1 (input read once); K and V go
# from the QKV epilogue straight into the cache; a residual add reads only its skip input, in the epilogue of the
# matmul before it, which writes the sum; w1's epilogue writes silu(gate)·up, the F-wide input of w2.
_FUSED_ACTIVATIONS: dict[str, tuple[str, str]] = {
    "attention_norm": ("", ""), "attention.wq": ("d", "q"), "attention.wk": ("", ""), "attention.wv": ("", ""),
    "attention.qk_norm": ("", ""), "attention.rope": ("", ""), "attention.kv_cache": ("", ""),
    "attn_residual": ("d", ""), "ffn_norm": ("", ""),
    "feed_forward.w1": ("d", "F"), "feed_forward.w3": ("", ""), "feed_forward.act": ("", ""),
    "ffn_residual": ("d", ""), "norm": ("", ""),
    # Gemma's: the scale in the gather's epilogue, the norms after attention and FFN in their matmul's epilogue,
    # gelu(gate)·up in w1's as silu's, the soft-cap in the LM head's
    "embed_scale": ("", ""), "post_attention_norm": ("", ""), "feed_forward.gelu": ("", ""),
    "post_ffn_norm": ("", ""), "softcap": ("", ""),
}


def _fused_traffic(row: _Row, cfg: ModelConfig, rows: int, a: float) -> _Row:
    widths = {"": 0, "d": cfg.dim, "q": cfg.q_dim, "F": cfg.ffn_dim}
    read, write = _FUSED_ACTIVATIONS[row.name]
    c = row.cost
    return row.with_cost(Cost(c.flops, c.useful_flops, c.weight_bytes, c.kv_read_bytes, c.kv_write_bytes,
                              int(rows * widths[read] * a), int(rows * widths[write] * a)))


def _context_free_rows(cfg: ModelConfig, batch: int, t: int, dt: Dtypes, kernels: Kernels) -> list[_Row]:
    """The components whose cost does not depend on how many positions are cached."""
    rows = _eager_context_free_rows(cfg, batch, t, dt)
    if kernels is Kernels.FUSED:
        a = dt.activations.bytes_per_value
        rows = [_fused_traffic(row, cfg, batch * t if row.per_layer else batch, a) if row.name in _FUSED_ACTIVATIONS
                else row for row in rows]
    return rows if cfg.moe is None else _routed_rows(cfg, rows, batch * t, dt)


def _eager_context_free_rows(cfg: ModelConfig, batch: int, t: int, dt: Dtypes) -> list[_Row]:
    """The context-free components as eager kernels run them: each reads its inputs and writes its output."""
    return _EagerRows(cfg, batch, t, dt).rows()


class _EagerRows:
    """The eager estimate of one pass's context-free stages: each stage kind's row (FLOPs, weight and activation
    bytes, formula) made by its own method, in the contract's stage order."""

    def __init__(self, cfg: ModelConfig, batch: int, t: int, dt: Dtypes) -> None:
        self.cfg, self.batch, self.t, self.dt = cfg, batch, t, dt
        self.r = batch * t  # rows through the per-token layers
        self.a = dt.activations.bytes_per_value
        self.vector_dtype = norm_dtype_for(dt.weights)  # norm weights and biases
        self.by_kind: dict[str, Callable[[contract.StageSpec, str, int, str], list[_Row]]] = {
            "linear": self.linear, "lm_head": self.linear, "rmsnorm": self.norm, "residual": self.residual,
            "embedding": self.embedding, "qk_norm": self.qk_norm, "rope": self.rope, "kv_cache": self.kv_cache,
            "swiglu": self.gated, "geglu": self.gated, "scale": self.scale, "softcap": self.softcap,
            "shared_expert_add": self.shared_add}

    def rows(self) -> list[_Row]:
        rows: list[_Row] = []
        for spec in contract.staged_stages(self.cfg):  # in execution order, the attention core apart
            label = spec.label.replace("SwiGLU", "GeGLU") if self.cfg.geglu else spec.label  # Gemma gates a gelu
            if spec.role in MOE_REPLICATED:
                continue  # a mixture of experts' router, route and weighted sum: _routed_rows places them
            make = self.by_kind.get(spec.kind)
            if make is None and spec.kind not in _CORE_KINDS:
                raise ValueError(f"no estimate for stage kind {spec.kind!r}")
            if make is not None:  # the last position of each sequence only, past the layers
                rows += make(spec, label, *((self.r, "BT") if spec.in_layer else (self.batch, "B")))
        return rows

    def flops(self, kind: str, per_layer: bool = True, widths: tuple[int, int] = (0, 0), bias: bool = False) -> int:
        """The stage kind's FLOPs (stage_kinds: its matmul's, or for `bias` a projection's bias add alone)."""
        matmul, elementwise = step_flops(kind, _dims(self.cfg, self.batch, self.t, self.t, per_layer, widths), bias)
        return elementwise if bias or not KINDS[kind].matmul else matmul

    def elementwise(self, spec: contract.StageSpec, label: str, formula: Callable[[], str], kind: str,
                    read: int, write: int, weight_bytes: int = 0, every_token: bool = True) -> list[_Row]:
        """A row of `kind`'s FLOPs over every token's row (else the last position's only) that reads `read` and
        writes `write` activation values."""
        fl = self.flops(kind, every_token)
        return [_Row(spec.role, label, ELEMENTWISE, spec.in_layer, formula,
                     Cost(fl, fl, weight_bytes, 0, 0, int(read * self.a), int(write * self.a)))]

    def linear(self, spec: contract.StageSpec, label: str, rows: int, sym: str) -> list[_Row]:
        """A projection (the LM head too), and its bias add where it has one."""
        cfg, dt, weight = self.cfg, self.dt, spec.tensors[0]
        (o, i), (out_sym, in_sym) = contract.shape_of(weight, cfg), weight.shape
        fl = self.flops("linear", spec.in_layer, (i, o))
        stored = "tok_embeddings.weight" if weight.name == "output.weight" and cfg.tie_embeddings else weight.name
        formula = lambda: f"2·{sym}·{in_sym}·{out_sym} = 2·{rows}·{i}·{o}"  # noqa: E731
        out = [_Row(spec.role, label, MATMUL, spec.in_layer, formula,
                    Cost(fl, fl, dt.tensor_bytes(stored, o * i, dt.weights.matrix_bytes(o, i)), 0, 0,
                         int(rows * i * self.a), int(rows * o * self.a)))]
        bias = contract.bias_of(spec, cfg)
        if bias is not None:  # added in the product's epilogue (addmm): FLOPs and the vector's bytes, no traffic
            fl = self.flops("linear", spec.in_layer, (o, o), bias=True)
            out.append(_Row(f"{spec.role}.bias", f"{label} bias", ELEMENTWISE, spec.in_layer,
                            lambda: f"{sym}·{out_sym} = {rows}·{o}",
                            Cost(fl, fl, dt.tensor_bytes(bias.name, o, self.vector_dtype.row_bytes(o)))))
        return out

    def norm(self, spec: contract.StageSpec, label: str, rows: int, sym: str) -> list[_Row]:
        d = self.cfg.dim
        formula = lambda: f"{sym}·({_NE}d+{_NR}) = {rows}·({_NE}·{d}+{_NR})"  # noqa: E731
        return self.elementwise(spec, label, formula, "rmsnorm", rows * d,
                                rows * d, self.dt.tensor_bytes(spec.tensors[0].name, d, self.vector_dtype.row_bytes(d)),
                                every_token=spec.in_layer)

    def residual(self, spec: contract.StageSpec, label: str, rows: int, sym: str) -> list[_Row]:
        r, d = self.r, self.cfg.dim
        return self.elementwise(spec, label, lambda: f"BT·d = {r}·{d}", "residual", 2 * r * d, r * d)

    def embedding(self, spec: contract.StageSpec, label: str, rows: int, sym: str) -> list[_Row]:
        r, d, dt = self.r, self.cfg.dim, self.dt
        return [_Row(spec.role, label, MEMORY, spec.in_layer, lambda: f"gather {r} rows of {d}: 0 FLOPs",
                     Cost(weight_bytes=dt.tensor_bytes(spec.tensors[0].name, r * d, r * dt.weights.row_bytes(d)),
                          act_write_bytes=int(r * d * self.a)))]

    def qk_norm(self, spec: contract.StageSpec, label: str, rows: int, sym: str) -> list[_Row]:
        """RMSNorm over each of the (H+Hkv) heads' D values of every token, or (OLMoE) over each token's whole q
        and whole k."""
        cfg, r = self.cfg, self.r
        h, hkv, hd, q, kv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.q_dim, cfg.kv_dim
        widths = [contract.shape_of(tensor, cfg)[0] for tensor in spec.tensors]  # D each, or H·D and Hkv·D
        vectors = sum(self.dt.tensor_bytes(t.name, n, self.vector_dtype.row_bytes(n))
                      for t, n in zip(spec.tensors, widths))
        if cfg.qk_norm_whole:
            formula = lambda: (f"BT·({_NE}·H·D+{_NR}) + BT·({_NE}·Hkv·D+{_NR}) = "  # noqa: E731
                               f"{r}·({_NE}·{q}+{_NR}) + {r}·({_NE}·{kv}+{_NR})")
        else:
            formula = lambda: f"BT·(H+Hkv)·({_NE}D+{_NR}) = {r}·({h}+{hkv})·({_NE}·{hd}+{_NR})"  # noqa: E731
        return self.elementwise(spec, label, formula, "qk_norm", r * (q + kv), r * (q + kv), vectors)

    def rope(self, spec: contract.StageSpec, label: str, rows: int, sym: str) -> list[_Row]:
        """3 FLOPs a value turned: every value of each q and k head, or a partial rotary's first R of each."""
        cfg, r = self.cfg, self.r
        h, hkv, width, rotary = cfg.n_heads, cfg.n_kv_heads, cfg.q_dim + cfg.kv_dim, cfg.rotary_dim
        turned = "D" if cfg.rope_dim is None else "R"
        return self.elementwise(spec, label,
                                lambda: f"{_RO}·BT·(H+Hkv)·{turned} = {_RO}·{r}·({h}+{hkv})·{rotary}", "rope",
                                r * width, r * width)

    def kv_cache(self, spec: contract.StageSpec, label: str, rows: int, sym: str) -> list[_Row]:
        r, hkv, hd = self.r, self.cfg.n_kv_heads, self.cfg.head_dim
        kv_vec = self.dt.kv.row_bytes(hd)  # one head vector of K or V, scales included
        formula = lambda: f"store 2·BT·Hkv·D = 2·{r}·{hkv}·{hd} values"  # noqa: E731
        return [_Row(spec.role, label, MEMORY, spec.in_layer, formula,
                     Cost(kv_write_bytes=2 * r * hkv * kv_vec, act_read_bytes=int(2 * r * self.cfg.kv_dim * self.a)))]

    def gated(self, spec: contract.StageSpec, label: str, rows: int, sym: str) -> list[_Row]:
        """silu(gate)·up (6 FLOPs an element) or Gemma's gelu(gate)·up (10), F wide (a shared expert's: Fs)."""
        r = self.r
        shared = spec.role in contract.SHARED_EXPERT_ROLES
        f, width = (self.cfg.shared_expert_dim or 0, "Fs") if shared else (self.cfg.ffn_dim, "F")
        per = ff.SWIGLU_FLOPS_PER_ELEMENT if spec.kind == "swiglu" else ff.GEGLU_FLOPS_PER_ELEMENT
        fl = step_flops(spec.kind, replace(_dims(self.cfg, self.batch, self.t, self.t), ffn_dim=f))[1]
        return [_Row(spec.role, label, ELEMENTWISE, spec.in_layer, lambda: f"{per}·BT·{width} = {per}·{r}·{f}",
                     Cost(fl, fl, 0, 0, 0, int(2 * r * f * self.a), int(r * f * self.a)))]

    def shared_add(self, spec: contract.StageSpec, label: str, rows: int, sym: str) -> list[_Row]:
        """Qwen2-MoE's shared expert output times sigmoid(logit), added to the routed sum: the sigmoid once a token,
        a multiply and an add an element."""
        r, d = self.r, self.cfg.dim
        return self.elementwise(spec, label, lambda: f"BT·(4 + 2d) = {r}·(4 + 2·{d})", spec.kind, r * (2 * d + 1),
                                r * d)

    def scale(self, spec: contract.StageSpec, label: str, rows: int, sym: str) -> list[_Row]:
        """Gemma's embeddings times sqrt(d): every token row."""
        r, d = self.r, self.cfg.dim
        return self.elementwise(spec, label, lambda: f"BT·d = {r}·{d}", "scale", r * d, r * d)

    def softcap(self, spec: contract.StageSpec, label: str, rows: int, sym: str) -> list[_Row]:
        """The last position's logits."""
        b, v = self.batch, self.cfg.vocab_size
        return self.elementwise(spec, label, lambda: f"{_SC}·B·V = {_SC}·{b}·{v}", "softcap", b * v, b * v,
                                every_token=False)


# The components a mixture of experts adds around its experts, which every tensor-parallel device runs in full (the
# router is replicated, as vLLM's ReplicatedLinear gate; each device sums its experts' partial outputs before the
# all-reduce).
ROUTER, ROUTE, COMBINE = "feed_forward.router", "feed_forward.route", "feed_forward.combine"
MOE_REPLICATED = frozenset((ROUTER, ROUTE, COMBINE))


def expert_components(cfg: ModelConfig) -> frozenset[str]:
    """The components that run once per chosen expert: the FFN's products, their biases and silu(gate)·up."""
    names = {s.role for s in contract.staged_stages(cfg) if s.kind in ("swiglu", "geglu")
             and s.role not in contract.SHARED_EXPERT_ROLES}  # a shared expert runs once a token
    for spec in contract.staged_stages(cfg):
        for tensor in contract.stage_tensors(spec, cfg):
            if tensor.group == "ffn":
                names.add(f"{spec.role}.bias" if tensor.name.endswith(".bias") else spec.role)
    return frozenset(names)


def _routed_rows(cfg: ModelConfig, rows: list[_Row], tokens: int, dt: Dtypes) -> list[_Row]:
    """The dense FFN's rows turned into a mixture of experts': every expert row k times the work (each token runs
    k experts) reading the distinct experts expected for `tokens` tokens, the router after the FFN norm, the
    weighted sum after the last expert row."""
    assert cfg.moe is not None
    e, k, d = cfg.moe.n_experts, cfg.moe.experts_per_token, cfg.dim
    read = expected_distinct_experts(e, k, tokens)
    experts = expert_components(cfg)
    a = dt.activations.bytes_per_value
    dims = CallDims(tokens, 1, 1, d, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, (tokens, 1), widths=(d, e),
                    experts=e, top_k=k)
    logits = step_flops("linear", dims)[0]
    route = step_flops("route", dims, renormalised=cfg.moe.router_norm == "renormalised")[1]
    combine = step_flops("expert_combine", dims)[1]
    renorm = " + 2·k" if cfg.moe.router_norm == "renormalised" else ""
    router = [
        _Row(ROUTER, "router logits", MATMUL, True, lambda: f"2·BT·d·E = 2·{tokens}·{d}·{e}",
             Cost(logits, logits, dt.weights.matrix_bytes(e, d), 0, 0, int(tokens * d * a), int(tokens * e * a))),
        _Row(ROUTE, f"softmax, top-{k}", ELEMENTWISE, True,
             lambda: f"BT·({_SM}·E + k·E{renorm}) = {tokens}·({_SM}·{e} + {k}·{e}{renorm.replace('k', str(k))})",
             Cost(route, route, 0, 0, 0, int(tokens * e * a), int(tokens * 2 * k * a))),
    ]
    weighted = _Row(COMBINE, f"weighted sum of {k}", ELEMENTWISE, True,
                    lambda: f"BT·d·(2k-1) = {tokens}·{d}·{2 * k - 1}",
                    Cost(combine, combine, 0, 0, 0, int(tokens * k * d * a), int(tokens * d * a)))

    def per_expert(row: _Row) -> _Row:
        c, formula = row.cost, row.formula
        symbols, _, numbers = formula().partition(" = ")
        return _Row(row.name, f"{row.label} ×{k} experts", row.kind, row.per_layer,
                    lambda: f"{symbols}·k = {numbers}·{k}",
                    Cost(c.flops * k, c.useful_flops * k, round(c.weight_bytes * read), c.kv_read_bytes,
                         c.kv_write_bytes, c.act_read_bytes * k, c.act_write_bytes * k))

    out: list[_Row] = []
    expert_rows = [i for i, row in enumerate(rows) if row.name in experts]
    for i, row in enumerate(rows):
        if i == expert_rows[0]:  # the router before the first expert (after the FFN norm and a shared expert)
            out.extend(router)
        out.append(per_expert(row) if row.name in experts else row)
        if i == expert_rows[-1]:
            out.append(weighted)
    return out


@dataclass(frozen=True, slots=True)
class _Counted:
    """A component's cost as the totals count it: `cost` per instance, `instances` of it; `in_layer` adds it to
    the per-layer FLOPs (once); an attention product adds it to the attention FLOPs."""

    name: str
    kind: str
    in_layer: bool
    instances: int
    cost: Cost


def _totals(counted: list[_Counted], peak: int) -> Totals:
    mm = ew = useful = att_dense = att_useful = per_layer = wb = kvr = kvw = act = 0
    for item in counted:
        n, c = item.instances, item.cost
        if item.kind == MATMUL:
            mm += c.flops * n
        else:
            ew += c.flops * n
        useful += c.useful_flops * n
        if item.name in _ATTENTION_PRODUCTS:
            att_dense += c.flops * n
            att_useful += c.useful_flops * n
        if item.in_layer and not is_global(item.name):
            per_layer += c.flops
        wb, kvr, kvw = wb + c.weight_bytes * n, kvr + c.kv_read_bytes * n, kvw + c.kv_write_bytes * n
        act += c.activation_bytes * n
    return _make_totals(mm, ew, useful, att_dense, att_useful, per_layer, wb, kvr, kvw, act, peak)


def _make_totals(mm: int, ew: int, useful: int, att_dense: int, att_useful: int, per_layer: int,
                 wb: int, kvr: int, kvw: int, act: int, peak: int) -> Totals:
    total = mm + ew
    min_bytes = wb + kvr + kvw
    return Totals(
        matmul_flops=mm, elementwise_flops=ew, total_flops=total, useful_flops=useful,
        attention_dense_flops=att_dense, attention_useful_flops=att_useful, per_layer_flops=per_layer,
        weight_bytes=wb, kv_read_bytes=kvr, kv_write_bytes=kvw, activation_bytes=act, min_bytes=min_bytes,
        total_bytes=min_bytes + act, arithmetic_intensity=total / (min_bytes + act) if min_bytes + act else 0.0,
        weights_kv_intensity=total / min_bytes if min_bytes else 0.0, peak_activation_bytes=peak,
    )


def _peak_activation_bytes(rows: list[_Row]) -> int:
    """The largest activation inputs + outputs of one kernel: what must be live at once, at least."""
    return max(row.cost.activation_bytes for row in rows)


_ATTENTION_PRODUCTS = ("attention.scores", "attention.pv", "attention.scores" + GLOBAL_SUFFIX,
                       "attention.pv" + GLOBAL_SUFFIX)


def _counted(cfg: ModelConfig, rows: list[_Row]) -> list[_Counted]:
    return [_Counted(row.name, row.kind, row.per_layer, row.count(cfg), row.cost) for row in rows]


def _phase(cfg: ModelConfig, phase: str, batch: int, t: int, cached: int, dt: Dtypes,
           kernels: Kernels) -> PhaseEstimate:
    s = cached + t
    rows = _rows(cfg, batch, t, s, dt, kernels)
    components = []
    for row in rows:
        n, c = row.count(cfg), row.cost
        components.append(ComponentCost(
            name=row.name, label=row.label, kind=row.kind, per_layer=row.per_layer, instances=n,
            formula=row.formula(), flops=c.flops, useful_flops=c.useful_flops, weight_bytes=c.weight_bytes,
            kv_read_bytes=c.kv_read_bytes, kv_write_bytes=c.kv_write_bytes, act_read_bytes=c.act_read_bytes,
            act_write_bytes=c.act_write_bytes, total_flops=c.flops * n, total_useful_flops=c.useful_flops * n,
        ))
    return PhaseEstimate(phase=phase, kernels=kernels.value, batch=batch, new_tokens=t, cached_before=cached,
                         kv_len=s, components=tuple(components),
                         totals=_totals(_counted(cfg, rows), _peak_activation_bytes(rows)))


def check_count(name: str, value: int, minimum: int = 1) -> int:
    """`value` when it is an integer >= `minimum`, else the one-line BadArgumentError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def prefill(cfg: ModelConfig, prompt_len: int, dtypes: Dtypes, batch: int = 1,
            kernels: Kernels = Kernels.EAGER) -> PhaseEstimate:
    """Prefill of `prompt_len` tokens per sequence into an empty cache."""
    return _phase(cfg, "prefill", check_count("batch", batch), check_count("prompt length", prompt_len), 0, dtypes,
                  Kernels(kernels))


def decode_step(cfg: ModelConfig, context_len: int, dtypes: Dtypes, batch: int = 1,
                kernels: Kernels = Kernels.EAGER) -> PhaseEstimate:
    """One decode step: 1 new token per sequence with `context_len` positions already in the cache."""
    return _phase(cfg, "decode", check_count("batch", batch), 1, check_count("context length", context_len, 0), dtypes,
                  Kernels(kernels))


def generation(cfg: ModelConfig, prompt_len: int, new_tokens: int, dtypes: Dtypes, batch: int = 1,
               prefill_estimate: PhaseEstimate | None = None, kernels: Kernels = Kernels.EAGER) -> GenerationEstimate:
    """Prefill of P tokens then N - 1 decode steps at L = P .. P+N-2, every step summed exactly.

    `prefill_estimate`: the same prefill already computed by the caller (same kernels), to avoid computing it
    twice."""
    check_count("new tokens", new_tokens)
    kernels = Kernels(kernels)
    pre = prefill_estimate if prefill_estimate is not None else prefill(cfg, prompt_len, dtypes, batch, kernels)
    if pre.kernels != kernels.value:
        raise ValueError(f"prefill_estimate was costed with {pre.kernels} kernels, not {kernels.value}")
    steps = new_tokens - 1
    # Per component: its Cost summed over all decode steps, all instances. The context-free components cost the
    # same at every step; the attention core is summed step by step.
    core_at = _core_at(cfg)
    free = [row.cost.times((cfg.n_layers if row.per_layer else 1) * steps)
            for row in _context_free_rows(cfg, batch, 1, dtypes, kernels)]
    core = [c.times(cfg.windowed_layers if cfg.mixed_windows else cfg.n_layers)
            for c in _attention_core_sums(cfg, batch, prompt_len, steps, dtypes, kernels)]
    if cfg.mixed_windows:  # the global layers' core after the windowed layers' (as _rows orders them)
        core += [c.times(len(cfg.full_layers))
                 for c in _attention_core_sums(_full_attention(cfg), batch, prompt_len, steps, dtypes, kernels)]
    sums = free[:core_at] + core + free[core_at:]  # in the order of pre.components
    # per_layer False: a per-layer figure makes no sense for a sum over steps of different lengths.
    # The last step, attending the most positions, has the largest working set of them all.
    decode_peak = (_peak_activation_bytes(_rows(cfg, batch, 1, prompt_len + steps, dtypes, kernels))
                   if steps else 0)
    decode_totals = _totals([_Counted(c.name, c.kind, False, 1, acc) for c, acc in zip(pre.components, sums)],
                            decode_peak)
    p = pre.totals
    totals = _make_totals(
        p.matmul_flops + decode_totals.matmul_flops, p.elementwise_flops + decode_totals.elementwise_flops,
        p.useful_flops + decode_totals.useful_flops, p.attention_dense_flops + decode_totals.attention_dense_flops,
        p.attention_useful_flops + decode_totals.attention_useful_flops, 0,
        p.weight_bytes + decode_totals.weight_bytes, p.kv_read_bytes + decode_totals.kv_read_bytes,
        p.kv_write_bytes + decode_totals.kv_write_bytes, p.activation_bytes + decode_totals.activation_bytes,
        max(p.peak_activation_bytes, decode_peak),
    )
    components = tuple(
        ComponentSum(name=c.name, label=c.label, kind=c.kind, prefill_flops=c.total_flops,
                     decode_flops=acc.flops, total_flops=c.total_flops + acc.flops,
                     total_useful_flops=c.total_useful_flops + acc.useful_flops)
        for c, acc in zip(pre.components, sums)
    )
    final_kv_len = prompt_len + steps
    return GenerationEstimate(
        prompt_len=prompt_len, new_tokens=new_tokens, batch=batch, kernels=kernels.value, decode_steps=steps,
        final_kv_len=final_kv_len,
        exceeds_max_seq_len=final_kv_len > cfg.max_seq_len, components=components, prefill_totals=pre.totals,
        decode_totals=decode_totals, totals=totals,
    )


def moe_reads(cfg: ModelConfig, context: int, dtypes: Dtypes, batch: int, kernels: Kernels = Kernels.EAGER,
              step: PhaseEstimate | None = None) -> MoeSummary | None:
    """A mixture of experts' decode step at `context` costed at each batch size the views show (moe.batches_shown):
    its weight bytes and the expert products' part of them. None for a dense model. `step`: the step at `batch`,
    already costed by the caller."""
    if cfg.moe is None:
        return None
    experts = expert_components(cfg)
    steps = {}
    for b in batches_shown(batch):
        at = step if step is not None and b == batch else decode_step(cfg, context, dtypes, b, kernels)
        steps[b] = (at.totals.weight_bytes,
                    sum(c.weight_bytes * c.instances for c in at.components if c.name in experts))
    return moe_summary(cfg, dtypes.weights, steps)
