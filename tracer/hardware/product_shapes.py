"""The matrices one step of the fused path multiplies by, at a model's shapes. Pure Python (no torch).

Q|K|V and gate|up are packed (one product each, their rows added), the LM head once per step
(contract.fused_stages). Shared by the product timings that choose a kernel (product_timing.py), the decode
ceilings measured at these shapes and the analytical roofline that reads them back (decode_ceilings.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrace.tracer.core import contract
from llmtrace.tracer.core.config import ModelConfig


@dataclass(frozen=True, slots=True)
class ProductShape:
    """One matrix the model multiplies by: (rows, cols) = (out features, in features)."""

    role: str  # "attention.wqkv", "feed_forward.w13", "output"...
    rows: int
    cols: int
    per_layer: bool  # once per layer; False: once per step (the LM head)


def product_shapes(config: ModelConfig) -> tuple[ProductShape, ...]:
    """The matrices a fused-path step multiplies by, packed ones as one (their rows added)."""
    shapes = []
    for spec in contract.fused_stages(config):
        if spec.kind not in ("linear", "lm_head"):
            continue
        weights = [contract.shape_of(m.tensors[0], config) for m in spec.members]  # (out, in) each
        shapes.append(ProductShape(spec.role, sum(w[0] for w in weights), weights[0][1], spec.in_layer))
    return tuple(shapes)
