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
    tok_embeddings, layers.{i}.attention_norm, layers.{i}.attention.{wq,wk,wv,rope,kv_cache,scores,softmax,pv,wo},
    layers.{i}.attn_residual, layers.{i}.ffn_norm, layers.{i}.feed_forward.{w1,w3,act,w2}, layers.{i}.ffn_residual,
    norm, output. A projection has a bias where the contract declares one for the config (contract.has_bias:
wq, wk, wv with config.qkv_bias, wo with wo_bias, w1, w3, w2 with mlp_bias).

Numerics follow HF transformers' LlamaForCausalLM: RMSNorm in fp32 then cast back before the weight multiply,
RoPE tables computed in fp32 and cast to the model dtype, softmax in fp32. Attention uses explicit batched matmuls
(no SDPA) so FlopCounterMode counts what runs; GQA groups the R query heads of each KV head into the rows of one
matmul instead of copying K and V R times.

Two ways through prefill/decode_one: stage by stage through these modules (whenever anything watches them: hooks,
forward wrappers, FlopCounterMode), or, when nothing does, the fused path of tracer/model/fused.py, the same math
and the same roundings (both call tracer/model/functional.py) in fewer tensor ops (decode speed on a CPU is mostly
their count). `use_fused = False` forces the first. The
fused path reports its own stages through `stage_mark` (tracer/trace/fused_marks.py), so it can be traced as it runs.
Stage by stage with `staged_native` (`run --staged`), a one-token step of one sequence whose model has a native
decode step runs that C step with the stage modules' stages apart, each timed in C (FusedPlan.staged_step), unless
something that would miss it watches the modules (`staged_native_reason`).
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Callable, Mapping

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from llmtrace.tracer.core.config import ModelConfig, first_attended_position
from llmtrace.tracer.core.contract import expected_shapes, has_bias, tensor_of
from llmtrace.tracer.core.dtypes import FP32, DType
from llmtrace.tracer.core.errors import BadArgumentError, CheckpointError, HardwareError
from llmtrace.tracer.hardware.dtype_policy import torch_dtype
from llmtrace.tracer.hardware.memory import available_memory_bytes, check_prefill_fits
from llmtrace.tracer.model.edit_watch import EDIT_COUNTER, ForwardWatched, watch
from llmtrace.tracer.model.functional import (
    grouped_scores,
    grouped_values,
    project,
    rms_norm,
    rms_norm_floor,
    softmax_fp32,
    step_mask,
    swiglu,
)
from llmtrace.tracer.model.fused import TAKE_STAMPS, FusedPlan, Mark, no_mark, watched
from llmtrace.tracer.model.kv_cache import KVCache
from llmtrace.tracer.model.native_step import host_clock_matches
from llmtrace.tracer.model.rope import RotaryEmbedding, rope_tables
from llmtrace.tracer.model.weight_formats import PackedWeight


class Linear(ForwardWatched, nn.Linear):
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


class Embedding(ForwardWatched, nn.Embedding):
    """An nn.Embedding whose table may be held as stored (`packed`): then a lookup dequantizes only the rows it
    reads, into `compute_dtype`."""

    packed: PackedWeight | None = None
    compute_dtype: torch.dtype = torch.float32
    held_as: tuple[int, str] | None = None  # as Linear.held_as

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.rows(ids, self.compute_dtype)  # (..., dim)
        return super().forward(ids)


class RMSNorm(ForwardWatched):
    """x / sqrt(mean(x^2) + eps) * weight; the normalisation runs in fp32 and is cast back before the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self._floor: torch.Tensor | None = None  # sqrt(dim * eps), fp32, on the weight's device (made on first use)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        floor = self._floor
        if floor is None or floor.device != x.device:
            floor = self._floor = rms_norm_floor(self.weight.shape[0], self.eps, x.device)
        return rms_norm(x, self.weight, floor)

    def extra_repr(self) -> str:
        return f"dim={self.weight.shape[0]}, eps={self.eps}"


class AttentionScores(ForwardWatched):
    """q (B, H, T, D) · k_all (B, Hkv, S, D) -> scores (B, H, T, S), scaled by 1/sqrt(D), causal mask applied.

    The new tokens sit at the last T of the S positions; query t may see keys up to position S - T + t and, under a
    sliding window W, none before S - T + t - W + 1.
    """

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, window: int | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.window = window  # sliding window: keys older than W positions are masked too
        # (B, 1, T, S) bool, True where a real query must not see a left-pad key; set by the model for the step of a
        # batch of prompts of different lengths (Transformer._pad_step), None otherwise. An attribute, not an
        # argument: the tracer's wrappers record every tensor argument as an activation the stage reads.
        self.pad_mask: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k_all: torch.Tensor) -> torch.Tensor:
        new, seen = q.shape[2], k_all.shape[2]
        mask = step_mask(new, seen, q.device, self.window, self.pad_mask)  # (T, S), (B, 1, T, S) or None
        return grouped_scores(q, k_all, self.scale, mask)  # (B, H, T, S)

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}"


class Softmax(ForwardWatched):
    """Softmax over the key axis, computed in fp32 and cast back to the scores' dtype (as HF does)."""

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return softmax_fp32(scores)


class AttentionValues(ForwardWatched):
    """probs (B, H, T, S) · v_all (B, Hkv, S, D) -> (B, H, T, D): the attention-weighted sum of values."""

    def forward(self, probs: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
        return grouped_values(probs, v_all)  # (B, H, T, D)


class Attention(ForwardWatched):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = Linear(config.dim, config.q_dim, bias=has_bias("attention.wq", config))
        self.wk = Linear(config.dim, config.kv_dim, bias=has_bias("attention.wk", config))
        self.wv = Linear(config.dim, config.kv_dim, bias=has_bias("attention.wv", config))
        self.rope = RotaryEmbedding(config.head_dim)
        self.kv_cache = KVCache(config.n_kv_heads, config.head_dim, config.sliding_window)
        self.scores = AttentionScores(config.n_heads, config.n_kv_heads, config.head_dim, config.sliding_window)
        self.softmax = Softmax()
        self.pv = AttentionValues()
        self.wo = Linear(config.q_dim, config.dim, bias=has_bias("attention.wo", config))

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, use_cache: bool) -> torch.Tensor:
        batch, new, _ = x.shape
        q = self.wq(x).view(batch, new, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).view(batch, new, self.n_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        v = self.wv(x).view(batch, new, self.n_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        q, k = self.rope(q, k, input_pos)
        if use_cache:
            k_all, v_all = self.kv_cache(input_pos, k, v)  # (B, Hkv, S, D) each
        else:
            k_all, v_all = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, S=T, D) each
        scores = self.scores(q.transpose(1, 2), k_all)  # q: (B, H, T, D) -> scores (B, H, T, S)
        probs = self.softmax(scores)  # (B, H, T, S)
        out = self.pv(probs, v_all)  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(batch, new, self.n_heads * self.head_dim)  # (B, T, H*D)
        return self.wo(out)  # (B, T, dim)


class SwiGLUActivation(ForwardWatched):
    """silu(gate) * up, elementwise over (B, T, F)."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate, up)


class FeedForward(ForwardWatched):
    """SwiGLU FFN: w2(silu(w1 x) * w3 x); w1 = gate, w3 = up, w2 = down (Meta's names)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, ffn_dim = config.dim, config.ffn_dim
        self.w1 = Linear(dim, ffn_dim, bias=has_bias("feed_forward.w1", config))
        self.w3 = Linear(dim, ffn_dim, bias=has_bias("feed_forward.w3", config))
        self.act = SwiGLUActivation()
        self.w2 = Linear(ffn_dim, dim, bias=has_bias("feed_forward.w2", config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x), self.w3(x)))  # (B, T, F) inside, (B, T, dim) out


class Residual(ForwardWatched):
    """x + delta: the residual stream after a sub-block."""

    def forward(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return x + delta


def whole(x: torch.Tensor, layer: int | None, after: str) -> torch.Tensor:
    """A block's all-reduce on one rank: the row-split products' outputs are already the whole sums."""
    return x


class TransformerBlock(ForwardWatched):
    """Pre-norm block: h = x + attention(norm(x)); out = h + ffn(norm(h)).

    Tensor parallelism (tracer/model/tensor_parallel.py) builds this block from a shard's config, with `all_reduce`
    its process group's sum: then wo and w2 multiply this rank's heads' and FFN columns' rows, and their partial
    outputs are summed over the ranks before each residual. `layer` names the block to the collective."""

    def __init__(self, config: ModelConfig, layer: int | None = None,
                 all_reduce: Callable[[torch.Tensor, int | None, str], torch.Tensor] = whole) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.attn_residual = Residual()
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)
        self.ffn_residual = Residual()
        self.layer_index, self.all_reduce = layer, all_reduce

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, use_cache: bool) -> torch.Tensor:
        attended = self.attention(self.attention_norm(x), input_pos, use_cache)  # (B, T, dim)
        h = self.attn_residual(x, self.all_reduce(attended, self.layer_index, "attention.wo"))
        down = self.feed_forward(self.ffn_norm(h))  # (B, T, dim)
        return self.ffn_residual(h, self.all_reduce(down, self.layer_index, "feed_forward.w2"))


class Transformer(ForwardWatched):
    """The whole model. Build big ones on the meta device (`build_meta_model`) and load with `load_weights`.

    Generation: `setup_cache(max_batch, max_seq)`, then `prefill(prompt)` and `decode_one(token)` repeatedly.
    `forward(tokens)` (through `model(tokens)`) is the cache-free full recompute used to check the cached path.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        embedding = torch.empty(config.vocab_size, config.dim)
        if embedding.device.type != "meta":
            # nn.Embedding's own init, skipped on meta, where normal_ imports torch._dynamo (2 s of load time)
            nn.init.normal_(embedding)
        self.tok_embeddings = Embedding(config.vocab_size, config.dim, _weight=embedding)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = Linear(config.dim, config.vocab_size, bias=has_bias("output", config))
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_state_dict_post_hook(_drop_tied_output)
        self._pos = 0
        self._positions: torch.Tensor | None = None  # arange(max_seq) on the model's device; input_pos slices it
        self._rope_key: tuple[int, torch.device, torch.dtype] | None = None  # (length, device, dtype) of the tables
        self._rope_cos: torch.Tensor | None = None  # (max_seq, 1, D), shared with every layer's RotaryEmbedding
        self._rope_sin: torch.Tensor | None = None
        self.use_fused = True  # False: always run stage by stage, even without hooks (for comparisons)
        # False: the fused path's one-token step runs its torch ops even where the native decode step
        # (tracer/model/native_step.py) could run it in one C call (for comparisons)
        self.use_native_step = True
        # The fused path's one-token product kernel (functional.MATVEC_KERNELS: "mv" or "mm"), as this machine's
        # measurement chose it for the model's dtype (the loader sets it; setup_cache applies it).
        self.decode_kernel = "mv"
        self.stage_mark: Mark = no_mark  # called by the fused path after each stage (tracer/trace/fused_marks.py)
        # --staged (tracer/run/generate.py): a one-token step of one sequence runs the native decode step with the
        # staged path's stages apart, each its own phase timed in C (FusedPlan.staged_step), instead of the stage
        # modules, where `staged_native_reason()` finds nothing against it. `staged_mark`'s TAKE_STAMPS, when it has
        # one, receives that step's clock readings (the tracer's "wrap" mechanism: tracer/trace/fused_marks.py's
        # FusedMarks(staged=True)).
        self.staged_native = False
        self.staged_mark: Mark = no_mark
        self._fused_plan: FusedPlan | None = None  # built by setup_cache
        # (L, B_max, 2*Hkv, S_max, D): every layer's KV cache buffer is one slice of it (setup_cache), so the fused
        # path's one-token step takes all layers' write positions and live keys/values in a few views per step.
        self._kv_all: torch.Tensor | None = None
        self._hook_free_stamp = -1  # RemovableHandle.next_id when `_watcher` last found no forward hook
        # (B,) left pads of each cached sequence when a batch of prompts of different lengths was prefilled
        # (`prefill(tokens, pad)`), None when no row has any.
        self._pad: torch.Tensor | None = None

    # ---- cache ---------------------------------------------------------------------------------------------

    @property
    def pos(self) -> int:
        """Tokens already in the KV cache (the position the next token will take)."""
        return self._pos

    def setup_cache(self, max_batch: int, max_seq: int) -> None:
        """Allocate every layer's KV cache for `max_batch` sequences of up to `max_seq` tokens; resets `pos`."""
        if max_batch <= 0 or max_seq <= 0:
            raise BadArgumentError(f"cache size must be positive, got max_batch={max_batch}, max_seq={max_seq}")
        if max_seq > self.config.max_seq_len:
            raise BadArgumentError(
                f"max_seq {max_seq} exceeds the model's context length {self.config.max_seq_len}; ask for fewer tokens"
            )
        weight = self.norm.weight  # always dense, in the model's dtype (a stored embedding is a meta placeholder)
        if weight.device.type == "cpu":
            need = 2 * self.config.n_layers * max_batch * max_seq * self.config.kv_dim * weight.element_size()
            free = available_memory_bytes()
            if free is not None and need > free * 0.9:
                raise HardwareError(
                    f"a KV cache for {max_seq:,} positions needs {need / 1e9:,.1f} GB, this machine has "
                    f"{free / 1e9:,.1f} GB free; ask for fewer --max-new-tokens or a shorter prompt")
        watch(self)  # the edit counter FusedPlan relies on, started before the caches' list is read
        caches = self._kv_caches()
        heads = {(cache.n_kv_heads, cache.head_dim) for cache in caches}
        self._kv_all = None
        if len(heads) == 1:  # every layer's cache is one slice of a single tensor (FusedPlan reads them together)
            (kv_heads, head_dim), = heads
            self._kv_all = torch.zeros((len(caches), max_batch, 2 * kv_heads, max_seq, head_dim),
                                       dtype=weight.dtype, device=weight.device)  # (L, B_max, 2*Hkv, S_max, D)
        for index, cache in enumerate(caches):
            buffer = None if self._kv_all is None else self._kv_all[index]  # (B_max, 2*Hkv, S_max, D)
            cache.allocate(max_batch, max_seq, weight.dtype, weight.device, buffer)
        self._ensure_rope(max_seq)
        for layer in self.layers:  # a layer replaced since the tables were made has none yet
            layer.attention.rope.set_tables(self._rope_cos, self._rope_sin, self._positions)
        self._fused_plan = FusedPlan(self)
        self._hook_free_stamp = -1  # a new plan: the next `fusable()` takes a full look
        self._pos = 0
        self._pad = None

    def reset_cache(self) -> None:
        """Forget the cached sequence (buffers stay allocated)."""
        for cache in self._kv_caches():
            cache.reset()
        self._pos = 0
        self._pad = None

    def _kv_caches(self) -> list[KVCache]:
        """Every layer's KVCache, in order, as a plain list: read a few times per step (their sizes for the step's
        record), where nn.Module's attribute lookups cost ~2 us each (layer.attention.kv_cache: ~120 us a step).
        Rebuilt when `layers` is another ModuleList or another length, or anything in the module tree was replaced
        (a layer, a cache) since it was made (the edit counter setup_cache starts: tracer/model/edit_watch.py)."""
        layers = self._modules["layers"]
        counter = self.__dict__.get(EDIT_COUNTER)
        generation = None if counter is None else counter.generation
        cached = self.__dict__.get("_kv_cache_list")
        if cached is None or cached[0] is not layers or cached[1] != generation or len(cached[2]) != len(layers):
            cached = (layers, generation, [layer.attention.kv_cache for layer in layers])
            self.__dict__["_kv_cache_list"] = cached  # a plain attribute, not a submodule registration
        return cached[2]

    @property
    def batch(self) -> int:
        """Sequences in the cache (0 before the first prefill)."""
        caches = self._kv_caches()
        return caches[0].batch if caches else 0

    @property
    def pads(self) -> tuple[int, ...]:
        """Left pads of each cached sequence (all 0 unless prompts of different lengths were prefilled together)."""
        if self._pad is None:
            return (0,) * self.batch
        return tuple(int(p) for p in self._pad.tolist())

    def keep_rows(self, rows: list[int]) -> None:
        """Compact the batch to the sequences `rows` (indices into the current batch, ascending): each layer's cache
        copies those rows' live positions to the front of its buffer, so the next step runs on len(rows) rows only.
        A finished sequence leaves the batch this way and costs nothing more."""
        if not rows or list(rows) != sorted(set(rows)) or rows[-1] >= self.batch:
            raise BadArgumentError(f"keep_rows takes ascending row indices below the batch of {self.batch}, got {rows}")
        if len(rows) == self.batch:
            return
        # on the caches' device: the dense final norm's (a table held as stored leaves a meta placeholder, and a
        # meta index made index_select return uninitialised rows without a word)
        index = torch.tensor(rows, dtype=torch.long, device=self.norm.weight.device)  # (B',)
        for cache in self._kv_caches():
            cache.keep_rows(index)
        if self._pad is not None:
            pad = self._pad.index_select(0, index)  # (B',)
            self._pad = pad if bool(pad.any()) else None

    @property
    def kv_bytes_per_position(self) -> int:
        """K and V bytes one position of one sequence holds in the caches of all layers together."""
        return sum(2 * c.n_kv_heads * c.head_dim * c.kv.element_size() for c in self._kv_caches() if c.kv is not None)

    @property
    def kv_allocated_bytes(self) -> int:
        return sum(cache.allocated_bytes for cache in self._kv_caches())

    @property
    def kv_live_bytes(self) -> int:
        """Bytes of K and V attention can still read, over every layer. Between steps every layer's cache holds the
        same positions and sequences (a step writes all or, failing, none), so when every cache is a slice of one
        tensor (the same heads, head dim and dtype) and none was replaced since (the fused plan's edit counter),
        that is layers x one cache's, from the plan's plain values (FusedPlan.kv_live_bytes): no cache module or
        tensor touched, where ~30 cold cache reads took ~60 us a step and one still took ~30 us."""
        plan = self._fused_plan
        if plan is not None and plan.kv_rows is not None and plan.caches and plan.tree_unchanged():
            return plan.kv_live_bytes()
        return sum(cache.live_bytes for cache in self._kv_caches())

    def _ensure_rope(self, length: int) -> None:
        """Share one cos/sin table of at least `length` positions among every layer's RotaryEmbedding."""
        weight = self.norm.weight
        key = self._rope_key
        if key is not None and key[0] >= length and key[1] == weight.device and key[2] == weight.dtype:
            return
        cos, sin = rope_tables(self.config, length, weight.dtype, weight.device)
        self._positions = torch.arange(length, device=weight.device)
        for layer in self.layers:
            layer.attention.rope.set_tables(cos, sin, self._positions)
        self._rope_cos, self._rope_sin = cos, sin
        self._rope_key = (length, weight.device, weight.dtype)
        if self._fused_plan is not None:
            # Longer tables (a cache-free forward past max_seq) hold the same rows: the plan stays valid.
            self._fused_plan.cos, self._fused_plan.sin = cos, sin

    # ---- forward passes ------------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Cache-free forward over all positions from 0: tokens (B, T) -> logits (B, T, V). Leaves the cache alone."""
        new = tokens.shape[1]
        self._check_attention_fits(tokens.shape[0], new, new)
        self._ensure_rope(new)
        input_pos = self._positions[:new]  # (T,)
        x = self.embed(tokens)  # (B, T, dim)
        for layer in self.layers:
            x = layer(x, input_pos, False)
        return self.logits(x)  # (B, T, V)

    def prefill(self, tokens: torch.Tensor, pad: list[int] | None = None) -> torch.Tensor:
        """Run the prompt tokens (B, T) through the model, filling the cache; logits (B, V) of the last position.

        Only the last position goes through the final norm and the LM head: the others' logits are never used.
        `pad` (one count per row): prompts of different lengths, left-padded to T; row b's first pad[b] tokens are
        padding. No real query attends a pad key (now or in any later decode step), and each row's positions count
        from its first real token, so its RoPE angles, and so its logits, are those of its batch-1 run.
        """
        if pad is not None:
            if len(pad) != tokens.shape[0] or min(pad) < 0 or max(pad) >= tokens.shape[1]:
                raise BadArgumentError(f"pad needs one count in [0, {tokens.shape[1]}) per row, got {list(pad)}")
            if self._pos:
                raise BadArgumentError("pads are set by the first prefill of a sequence; reset the cache first")
        self._check_attention_fits(tokens.shape[0], tokens.shape[1], self._pos + tokens.shape[1])
        self._pad = (torch.tensor(pad, dtype=torch.long, device=tokens.device)  # (B,)
                     if pad is not None and any(pad) else None)
        return self._cached_step(tokens)

    def _check_attention_fits(self, batch: int, new: int, seen: int) -> None:
        """A step of many tokens holds (B, H, T, S) attention scores: refused in one line before the first layer
        when they cannot fit in this machine's memory (tracer/hardware/memory.py); the meta device holds nothing."""
        if new > 1 and self.norm.weight.device.type == "cpu":
            check_prefill_fits(self.config.n_heads, batch, new, seen)

    def decode_one(self, tokens: torch.Tensor) -> torch.Tensor:
        """One new token per sequence, tokens (B, 1), at position `pos`; logits (B, V)."""
        shape = tokens.shape
        if len(shape) != 2 or shape[1] != 1:
            raise BadArgumentError(f"decode_one takes tokens of shape (B, 1), got {tuple(shape)}")
        return self._cached_step(tokens, shape)

    def _cached_step(self, tokens: torch.Tensor, shape: torch.Size | None = None) -> torch.Tensor:
        """One cached step of tokens (B, T) (`shape`: theirs, when the caller read it). Everything it reads before
        the step is cold (the last step streamed the weights): tens of us per nn.Module lookup or torch getter, so
        while the fused plan still describes the module tree (its edit counter), the caches' size comes from the
        plan's plain values instead of the caches' modules and tensors."""
        plan = self._fused_plan
        if plan is not None and plan.caches and plan.tree_unchanged():
            # the caches the plan was made over: allocated by setup_cache, none replaced since
            max_seq, cached_batch = plan.max_seq, plan.cache_dicts[0]["batch"]
        else:
            caches = self._kv_caches()
            kv_cache = caches[0] if caches else None
            if kv_cache is None or not kv_cache.is_allocated:
                raise BadArgumentError("the KV cache is not set up; call setup_cache(max_batch, max_seq) first")
            max_seq, cached_batch = kv_cache.max_seq, kv_cache.batch
        batch, new = tokens.shape if shape is None else shape
        start = self._pos
        if start + new > max_seq:
            raise BadArgumentError(
                f"{start} cached + {new} new tokens exceed the cache of {max_seq} positions; "
                "set up a longer cache or ask for fewer tokens"
            )
        if start and batch != cached_batch:
            raise BadArgumentError(f"batch size changed from {cached_batch} to {batch} mid-sequence; reset the cache")
        staged = False  # the stage-by-stage path sets every layer's pad mask; only then is there one to clear
        try:
            fused = self.fusable()
            logits = None
            if fused and batch == 1 and new == 1 and self._pad is None:
                # The native decode step, when it takes this step: one C call, no autograd op, no position tensor
                # (everything touched after a step that streamed the weights is cold: tens of us per torch op).
                logits = self._fused_plan.native_decode(tokens, start, self.stage_mark, self.use_native_step)
            if logits is None:
                with torch.no_grad():
                    input_pos = self._positions[start : start + new]  # (T,)
                    pad_mask = None
                    if self._pad is not None:
                        input_pos, pad_mask = self._pad_step(input_pos, start + new)  # (B, T), (B, 1, T, S)
                    if fused:
                        logits = self._fused_plan.step(tokens, start, self.stage_mark,
                                                       None if pad_mask is None else input_pos, pad_mask,
                                                       self.use_native_step)
                    elif batch == 1 and new == 1 and pad_mask is None and not self.staged_native_reason():
                        logits = self._fused_plan.staged_step(tokens, start,
                                                              getattr(self.staged_mark, TAKE_STAMPS, None))
                    else:
                        staged = True
                        x = self.embed(tokens)  # (B, T, dim)
                        for layer in self.layers:
                            layer.attention.scores.pad_mask = pad_mask
                        for layer in self.layers:
                            x = layer(x, input_pos, True)
                        x = x[:, -1, :]  # (B, dim): the last position only
                        logits = self.logits(x)  # (B, V)
        except BaseException:
            self.rewind(start)  # a failure (or Ctrl-C) mid-pass: no layer's cache one step ahead of the others
            raise
        finally:
            if staged:
                for layer in self.layers:
                    layer.attention.scores.pad_mask = None
        # a plain attribute: written past nn.Module.__setattr__ (its parameter, buffer and module checks: ~35 us cold)
        self.__dict__["_pos"] = start + new
        return logits

    def rewind(self, start: int) -> None:
        """Every layer's cache back to `start` positions: a step that failed (or a Ctrl-C) mid-pass leaves no layer
        ahead of the others."""
        for cache in self._kv_caches():
            cache.length = start

    def advance(self, end: int) -> None:
        """`pos` becomes `end`: the positions a backend that writes the caches itself filled (the native step running
        several steps a call: tracer/run/native_backend.py)."""
        self.__dict__["_pos"] = end  # a plain attribute: past nn.Module.__setattr__, as _cached_step writes it

    def _pad_step(self, index: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a step over the cache indices `index` (T,) of left-padded rows: each row's positions (B, T), counted
        from its first real token (pads at 0, never seen), and the pad mask (B, 1, T, S) hiding the pad keys among
        the S keys the step reads from every real query. A pad query may see earlier pads (only pads): its softmax
        stays finite, and no real row ever reads what it computes."""
        pad = self._pad  # (B,)
        positions = (index.unsqueeze(0) - pad.unsqueeze(1)).clamp_(min=0)  # (B, T)
        first = first_attended_position(end, index.shape[0], self.config.sliding_window)
        keys = torch.arange(first, end, device=index.device)  # (S,) cache indices the step reads
        key_is_pad = keys.unsqueeze(0) < pad.unsqueeze(1)  # (B, S)
        query_is_real = index.unsqueeze(0) >= pad.unsqueeze(1)  # (B, T)
        hidden = (query_is_real.unsqueeze(2) & key_is_pad.unsqueeze(1)).unsqueeze(1)  # (B, 1, T, S)
        return positions, hidden

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> hidden states (B, T, dim) through the tok_embeddings stage. The stage-by-stage path's
        one way in: a tensor-parallel model (tracer/model/tensor_parallel.py) adds its all-reduce here."""
        return self.tok_embeddings(tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states (..., dim) -> logits (..., V) through the final norm and the LM head (the stage-by-stage
        path's one way out; a tensor-parallel model gathers the vocabulary slices here)."""
        return self.output(self.norm(x))

    # ---- the fused path ------------------------------------------------------------------------------------

    def fusable(self) -> bool:
        """True when `prefill`/`decode_one` may run the fused path (tracer/model/fused.py): the same math in about half
        the tensor ops. It needs `use_fused`, the plan `setup_cache` made still describing the model (a reload,
        `.to()`, a replaced module or an in-place weight edit voids it until the next setup_cache), and nothing
        watching a module: any nn.Module forward hook, local or global (a tracer's hooks, FlopCounterMode's module
        tracker), or an instance-level forward wrapper sends the call stage by stage, so what is traced is what runs.

        Asked before every step, so the answer of the last full look is kept while nothing that could change it
        happened: no hook registered anywhere (RemovableHandle.next_id), nothing replaced or wrapped in the module
        tree (the model's edit counter, tracer/model/edit_watch.py), no wrapper on a module that does not count its
        own, the same rope tables and parameter versions. A full look (`_watcher`) walks every module, parameter and
        buffer: ~0.45 ms a step on the bundled model, with the caches a decode step just flushed."""
        plan = self._fused_plan
        if not self.use_fused or plan is None:
            return False
        if RemovableHandle.next_id == self._hook_free_stamp and plan.unchanged(self) and not any(
                map(operator.contains, plan.unwatched_dicts, repeat("forward"))):
            return True
        if self._watcher(plan):
            return False
        plan.rearm()  # `unchanged` holds from this edit generation on (and no hook at this stamp: `_watcher`)
        return True

    def native_decode_reason(self) -> str:
        """"" when an untraced one-token step of one sequence runs as the native decode step now (one C call:
        FusedPlan.native), else why the fused path's torch ops or the stage modules run it: no cache set up, no
        native step (FusedPlan.native_off_reason: none for this model, switched off, rope tables or KV rows replaced),
        or the model not fusable (a hook, a replaced module, an edit since setup_cache)."""
        plan = self._fused_plan
        if plan is None:
            return "the KV cache is not set up"
        off = plan.native_off_reason(self.use_native_step)
        if off:
            return off
        if not self.fusable():
            return "the fused path does not run (fusable() is False: a hook, a replaced module or an edit)"
        return ""

    def staged_native_reason(self) -> str:
        """"" when a one-token step of one sequence runs as the native staged step (`staged_native`), else why the
        stage modules run it: the step is not asked for, the model has no native decode step (FusedPlan.native), or
        something watches the stage modules that would miss it (a forward hook: --lens, --attention,
        FlopCounterMode; an instance-level forward wrapper that takes no C stamps)."""
        plan = self._fused_plan
        if not self.staged_native:
            return "not asked for (staged_native is off)"
        if plan is None:
            return "the KV cache is not set up"
        off = plan.native_off_reason(self.use_native_step)
        if off:
            return off
        take = getattr(self.staged_mark, TAKE_STAMPS, None)
        watcher = self._watcher(plan, wrappers_take_stamps=take is not None)
        if watcher:
            return watcher
        if take is not None and not host_clock_matches():
            return "the host clock is not CLOCK_MONOTONIC, the one the C step stamps with"
        return ""

    def _watcher(self, plan: FusedPlan, wrappers_take_stamps: bool = False) -> str:
        """"" when nothing watches the modules that a step run past them (the fused path, the native step) would
        miss and `plan` still describes the model, else what does: a forward hook, local or global (a tracer's
        hooks, --lens, --attention, FlopCounterMode's module tracker), an instance-level forward wrapper (unless
        `wrappers_take_stamps`: the "wrap" tracer's, whose staged mark takes the native staged step's C readings), or
        a replaced or edited weight (FusedPlan.valid). `fusable()` and `staged_native_reason()` both ask it.

        Hooks are looked for only when one was registered anywhere since none was last seen (RemovableHandle.next_id,
        bumped by every registration, kept in `_hook_free_stamp`). Wrappers bump no stamp: every module's __dict__ is
        looked in (a C loop: ~15 us warm for ~600 modules)."""
        stamp = RemovableHandle.next_id
        if stamp != self._hook_free_stamp:
            if watched(plan.modules):
                return "forward hooks watch the stage modules (--lens, --attention or FlopCounterMode)"
            self._hook_free_stamp = stamp
        if not wrappers_take_stamps and any(map(operator.contains, plan.module_dicts, repeat("forward"))):
            return "forward wrappers that take no C stamps watch the stage modules"
        if not plan.valid(self):
            return "the weights changed since setup_cache (a reload, .to() or an in-place edit)"
        return ""

    def rope_tables(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The cos and signed-sin tables (S_max, 1, D) every layer's RotaryEmbedding shares."""
        return self._rope_cos, self._rope_sin

    # ---- weights -------------------------------------------------------------------------------------------

    def load_stored(self, state_dict: Mapping[str, torch.Tensor], packed: Mapping[str, PackedWeight]) -> None:
        """Adopt dense tensors (`state_dict`: norms, biases, matrices without a stored kernel) and matrices as stored
        (`packed`, by the same names: "layers.0.attention.wq.weight"...), strictly checked together. A packed
        matrix's parameter becomes a meta placeholder of its shape in the model's dtype (no memory); its module
        multiplies (Linear) or looks up (Embedding) through the PackedWeight."""
        dtype = self.norm_dtype(state_dict)
        placeholders = {name: torch.empty(w.shape, dtype=dtype, device="meta") for name, w in packed.items()}
        overlap = sorted(set(state_dict) & set(packed))
        if overlap:
            raise CheckpointError(f"tensors given both dense and packed: {', '.join(overlap[:3])}")
        self.load_weights({**state_dict, **placeholders})
        for name, weight in packed.items():
            module = self.get_submodule(name.removesuffix(".weight"))
            if not isinstance(module, (Linear, Embedding)):
                raise CheckpointError(f"{name} is not a matrix a stored kernel can run")
            module.packed = weight
            if isinstance(module, Embedding):
                module.compute_dtype = dtype
        if self.config.tie_embeddings:
            self.output.packed = self.tok_embeddings.packed

    def norm_dtype(self, state_dict: Mapping[str, torch.Tensor]) -> torch.dtype:
        """The model's compute dtype: its final norm's (the one tensor every checkpoint holds dense)."""
        norm = state_dict.get("norm.weight")
        if norm is None:
            raise CheckpointError("checkpoint does not match: missing norm.weight")
        return norm.dtype

    def stored_weights(self) -> dict[str, PackedWeight]:
        """{module name: PackedWeight} of every matrix held as stored (the tied LM head under both names)."""
        return {name: module.packed for name, module in self.named_modules()
                if isinstance(module, (Linear, Embedding)) and module.packed is not None}

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
            if isinstance(module, (Linear, Embedding)):
                module.packed = None  # dense weights now: a stored matrix of an earlier load is gone
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self._positions, self._rope_key = None, None
        self._fused_plan = None
        self._kv_all = None
        for layer in self.layers:  # the caches were sized and typed for the old weights: set them up again
            layer.attention.kv_cache.kv = None
            layer.attention.kv_cache.reset()
        self._pos = 0


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
