"""Tensor parallelism (Megatron-LM style) over N devices: what each device holds, computes and sends. Pure Python.

Layout (Shoeybi et al. 2019, "Megatron-LM", section 3; vLLM and TensorRT-LLM shard LLaMA the same way):
- wq, wk, wv, w1, w3 are split by output columns (whole heads / FFN columns per device), wo and w2 by input rows;
  attention runs on each device's own heads, so its FLOPs, its KV cache and RoPE/softmax work divide by N.
- The embedding table and the LM head are split along the vocabulary.
- RMSNorms and residual adds are replicated: every device does them on the full hidden vector.
- Two all-reduces per layer (after wo and after w2), each of B*T*d activations. A ring all-reduce sends, and
  receives, 2(N-1)/N of the payload per device, so its time is that over the link's one-way bandwidth
  (nccl-tests' "bus bandwidth"). Latency per all-reduce (microseconds) is not modelled, nor the two small
  collectives of the vocab-parallel embedding and LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrace.tracer.analytic.estimate import MOE_REPLICATED, ComponentCost, PhaseEstimate
from llmtrace.tracer.core import contract
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.errors import BadArgumentError, HardwareError
from llmtrace.tracer.hardware.profiles import HardwareProfile

ALLREDUCES_PER_LAYER = 2


@dataclass(frozen=True, slots=True)
class DeviceCost:
    """One forward pass as one device of the tensor-parallel group sees it (the whole pass when tp = 1)."""

    flops: int  # dense as executed
    useful_flops: int  # attention products over causal pairs only
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    activation_bytes: int  # read + written
    comm_bytes: int  # all-reduce bytes this device sends (ring), whole pass
    peak_activation_bytes: int = 0  # largest one kernel's activation inputs + outputs on this device

    @property
    def bytes(self) -> int:
        """Everything this device moves through its memory: weights + KV read + KV written + activations."""
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.activation_bytes


def tp_sizes(config: ModelConfig) -> list[int]:
    """Every tp > 1 the model splits over: dividing the query heads, the KV heads, the FFN dim (each expert's, in a
    mixture of experts) and a shared expert's width."""
    return [n for n in range(2, config.n_kv_heads + 1)
            if config.n_heads % n == 0 and config.n_kv_heads % n == 0 and config.ffn_dim % n == 0
            and (config.shared_expert_dim or 0) % n == 0]


def check_tp(config: ModelConfig, tp: int, hardware: HardwareProfile) -> int:
    """`tp` if the model can be split over that many devices of this hardware, else a one-line error."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise BadArgumentError(f"--tp must be an integer >= 1, got {tp!r}")
    if tp == 1:
        return tp
    for what, value in (("query heads", config.n_heads), ("KV heads", config.n_kv_heads),
                        ("FFN dim", config.ffn_dim), ("shared expert width", config.shared_expert_dim or 0)):
        if value % tp:
            divisors = tp_sizes(config)
            hint = f"use --tp {', '.join(map(str, divisors[:6]))}" if divisors else "this model cannot be split"
            raise BadArgumentError(
                f"--tp {tp} does not divide {config.name}'s {value} {what}; each device needs whole heads: {hint}"
            )
    if hardware.interconnect_bandwidth <= 0:
        raise HardwareError(
            f"{hardware.name} has no interconnect for tensor parallelism; use --tp 1 or another --hardware"
        )
    return tp


def ring_allreduce_bytes(payload_bytes: int, tp: int) -> int:
    """Bytes one device sends in a ring all-reduce of `payload_bytes`: 2(N-1)/N of it (0 when N = 1)."""
    return 2 * (tp - 1) * payload_bytes // tp


def allreduce_payload_bytes(config: ModelConfig, batch: int, new_tokens: int, activation_bytes: float) -> int:
    """One all-reduce's payload: the B*T*d hidden states in the activation dtype."""
    return int(batch * new_tokens * config.dim * activation_bytes)


def comm_bytes_per_pass(config: ModelConfig, batch: int, new_tokens: int, activation_bytes: float, tp: int) -> int:
    """All-reduce bytes one device sends in one forward pass: layers x 2 all-reduces x ring share."""
    payload = allreduce_payload_bytes(config, batch, new_tokens, activation_bytes)
    return config.n_layers * ALLREDUCES_PER_LAYER * ring_allreduce_bytes(payload, tp)


def vocab_slice(config: ModelConfig, tp: int) -> int:
    """Rows of the embedding and LM head each rank holds: ceil(V / N) (the last slice padded when N does not divide
    V)."""
    return -(-config.vocab_size // tp)


def _split(value: int, tp: int) -> int:
    return -(-value // tp)  # ceil: the busiest device


def replicated_components() -> frozenset[str]:
    """Components every device runs in full: the contract's replicated stages (norms, residual adds) and a mixture
    of experts' router and weighted sum, a shared expert's gate logit and gated add (Qwen2-MoE); the rest
    (projections and their biases, attention, every expert's columns, as vLLM splits each expert by default, a shared
    expert's likewise, the embedding and the LM head) split over the devices."""
    return frozenset(s.role for s in contract.staged_stages() if s.replicated) | MOE_REPLICATED | frozenset(
        ("feed_forward.shared_gate", "feed_forward.shared_add"))


def _component_share(c: ComponentCost, tp: int, replicated: frozenset[str]) -> DeviceCost:
    """One component's work on the busiest device: all of it when replicated, else its 1/tp share (rounded up)."""
    n = c.instances
    share = (lambda v: v) if c.name in replicated else (lambda v: _split(v, tp))
    return DeviceCost(flops=share(c.flops * n), useful_flops=share(c.useful_flops * n),
                      weight_bytes=share(c.weight_bytes * n), kv_read_bytes=share(c.kv_read_bytes * n),
                      kv_write_bytes=share(c.kv_write_bytes * n),
                      activation_bytes=share((c.act_read_bytes + c.act_write_bytes) * n), comm_bytes=0,
                      peak_activation_bytes=share(c.act_read_bytes + c.act_write_bytes))


def device_cost(config: ModelConfig, phase: PhaseEstimate, activation_bytes: float, tp: int = 1) -> DeviceCost:
    """Per-device cost of one estimated pass split over `tp` devices (check_tp first)."""
    replicated = replicated_components()
    shares = [_component_share(c, tp, replicated) for c in phase.components]
    return DeviceCost(
        flops=sum(s.flops for s in shares), useful_flops=sum(s.useful_flops for s in shares),
        weight_bytes=sum(s.weight_bytes for s in shares), kv_read_bytes=sum(s.kv_read_bytes for s in shares),
        kv_write_bytes=sum(s.kv_write_bytes for s in shares),
        activation_bytes=sum(s.activation_bytes for s in shares),
        comm_bytes=comm_bytes_per_pass(config, phase.batch, phase.new_tokens, activation_bytes, tp),
        peak_activation_bytes=max(s.peak_activation_bytes for s in shares),
    )
