"""Where each head looks from the predicted position: the attention weights the Observer captured (the staged
model's softmax output, the predicted position's row), summarised per head (entropy, top positions) and per layer
(the heads' mean, a heat strip over the positions), kept in full for the first step when that stays small.

Worked out after the step's clocks stop (instrumentation, apart from the stages' FLOPs and time).
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import torch

from llmtrace.tracer.trace.journey_records import ATTENTION_FULL_LIMIT, AttentionStep, HeadFocus

HEAD_TOP = 3


def attention_step(weights: torch.Tensor, step: int, pieces: Sequence[str], keep_full: bool,
                   top: int = HEAD_TOP) -> AttentionStep:
    """`weights`: (n_layers, H, S) from the Observer; `pieces`: the token at each of the S positions."""
    start = time.perf_counter_ns()
    w = weights.float()
    layers, heads, positions = w.shape
    entropy = -(w * torch.log(w.clamp_min(1e-30))).sum(dim=-1) / math.log(2.0)  # (L, H) bits; 0 log 0 = 0
    k = min(top, positions)
    top_w, top_pos = w.topk(k, dim=-1)  # (L, H, k)
    focus = tuple(
        HeadFocus(layer=layer, head=head, entropy_bits=max(float(entropy[layer, head]), 0.0),
                  top_positions=tuple(top_pos[layer, head].tolist()), top_weights=tuple(top_w[layer, head].tolist()))
        for layer in range(layers) for head in range(heads)
    )
    full = None
    if keep_full and w.numel() <= ATTENTION_FULL_LIMIT:
        full = tuple(tuple(tuple(row) for row in layer) for layer in w.tolist())
    return AttentionStep(
        step=step, position=positions - 1, positions=positions, pieces=tuple(pieces),
        mean_weights=tuple(tuple(row) for row in w.mean(dim=1).tolist()), heads=focus, weights=full,
        instrument_ns=time.perf_counter_ns() - start,
    )
