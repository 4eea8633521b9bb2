"""The kernel model: which kernels a forward pass runs, and so what it reads and writes in memory. Pure Python.

FLOP counts of the matmuls do not depend on it; what does is the traffic between kernels and the attention core:

- `eager`: every operation is its own kernel that reads its inputs from memory and writes its output back, and
  attention is computed as written in the paper: the scores QKᵀ (B·H·T·S values) are materialised, scaled,
  soft-maxed and read again by P·V, every (query, key) pair computed, masked ones included. This is what
  llmtrace's own model executes (on the CPU as on a GPU), and what a traced run's bytes count.
- `fused`: attention as FlashAttention computes it (Dao et al. 2022; FlashAttention-2 2023): Q, K and V are read
  once, the output written once, the scores live only in on-chip memory, and tiles wholly above the causal diagonal
  are skipped, so the products and the softmax cost the causal pairs only. Elementwise operations are fused into
  the kernels next to them: the RMSNorms into the prologue of the matmul they feed, RoPE and the KV-cache write into
  the QKV matmul's epilogue, silu(gate)·up into the gate/up matmul's epilogue, each residual add into the epilogue
  of the matmul before it (which reads the skip input). Q, K, V come from one packed matmul and gate/up from
  another (their shared input read once). What remains between kernels is each matmul's input and output.
  This is what vLLM, TensorRT-LLM, llama.cpp (-fa) and SGLang execute.

Tile re-reads inside FlashAttention (K and V of one head are read once per query tile) are served by on-chip
memory and the L2 cache, not counted: the FlashAttention papers measure its HBM traffic near one pass over Q, K, V
and O at the head dims LLaMA uses. Tiles straddling the diagonal compute their masked half too; with 128-wide
tiles that is under 128/T of the causal work (0.4% at an 32k prompt), not counted.

Default: `fused` for datasheet accelerator profiles (every one in llmtrace.tracer.hardware.profiles is a GPU),
`eager` for `this-machine`, whose ceilings were measured for llmtrace's own model to run against.
"""

from __future__ import annotations

from enum import Enum

from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.hardware.profiles import HardwareProfile


class Kernels(str, Enum):
    EAGER = "eager"
    FUSED = "fused"


DESCRIPTIONS: dict[Kernels, str] = {
    Kernels.EAGER: "eager kernels: each op reads and writes its tensors, attention scores in memory",
    Kernels.FUSED: "fused kernels: FlashAttention (masked tiles skipped), elementwise ops in the matmuls",
}


def parse_kernels(value: str | Kernels) -> Kernels:
    """The kernel model named `value` ("eager" or "fused"); a one-line BadArgumentError otherwise."""
    if isinstance(value, Kernels):
        return value
    try:
        return Kernels(str(value).strip().lower())
    except ValueError:
        raise BadArgumentError(f"--kernels must be eager or fused, got {value!r}") from None


def default_kernels(hardware: HardwareProfile) -> Kernels:
    """`eager` for a measured profile (this machine, where llmtrace's own eager model runs), `fused` for a GPU."""
    return Kernels.EAGER if hardware.measured else Kernels.FUSED
