"""The packed backend's plan: the stage modules' own forwards on packed weights, without hooks.

Decode on a CPU is a stream of small operations between weight-streaming matrix-vector products, and each small
operation after a product that has flushed the caches costs several microseconds; per-token time is mostly
their count. So when nothing watches the stage modules, the run's packed and native backends (tracer/run/backends.py,
chosen by tracer/run/select.py) run the layer with fewer ops. The layer is not written again here: `FusedPlan.step`
runs each TransformerBlock's own forward (tracer/model/transformer.py) with a `PackedStep` as its `run` (the calls of
tracer/model/stage_calls.py), a frozen view of one layer's step, which makes the same forward
- multiply by wq|wk|wv and w1|w3 (and their biases) as one product each (`PackedLayer`: the row blocks the load laid
  out in one tensor, tracer/model/packing.py), so Q, K, V come from one product and gate, up from another, as views
  of its output; a mixture of experts' chosen expert its gate|up in one product too;
- normalise (QK-norm) and rotate q and k together, in place, and write K and V to the cache in one copy (the cache
  keeps them in one buffer; every layer's cache views for a step made at once, from the one tensor all layers'
  caches share);
- call each stage module's forward past nn.Module's call, so no hooks, and `mark()` after each stage.
Every rounding is the stage modules' (which are HF transformers' eager LlamaAttention's), through the same functions
(tracer/model/functional.py); in bf16 the two routes agree to the last bit but for the packed products' accumulation
order (tests/test_fused_trace.py states the tolerance). A plan is built per run, from the model as the run starts
(nothing edits the model, before or while it runs): a reload, a `.to()`, a replaced layer or an edited weight is
seen by the next run's plan.

One token of one sequence runs 1-D vectors through matrix-vector products (mv: for bf16 on CPU about twice as
fast as the same product through mm); any other batch and length runs (B*T, dim) rows through mm: prefill, decode
and batches go through the one forward. When every product of a one-token step is held for the native kernel and
the model runs in fp32 on the CPU, the step is one C call instead (tracer/model/native_step.py: the same stages in
the same order, all layers in one OpenMP region); a traced step then takes the readings C stamps after each stage
(a mark's TAKE_STAMPS), and a mark that cannot take them gets the torch ops and their mark() calls.

The marks are the tracer's hook points on this route: one after each stage of llmtrace.tracer.core.contract.
fused_stages (its stages with Q|K|V and gate|up packed), which costs one no-op call when nothing traces and one
clock read when tracer/trace/fused_marks.py does. So a traced run executes exactly the untraced run's tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from llmtrace.tracer.core.config import first_attended_position
from llmtrace.tracer.model.functional import (
    MATVEC_KERNELS,
    grouped_scores,
    project,
    rms_norm,
    rms_norm_plus_one,
    rotate,
    softcap,
    step_mask,
)
from llmtrace.tracer.model.moe import ExpertsPlan, MixtureOfExperts
from llmtrace.tracer.model.native_step import AheadRun, Chooser, NativeStep, host_clock_matches
from llmtrace.tracer.model.packing import detached, rows_of, weight_of
from llmtrace.tracer.model.weight_formats import PackedWeight

Mark = Callable[[], None]
# A mark may carry this attribute: a function taking the host clock readings (time.perf_counter_ns's nanoseconds)
# of stages that ran outside Python (the native decode step stamps its stages in C), in stage order, as if mark()
# had been called at each. A mark without it makes the one-token step run its torch ops, which call it.
TAKE_STAMPS = "take_stamps"


def no_mark() -> None:
    """The mark of an untraced run."""


class PackedLayer:
    """One TransformerBlock's products as a run's plan holds them (read by its PackedSteps and the native step, never
    changed): Q|K|V and gate|up one weight each (views of the layout the load made, tracer/model/packing.py, or the
    stored matrices' concatenation), QK-norm's weight over the q|k rows, a mixture of experts' ExpertsPlan, and the
    shapes the native step reads. `products`: (weight, bias) by the module a stage forward names (run.product,
    run.pair), an expert's weight indexed by expert."""

    __slots__ = ("attention_norm", "b13", "b2", "bo", "bqkv", "experts", "ffn_dim", "ffn_norm", "head_dim", "heads",
                 "kv_heads", "products", "qk_floor", "qk_weight", "qk_whole", "scale", "w13", "w2", "window", "wo",
                 "wqkv")

    def __init__(self, layer: nn.Module) -> None:
        attn, ffn = layer.attention, layer.feed_forward
        self.heads, self.kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.scale = attn.scores.scale
        self.window = attn.kv_cache.window  # this layer's (Gemma 3: None on its global layers)
        self.attention_norm, self.ffn_norm = layer.attention_norm, layer.ffn_norm
        self.wqkv, self.bqkv = rows_of(attn.wq, attn.wk, attn.wv)  # ((H+2Hkv)*D, dim), ((H+2Hkv)*D,)
        self.wo, self.bo = weight_of(attn.wo), detached(attn.wo.bias)  # (dim, H*D), (dim,)
        # A mixture of experts (tracer/model/moe.py): its experts as stored (None when dense), no dense FFN
        self.experts = ExpertsPlan.of(ffn) if isinstance(ffn, MixtureOfExperts) else None
        if isinstance(ffn, MixtureOfExperts):
            self.w13 = self.b13 = self.w2 = self.b2 = None
            self.ffn_dim = ffn.w2.weight.shape[-1]
            experts = self.experts  # stored: each expert's gate|up and down; dense: the stacks (no gate|up in one)
            gate_up, down = (None, ffn.w2.weight.detach()) if experts is None else (experts.gate_up, experts.down)
            self.products = {ffn.router: (weight_of(ffn.router), None), ffn.w1: (gate_up, None), ffn.w2: (down, None)}
            if ffn.shared_add is not None:  # Qwen2-MoE's shared expert: gate|up one product, down, its gate's logit
                self.products[ffn.shared_w1] = rows_of(ffn.shared_w1, ffn.shared_w3)  # (2Fs, dim), None
                for linear in (ffn.shared_w2, ffn.shared_gate):  # (dim, Fs), (1, dim)
                    self.products[linear] = weight_of(linear), detached(linear.bias)
        else:
            self.w13, self.b13 = rows_of(ffn.w1, ffn.w3)  # (2F, dim), (2F,)
            self.w2, self.b2 = weight_of(ffn.w2), detached(ffn.w2.bias)  # (dim, F), (dim,)
            self.ffn_dim = self.w2.shape[1]
            self.products = {ffn.w1: (self.w13, self.b13), ffn.w2: (self.w2, self.b2)}
        self.products[attn.wo] = self.wo, self.bo
        # QK-norm (Qwen3; None without): its q weight repeated over the H query heads, then its k weight over the
        # Hkv key heads, so q and k are normalised together as the rows of the q|k view, as RoPE rotates them
        qk_norm = attn.qk_norm
        whole = qk_norm is not None and attn.qk_norm_whole  # OLMoE's: over each token's whole q and whole k
        self.qk_weight = None if qk_norm is None or whole else torch.cat([
            qk_norm.q_weight.detach().expand(self.heads, -1), qk_norm.k_weight.detach().expand(self.kv_heads, -1)])
        if qk_norm is not None and qk_norm.plus_one is not None:  # Gemma: 1 + w in fp32 (rms_norm_plus_one's)
            self.qk_weight = 1.0 + self.qk_weight.float()
        self.qk_floor = None if qk_norm is None else qk_norm.floor(qk_norm.q_weight.device)
        self.qk_whole = None if not whole else qk_norm  # its q (H*D,) and k (Hkv*D,) weights and floors


@dataclass(frozen=True, slots=True)
class PackedStep:
    """One layer's stage calls in one packed step (the `run` TransformerBlock.forward takes: tracer/model/
    stage_calls.py): its PackedLayer, the step's B and T, the attention mask made for its window, its cache views
    and the mark, called after each stage. x runs as (B*T, dim) rows, or (dim,) for one token of one sequence. Made
    anew for every step: nothing of a step is left on an object."""

    layer: PackedLayer
    batch: int
    new: int
    mask: torch.Tensor | None  # (T, S), (B, 1, T, S) or None: step_mask for this layer's window, pads included
    write: torch.Tensor  # (B, 2*Hkv, T, D): where this step's K|V go
    keys: torch.Tensor  # (B, Hkv, S, D): what attention reads
    values: torch.Tensor  # (B, Hkv, S, D)
    kernel: Callable[..., torch.Tensor]  # functional.project with the run's one-token kernel (FusedPlan.product)
    mark: Mark = no_mark

    def call(self, module: nn.Module, *args: Any) -> Any:
        """A stage module's forward, past nn.Module's call (no hooks), then the mark."""
        out = type(module).forward(module, *args)
        self.mark()
        return out

    def enter(self, module: nn.Module, *args: Any) -> Any:
        return type(module).forward(module, *args, self)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        out = self.kernel(x, weight, bias)
        self.mark()
        return out

    def qkv(self, attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One Q|K|V product; (q (B, T, H, D), q|k (B, T, H+Hkv, D), K|V (B, T, 2*Hkv, D)), views of it: QK-norm and
        RoPE work on q|k in place, the cache takes K|V in one copy."""
        layer = self.layer
        qkv = self.linear(x, layer.wqkv, layer.bqkv).view(self.batch, self.new, -1, layer.head_dim)
        qk = qkv.narrow(2, 0, layer.heads + layer.kv_heads)
        return qk.narrow(2, 0, layer.heads), qk, qkv.narrow(2, layer.heads, 2 * layer.kv_heads)

    def qk_norm(self, attn: nn.Module, q: torch.Tensor, qk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q|k normalised in place: as rows of heads with the (H+Hkv, D) weight, or (OLMoE) each token's whole q and
        whole k with their own weights."""
        layer = self.layer
        whole = layer.qk_whole
        if whole is not None:
            flat_q, flat_k = q.flatten(2), qk.narrow(2, layer.heads, layer.kv_heads).flatten(2)  # views
            rms_norm(flat_q, whole.q_weight, layer.qk_floor, out=flat_q)
            rms_norm(flat_k, whole.k_weight, whole.k_floor(q.device), out=flat_k)
        else:
            norm = rms_norm_plus_one if attn.qk_norm.plus_one is not None else rms_norm  # its weight 1 + w, fp32
            norm(qk, layer.qk_weight, layer.qk_floor, out=qk)
        self.mark()
        return q, qk

    def rope(self, rope: nn.Module, q: torch.Tensor, qk: torch.Tensor,
             input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope.angles(input_pos)
        rotate(qk, cos, sin, out=qk)  # q with it: three ops for both, not six
        self.mark()
        return q, qk

    def cache(self, cache: nn.Module, input_pos: torch.Tensor, qk: torch.Tensor,
              kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.write.copy_(kv.transpose(1, 2))  # (B, 2*Hkv, T, D)
        self.mark()
        return self.keys, self.values

    def scores(self, scores: nn.Module, q: torch.Tensor, k_all: torch.Tensor) -> torch.Tensor:
        out = grouped_scores(q, k_all, scores.scale, self.mask)  # (B, H, T, S)
        self.mark()
        return out

    def residual(self, module: nn.Module, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Added into delta, the sub-block's output, which nothing else holds (no hooks): no new tensor."""
        out = delta.add_(x)
        self.mark()
        return out

    def product(self, module: nn.Module, x: torch.Tensor, *expert: int) -> torch.Tensor:
        """x times `module`'s matrix (wo, w2, the router; `expert`'s of a mixture's w2) through the plan's kernel."""
        weight, bias = self.layer.products[module]
        return self.linear(x, weight[expert[0]] if expert else weight, bias)

    def pair(self, first: nn.Module, second: nn.Module, x: torch.Tensor,
             *expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """gate, up: views of the halves of one gate|up product (`expert`'s, for a mixture); two products, marked
        once, for a mixture's dense experts (no one matrix holds an expert's gate and up)."""
        weight, bias = self.layer.products[first]
        if weight is None:
            gate = self.kernel(x, first.weight[expert[0]].detach(), None)
            return gate, self.linear(x, second.weight[expert[0]].detach(), None)
        gate_up = self.linear(x, weight[expert[0]] if expert else weight, bias)  # (..., 2F): gate | up
        ffn_dim = gate_up.shape[-1] // 2  # F, or a shared expert's Fs
        return gate_up.narrow(-1, 0, ffn_dim), gate_up.narrow(-1, ffn_dim, ffn_dim)


class FusedPlan:
    """Everything the packed backend reads besides the stage modules, built per run once the cache is set up
    (tracer/run/select.py): each layer's products (PackedLayer), the product kernel, the caches' views and sizes,
    and the native step when it can run."""

    def __init__(self, model: Any, matvec: str = "mv") -> None:
        """`matvec`: the one-token product kernel (functional.MATVEC_KERNELS: "mv" or "mm"), as this machine's
        measurement chose it for the model's dtype (the run's Request.matvec)."""
        self.product = partial(project, vector_kernel=MATVEC_KERNELS[matvec])
        self.blocks = list(model.layers)
        self.layers = [PackedLayer(layer) for layer in self.blocks]
        self.tok_embeddings = model.tok_embeddings
        self.embedding = weight_of(model.tok_embeddings)  # (V, dim), or as stored (the native step's table)
        self.output, self.output_bias = weight_of(model.output), detached(model.output.bias)  # (V, dim), (V,)
        self.final_norm = model.norm
        self.dtype = model.norm.weight.dtype  # the compute dtype (a stored embedding's rows are dequantized to it)
        # Gemma's stages before the layers and after the LM head (None without): × sqrt(dim), the soft-cap
        self.embed_scale, self.softcap = getattr(model, "embed_scale", None), getattr(model, "softcap", None)
        self.cos, self.sin = model.rope_tables()  # (S_max, 1, R) each: the native step's
        # Row 0 of every layer's cache as one (L, 2*Hkv, S_max, D) view, when the model keeps them in one tensor
        # (Transformer.setup_cache) and the layers' buffers are still its slices; else None (no one-token path).
        self.caches = [layer.attention.kv_cache for layer in self.blocks]
        self.fill = model.fill  # positions written and sequences held, every layer's (kv_cache.CacheFill)
        kv_all = getattr(model, "_kv_all", None)
        shared = kv_all is not None and len(self.caches) == kv_all.shape[0] and all(
            c.kv is not None and c.kv.data_ptr() == kv_all[i].data_ptr() and c.kv.stride() == kv_all[i].stride()
            and c.kv.shape == kv_all[i].shape for i, c in enumerate(self.caches))
        self.kv_all = kv_all if shared and self.caches else None  # (L, B_max, 2*Hkv, S_max, D)
        self.kv_rows = None if self.kv_all is None else kv_all.select(1, 0)  # (L, 2*Hkv, S_max, D)
        self.window = self.caches[0].window if self.caches else None
        self.windows = [cache.window for cache in self.caches]  # each layer's (Gemma 3: None on its global layers)
        self.window_set = tuple(set(self.windows))  # the distinct ones, for each step's masks
        self.mixed_windows = len(self.window_set) > 1
        # The caches' size in plain values, for the checks before every step (Transformer._cached_step) and the
        # step record's live bytes (`kv_live_bytes`): a cache module's attributes and tensor getters cost ~20-35 us
        # each right after a step. The plan is built per run from a model nothing changes while it runs.
        self.max_seq = self.caches[0].max_seq if self.caches else 0
        kv = self.caches[0].kv if self.caches else None
        self.position_bytes = 0 if kv is None else (
            len(self.caches) * 2 * self.caches[0].n_kv_heads * self.caches[0].head_dim * kv.element_size())
        # The one-token step as one C call (tracer/model/native_step.py) when every product is a native-kernel
        # PackedWeight and the model runs in fp32 on the CPU; else None, and `native_reason` says why.
        self.native, self.native_reason = NativeStep.build(self) if self.kv_rows is not None else (
            None, "the layers' KV caches are not one tensor")

    def kv_live_bytes(self, length: int | None = None) -> int:
        """Bytes of K and V attention can still read, over every layer: every layer's cache holds the same positions
        and sequences (the shared fill), so that is layers x one cache's live bytes (KVCache.live_bytes), from plain
        values; after `length` positions of its sequences, when given."""
        fill = self.fill
        length = fill.length if length is None else length
        if self.mixed_windows:  # Gemma 3: each layer its own window, or none
            held = sum(length if w is None else min(length, w) for w in self.windows)
            return self.position_bytes // len(self.windows) * fill.batch * held
        held = length if self.window is None else min(length, self.window)
        return self.position_bytes * fill.batch * held

    def step(self, tokens: torch.Tensor, start: int, input_pos: torch.Tensor, mark: Mark = no_mark,
             pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) at positions `input_pos` (T,), from `start` -> logits (B, V) of the last position, through
        every TransformerBlock's forward with its PackedStep; writes the caches (their fill moves when the caller's
        step is done: Transformer._cached_step).

        A left-padded batch (ModelCaches._pad_step) gives each row's `input_pos` (B, T) and the `pad_mask`
        (B, 1, T, S) hiding pad keys from real queries. `mark()` once before the embedding, then after each stage
        of contract.fused_stages (the layer stages once per layer). Always the torch ops: the native backend runs a
        one-token step as `native_decode` first."""
        batch, new = tokens.shape
        end = start + new
        # Per window the layers have (one but for Gemma 3's windowed and global layers): the oldest position its
        # queries attend and its mask. The cache views span the widest; a windowed layer reads their last S (a
        # left-padded batch's pad mask, made over the widest, too: ModelCaches._pad_step).
        first = min(first_attended_position(end, new, w) for w in self.window_set) if self.windows else 0
        spans = {}
        for window in self.window_set:
            own = first_attended_position(end, new, window)
            pads = None if pad_mask is None else pad_mask[..., own - first:]  # (B, 1, T, S) of its keys
            spans[window] = own - first, step_mask(new, end - own, tokens.device, window, pads)
        writes, keys, values = self._cache_views(batch, start, new, first)
        product, runs = self.product, []
        for layer, write, k, v in zip(self.layers, writes, keys, values):
            skip, mask = spans[layer.window]
            if skip:
                k, v = k.narrow(2, skip, k.shape[2] - skip), v.narrow(2, skip, v.shape[2] - skip)  # (B, Hkv, S, D)
            runs.append(PackedStep(layer, batch, new, mask, write, k, v, product, mark))
        mark()
        x = type(self.tok_embeddings).forward(self.tok_embeddings, tokens.reshape(-1))  # (B*T, dim)
        mark()
        if self.embed_scale is not None:
            x = type(self.embed_scale).forward(self.embed_scale, x)
            mark()
        if batch * new == 1:
            x = x[0]  # (dim,): one token runs vectors through matrix-vector products
        for block, run in zip(self.blocks, runs):
            x = block.forward(x, input_pos, True, run)
        norm = self.final_norm
        h = type(norm).forward(norm, x if x.dim() == 1 else x.view(batch, new, -1)[:, -1])  # (B, dim): the last one
        mark()
        logits = self.product(h, self.output, self.output_bias).view(batch, -1)  # (B, V)
        mark()
        if self.softcap is not None:
            logits = softcap(logits, self.softcap.cap)
            mark()
        return logits

    def _cache_views(self, batch: int, start: int, new: int, first: int) -> tuple[list[torch.Tensor], ...]:
        """Every layer's KV cache rows for a step of `new` tokens of `batch` sequences at `start`: where they are
        written (B, 2*Hkv, T, D), and the keys and values attention reads, positions first..start+new-1, (B, Hkv, S,
        D) each. From the one cache tensor all layers share (Transformer.setup_cache) in a few views, not ~6 a layer."""
        end = start + new
        kv_heads = self.layers[0].kv_heads
        if self.kv_all is not None:
            whole = self.kv_all  # (L, B_max, 2*Hkv, S_max, D)
            rows = whole if batch == whole.shape[1] else whole.narrow(1, 0, batch)  # (L, B, 2*Hkv, S_max, D)
            live = rows.narrow(3, first, end - first)  # (L, B, 2*Hkv, S, D)
            return (rows.narrow(3, start, new).unbind(0), live.narrow(2, 0, kv_heads).unbind(0),
                    live.narrow(2, kv_heads, kv_heads).unbind(0))
        buffers = [cache.kv.narrow(0, 0, batch) for cache in self.caches]  # L x (B, 2*Hkv, S_max, D)
        lives = [b.narrow(2, first, end - first) for b in buffers]  # L x (B, 2*Hkv, S, D)
        return ([b.narrow(2, start, new) for b in buffers], [live.narrow(1, 0, kv_heads) for live in lives],
                [live.narrow(1, kv_heads, kv_heads) for live in lives])

    def native_off_reason(self) -> str:
        """"" when a one-token step of one sequence may run as the native decode step (the plan has one), else why
        not: the one test of whether the native step runs, for `native_decode`, `select` and the decode ceilings."""
        if self.native is None:
            return f"no native decode step for this model: {self.native_reason}"
        return ""

    def native_decode(self, tokens: torch.Tensor, start: int, mark: Mark = no_mark) -> torch.Tensor | None:
        """`step` of tokens (1, 1) at position `start` as one C call (tracer/model/native_step.py), from the
        token id to the logits (1, V), when the native step can take it (`native_off_reason` finds nothing), and
        either untraced or traced by a mark that takes the readings C stamps (the step's start, then one after
        each stage); else None. Runs no autograd op: no torch.no_grad() needed."""
        if self.native is None:
            return None
        take = None if mark is no_mark else getattr(mark, TAKE_STAMPS, None)
        if mark is not no_mark and (take is None or not host_clock_matches()):
            return None
        return self._decode_native(tokens, start, take)

    def _decode_native(self, tokens: torch.Tensor, start: int, take: Callable[[list[int]], None] | None,
                       staged: bool = False) -> torch.Tensor:
        """A one-token `step` as one C call; when traced, `take` receives the readings C stamped (the step's start, then
        one after each stage). `staged`: the staged path's stages apart (`staged_step`)."""
        step = self.native
        logits = step(int(tokens), start, take is not None, staged)
        if take is not None:
            take(step.readings())
        return logits

    def native_ahead(self, token: int, start: int, steps: int, stop_token: int | None,
                     choose: Chooser, stamps: bool) -> AheadRun | None:
        """Up to `steps` one-token steps of one sequence from `token` at position `start` as one C call
        (NativeStep.run_ahead: each next token `choose(logits)`'s, called from C after each step), when the native
        step can take them (`native_off_reason` finds nothing) and C's clock is the host's (the steps' times are its
        readings, traced or not); else None. The caches' fill then counts the steps done."""
        if self.native is None or not host_clock_matches():
            return None
        run = self.native.run_ahead(token, start, steps, stop_token, choose, stamps)
        end = start + len(run.tokens)
        self.fill.length, self.fill.batch = end, 1
        return replace(run, kv_live_bytes=tuple(self.kv_live_bytes(length) for length in range(start + 1, end + 1)))

    def staged_step(self, tokens: torch.Tensor, start: int,
                    take: Callable[[list[int]], None] | None) -> torch.Tensor:
        """A one-token step (1, 1) of one sequence at position `start` as the native step with the stages of
        contract.staged_stages run apart, each its own phase (`--staged`'s native backend): the same logits
        and cache as the fused step, bit for bit. `take`, when given, receives the step's start and the clock
        reading after each staged stage. Needs `native` (the caller checks)."""
        return self._decode_native(tokens, start, take, staged=True)


def watcher(model: nn.Module, wrappers_take_stamps: bool = False) -> str:
    """"" when nothing watches the modules that a backend running past them (packed, native) would miss, else what
    does: a forward hook, local or global (a tracer's hooks, --lens, --attention, FlopCounterMode's module tracker),
    or an instance-level forward wrapper (unless `wrappers_take_stamps`: the "wrap" tracer's, whose staged marks take
    the native staged step's C readings). Asked once per run, as it starts (tracer/run/select.py)."""
    from torch.nn.modules import module as module_globals

    modules = list(model.modules())
    if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks or any(
            m._forward_hooks or m._forward_pre_hooks for m in modules):
        return "forward hooks watch the stage modules (--lens, --attention or FlopCounterMode)"
    if not wrappers_take_stamps and any("forward" in m.__dict__ for m in modules):
        return "forward wrappers that take no C stamps watch the stage modules"
    return ""
