"""A mixture-of-experts FFN (Mixtral; config.moe): a router picks k of E SwiGLU experts for each token, each chosen
expert runs on the tokens routed to it, and their outputs are summed, weighted by the router.

Its stages are modules with the contract's roles (tracer/core/contract.py), so hooks, the tracer and FlopCounterMode
see each: `router` (the d -> E logits), `route` (softmax, top-k, renormalisation), then `w1`, `w3`, `act`, `w2` once
per chosen expert (the dense FFN's roles: the same SwiGLU, with that expert's matrices, on its tokens only), and
`combine` (the weighted sum); Qwen2-MoE's shared expert (config.shared_expert_dim) runs on every token before the
router, `shared_w1`, `shared_w3`, `shared_act`, `shared_w2` and its gate's logit `shared_gate` (d -> 1), and
`shared_add` adds its output times sigmoid(logit) to the weighted sum. An expert that no token chose is never
called, so the trace's FLOPs and weight bytes count exactly the experts that ran (and the shared expert once).

The E experts' matrices are stacked, one (E, out, in) tensor per product, as llama.cpp's ffn_*_exps and
transformers' fused experts hold them (HF checkpoints, which name each expert's apart, are stacked by the loader):
the contract declares each tensor once, a stage module per product keeps the module tree the size of a dense
model's (Qwen3-30B-A3B has 128 experts in each of 48 layers: 18,432 modules more the other way), and a call's
weight bytes are one expert's slice of it (ExpertLinear.n_experts, tracer/trace/stage_cost.py).

Its forward calls its stages through a `run` (tracer/model/stage_calls.py), as the dense blocks do: the stage
modules, or the packed step (tracer/model/fused.py: each chosen expert's gate|up one product, `ExpertsPlan`'s). For
a one-token step of one sequence whose experts are held as a GGUF stores them (ExpertWeights: each expert its byte
range of the file's 3-D tensor), the native C decode step runs it too (tracer/model/native_step.py reads
`ExpertsPlan`: the router, and per expert its gate|up and down descriptions pointing at those bytes; its choice
written back into `Route.last` after the step). A dry run's meta model, which has no router weights, routes round-robin
(`dry_routes`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.model.functional import combine_experts, project, route_top_k, shared_expert_add
from llmtrace.tracer.model.stage_calls import HOOKED
from llmtrace.tracer.model.weight_formats import ExpertWeights, PackedWeight, concat_rows


class Route(nn.Module):
    """logits (N, E) -> (weights (N, k) fp32, experts (N, k) int64): functional.route_top_k. The last call's choice
    stays on the module (`last`) for the trace's routing record (tracer/trace/routing.py), read after the step."""

    def __init__(self, top_k: int, router_norm: str) -> None:
        super().__init__()
        self.top_k = top_k
        self.router_norm = router_norm  # config.ROUTER_NORMS: the route's FLOPs depend on it (stage_cost)
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = route_top_k(logits, self.top_k, self.router_norm == "renormalised")
        self.last = (weights, experts)
        return weights, experts

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, router_norm={self.router_norm}"


class ExpertLinear(nn.Module):
    """One SwiGLU product of E experts, their matrices stacked (E, out, in): a call multiplies the rows routed to one
    expert (n, in) by that expert's matrix -> (n, out), through functional.project as every product runs.

    With `packed` set (Transformer.load_stored: a GGUF's 3-D tensor as stored), expert e's product is
    `packed[e]`'s stored kernel over that expert's byte range of the file's blocks, and `weight` is a meta
    placeholder of the stack's shape (as transformer.Linear's)."""

    packed: ExpertWeights | None = None
    held_as: tuple[int, str] | None = None  # a dry run's meta stack: (bytes, format label) as run would hold it

    def __init__(self, n_experts: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.n_experts = n_experts  # a call reads one expert's slice: 1/n_experts of the weight (stage_cost)
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return project(x, self.weight[expert] if self.packed is None else self.packed[expert])

    def extra_repr(self) -> str:
        experts, out_features, in_features = self.weight.shape
        return f"experts={experts}, in_features={in_features}, out_features={out_features}"


class ExpertCombine(nn.Module):
    """outputs (N, k, d), weights (N, k) -> (N, d): each token's k expert outputs summed, weighted."""

    def forward(self, outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return combine_experts(outputs, weights)


class SharedExpertAdd(nn.Module):
    """routed (N, d), shared (N, d), logit (N, 1) -> (N, d): a shared expert's output, times sigmoid of its gate's
    logit, added to the routed experts' weighted sum (Qwen2-MoE)."""

    def forward(self, routed: torch.Tensor, shared: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
        return shared_expert_add(routed, shared, logit)


def dry_routes(tokens: int, top_k: int, n_experts: int) -> torch.Tensor:
    """(N, k) experts for a dry run's token rows, on the CPU: row r's slot s goes to expert (r·k + s) mod E, so the
    rows touch min(E, k·N) distinct experts, the most they could (the bound the weight bytes then count); FLOPs do not
    depend on the choice (each row runs k experts whichever)."""
    return (torch.arange(tokens * top_k) % n_experts).view(tokens, top_k)


class MixtureOfExperts(nn.Module):
    """x (B, T, dim) -> (B, T, dim). `linear(in, out)` and `act()` make transformer.py's Linear (bias-free) and
    SwiGLUActivation, passed in because that module builds this one: the router (dim -> E), and with
    config.shared_expert_dim (Qwen2-MoE) the shared expert's gate, up and down products, its silu(gate)·up, its gate's
    logit (dim -> 1) and the stage adding its gated output (`shared_add`); else those are None."""

    def __init__(self, config: ModelConfig, linear: Callable[[int, int], nn.Module],
                 act: Callable[[], nn.Module]) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        dim, ffn_dim, experts, shared = config.dim, config.ffn_dim, moe.n_experts, config.shared_expert_dim
        self.shared_w1 = linear(dim, shared) if shared else None  # (Fs, dim)
        self.shared_w3 = linear(dim, shared) if shared else None  # (Fs, dim)
        self.shared_act = act() if shared else None
        self.shared_w2 = linear(shared, dim) if shared else None  # (dim, Fs)
        self.shared_gate = linear(dim, 1) if shared else None  # (1, dim)
        self.router = linear(dim, experts)
        self.route = Route(moe.experts_per_token, moe.router_norm)
        self.w1 = ExpertLinear(experts, dim, ffn_dim)
        self.w3 = ExpertLinear(experts, dim, ffn_dim)
        self.act = act()
        self.w2 = ExpertLinear(experts, ffn_dim, dim)
        self.combine = ExpertCombine()
        self.shared_add = SharedExpertAdd() if shared else None

    def forward(self, x: torch.Tensor, run: Any = HOOKED) -> torch.Tensor:
        """x (B, T, dim), or a packed step's rows (N, dim) or one token's (dim,) -> the same shape, each stage called
        through `run` (tracer/model/stage_calls.py). The shared expert (where there is one) runs first, as HF's
        Qwen2MoeSparseMoeBlock runs it."""
        flat = x.reshape(-1, x.shape[-1])  # (N, dim): every token of every sequence
        if self.shared_add is not None:
            gate, up = run.pair(self.shared_w1, self.shared_w3, flat)  # (N, Fs) each
            shared = run.product(self.shared_w2, run.call(self.shared_act, gate, up))  # (N, dim)
            logit = run.product(self.shared_gate, flat)  # (N, 1)
        weights, experts = run.call(self.route, run.product(self.router, flat))  # (N, k) each
        if experts.device.type == "meta":  # a dry run has no router weights to choose by: round-robin (dry_routes)
            experts = dry_routes(*experts.shape, len(self.w1.weight))
        outputs = flat.new_empty(*experts.shape, flat.shape[-1])  # (N, k, dim): each token's k experts' outputs
        for expert in experts.unique().tolist():  # the experts chosen, in ascending order (as HF runs them)
            token, slot = torch.where(experts == expert)  # (n,) each: the tokens routed here, and in which slot
            gate, up = run.pair(self.w1, self.w3, flat[token], expert)  # (n, F) each
            outputs[token, slot] = run.product(self.w2, run.call(self.act, gate, up), expert)
        out = run.call(self.combine, outputs, weights)  # (N, dim)
        if self.shared_add is not None:
            out = run.call(self.shared_add, out, shared, logit)
        return out.view(x.shape)


@dataclass(frozen=True, slots=True)
class ExpertsPlan:
    """What the packed and native decode steps read of one layer's mixture of experts (tracer/model/native_step.py): the
    router's (E, dim) matrix (a PackedWeight as stored, or dense fp32), each expert's gate|up (its w1 rows, then its
    w3 rows: concat_rows, no copy of the blocks) and down, the route's k and renormalisation, and the Route module
    whose `last` the step's choice is written into (tracer/trace/routing.py reads it there)."""

    router: PackedWeight | torch.Tensor
    gate_up: tuple[PackedWeight, ...]  # E, each (2F, dim)
    down: tuple[PackedWeight, ...]  # E, each (dim, F)
    top_k: int
    renormalise: bool
    route: Route

    @classmethod
    def of(cls, moe: MixtureOfExperts) -> ExpertsPlan | None:
        """The plan of a layer whose experts are held as stored (ExpertWeights), else None (dense experts: an HF
        folder's, or --weights dense: the packed step multiplies by the stacks' slices)."""
        w1, w3, w2 = moe.w1.packed, moe.w3.packed, moe.w2.packed
        if w1 is None or w3 is None or w2 is None:
            return None
        router = moe.router.packed if moe.router.packed is not None else moe.router.weight.detach()
        return cls(router, tuple(concat_rows([w1[e], w3[e]]) for e in range(len(w1))), w2.experts,
                   moe.route.top_k, moe.route.router_norm == "renormalised", moe.route)
