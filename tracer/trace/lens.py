"""The logit lens (nostalgebraist 2020; TransformerLens' `accumulated_resid` + `apply_ln_to_stack`): the residual
stream at the predicted position after the embedding and after every layer, sent through the model's final
RMSNorm and LM head as if the model stopped there. After the last layer this is the model's own prediction
(tested); before it, what each layer "believes" the next token is.

One (n_layers + 1, dim) x (dim, V) product per step, worked out after the step's clocks stop (instrumentation,
apart from the stages' FLOPs and time).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from llmtrace.tracer.model.functional import project, rms_norm
from llmtrace.tracer.trace.journey_records import LensLayer, LensStep, LensToken

LENS_TOP = 3


def logit_lens(model: Any, residual: torch.Tensor, step: int, position: int, chosen: int,
               piece: Callable[[int], str], top: int = LENS_TOP) -> LensStep:
    """`residual`: (n_layers + 1, dim) rows from the Observer (tracer/trace/observe.py)."""
    start = time.perf_counter_ns()
    norm = model.norm
    floor = torch.tensor((norm.weight.shape[0] * norm.eps) ** 0.5, device=residual.device)
    with torch.no_grad():
        hidden = rms_norm(residual.to(norm.weight.dtype), norm.weight, floor)  # (L+1, dim)
        head = model.output.packed if getattr(model.output, "packed", None) is not None else model.output.weight
        logits = project(hidden, head).float()  # (L+1, V): the LM head as it runs (a stored one as stored)
        logprobs = torch.log_softmax(logits, dim=-1)
        probs = logprobs.exp()
        entropy = -(probs * logprobs.nan_to_num(neginf=0.0)).sum(dim=-1) / math.log(2.0)  # (L+1,) bits
        top_p, top_ids = probs.topk(top, dim=-1)  # (L+1, top)
        chosen_logit = logits[:, chosen : chosen + 1]  # (L+1, 1)
        ranks = (logits > chosen_logit).sum(dim=-1) + 1  # (L+1,)
    layers = []
    for row in range(residual.shape[0]):
        layers.append(LensLayer(
            layer=None if row == 0 else row - 1,
            top=tuple(LensToken(int(t), piece(int(t)), float(p)) for t, p in zip(top_ids[row].tolist(),
                                                                                  top_p[row].tolist())),
            chosen_rank=int(ranks[row]), chosen_probability=float(probs[row, chosen]),
            entropy_bits=max(float(entropy[row]), 0.0),
        ))
    first_top = next((layer.layer for layer in layers if layer.layer is not None and layer.chosen_rank == 1), None)
    return LensStep(step=step, position=position, token_id=chosen, piece=piece(chosen), first_top_layer=first_top,
                    layers=tuple(layers), instrument_ns=time.perf_counter_ns() - start)
