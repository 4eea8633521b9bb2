"""A LLaMA-family transformer in which every stage is a module with a stable dotted name, so hooks can see it.

Shape legend (used in every shape comment below):
    B    batch
    T    new tokens in this forward (the prompt length in prefill, 1 in decode)
    S    cached positions attention reads (positions so far, including the T new ones)
    dim  model width (hidden size)            V    vocabulary size
    H    query heads      Hkv  KV heads       R    H // Hkv (query heads per KV head; 1 = MHA)
    D    head dim (config.head_dim; not always dim // H)
    F    FFN width (SwiGLU intermediate size)

Module tree (the stages of tracer/core/contract.py, whose roles are these dotted names):
    tok_embeddings, layers.{i}.attention_norm,
    layers.{i}.attention.{wq,wk,wv,qk_norm (Qwen3's; None without),rope,kv_cache,scores,softmax,pv,wo},
    layers.{i}.attn_residual, layers.{i}.ffn_norm, layers.{i}.feed_forward.{w1,w3,act,w2}, layers.{i}.ffn_residual,
    norm, output; a mixture of experts' feed_forward.{router,route,w1,w3,act,w2,combine} (tracer/model/moe.py), with
    Qwen2-MoE's shared expert feed_forward.{shared_w1,shared_w3,shared_act,shared_w2,shared_gate,shared_add}. A
projection has a bias where the contract declares one for the config (contract.has_bias:
wq, wk, wv with config.qkv_bias, wo with wo_bias, w1, w3, w2 with mlp_bias).

Numerics follow HF transformers' LlamaForCausalLM: RMSNorm in fp32 then cast back before the weight multiply,
RoPE tables computed in fp32 and cast to the model dtype, softmax in fp32. Attention uses explicit batched matmuls
(no SDPA) so FlopCounterMode counts what runs; GQA groups the R query heads of each KV head into the rows of one
matmul instead of copying K and V R times.

`prefill`/`decode_one` run these modules: the reference, and the hook points. The layer is written once, here: each
block's forward calls its stages through a `run` (tracer/model/stage_calls.py): HOOKED calls them as modules; the
packed backend's PackedStep (tracer/model/fused.py, made per layer and step from a plan built per run) runs Q|K|V and
gate|up as one product each whose outputs are views, q and k normalised and rotated together in place, K and V
written in one copy, each stage called past its hooks and marked (the tracer's clock read) after it. So a stage is
added in one place, here (and in the native C step, tracer/model/native/decode_step.c). Backends are built per run
from the model as it stands (tracer/run/select.py, tracer/run/backends.py) and pass themselves as the step's `path`;
the model holds no mode and no run writes into it.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping

import torch
from torch import nn

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import expected_shapes, has_bias, tensor_of
from llmtrace.tracer.core.dtypes import FP32, DType
from llmtrace.tracer.core.errors import BadArgumentError, CheckpointError
from llmtrace.tracer.hardware.dtype_policy import torch_dtype
from llmtrace.tracer.hardware.memory import check_prefill_fits
from llmtrace.tracer.model.functional import (
    PlusOne,
    geglu,
    grouped_scores,
    grouped_values,
    project,
    rms_norm,
    rms_norm_floor,
    rms_norm_plus_one,
    softcap,
    softmax_fp32,
    step_mask,
    swiglu,
)
from llmtrace.tracer.model.kv_cache import KVCache, ModelCaches
from llmtrace.tracer.model.moe import ExpertLinear, MixtureOfExperts
from llmtrace.tracer.model.packing import pack_layers
from llmtrace.tracer.model.qk_norm import QKNorm
from llmtrace.tracer.model.rope import RotaryEmbedding
from llmtrace.tracer.model.stage_calls import HOOKED
from llmtrace.tracer.model.weight_formats import ExpertWeights, PackedWeight


class Linear(nn.Linear):
    """An nn.Linear (same parameters, state-dict names and repr) whose product is functional.project, the fused
    path's: one token through torch.mv (for bf16 on CPU up to twice as fast as mm: BENCHMARKS.md, "Model speed"),
    or mm while any TorchDispatchMode is active (FlopCounterMode counts mm but not mv, so what it counts is what
    runs); more tokens through F.linear. A bias (contract.has_bias) is added to the product's result.

    With `packed` set (Transformer.load_stored: the matrix as the GGUF stores it), the product is the packed
    weight's own kernel (llmtrace.tracer.model.weight_formats) and `weight` is a meta-device placeholder of the
    right shape (its shape and dtype are right, its values do not exist: code that multiplies by a module's
    weight directly must take `packed` when set, as functional.project does)."""

    packed: PackedWeight | None = None
    # On a dry run's meta model: (bytes, format label) of the matrix as `run` would hold it (a GGUF's stored bytes
    # under the kernel the run picks: tracer/load/dry_weights.py), which the trace's byte counts take; else None.
    held_as: tuple[int, str] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight if self.packed is None else self.packed, self.bias)


class Embedding(nn.Embedding):
    """An nn.Embedding whose table may be held as stored (`packed`): then a lookup dequantizes only the rows it
    reads, into `compute_dtype`."""

    packed: PackedWeight | None = None
    compute_dtype: torch.dtype = torch.float32
    held_as: tuple[int, str] | None = None  # as Linear.held_as

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.rows(ids, self.compute_dtype)  # (..., dim)
        return super().forward(ids)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight; the normalisation runs in fp32 and is cast back before the weight.
    `plus_one` (Gemma): times (1 + weight) instead, in fp32, cast back after (functional.rms_norm_plus_one)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self._floor: torch.Tensor | None = None  # sqrt(dim * eps), fp32, on the weight's device (made on first use)
        self.plus_one = PlusOne() if plus_one else None  # 1 + weight in fp32, made again when the weight changes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plus_one is not None:
            return rms_norm_plus_one(x, self.plus_one.of(self.weight), self.floor(x.device))
        return rms_norm(x, self.weight, self.floor(x.device))

    def floor(self, device: torch.device) -> torch.Tensor:
        """sqrt(dim * eps) as functional.rms_norm takes it, on `device` (made once; the native step reads it too)."""
        floor = self._floor
        if floor is None or floor.device != device:
            floor = self._floor = rms_norm_floor(self.weight.shape[0], self.eps, device)
        return floor

    def extra_repr(self) -> str:
        plus = ", 1 + w" if self.plus_one is not None else ""
        return f"dim={self.weight.shape[0]}, eps={self.eps}{plus}"


class EmbedScale(nn.Module):
    """Gemma's embedding rows (B, T, dim) times sqrt(dim), the constant rounded to their dtype first (HF's
    Gemma3TextScaledWordEmbedding: an fp32 sqrt(dim) cast to the weights' dtype: 55.4256 is 55.5 in bf16)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.value = dim**0.5
        self._scale: torch.Tensor | None = None  # the constant in the activations' dtype and device (first use)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self._scale
        if scale is None or scale.dtype != x.dtype or scale.device != x.device:
            scale = self._scale = torch.tensor(self.value, dtype=torch.float32).to(device=x.device, dtype=x.dtype)
        return x * scale

    def extra_repr(self) -> str:
        return f"scale={self.value:.6g}"


class SoftCap(nn.Module):
    """Gemma's final logits soft-capped: cap·tanh(logits / cap) (config.final_softcap)."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = cap

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return softcap(logits, self.cap)

    def extra_repr(self) -> str:
        return f"cap={self.cap:g}"


class AttentionScores(nn.Module):
    """q (B, H, T, D) · k_all (B, Hkv, S, D) -> scores (B, H, T, S), scaled by 1/sqrt(D), causal mask applied.

    The new tokens sit at the last T of the S positions; query t may see keys up to position S - T + t and, under a
    sliding window W, none before S - T + t - W + 1.
    """

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, window: int | None = None,
                 scale: float | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale  # Gemma: query_pre_attn_scalar^-1/2
        self.window = window  # sliding window: keys older than W positions are masked too
        # (B, 1, T, S) bool, True where a real query must not see a left-pad key; set by the model for the step of a
        # batch of prompts of different lengths (ModelCaches._pad_step), None otherwise. An attribute, not an
        # argument: the tracer's wrappers record every tensor argument as an activation the stage reads. Where
        # layers' windows differ (Gemma 3) it covers every key a full layer reads; a windowed layer's are its last S.
        self.pad_mask: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k_all: torch.Tensor) -> torch.Tensor:
        seen = k_all.shape[2]
        pad_mask = self.pad_mask
        if pad_mask is not None and pad_mask.shape[-1] != seen:
            pad_mask = pad_mask[..., -seen:]  # (B, 1, T, S): a windowed layer's keys are the last S of them
        mask = step_mask(q.shape[2], seen, q.device, self.window, pad_mask)  # (T, S), (B, 1, T, S) or None
        return grouped_scores(q, k_all, self.scale, mask)  # (B, H, T, S)

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}"


class Softmax(nn.Module):
    """Softmax over the key axis, computed in fp32 and cast back to the scores' dtype (as HF does)."""

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return softmax_fp32(scores)


class AttentionValues(nn.Module):
    """probs (B, H, T, S) · v_all (B, Hkv, S, D) -> (B, H, T, D): the attention-weighted sum of values."""

    def forward(self, probs: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
        return grouped_values(probs, v_all)  # (B, H, T, D)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = Linear(config.dim, config.q_dim, bias=has_bias("attention.wq", config))
        self.wk = Linear(config.dim, config.kv_dim, bias=has_bias("attention.wk", config))
        self.wv = Linear(config.dim, config.kv_dim, bias=has_bias("attention.wv", config))
        self.qk_norm = None  # Qwen3's per head, OLMoE's over the whole projections (config.qk_norm_whole), or none
        if config.qk_norm:
            self.qk_norm = (QKNorm(config.q_dim, config.norm_eps, config.kv_dim) if config.qk_norm_whole else
                            QKNorm(config.head_dim, config.norm_eps, plus_one=config.norm_plus_one))
        self.qk_norm_whole = config.qk_norm_whole
        self.rope = RotaryEmbedding(config.head_dim, config.rotary_dim)
        window = config.layer_window(layer)  # Gemma 3: the global layers' None among the windowed layers'
        self.kv_cache = KVCache(config.n_kv_heads, config.head_dim, window)
        self.scores = AttentionScores(config.n_heads, config.n_kv_heads, config.head_dim, window,
                                      config.attention_scale)
        self.softmax = Softmax()
        self.pv = AttentionValues()
        self.wo = Linear(config.q_dim, config.dim, bias=has_bias("attention.wo", config))

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, use_cache: bool, run: Any = HOOKED) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim), each stage called through `run` (tracer/model/stage_calls.py): as a module
        (HOOKED), or as a packed step runs it (x (B*T, dim) rows, or (dim,) for one token of one sequence)."""
        q, k, v = run.qkv(self, x)  # (B, T, H, D), (B, T, Hkv, D) each
        if self.qk_norm is not None:
            q, k = run.qk_norm(self, q, k)
        q, k = run.rope(self.rope, q, k, input_pos)
        if use_cache:
            k_all, v_all = run.cache(self.kv_cache, input_pos, k, v)  # (B, Hkv, S, D) each
        else:
            k_all, v_all = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, S=T, D) each
        scores = run.scores(self.scores, q.transpose(1, 2), k_all)  # q: (B, H, T, D) -> scores (B, H, T, S)
        probs = run.call(self.softmax, scores)  # (B, H, T, S)
        out = run.call(self.pv, probs, v_all)  # (B, H, T, D)
        return run.product(self.wo, out.transpose(1, 2).reshape(*x.shape[:-1], -1))  # (B, T, dim), or x's rows


class SwiGLUActivation(nn.Module):
    """silu(gate) * up, elementwise over (B, T, F)."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate, up)


class GeGLUActivation(nn.Module):
    """gelu_tanh(gate) * up, elementwise over (B, T, F): Gemma's gating (contract stage feed_forward.gelu)."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return geglu(gate, up)


class FeedForward(nn.Module):
    """SwiGLU FFN: w2(silu(w1 x) * w3 x); w1 = gate, w3 = up, w2 = down (Meta's names). GeGLU (config.geglu,
    Gemma): gelu in place of silu, its stage `gelu` in place of `act`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, ffn_dim = config.dim, config.ffn_dim
        self.w1 = Linear(dim, ffn_dim, bias=has_bias("feed_forward.w1", config))
        self.w3 = Linear(dim, ffn_dim, bias=has_bias("feed_forward.w3", config))
        if config.geglu:
            self.gelu = GeGLUActivation()
        else:
            self.act = SwiGLUActivation()
        self.w2 = Linear(ffn_dim, dim, bias=has_bias("feed_forward.w2", config))

    def forward(self, x: torch.Tensor, run: Any = HOOKED) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim), each stage called through `run` (as Attention's)."""
        gate, up = run.pair(self.w1, self.w3, x)  # (B, T, F) each
        return run.product(self.w2, run.call(self.gating, gate, up))  # (B, T, dim)

    @property
    def gating(self) -> nn.Module:
        """Gemma's gelu(gate)·up, else silu(gate)·up."""
        return self.gelu if "gelu" in self._modules else self.act


class Residual(nn.Module):
    """x + delta: the residual stream after a sub-block."""

    def forward(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return x + delta


def whole(x: torch.Tensor, layer: int | None, after: str) -> torch.Tensor:
    """A block's all-reduce on one rank: the row-split products' outputs are already the whole sums."""
    return x


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attention(norm(x)); out = h + ffn(norm(h)). With config.post_norms (Gemma) each
    sub-block's output is normalised too before its residual add: h = x + norm(attention(norm(x))).

    Tensor parallelism (tracer/model/tensor_parallel.py) builds this block from a shard's config, with `all_reduce`
    its process group's sum: then wo and w2 multiply this rank's heads' and FFN columns' rows, and their partial
    outputs are summed over the ranks before each residual. `layer` names the block to the collective."""

    def __init__(self, config: ModelConfig, layer: int | None = None,
                 all_reduce: Callable[[torch.Tensor, int | None, str], torch.Tensor] = whole) -> None:
        super().__init__()
        plus_one = config.norm_plus_one
        self.attention_norm = RMSNorm(config.dim, config.norm_eps, plus_one)
        self.attention = Attention(config, layer or 0)
        # Gemma's norms after attention and after the FFN (contract: post_attention_norm, post_ffn_norm), else None
        self.post_attention_norm = RMSNorm(config.dim, config.norm_eps, plus_one) if config.post_norms else None
        self.attn_residual = Residual()
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps, plus_one)
        self.feed_forward: nn.Module = FeedForward(config) if config.moe is None else MixtureOfExperts(
            config, partial(Linear, bias=False), SwiGLUActivation)
        self.post_ffn_norm = RMSNorm(config.dim, config.norm_eps, plus_one) if config.post_norms else None
        self.ffn_residual = Residual()
        self.layer_index, self.all_reduce = layer, all_reduce

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, use_cache: bool, run: Any = HOOKED) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim), each stage called through `run` (tracer/model/stage_calls.py): the stage
        modules, each a hook point (HOOKED), or a packed step's products and calls past the hooks."""
        normed = run.call(self.attention_norm, x)
        attended = self.all_reduce(run.enter(self.attention, normed, input_pos, use_cache), self.layer_index,
                                   "attention.wo")  # (B, T, dim)
        if self.post_attention_norm is not None:  # Gemma: the sum of the ranks' outputs normalised
            attended = run.call(self.post_attention_norm, attended)
        h = run.residual(self.attn_residual, x, attended)
        normed = run.call(self.ffn_norm, h)
        down = self.all_reduce(run.enter(self.feed_forward, normed), self.layer_index, "feed_forward.w2")
        if self.post_ffn_norm is not None:
            down = run.call(self.post_ffn_norm, down)
        return run.residual(self.ffn_residual, h, down)


class Transformer(ModelCaches):
    """The whole model. Build big ones on the meta device (`build_meta_model`) and load with `load_weights`.

    Generation: `setup_cache(max_batch, max_seq)`, then `prefill(prompt)` and `decode_one(token)` repeatedly, stage by
    stage through the modules (the reference), or through a run's backend (tracer/run/backends.py: the `path` it
    passes). `forward(tokens)` (through `model(tokens)`) is the cache-free full recompute used to check the cached path.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        embedding = torch.empty(config.vocab_size, config.dim)
        if embedding.device.type != "meta":
            # nn.Embedding's own init, skipped on meta, where normal_ imports torch._dynamo (2 s of load time)
            nn.init.normal_(embedding)
        self.tok_embeddings = Embedding(config.vocab_size, config.dim, _weight=embedding)
        self.embed_scale = EmbedScale(config.dim) if config.embed_scale else None  # Gemma's sqrt(dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_plus_one)
        self.output = Linear(config.dim, config.vocab_size, bias=has_bias("output", config))
        self.softcap = SoftCap(config.final_softcap) if config.final_softcap else None  # Gemma's, where set
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_state_dict_post_hook(_drop_tied_output)

    # ---- forward passes ------------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Cache-free forward over all positions from 0: tokens (B, T) -> logits (B, T, V). Leaves the cache alone."""
        new = tokens.shape[1]
        self._check_attention_fits(tokens.shape[0], new, new)
        with self.rope_for_pass(new) as input_pos:  # (T,)
            x = self.embed(tokens)  # (B, T, dim)
            for layer in self.layers:
                x = layer(x, input_pos, False)
            return self.logits(x)  # (B, T, V)

    def prefill(self, tokens: torch.Tensor, pad: list[int] | None = None, path: Any = None) -> torch.Tensor:
        """Run the prompt tokens (B, T) through the model, filling the cache; logits (B, V) of the last position.

        Only the last position goes through the final norm and the LM head: the others' logits are never used.
        `pad` (one count per row): prompts of different lengths, left-padded to T; row b's first pad[b] tokens are
        padding. No real query attends a pad key (now or in any later decode step), and each row's positions count
        from its first real token, so its RoPE angles, and so its logits, are those of its batch-1 run.
        `path`: a backend running the step instead of the stage modules (`_cached_step`).
        """
        if pad is not None:
            if len(pad) != tokens.shape[0] or min(pad) < 0 or max(pad) >= tokens.shape[1]:
                raise BadArgumentError(f"pad needs one count in [0, {tokens.shape[1]}) per row, got {list(pad)}")
            if self.pos:
                raise BadArgumentError("pads are set by the first prefill of a sequence; reset the cache first")
        self._check_attention_fits(tokens.shape[0], tokens.shape[1], self.pos + tokens.shape[1])
        self._pad = (torch.tensor(pad, dtype=torch.long, device=tokens.device)  # (B,)
                     if pad is not None and any(pad) else None)
        return self._cached_step(tokens, None, path)

    def _check_attention_fits(self, batch: int, new: int, seen: int) -> None:
        """A step of many tokens holds (B, H, T, S) attention scores: refused in one line before the first layer
        when they cannot fit in this machine's memory (tracer/hardware/memory.py); the meta device holds nothing."""
        if new > 1 and self.norm.weight.device.type == "cpu":
            check_prefill_fits(self.config.n_heads, batch, new, seen)

    def decode_one(self, tokens: torch.Tensor, path: Any = None) -> torch.Tensor:
        """One new token per sequence, tokens (B, 1), at position `pos`; logits (B, V)."""
        shape = tokens.shape
        if len(shape) != 2 or shape[1] != 1:
            raise BadArgumentError(f"decode_one takes tokens of shape (B, 1), got {tuple(shape)}")
        return self._cached_step(tokens, shape, path)

    def _cached_step(self, tokens: torch.Tensor, shape: torch.Size | None, path: Any) -> torch.Tensor:
        """One cached step of tokens (B, T) (`shape`: theirs, when the caller read it) through the stage modules, or
        through `path` (a run's backend, tracer/run/backends.py: `one` for a one-token step of one unpadded sequence,
        None when it runs none; `many` otherwise; `max_seq`, its plan's plain value, where the caches' modules and
        tensors are cold after a step: tens of us per lookup). The fill moves once the step is done: one that fails
        (or a Ctrl-C mid-pass) leaves every layer's cache where it was."""
        if path is None:
            caches = self._kv_caches()
            if not caches or not caches[0].is_allocated:
                raise BadArgumentError("the KV cache is not set up; call setup_cache(max_batch, max_seq) first")
            max_seq = caches[0].max_seq
        else:
            max_seq = path.max_seq
        fill = self.fill
        batch, new = tokens.shape if shape is None else shape
        start = fill.length
        if start + new > max_seq:
            raise BadArgumentError(
                f"{start} cached + {new} new tokens exceed the cache of {max_seq} positions; "
                "set up a longer cache or ask for fewer tokens"
            )
        if start and batch != fill.batch:
            raise BadArgumentError(f"batch size changed from {fill.batch} to {batch} mid-sequence; reset the cache")
        logits = None
        if path is not None and batch == 1 and new == 1 and self._pad is None:
            # The native decode step, when the backend runs one: one C call, no autograd op, no position tensor
            # (everything touched after a step that streamed the weights is cold: tens of us per torch op).
            logits = path.one(tokens, start)
        if logits is None:
            with torch.no_grad():
                input_pos = self._positions[start : start + new]  # (T,)
                pad_mask = None
                if self._pad is not None:
                    input_pos, pad_mask = self._pad_step(input_pos, start + new)  # (B, T), (B, 1, T, S)
                run = self.modules_step if path is None else path.many
                logits = run(tokens, start, input_pos, pad_mask)
        fill.length, fill.batch = start + new, batch
        return logits

    def modules_step(self, tokens: torch.Tensor, start: int, input_pos: torch.Tensor,
                     pad_mask: torch.Tensor | None) -> torch.Tensor:
        """A cached step through the stage modules: tokens (B, T) at `input_pos` (T,), or each row's (B, T) with the
        left-padded batch's `pad_mask` (B, 1, T, S) -> logits (B, V) of the last position."""
        layers = self.layers
        x = self.embed(tokens)  # (B, T, dim)
        try:
            for layer in layers:
                layer.attention.scores.pad_mask = pad_mask
            for layer in layers:
                x = layer(x, input_pos, True)
        finally:
            if pad_mask is not None:
                for layer in layers:
                    layer.attention.scores.pad_mask = None
        return self.logits(x[:, -1, :])  # (B, V): the last position only

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> hidden states (B, T, dim) through the tok_embeddings stage. The stage-by-stage path's
        one way in: a tensor-parallel model (tracer/model/tensor_parallel.py) adds its all-reduce here."""
        x = self.tok_embeddings(tokens)
        return x if self.embed_scale is None else self.embed_scale(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states (..., dim) -> logits (..., V) through the final norm and the LM head (the stage-by-stage
        path's one way out; a tensor-parallel model gathers the vocabulary slices here)."""
        logits = self.output(self.norm(x))
        return logits if self.softcap is None else self.softcap(logits)

    # ---- weights -------------------------------------------------------------------------------------------

    def load_stored(self, state_dict: Mapping[str, torch.Tensor],
                    packed: Mapping[str, PackedWeight | ExpertWeights]) -> None:
        """Adopt dense tensors (`state_dict`: norms, biases, matrices without a stored kernel) and matrices as stored
        (`packed`, by the same names: "layers.0.attention.wq.weight"...), strictly checked together. A packed
        matrix's parameter becomes a meta placeholder of its shape in the model's dtype (no memory); its module
        multiplies (Linear; ExpertLinear through an ExpertWeights, one expert's blocks a product) or looks up
        (Embedding) through the PackedWeight."""
        dtype = self.norm_dtype(state_dict)
        placeholders = {name: torch.empty(w.shape, dtype=dtype, device="meta") for name, w in packed.items()}
        overlap = sorted(set(state_dict) & set(packed))
        if overlap:
            raise CheckpointError(f"tensors given both dense and packed: {', '.join(overlap[:3])}")
        self.load_weights({**state_dict, **placeholders})
        for name, weight in packed.items():
            module = self.get_submodule(name.removesuffix(".weight"))
            if not isinstance(module, (Linear, Embedding, ExpertLinear)) or \
                    isinstance(module, ExpertLinear) != isinstance(weight, ExpertWeights):
                raise CheckpointError(f"{name} is not a matrix a stored kernel can run")
            module.packed = weight
            if isinstance(module, Embedding):
                module.compute_dtype = dtype
        if self.config.tie_embeddings:
            self.output.packed = self.tok_embeddings.packed
        pack_layers(self)

    def norm_dtype(self, state_dict: Mapping[str, torch.Tensor]) -> torch.dtype:
        """The model's compute dtype: its final norm's (the one tensor every checkpoint holds dense)."""
        norm = state_dict.get("norm.weight")
        if norm is None:
            raise CheckpointError("checkpoint does not match: missing norm.weight")
        return norm.dtype

    def stored_weights(self) -> dict[str, PackedWeight | ExpertWeights]:
        """{module name: PackedWeight} of every matrix held as stored (the tied LM head under both names; a mixture
        of experts' stacked experts as one ExpertWeights)."""
        return {name: module.packed for name, module in self.named_modules()
                if isinstance(module, (Linear, Embedding, ExpertLinear)) and module.packed is not None}

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Adopt the tensors of a checkpoint in our naming (no copy: `assign=True`), strictly checked first.

        Works on a model built on the meta device; the model takes the tensors' dtype and device.
        """
        check_state_dict(self.config, state_dict)
        full = dict(state_dict)
        if self.config.tie_embeddings:
            full["output.weight"] = full["tok_embeddings.weight"]
        self.load_state_dict(full, strict=True, assign=True)
        for module in self.modules():
            if isinstance(module, (Linear, Embedding, ExpertLinear)):
                module.packed = None  # dense weights now: a stored matrix of an earlier load is gone
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        pack_layers(self)  # Q|K|V and gate|up laid out as one product each (tracer/model/packing.py)
        self._positions, self._rope_key = None, None
        self._kv_all, self._caches = None, None
        for layer in self.layers:  # the caches were sized and typed for the old weights: set them up again
            layer.attention.kv_cache.kv = None
        self.reset_cache()


def _drop_tied_output(module: Transformer, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A tied LM head is the embedding: the checkpoint names it once, as tok_embeddings.weight."""
    if module.config.tie_embeddings:
        state_dict.pop(prefix + "output.weight", None)


# ---- checkpoints -----------------------------------------------------------------------------------------------


def check_state_dict(config: ModelConfig, state_dict: Mapping[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Raise CheckpointError naming every missing, unexpected and mis-shaped tensor (a few of each, and counts)."""
    expected = expected_shapes(config)
    missing = [name for name in expected if name not in state_dict]
    unexpected = [name for name in state_dict if name not in expected]
    misshaped = [
        f"{name} is {tuple(state_dict[name].shape)}, config wants {shape}"
        for name, shape in expected.items()
        if name in state_dict and tuple(state_dict[name].shape) != shape
    ]
    problems = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped)):
        if items:
            shown = "; ".join(items[:3]) + (f"; ... {len(items) - 3} more" if len(items) > 3 else "")
            problems.append(f"{len(items)} {label}: {shown}")
    if problems:
        raise CheckpointError(
            f"{source} does not match config {config.name!r} ({' | '.join(problems)}); "
            "check that the weights and config.json belong to the same model"
        )


# ---- building --------------------------------------------------------------------------------------------------

def build_meta_model(config: ModelConfig) -> Transformer:
    """The model on the meta device: every shape, no memory (a dry run of any size, or a shell to load into)."""
    with torch.device("meta"):
        return Transformer(config)


def random_weights(config: ModelConfig, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights in our naming, on the CPU: N(0, 0.02^2) matrices and biases (GPT-2/LLaMA init std,
    drawn in fp32 then cast to `dtype`, so every dtype gets the same values up to rounding), norm weights 1."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in expected_shapes(config).items():
        if tensor_of(name).group in ("norm", "final_norm"):
            state[name] = torch.ones(shape, dtype=dtype)
        else:
            state[name] = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator).to(dtype)
    return state


def build_random_model(
    config: ModelConfig, seed: int = 0, dtype: DType = FP32, device: str | torch.device = "cpu"
) -> Transformer:
    """A model of `config`'s size with `random_weights(config, dtype, seed)` on `device`, built on the meta device
    first, so the default (slow) initialisation never runs."""
    state = {name: tensor.to(device) for name, tensor in random_weights(config, torch_dtype(dtype), seed).items()}
    model = build_meta_model(config)
    model.load_weights(state)
    return model
