"""The preset catalogue as records: key dimensions, parameter count and KV bytes per token of every preset."""

from __future__ import annotations

from dataclasses import dataclass

from llmtrace.tracer.analytic.kvmem import kv_bytes_per_token, kv_bytes_per_token_per_layer
from llmtrace.tracer.analytic.model_dims import ModelDims
from llmtrace.tracer.analytic.params import count_params, weight_bytes
from llmtrace.tracer.core.dtypes import DType
from llmtrace.tracer.core.presets import PRESETS

MODELS_SCHEMA = "llmtrace.models/1"


# Output records, read field by field and through asdict(): eq=False and repr=False spare compiling __eq__,
# __hash__ and __repr__ for each at import, which the analytical commands (answering in a blink) feel.
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ModelRow(ModelDims):
    """A preset's key dimensions (ModelDims), then its size in the chosen dtype."""

    params: int
    active_params: int  # those one token's pass multiplies by: params, or fewer in a mixture of experts
    n_experts: int  # E experts a layer (1: a dense FFN)
    experts_per_token: int  # k of them a token is routed to (1: a dense FFN)
    shared_expert_dim: int  # the width of a shared expert every token runs beside them (Qwen2-MoE; 0: none)
    weight_bytes: int  # all weights in the chosen dtype (every expert's)
    kv_bytes_per_token: int  # one position, all layers, one sequence, in the chosen dtype
    sliding_window: int  # positions a windowed layer keeps (0: no windowed layer)
    windowed_layers: int  # how many layers keep only the window
    kv_bytes_per_token_past_window: int  # what a position past the window adds: the global layers' K and V only
    rotary_dim: int  # the values of each head RoPE turns: head_dim, or fewer under a partial rotary (Phi-4-mini)


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ModelsReport:
    schema: str
    dtype: str
    models: tuple[ModelRow, ...]


def models_report(dtype: DType) -> ModelsReport:
    rows = []
    for c in PRESETS.values():
        p = count_params(c)
        rows.append(ModelRow.of(
            c, params=p.total, active_params=p.active, n_experts=p.n_experts, experts_per_token=p.experts_per_token,
            shared_expert_dim=c.shared_expert_dim or 0, weight_bytes=weight_bytes(c, dtype), kv_bytes_per_token=kv_bytes_per_token(c, dtype),
            sliding_window=c.sliding_window or 0, windowed_layers=c.windowed_layers,
            kv_bytes_per_token_past_window=kv_bytes_per_token_per_layer(c.n_kv_heads, c.head_dim, dtype)
            * (c.n_layers - c.windowed_layers), rotary_dim=c.rotary_dim,
        ))
    return ModelsReport(schema=MODELS_SCHEMA, dtype=dtype.name, models=tuple(rows))
