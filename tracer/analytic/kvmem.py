"""KV-cache size: 2 (K and V) x layers x KV heads x head dim x bytes per value x positions x batch. Pure Python.

Positions are those the cache must hold: the context, or under a sliding window W (Mistral 7B v0.1: 4096) only
the last min(context, W), as Mistral's reference implementation holds them (a rolling buffer). Where windowed and
global layers interleave (Gemma 3: five windowed to one global) each windowed layer holds min(context, W) and each
global layer the whole context, as llama.cpp's and transformers' hybrid caches do. `run` itself allocates every
layer's buffer to the run's whole length and reads the window's part (tracer/model/kv_cache.py): `run_note` says so.

For block-quantized cache dtypes (int8, int4) the scales are stored per head vector of D values, so the exact
bytes of one head vector are dtype.row_bytes(D) and "bytes per value" is that divided by D.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmtrace.tracer.analytic.params import weight_bytes
from llmtrace.tracer.checkpoint.weights_summary import WeightsSummary
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import BF16, FP16, FP32, DType
from llmtrace.tracer.core.errors import BadArgumentError


# Output records, read field by field and through asdict(): eq=False and repr=False spare compiling __eq__,
# __hash__ and __repr__ for each at import, which the analytical commands (answering in a blink) feel.
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class KVCacheSize:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    bytes_per_value: float  # scales included
    batch: int
    seq: int  # context positions per sequence
    cached_positions: int  # positions per sequence the cache holds: seq, or min(seq, sliding window) (a windowed layer's)
    bytes_per_token_per_layer: int  # one position of one sequence, K and V, one layer
    bytes_per_token: int  # one position of one sequence, all layers
    bytes_per_layer: int  # all positions and sequences, one layer (a windowed one where global layers interleave)
    total_bytes: int
    global_layers: int = 0  # layers holding every position among windowed ones (Gemma 3's global layers), else 0


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ContextRow:
    seq: int
    total_bytes: int


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class BudgetFit:
    budget_bytes: int
    max_positions_kv_only: int  # positions per sequence whose cache fits in the budget (under a sliding window:
    # the model's whole context once the window's cache fits, since the cache never grows past the window)
    weights_dtype: str
    weights_bytes: int
    max_positions_with_weights: int  # positions per sequence that fit beside the weights (0 if the weights do not fit)
    model_max_seq_len: int


KVMEM_SCHEMA = "llmtrace.kvmem/1"


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class KVMemReport:
    schema: str
    model: str
    max_seq_len: int
    formula: str  # with the numbers substituted
    size: KVCacheSize
    without_gqa: KVCacheSize  # the same model with n_kv_heads = n_heads (plain multi-head attention)
    gqa_saving: float  # without_gqa.total_bytes / size.total_bytes
    table: tuple[ContextRow, ...]
    budget: BudgetFit | None
    dtype_note: str = ""  # why the cache has this dtype when no --dtype chose it (run_cache_dtype), else ""
    run_note: str = ""  # what `run` allocates where it is more than the figure (a sliding window's layers), else ""


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadArgumentError(f"{name} must be a positive integer, got {value!r}")
    return value


def kv_bytes_per_token_per_layer(n_kv_heads: int, head_dim: int, dtype: DType) -> int:
    """K and V of one position in one layer: 2 * Hkv * bytes(D values)."""
    return 2 * n_kv_heads * dtype.row_bytes(head_dim)


def kv_bytes_per_token(config: ModelConfig, dtype: DType) -> int:
    """K and V of one position, all layers, one sequence: 2 * layers * Hkv * bytes(D values)."""
    return config.n_layers * kv_bytes_per_token_per_layer(config.n_kv_heads, config.head_dim, dtype)


def kv_cache_bytes(config: ModelConfig, seq: int, dtype: DType, batch: int = 1) -> int:
    """2 * Hkv * D * bytes per value * positions of every layer * batch; positions = min(seq, sliding window) on a
    windowed layer (config.cached_layer_positions)."""
    per_layer_token = kv_bytes_per_token_per_layer(config.n_kv_heads, config.head_dim, dtype)
    return per_layer_token * config.cached_layer_positions(_positive("seq", seq)) * _positive("batch", batch)


def kv_cache_size(config: ModelConfig, seq: int, dtype: DType, batch: int = 1, n_kv_heads: int | None = None) -> KVCacheSize:
    _positive("seq", seq)
    _positive("batch", batch)
    heads = config.n_kv_heads if n_kv_heads is None else n_kv_heads
    per_layer_token = kv_bytes_per_token_per_layer(heads, config.head_dim, dtype)
    held = config.cached_positions(seq)
    return KVCacheSize(
        n_layers=config.n_layers, n_kv_heads=heads, head_dim=config.head_dim, dtype=dtype.name,
        bytes_per_value=dtype.row_bytes(config.head_dim) / config.head_dim, batch=batch, seq=seq,
        cached_positions=held, bytes_per_token_per_layer=per_layer_token,
        bytes_per_token=per_layer_token * config.n_layers, bytes_per_layer=per_layer_token * held * batch,
        total_bytes=per_layer_token * config.cached_layer_positions(seq) * batch,
        global_layers=len(config.full_layers) if config.mixed_windows else 0,
    )


def context_lengths(max_seq_len: int, seq: int) -> tuple[int, ...]:
    """Powers of two from 128 up to the model's max context, plus the requested length and the max itself."""
    lengths = {seq, max_seq_len}
    n = 128
    while n < max_seq_len:
        lengths.add(n)
        n *= 2
    return tuple(sorted(lengths))


def budget_fit(config: ModelConfig, dtype: DType, batch: int, budget_bytes: int, weights: DType,
               stored_bytes: int | None = None) -> BudgetFit:
    """stored_bytes: the file's weights as stored (a GGUF's tensors, each its own type) instead of `weights`' size."""
    per_position = kv_bytes_per_token(config, dtype) * batch
    w_bytes = weight_bytes(config, weights) if stored_bytes is None else stored_bytes
    return BudgetFit(
        budget_bytes=budget_bytes, max_positions_kv_only=_positions_within(config, budget_bytes // per_position),
        weights_dtype=weights.name, weights_bytes=w_bytes,
        max_positions_with_weights=_positions_within(config, max(0, budget_bytes - w_bytes) // per_position),
        model_max_seq_len=config.max_seq_len,
    )


def _positions_within(config: ModelConfig, cacheable: int) -> int:
    """Context positions whose cache fits when `cacheable` positions of every layer do: the same, or with a sliding
    window that fits, the model's whole context (the cache holds W positions however long the context grows); where
    global layers interleave, the most positions p with windowed·min(p, W) + global·p within cacheable·layers."""
    window = config.sliding_window
    if config.mixed_windows and window is not None:
        room, full, windowed = cacheable * config.n_layers, len(config.full_layers), config.windowed_layers
        if room < config.n_layers * window:  # every layer still holds all p positions
            return room // config.n_layers
        return (room - windowed * window) // full
    return max(cacheable, config.max_seq_len) if window is not None and cacheable >= window else cacheable


# A float checkpoint's stored dtype -> the dtype `run` computes it in, and so allocates its cache in.
_FLOAT_CACHE = {"F32": FP32, "BF16": BF16, "F16": FP16}


def run_cache_dtype(weights: WeightsSummary | None) -> tuple[DType, str]:
    """The KV-cache dtype `llmtrace run` allocates for a checkpoint, and one line saying why. The cache holds K and
    V in the activations' dtype: a GGUF's are fp32 (its stored kernels take fp32 activations and its dequantized
    matrices are fp32), a float checkpoint's its own dtype (bf16, fp16 or fp32), a preset's (shapes only: `run
    --dry-run`) fp32."""
    if weights is None:
        return FP32, "fp32, as `run --dry-run` allocates it for a preset"
    if weights.format == "gguf":
        return FP32, "fp32, as `run` allocates it for a GGUF"
    dtype = _FLOAT_CACHE.get(weights.main_dtype, FP32)
    return dtype, f"{dtype.name}, as `run` allocates it for a {weights.main_dtype} checkpoint"


def kvmem_report(
    config: ModelConfig, seq: int, dtype: DType, batch: int = 1,
    budget_bytes: int | None = None, weights_dtype: DType | None = None, stored_weight_bytes: int | None = None,
    dtype_note: str = "",
) -> KVMemReport:
    """stored_weight_bytes: a GGUF's weights as stored (each tensor its own type), which the budget then takes.
    dtype_note: why `dtype` (run_cache_dtype's line), shown under the headline."""
    size = kv_cache_size(config, seq, dtype, batch)
    mha = kv_cache_size(config, seq, dtype, batch, n_kv_heads=config.n_heads)
    positions = f"{seq} positions" if size.cached_positions == seq else \
        f"{size.cached_positions} positions (sliding window {config.sliding_window} of {seq})"
    if config.mixed_windows:  # Gemma 3: the windowed layers' window, the global layers' whole context
        layers = (f"({config.windowed_layers} windowed layers × {positions} + {size.global_layers} global layers × "
                  f"{seq} positions)")
        formula = (f"2 × {config.n_kv_heads} KV heads × {config.head_dim} head dim × {size.bytes_per_value:g} B "
                   f"({dtype.name}) × {layers} × {batch} batch = {size.total_bytes:,} B")
    else:
        formula = (
            f"2 × {config.n_layers} layers × {config.n_kv_heads} KV heads × {config.head_dim} head dim × "
            f"{size.bytes_per_value:g} B ({dtype.name}) × {positions} × {batch} batch = {size.total_bytes:,} B"
        )
    table = tuple(ContextRow(n, size.bytes_per_token_per_layer * config.cached_layer_positions(n) * batch)
                  for n in context_lengths(config.max_seq_len, seq))
    run_note = ""
    if config.sliding_window is not None and seq > config.sliding_window:
        allocated = size.bytes_per_token * seq * batch
        run_note = (f"`run` allocates every layer's cache to the run's whole length ({allocated:,} B at {seq:,} "
                    "positions), written by position, and reads the window's part")
    budget = None
    if budget_bytes is not None:
        budget = budget_fit(config, dtype, batch, _positive("budget", budget_bytes), weights_dtype or dtype,
                            stored_weight_bytes)
    return KVMemReport(
        schema=KVMEM_SCHEMA, model=config.name, max_seq_len=config.max_seq_len, formula=formula, size=size, without_gqa=mha,
        gqa_saving=mha.total_bytes / size.total_bytes, table=table, budget=budget, dtype_note=dtype_note,
        run_note=run_note,
    )


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def parse_bytes(text: str) -> int:
    """'24GiB' -> 25769803776, '80GB' -> 80e9, '1024' -> 1024 bytes. GB = 1e9, GiB = 2^30."""
    match = _SIZE_RE.match(text.lower())
    if not match or match.group(2) not in _UNITS:
        raise BadArgumentError(f"cannot read {text!r} as a memory size; write e.g. 24GiB, 80GB or 512MiB")
    value = int(float(match.group(1)) * _UNITS[match.group(2)])
    if value <= 0:
        raise BadArgumentError(f"memory size {text!r} must be more than 0 bytes")
    return value
