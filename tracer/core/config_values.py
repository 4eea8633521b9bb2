"""The parts a ModelConfig is built of beyond plain numbers (RoPE scaling, a mixture of experts), the bounds every
field is checked against, and the number checks the config readers (config_hf.py, config_gguf.py) share.

Pure Python (no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from llmtrace.tracer.core.errors import ConfigError, short_repr
from llmtrace.tracer.core.json_input import is_int

# Upper bounds far past any released model (Llama 3.1 405B: dim 16,384, 126 layers, 128 heads, FFN 53,248,
# vocabulary 128,256; the longest contexts are ~10M): a value beyond them is a corrupt file, and refusing it here
# keeps torch from being asked for a tensor of 2^60 elements.
INT_LIMITS = {"vocab_size": 2**31 - 1, "dim": 2**20, "n_layers": 2**14, "n_heads": 2**14, "n_kv_heads": 2**14,
              "ffn_dim": 2**24, "max_seq_len": 2**30}
MAX_EXPERTS = 2**16  # DeepSeek-V3 has 256 routed experts a layer


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3.1-style frequency-dependent RoPE scaling ("rope_type": "llama3": its low and high frequency factors
    bound the band blended between scaled and kept), or with `kind` "linear" every frequency divided by `factor`
    (Gemma 3's global layers), or with `kind` "longrope" (Phi-3's 128k models) frequency i divided by short_factor[i]
    up to `original_max_position` positions and by long_factor[i] past it, cos and sin times `attention_factor`
    (`factor` is then the context's stretch, for show), or with `kind` "freqs" frequency i divided by freq_factors[i]
    at every length (llama.cpp's `rope_freqs` tensor, how its converter writes Llama 3.1's scaling into a GGUF;
    `factor` is then the largest, for show)."""

    factor: float
    original_max_position: int
    kind: str = "llama3"  # "llama3", "linear", "longrope" or "freqs"
    low_freq_factor: float | None = None  # llama3's alone (None for the other kinds)
    high_freq_factor: float | None = None
    short_factor: tuple[float, ...] = ()  # LongRoPE's, one per frequency (head_dim / 2)
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # LongRoPE's
    freq_factors: tuple[float, ...] = ()  # kind "freqs": one divisor per frequency (head_dim / 2)

    def check(self, name: str) -> None:
        if self.kind not in ("llama3", "linear", "longrope", "freqs"):
            raise ConfigError(f"config {name!r}: rope scaling kind must be 'llama3', 'linear', 'longrope' or 'freqs', "
                              f"got {self.kind!r}")
        if (self.kind == "freqs") != bool(self.freq_factors) or not all(
                isinstance(f, float) and math.isfinite(f) and f > 0 for f in self.freq_factors):
            raise ConfigError(f"config {name!r}: rope scaling 'freqs' needs one factor per frequency, each a finite "
                              "number > 0 (and no other kind takes them)")
        if self.kind == "longrope" and not (len(self.short_factor) == len(self.long_factor) > 0 and all(
                isinstance(f, float) and math.isfinite(f) and f > 0 for f in (*self.short_factor, *self.long_factor,
                                                                             self.attention_factor))):
            raise ConfigError(f"config {name!r}: LongRoPE needs short and long factors of one length and an attention "
                              "factor, each a finite number > 0")
        llama3 = self.kind == "llama3"
        for field_name in ("factor", "low_freq_factor", "high_freq_factor") if llama3 else ("factor",):
            value = getattr(self, field_name)
            if not positive_real(value):
                raise ConfigError(f"config {name!r}: rope scaling {field_name} must be a finite number > 0, got "
                                  f"{value!r}")
        if llama3 and self.low_freq_factor >= self.high_freq_factor:
            raise ConfigError(f"config {name!r}: rope scaling low_freq_factor ({self.low_freq_factor}) must be below "
                              f"high_freq_factor ({self.high_freq_factor})")
        if not llama3 and (self.low_freq_factor, self.high_freq_factor) != (None, None):
            raise ConfigError(f"config {name!r}: rope scaling low_freq_factor and high_freq_factor are 'llama3' "
                              f"scaling's; {self.kind!r} has none")
        if not is_int(self.original_max_position) or not 0 < self.original_max_position <= INT_LIMITS["max_seq_len"]:
            raise ConfigError(f"config {name!r}: rope scaling original_max_position must be a positive integer, got "
                              f"{self.original_max_position!r}")


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
            if not is_int(value) or not 0 < value <= MAX_EXPERTS:
                raise ConfigError(f"config {name!r}: {field_name} must be an integer from 1 to {MAX_EXPERTS:,}, "
                                  f"got {value!r}")
        if self.experts_per_token > self.n_experts:
            raise ConfigError(f"config {name!r}: {self.experts_per_token} experts per token of only "
                              f"{self.n_experts}; k cannot exceed E")
        if self.router_norm not in ROUTER_NORMS:
            raise ConfigError(f"config {name!r}: router_norm must be one of {', '.join(ROUTER_NORMS)}, got "
                              f"{self.router_norm!r}")


def positive_real(value: object) -> bool:
    """A finite number > 0 (an int or a float, not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def whole_number(value: Any, source: str, key: str) -> int:
    """`value` as an int when it is one (or a float with no fraction, as some writers store sizes); else the
    one-line ConfigError naming the file and the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"{source}: {key!r} must be a whole number, got {short_repr(value)}; the file is malformed")
    return int(value)


def real_number(value: Any, source: str, key: str) -> float:
    """`value` as a finite float; else the one-line ConfigError naming the file and the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{source}: {key!r} must be a finite number, got {short_repr(value)}; the file is malformed")
    return float(value)


def positive_window(window: Any, rule: str) -> int | None:
    """A sliding window as a file gives it: None (no window) or a positive int; else the one-line ConfigError that
    `rule` begins (the file, the key and what it must be)."""
    if window is None:
        return None
    if not is_int(window) or window <= 0:
        raise ConfigError(f"{rule}, got {window!r}")
    return int(window)  # a numpy integer (is_int takes one) as the plain int a config holds


def dict_or_empty(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}
